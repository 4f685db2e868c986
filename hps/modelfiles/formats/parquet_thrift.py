"""Parquet page headers: Thrift's compact protocol, decoded as far as a page header needs.

Each page of a Parquet column chunk starts with a `PageHeader` struct in Thrift's compact
protocol. `read_struct` decodes any compact struct into {field id: value} (nested structs
as dicts, lists as lists, binaries as bytes), so fields this module does not name are
skipped correctly; the field ids below are those of parquet-format's `PageHeader`,
`DataPageHeader`, `DataPageHeaderV2` and `DictionaryPageHeader`.

Raises HeaderError (a ValueError) for bytes that are not a compact struct, or that run
past the buffer.
"""

from __future__ import annotations

from typing import Any

# PageHeader
PAGE_TYPE, UNCOMPRESSED_SIZE, COMPRESSED_SIZE, CRC = 1, 2, 3, 4
DATA_PAGE_HEADER, DICTIONARY_PAGE_HEADER, DATA_PAGE_HEADER_V2 = 5, 7, 8
# PageType
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
# DataPageHeader (v1)
V1_NUM_VALUES, V1_ENCODING, V1_DEF_ENCODING, V1_REP_ENCODING = 1, 2, 3, 4
# DataPageHeaderV2
V2_NUM_VALUES, V2_NUM_NULLS, V2_NUM_ROWS, V2_ENCODING = 1, 2, 3, 4
V2_DEF_BYTES, V2_REP_BYTES, V2_IS_COMPRESSED = 5, 6, 7
# DictionaryPageHeader
DICT_NUM_VALUES, DICT_ENCODING = 1, 2
# Encoding
PLAIN, PLAIN_DICTIONARY, RLE, RLE_DICTIONARY, BYTE_STREAM_SPLIT = 0, 2, 3, 8, 9

_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY = 1, 2, 3, 4, 5, 6, 7, 8
_LIST, _SET, _MAP, _STRUCT = 9, 10, 11, 12
#: deeper nesting than any page header has: a guard against crafted recursion
_MAX_DEPTH = 16


class HeaderError(ValueError):
    """Bytes that do not decode as a Thrift compact struct."""


def read_struct(buf: Any, pos: int, depth: int = 0) -> tuple[dict[int, Any], int]:
    """The struct at buf[pos:] (bytes, memoryview or a uint8 array) as {field id: value},
    and the position after it."""
    if depth > _MAX_DEPTH:
        raise HeaderError("structs nested too deep")
    fields: dict[int, Any] = {}
    last = 0
    while True:
        head = _byte(buf, pos)
        pos += 1
        if head == 0:  # stop field
            return fields, pos
        kind, delta = head & 0x0F, head >> 4
        if delta:
            field = last + delta
        else:
            raw, pos = _varint(buf, pos)
            field = _unzigzag(raw)
        last = field
        if kind in (_TRUE, _FALSE):  # a struct's booleans live in the field type
            fields[field] = kind == _TRUE
        else:
            fields[field], pos = _value(buf, pos, kind, depth)


def _value(buf: Any, pos: int, kind: int, depth: int) -> tuple[Any, int]:
    if kind in (_TRUE, _FALSE, _BYTE):  # a boolean inside a list is one byte
        return _byte(buf, pos), pos + 1
    if kind in (_I16, _I32, _I64):
        raw, pos = _varint(buf, pos)
        return _unzigzag(raw), pos
    if kind == _DOUBLE:
        _byte(buf, pos + 7)
        return None, pos + 8
    if kind == _BINARY:
        size, pos = _varint(buf, pos)
        if size:
            _byte(buf, pos + size - 1)
        return bytes(buf[pos : pos + size]), pos + size
    if kind in (_LIST, _SET):
        head = _byte(buf, pos)
        pos += 1
        size, item = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        items = []
        for _ in range(size):
            value, pos = _value(buf, pos, item, depth + 1)
            items.append(value)
        return items, pos
    if kind == _MAP:  # no page header field is a map: skipped, not kept
        size, pos = _varint(buf, pos)
        if size:
            types = _byte(buf, pos)
            pos += 1
            for _ in range(size):
                _, pos = _value(buf, pos, types >> 4, depth + 1)
                _, pos = _value(buf, pos, types & 0x0F, depth + 1)
        return None, pos
    if kind == _STRUCT:
        return read_struct(buf, pos, depth + 1)
    raise HeaderError(f"unknown compact type {kind}")


def _byte(buf: Any, pos: int) -> int:
    if pos >= len(buf):
        raise HeaderError("header runs past the end of the data")
    return int(buf[pos])


def _varint(buf: Any, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = _byte(buf, pos)
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 70:
            raise HeaderError("varint longer than 10 bytes")


def _unzigzag(raw: int) -> int:
    return (raw >> 1) ^ -(raw & 1)
