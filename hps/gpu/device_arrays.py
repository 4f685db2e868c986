"""Keys and rows as a GPU table takes them: on its device, int64 keys and float32 rows.

The GPU tables' checked calls (query, insert, build, update, remove) accept NumPy or CuPy
arrays; these functions bring them to the table's device in the form the kernels read:

- `host_keys(keys)`: host keys of any integer width and shape as int64 [n] (checked by
  hps/intake/keys.py);
- `device_keys(...)`: int64 [n] keys on the device (host keys copied over);
- `device_rows(...)`: float32 [n, dim] C-contiguous rows on the device (host rows copied
  over), checked to fit the table's storage type (hps/rows/storage_types.py);
- `host_rows(...)`: the same rows, checked the same way, left on the host (online
  updates stage them themselves: hps/gpu/host_updates.py).

They raise KeyTypeError (keys), LookupInputError (rows of the wrong shape, dtype or
values) and DeviceError (arrays on another device) before anything is written. The
lookup path (hps/gpu/table.py, sharded.py) reads its arrays through hps/intake/keys.py
instead, with `lookup_refs`: what every GPU table's lookup checks of its arguments.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hps.errors import DeviceError, LookupInputError, OutputBufferError
from hps.intake.array_ref import ArrayRef
from hps.intake.keys import as_key_array, key_ref, key_view, output_ref
from hps.rows.gpu_layout import output_code
from hps.rows.storage_types import StorageType, first_unencodable_row


def lookup_refs(keys: Any, out: Any, dim: int, storage: StorageType, device_id: int
                ) -> tuple[ArrayRef, ArrayRef, int]:
    """(keys, out, output type code) of a lookup into a GPU table on `device_id`: both
    ArrayRefs the caller read and checked (the server), or arrays of any producer read
    and checked here (out of shape [n, dim]). Raises KeyTypeError or OutputBufferError
    for bad arguments, DeviceError for arrays on another device."""
    if isinstance(keys, ArrayRef):
        kref, oref = keys, out
    else:
        kref = key_ref(keys)
        shape = tuple(getattr(out, "shape", ()))
        if shape != (kref.size, dim):
            raise OutputBufferError(f"out must have shape [{kref.size}, {dim}], got {list(shape)}")
        oref = output_ref(out, kref.size, dim, storage)
    out_type = output_code(oref, storage)
    if (kref.device != device_id and kref.device >= 0
            or oref.device != device_id and oref.device >= 0):
        raise DeviceError(
            f"the GPU cache is on cuda:{device_id} but the keys are on {kref.where()} and "
            f"the output on {oref.where()}")
    return kref, oref, out_type


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.startswith("cupy")


def host_keys(keys: np.ndarray) -> np.ndarray:
    """Host keys of any integer width and shape, widened and flattened to int64 [n]
    (checked by hps/intake/keys.py)."""
    return key_view(as_key_array(keys))  # type: ignore[no-any-return]


def device_keys(cp: Any, keys: Any, device: Any, device_id: int) -> Any:
    """int64 1-D keys on device `device_id` (`device`: its cupy.cuda.Device), checked by
    hps/intake/keys.py (host arrays: see host_keys, then copied over)."""
    if isinstance(keys, np.ndarray):
        host = host_keys(keys)
        with device:
            return cp.asarray(host)
    return key_view(keys, device_id)


def device_rows(cp: Any, vectors: Any, n: int, dim: int, device: Any, device_id: int,
                storage: StorageType, kind: str) -> Any:
    """float32 [n, dim] C-contiguous rows on device `device_id` (host arrays copied over)
    for a table (`kind`, named in errors) stored as `storage`. Raises LookupInputError for
    the wrong shape or dtype and, for compact storage, for rows it cannot hold (see
    hps/rows/storage_types.py)."""
    rows = _device_rows_unchecked(cp, vectors, n, dim, device, device_id, kind)
    if storage.compact and n:
        with device:
            limit = np.float32(storage.max_magnitude)
            unfit = ~(cp.abs(rows) < limit).all(axis=1)  # NaN compares False
            bad = int(cp.flatnonzero(unfit)[0]) if bool(unfit.any()) else None
        if bad is not None:
            raise _unfit_row(bad, storage, kind)
    return rows


def host_rows(vectors: np.ndarray, n: int, dim: int, storage: StorageType, kind: str
              ) -> np.ndarray:
    """`device_rows` of host rows, left on the host: float32 [n, dim] C-contiguous, checked
    the same way (the compact storage check in NumPy)."""
    rows = _shaped_host_rows(vectors, n, dim)
    if storage.compact and n:
        bad = first_unencodable_row(storage, rows)
        if bad is not None:
            raise _unfit_row(bad, storage, kind)
    return rows


def _shaped_host_rows(vectors: np.ndarray, n: int, dim: int) -> np.ndarray:
    rows = np.ascontiguousarray(vectors, dtype=np.float32)
    if rows.shape != (n, dim):
        raise LookupInputError(f"vectors must have shape ({n}, {dim}), got {rows.shape}")
    return rows


def _unfit_row(bad: int, storage: StorageType, kind: str) -> LookupInputError:
    return LookupInputError(
        f"row {bad} holds NaN, infinity or a value of magnitude ≥ {storage.max_magnitude:g}, "
        f"which the {kind}'s {storage.name} storage cannot hold")


def _device_rows_unchecked(cp: Any, vectors: Any, n: int, dim: int, device: Any,
                           device_id: int, kind: str) -> Any:
    if isinstance(vectors, np.ndarray):
        host = _shaped_host_rows(vectors, n, dim)
        with device:
            return cp.asarray(host)
    if not _is_cupy(vectors):
        raise LookupInputError(
            f"vectors must be a CuPy or NumPy array, got {type(vectors).__name__}"
        )
    if vectors.dtype != np.float32:
        raise LookupInputError(f"vectors must be float32, got dtype {vectors.dtype.name}")
    if tuple(vectors.shape) != (n, dim):
        raise LookupInputError(
            f"vectors must have shape ({n}, {dim}), got {tuple(vectors.shape)}"
        )
    if vectors.device.id != device_id:
        raise DeviceError(
            f"vectors are on device {vectors.device.id}, the {kind} on device "
            f"{device_id}"
        )
    return vectors if vectors.flags.c_contiguous else cp.ascontiguousarray(vectors)
