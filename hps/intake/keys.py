"""Checks of lookup keys and output buffers, from any array producer.

Accepted: NumPy and CuPy arrays, torch tensors, objects implementing `__dlpack__` (JAX
arrays, …) and legacy DLPack capsules (`torch.utils.dlpack.to_dlpack(t)`); where they
live is read by hps/intake/array_ref.py (one cached adapter per producer type, no copy).
Capsules are read, never consumed: HugeCTR's callers read their output capsule again
after `lookup_fromdlpack`.

Keys of any shape count as their flattened elements; integer keys are widened to int64.
Outputs must be writable with at least n × dim elements; a contiguous output's shape is
otherwise free (HugeCTR's tests pass `(1, n × dim)`), a strided one must be (n, dim).

Output dtypes (`check_output_dtype`, the one rule): float32 always; float16 or bfloat16
only for a table that stores that type (`embedding_storage_dtype`, hps/rows/storage_types.py), whose
rows are then written as stored, without widening. A float16 or bfloat16 output of a
table stored otherwise is an OutputBufferError: narrowing there would hide a precision
loss the model's config does not ask for. NumPy has no bfloat16: such outputs (torch
tensors, DLPack producers) are handed to the tiers as uint16 arrays of the same memory,
holding the bits.

This is the one place keys and outputs are checked. `key_ref` and `output_ref` check what
a user passes, as ArrayRefs (the GPU lookup path works on those); `as_key_array` and
`as_output_array` turn it into NumPy or CuPy arrays; `key_view`, `output_view` and
`device_output_view` check arrays already in the form the GPU tier (hps/gpu/) works on,
int64 [n] keys and float32 [n, dim] outputs as NumPy or CuPy arrays.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from hps.errors import BatchTooLargeError, DeviceError, KeyTypeError, OutputBufferError
from hps.intake.array_ref import ArrayRef, array_ref
from hps.rows.storage_types import BFLOAT16, FLOAT32, StorageType

_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
_FLOAT32 = np.dtype(np.float32)
_UINT16 = np.dtype(np.uint16)
_FLOAT16 = np.dtype(np.float16)


def key_ref(keys: Any) -> ArrayRef:
    """Where the keys are (see hps/intake/array_ref.py), checked to be integers.

    Keys of any shape count as their flattened elements. Raises KeyTypeError for what is
    no integer array and DeviceError for arrays on devices other than the CPU and CUDA.
    """
    ref = array_ref(keys, "keys")
    dtype = ref.dtype
    if dtype is None or dtype.kind not in "iu":
        raise KeyTypeError(
            f"keys must be integers (int64, int32 or uint32), got dtype {ref.dtype_name}"
        )
    return ref


def is_wide(ref: ArrayRef) -> bool:
    """Whether keys are already 64-bit (int64, or uint64 read as int64) and contiguous."""
    return ref.contiguous and (ref.dtype == _INT64 or ref.dtype == _UINT64)


def check_output_dtype(dtype_name: str, storage: StorageType = FLOAT32,
                       what: str = "output") -> None:
    """The output dtypes a lookup of a table stored as `storage` accepts: float32, and
    the storage's own float16 / bfloat16 (see the module docstring). Raises
    OutputBufferError naming the dtypes this table accepts."""
    if dtype_name == "float32" or dtype_name in storage.output_dtypes:
        return
    if storage.narrow_output is not None:
        raise OutputBufferError(
            f"{what} must be float32 or {storage.narrow_output} (the table stores "
            f"{storage.name} rows), got dtype {dtype_name}")
    hint = ""
    if dtype_name in ("float16", "bfloat16"):
        hint = (f": a {dtype_name} output takes a table stored as {dtype_name} "
                f"(embedding_storage_dtype; this one stores {storage.name})")
    raise OutputBufferError(f"{what} must be float32, got dtype {dtype_name}{hint}")


def _is_narrow(ref: ArrayRef, storage: StorageType) -> bool:
    """Whether `ref` has the 16-bit output dtype of `storage` (check_output_dtype's rule,
    without the dtype's name: NumPy computes names slowly, and this is on the path)."""
    narrow = storage.narrow_output
    if narrow is None:
        return False
    if ref.dtype is None:
        return ref.alien_dtype == narrow
    return narrow == "float16" and ref.dtype == _FLOAT16


def output_ref(out: Any, n: int, dim: int, storage: StorageType = FLOAT32) -> ArrayRef:
    """Where the output is, checked to take n × dim values of a dtype a table stored as
    `storage` fills (`check_output_dtype`).

    A contiguous output may have any shape with at least n × dim elements (the first
    n × dim are written, row after row); a strided one must have shape (n, dim) exactly.
    Raises OutputBufferError for the wrong dtype, a too-small, read-only or unusably
    strided buffer, and DeviceError for devices other than the CPU and CUDA.
    """
    ref = array_ref(out, "output")
    if ref.dtype is not _FLOAT32 and ref.dtype != _FLOAT32 and not _is_narrow(ref, storage):
        check_output_dtype(ref.dtype_name, storage)
    if ref.size < n * dim:
        raise OutputBufferError(
            f"output holds {ref.size} floats but {n} keys × width {dim} = {n * dim} "
            "are needed"
        )
    if not ref.contiguous and tuple(ref.shape) != (n, dim):
        raise OutputBufferError(
            f"output is strided (not C-contiguous): a strided output must have shape "
            f"[{n}, {dim}], got {list(ref.shape)}"
        )
    if not ref.writable:
        raise OutputBufferError("output is read-only")
    return ref


def _array_of(ref: ArrayRef) -> Any:
    if ref.dtype is None and ref.alien_dtype == BFLOAT16.name:
        ref = _as_bits(ref)
    return ref.host_array() if ref.on_host else ref.device_array()


def _as_bits(ref: ArrayRef) -> ArrayRef:
    """A bfloat16 output as uint16 (NumPy and CuPy have no bfloat16): same memory."""
    return ArrayRef(ref.ptr, ref.shape, ref.size, _UINT16, "", ref.device, ref.contiguous,
                    ref.strides, ref.writable, ref.stream, None, ref.owner)


def is_device_array(array: Any) -> bool:
    """Whether an array returned by this module lives on a CUDA device."""
    return not isinstance(array, np.ndarray)


def device_of(array: Any) -> int | None:
    """CUDA device id of a device array, None for host arrays."""
    return None if isinstance(array, np.ndarray) else int(array.device.id)


def as_key_array(keys: Any) -> Any:
    """Keys as a 1-D int64 array on the device they came from (NumPy or CuPy).

    Integer keys of other widths are widened (uint64 is reinterpreted, as HugeCTR's
    `long long` keys were). Raises KeyTypeError for non-integer keys.
    """
    return key_array(key_ref(keys))


def key_array(ref: ArrayRef) -> Any:
    """as_key_array for keys already checked by key_ref."""
    flat = _array_of(ref).reshape(-1)
    dtype = ref.dtype
    if dtype == _INT64:
        return flat if flat.flags.c_contiguous else flat.copy()
    if dtype == _UINT64:
        return flat.view(np.int64) if flat.flags.c_contiguous else flat.copy().view(np.int64)
    return flat.astype(np.int64)


def as_output_array(out: Any, n: int, dim: int, storage: StorageType = FLOAT32) -> Any:
    """A writable [n, dim] view of the first n × dim elements of `out`: float32, or the
    16-bit type of a table stored as float16 (float16) or bfloat16 (uint16 bits) (see
    output_ref for what is accepted and raised)."""
    return output_array(output_ref(out, n, dim, storage), n, dim)


def output_array(ref: ArrayRef, n: int, dim: int) -> Any:
    """as_output_array for an output already checked by output_ref."""
    array = _array_of(ref)
    if not ref.contiguous:
        return array
    return array.reshape(-1)[: n * dim].reshape(n, dim)


def _require_output_dtype(array: Any, what: str, storage: StorageType) -> None:
    if array.dtype != _FLOAT32:
        # an array form holds bfloat16 as its uint16 bits
        name = (BFLOAT16.name if storage is BFLOAT16 and array.dtype == _UINT16
                else array.dtype.name)
        check_output_dtype(name, storage, what)


def _require_dense_writable(array: Any, what: str) -> None:
    if not array.flags.c_contiguous:
        raise OutputBufferError(f"{what} must be C-contiguous (a dense row-major buffer)")
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        raise OutputBufferError(f"{what} is read-only")


# -- arrays already in the GPU tier's form ------------------------------------------------

# Most keys one call may carry: the GPU kernels number a batch's positions with int32.
MAX_KEYS_PER_CALL = 2**31 - 1


def _is_cupy_array(obj: Any) -> bool:
    cupy = sys.modules.get("cupy")  # a CuPy array means CuPy is imported already
    return cupy is not None and isinstance(obj, cupy.ndarray)


def key_view(keys: Any, device_id: int | None = None) -> Any:
    """`keys` as the GPU tier takes them: a 1-D int64 NumPy or CuPy array of at most
    MAX_KEYS_PER_CALL keys, a CuPy array on device `device_id` (not checked when None).

    Returns `keys`, or a C-contiguous copy of a strided view (on the same device). No
    widening: input of other integer widths goes through `as_key_array` first. Raises
    KeyTypeError (not such an array), BatchTooLargeError (too many keys) or DeviceError
    (keys on another device).
    """
    on_device = not isinstance(keys, np.ndarray)
    if on_device and not _is_cupy_array(keys):
        raise KeyTypeError(f"keys must be a NumPy or CuPy array, got {type(keys).__name__}")
    if keys.dtype != _INT64:
        raise KeyTypeError(f"keys must be int64, got dtype {keys.dtype.name}")
    if keys.ndim != 1:
        raise KeyTypeError(f"keys must be 1-D, got shape {tuple(keys.shape)}")
    if keys.shape[0] > MAX_KEYS_PER_CALL:
        raise BatchTooLargeError(
            f"at most {MAX_KEYS_PER_CALL} keys per call, got {keys.shape[0]}"
        )
    if on_device and device_id is not None and keys.device.id != device_id:
        raise DeviceError(
            f"keys are on device {keys.device.id} but the GPU table is on device {device_id}"
        )
    if keys.flags.c_contiguous:
        return keys
    if on_device:
        with keys.device:
            return keys.copy()
    return np.ascontiguousarray(keys)


def output_view(out: Any, n: int, dim: int, device_id: int | None = None,
                storage: StorageType = FLOAT32) -> Any:
    """`out` as the GPU tier writes it: [n, dim], C-contiguous, a writable NumPy array or
    a CuPy array on device `device_id` (not checked when None); float32, or for a table
    stored as float16 / bfloat16 also float16 / uint16 (bfloat16 bits). Returns `out`.
    Raises OutputBufferError, or DeviceError for an array on another device.
    """
    on_device = not isinstance(out, np.ndarray)
    if on_device and not _is_cupy_array(out):
        raise OutputBufferError(f"out must be a NumPy or CuPy array, got {type(out).__name__}")
    _require_output_dtype(out, "out", storage)
    if out.shape != (n, dim):
        raise OutputBufferError(f"out must have shape [{n}, {dim}], got {list(out.shape)}")
    _require_dense_writable(out, "out")
    if on_device and device_id is not None and out.device.id != device_id:
        raise DeviceError(
            f"out is on device {out.device.id} but the GPU table is on device {device_id}"
        )
    return out


def device_output_view(out: Any, n: int, dim: int, device_id: int,
                       storage: StorageType = FLOAT32) -> Any:
    """output_view for a kernel's own output: only a CuPy array on `device_id` will do."""
    if not _is_cupy_array(out):
        raise OutputBufferError(
            f"out must be a CuPy array on device {device_id}, got {type(out).__name__}"
        )
    return output_view(out, n, dim, device_id, storage)
