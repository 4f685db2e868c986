"""A key log: the keys of a table's lookups, in the order they came, as one int64 array.

`read_key_log(path)` takes three layouts, told apart by the file itself:

    .npy              a NumPy array of integers (any shape, read in C order), memory-mapped
                      (told by its magic bytes, whatever the file's name)
    JSON              {"keys": [...]}: the hot-set export of a table (a .json file, or a
                      file that opens with `{` and parses as such JSON)
    anything else     raw little-endian int64, 8 bytes a key, memory-mapped

Raw and .npy logs are mapped, not read: a 10M-key log costs no memory until it is
replayed. Raises SourceNotFoundError for a path that is no file, KeyTypeError for a file
that holds no integer keys (a raw file whose size is not a multiple of 8, a .npy of
floats, JSON without an integer list "keys", an empty log). Nothing here is per key.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hps.errors import KeyTypeError, SourceNotFoundError

_NPY_MAGIC = b"\x93NUMPY"
_INT64_MAX = np.iinfo(np.int64).max


def read_key_log(path: str | Path) -> np.ndarray:
    """The keys of the log at `path` (int64 [n], n ≥ 1; see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise SourceNotFoundError(f"key log {str(path)!r}: no such file")
    with path.open("rb") as f:
        head = f.read(len(_NPY_MAGIC))
    if head.startswith(_NPY_MAGIC):
        keys = _npy_keys(path)
    elif path.suffix.lower() == ".json":
        keys = _json_keys(path)
    elif head[:1] == b"{":
        # a raw log whose first key's low byte is `{` is still a raw log
        try:
            keys = _json_keys(path)
        except KeyTypeError:
            keys = _raw_keys(path)
    else:
        keys = _raw_keys(path)
    if keys.size == 0:
        raise KeyTypeError(f"key log {str(path)!r} holds no keys")
    return keys


def _npy_keys(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise KeyTypeError(f"key log {str(path)!r} is not a readable .npy file: {exc}") from None
    if array.dtype.kind not in "iu":
        raise KeyTypeError(f"key log {str(path)!r} holds {array.dtype} values, not integer "
                           "keys")
    if array.dtype == np.uint64 and array.size and int(array.max()) > _INT64_MAX:
        raise KeyTypeError(f"key log {str(path)!r} holds keys above the int64 range")
    return np.ascontiguousarray(array.reshape(-1), dtype=np.int64)


def _json_keys(path: Path) -> np.ndarray:
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeyTypeError(f"key log {str(path)!r} is not JSON: {exc}") from None
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list):
        raise KeyTypeError(f"key log {str(path)!r}: expected a JSON object with a list "
                           '"keys" (the hot-set export), got '
                           f"{type(keys if isinstance(doc, dict) else doc).__name__}")
    try:
        array = np.asarray(keys)
    except ValueError:
        array = np.asarray([], dtype=object)
    if array.ndim != 1 or array.dtype.kind not in "iu" or (
            array.dtype == np.uint64 and array.size and int(array.max()) > _INT64_MAX):
        raise KeyTypeError(f"key log {str(path)!r}: \"keys\" must be a list of int64 keys")
    return array.astype(np.int64, copy=False)


def _raw_keys(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size % 8:
        raise KeyTypeError(
            f"key log {str(path)!r} is {size} bytes, not a multiple of 8: not raw int64 "
            "keys (or a .npy / JSON {\"keys\": [...]} file)")
    if size == 0:
        return np.empty(0, np.int64)
    return np.memmap(path, dtype="<i8", mode="r")
