"""Table files written by hps.tiers.rocksdb.sst, against rocksdict's own SstFileWriter, and
the bulk load paths of hps.tiers.rocksdb.bulk (sink, spill), on real files and live RocksDB
stores."""

from __future__ import annotations

import collections
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import rocksdict

from hps.errors import TierError
from hps.tiers.rocksdb import sst
from hps.tiers.rocksdb.bulk import BucketSpill, SstSink, _FileWriter, bytewise_order, swapped_keys
from tests.support.rows import vectors_of

# -- reading a table file back (enough of the format to compare two writers) ------------


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _handle(buf: bytes, i: int) -> tuple[tuple[int, int], int]:
    offset, i = _varint(buf, i)
    size, i = _varint(buf, i)
    return (offset, size), i


def _entries(block: bytes) -> list[tuple[bytes, bytes]]:
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 - 4 * restarts
    out, last, i = [], b"", 0
    while i < end:
        shared, i = _varint(block, i)
        unshared, i = _varint(block, i)
        length, i = _varint(block, i)
        key = last[:shared] + block[i : i + unshared]
        i += unshared
        out.append((key, block[i : i + length]))
        i += length
        last = key
    return out


def table_parts(path: Path) -> dict[str, object]:
    """Footer fields, the data-block handles (from the index) and the properties."""
    data = path.read_bytes()
    footer = data[-53:]
    (meta_offset, meta_size), i = _handle(footer, 1)
    (index_offset, index_size), _ = _handle(footer, i)
    index = _entries(data[index_offset : index_offset + index_size])
    handles = [_handle(value, 0)[0] for _, value in index]
    meta = dict(_entries(data[meta_offset : meta_offset + meta_size]))
    (props_offset, props_size), _ = _handle(meta[b"rocksdb.properties"], 0)
    properties = dict(_entries(data[props_offset : props_offset + props_size]))
    return {"data": data, "handles": handles, "index_keys": [k for k, _ in index],
            "properties": properties, "format_version": struct.unpack_from("<I", footer, 41)[0],
            "magic": struct.unpack_from("<Q", footer, 45)[0], "checksum": footer[0]}


def rocksdict_file(path: Path, keys: np.ndarray, vectors: np.ndarray) -> None:
    """The same rows through rocksdict's SstFileWriter, with the options sst.py writes."""
    options = rocksdict.Options(raw_mode=True)
    options.set_compression_type(rocksdict.DBCompressionType.none())
    table = rocksdict.BlockBasedOptions()
    table.set_format_version(2)
    table.set_checksum_type(rocksdict.ChecksumType.no_checksum())
    options.set_block_based_table_factory(table)
    writer = rocksdict.SstFileWriter(options)
    writer.open(str(path))
    rows = np.ascontiguousarray(vectors, np.float32)
    collections.deque(map(writer.__setitem__, keys.astype("<i8").view("V8").tolist(),
                          rows.view(f"V{rows.shape[1] * 4}").reshape(-1).tolist()), maxlen=0)
    writer.finish()


def random_sorted_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64))
    return keys[bytewise_order(keys)]


@pytest.mark.parametrize("dim", [1, 3, 16, 64, 129])
@pytest.mark.parametrize("n", [1, 17, 5000])
def test_data_blocks_are_rocksdbs_own_byte_for_byte(tmp_path: Path, dim: int, n: int) -> None:
    rng = np.random.default_rng(dim * 1000 + n)
    keys = random_sorted_keys(rng, n)
    vectors = rng.standard_normal((keys.size, dim), dtype=np.float32)
    rocksdict_file(tmp_path / "theirs.sst", keys, vectors)
    sst.write_file(str(tmp_path / "ours.sst"), keys, vectors)
    theirs, ours = table_parts(tmp_path / "theirs.sst"), table_parts(tmp_path / "ours.sst")
    assert ours["handles"] == theirs["handles"]  # same blocks, cut at the same entries
    offset, size = theirs["handles"][-1]  # type: ignore[index]
    end = offset + size + 5
    assert ours["data"][:end] == theirs["data"][:end]  # type: ignore[index]
    assert (ours["format_version"], ours["magic"], ours["checksum"]) == (
        theirs["format_version"], theirs["magic"], theirs["checksum"])
    # every property but who wrote it, when, and the index size (RocksDB shortens the
    # index keys between blocks; ours are the blocks' last keys, also valid separators)
    for name, value in theirs["properties"].items():  # type: ignore[attr-defined]
        if b"identity" not in name and b"time" not in name and name != b"rocksdb.index.size":
            assert ours["properties"][name] == value, name  # type: ignore[index]
    # each index key is the internal key of its block's last key: ≥ every key in it
    last_keys = [key[:8] for key in ours["index_keys"]]  # type: ignore[attr-defined]
    assert last_keys[-1] == keys[-1:].astype("<i8").tobytes()


def open_store(path: Path) -> rocksdict.Rdict:
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    return rocksdict.Rdict(str(path), options)


def ingest(db: rocksdict.Rdict, paths: list[str]) -> None:
    options = rocksdict.IngestExternalFileOptions()
    options.set_move_files(True)
    db.ingest_external_file(paths, options)


def test_files_ingest_and_read_back(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    keys = random_sorted_keys(rng, 30_000)
    vectors = vectors_of(keys, 8)
    paths = []
    for i, part in enumerate(np.array_split(np.arange(keys.size), 3)):
        paths.append(str(tmp_path / f"{i}.sst"))
        sst.write_file(paths[-1], keys[part], vectors, positions=part)
    db = open_store(tmp_path / "db")
    try:
        ingest(db, paths)
        query = keys[rng.permutation(keys.size)]
        values = db.get(query.astype("<i8").view("V8").tolist())
        assert b"".join(values) == vectors_of(query, 8).tobytes()
        absent = np.setdiff1d(rng.integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64), keys)
        assert db.get(absent.astype("<i8").view("V8").tolist()) == [None] * absent.size
        assert db.property_int_value("rocksdb.estimate-num-keys") == keys.size
        levels = {f["level"] for f in db.live_files()}
        assert levels == {6}  # three files side by side in the bottom level
    finally:
        db.close()


def test_the_sink_refuses_keys_out_of_order(tmp_path: Path) -> None:
    keys = random_sorted_keys(np.random.default_rng(2), 100)
    sink = SstSink(str(tmp_path), workers=2)
    try:
        sink.add(keys[:50], vectors_of(keys[:50], 2))
        with pytest.raises(TierError, match="bytewise order"):
            sink.add(keys[40:60], vectors_of(keys[40:60], 2))  # overlaps what came before
        with pytest.raises(TierError, match="bytewise order"):
            sink.add(keys[::-1][:10], vectors_of(keys[::-1][:10], 2))  # not sorted
        with pytest.raises(TierError, match="bytewise order"):
            sink.add(keys[[60, 60]], vectors_of(keys[[60, 60]], 2))  # a repeat
        assert len(sink.finish()) == 1
    finally:
        sink.close()


def test_the_sink_splits_files_and_writes_them_in_order(tmp_path: Path) -> None:
    keys = random_sorted_keys(np.random.default_rng(3), 20_000)
    vectors = vectors_of(keys, 4)
    sink = SstSink(str(tmp_path), workers=2, file_bytes=16 * 1000)  # 1000 rows a file
    try:
        for part in np.array_split(np.arange(keys.size), 7):
            sink.add(keys[part], vectors[part])
        paths = sink.finish()
    finally:
        sink.close()
    assert len(paths) == sum(-(-p.size // 1000) for p in np.array_split(np.arange(20_000), 7))
    db = open_store(tmp_path / "db")
    try:
        ingest(db, paths)
        values = db.get(keys.astype("<i8").view("V8").tolist())
        assert b"".join(values) == vectors.tobytes()
    finally:
        db.close()


def test_files_are_written_where_o_direct_is_refused(tmp_path: Path) -> None:
    """tmpfs has no O_DIRECT: the writer falls back to a plain write and fsync."""
    shm = Path("/dev/shm")
    if not shm.is_dir():  # not Linux: O_DIRECT fallback is the only path there anyway
        shm = tmp_path
    keys = random_sorted_keys(np.random.default_rng(4), 3000)
    path = shm / f"hps-test-{os.getpid()}.sst"
    writer = _FileWriter()
    try:
        writer.write(str(path), keys, vectors_of(keys, 4).view(np.uint8).reshape(keys.size, -1),
                     np.arange(keys.size))
        sst.write_file(str(tmp_path / "same.sst"), keys, vectors_of(keys, 4))
        fallback, direct = path.read_bytes(), (tmp_path / "same.sst").read_bytes()
        (index_offset, index_size), _ = _handle(direct[-53:], _handle(direct[-53:], 1)[1])
        end = index_offset + index_size  # the rest holds a session id of its own
        assert len(fallback) == len(direct) and fallback[:end] == direct[:end]
        assert table_parts(path)["properties"][b"rocksdb.num.entries"] == bytes([0xB8, 0x17])
    finally:
        writer.close()
        path.unlink(missing_ok=True)


def test_spill_sorts_each_range_and_keeps_the_last_repeat(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    batches = []
    for step in range(6):
        keys = rng.integers(-5000, 5000, 3000)
        batches.append((keys, vectors_of(keys, 3, salt=step)))
    spill = BucketSpill(str(tmp_path), 3, buckets=8)
    try:
        for keys, vectors in batches:
            spill.add(keys, vectors)
        runs = list(spill.runs())
    finally:
        spill.close()
    last: dict[int, np.ndarray] = {}
    for keys, vectors in batches:
        last.update(zip(keys.tolist(), vectors, strict=True))
    got_keys = np.concatenate([k for k, _, _ in runs])
    swapped = swapped_keys(got_keys)
    assert np.all(swapped[1:] > swapped[:-1])  # distinct, in order across the ranges
    assert sorted(got_keys.tolist()) == sorted(last)
    for keys, rows, positions in runs:
        assert np.array_equal(rows[positions], np.stack([last[k] for k in keys.tolist()]))


def test_spill_of_keys_that_share_their_first_bytes(tmp_path: Path) -> None:
    """Multiples of 2**40 share their five low bytes, which RocksDB compares first: the
    ranges are cut at quantiles of the keys seen, not at fixed byte values."""
    keys = np.arange(1, 5001, dtype=np.int64) << 40
    spill = BucketSpill(str(tmp_path), 1, buckets=10)
    try:
        spill.add(keys[::2], keys[::2, None].astype(np.float32))
        spill.add(keys[1::2], keys[1::2, None].astype(np.float32))
        sizes = [k.size for k, _, _ in spill.runs()]
    finally:
        spill.close()
    assert sum(sizes) == 5000 and max(sizes) <= 600  # about a tenth each


def test_bytewise_order_is_a_stable_sort_of_the_key_bytes() -> None:
    rng = np.random.default_rng()
    keys = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64),
                           rng.integers(-3, 3, 5000),  # repeats, and keys sharing bytes
                           np.arange(0, 2**40, 2**24, dtype=np.int64)])
    order = bytewise_order(keys)
    as_bytes = [k.tobytes() for k in keys.astype("<i8")]
    assert order.tolist() == sorted(range(keys.size), key=lambda i: (as_bytes[i], i))
