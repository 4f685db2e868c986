"""Checks of lookup keys and output buffers, from any array producer.

Accepted: NumPy and CuPy arrays, torch tensors, objects implementing `__dlpack__` (JAX
arrays, …) and legacy DLPack capsules (`torch.utils.dlpack.to_dlpack(t)`); where they
live is read by hps/producers.py (one cached adapter per producer type, no copy).
Capsules are read, never consumed: HugeCTR's callers read their output capsule again
after `lookup_fromdlpack`.

Keys of any shape count as their flattened elements; integer keys are widened to int64.
Outputs must be float32 and writable with at least n × dim elements; a contiguous output's
shape is otherwise free (HugeCTR's tests pass `(1, n × dim)`), a strided one must be
(n, dim).

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
from hps.producers import ArrayRef, array_ref

_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
_FLOAT32 = np.dtype(np.float32)


def key_ref(keys: Any) -> ArrayRef:
    """Where the keys are (see hps/producers.py), checked to be integers.

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


def output_ref(out: Any, n: int, dim: int) -> ArrayRef:
    """Where the output is, checked to take n × dim float32 values.

    A contiguous output may have any shape with at least n × dim elements (the first
    n × dim are written, row after row); a strided one must have shape (n, dim) exactly.
    Raises OutputBufferError for the wrong dtype, a too-small, read-only or unusably
    strided buffer, and DeviceError for devices other than the CPU and CUDA.
    """
    ref = array_ref(out, "output")
    if ref.dtype != _FLOAT32:
        raise OutputBufferError(f"output must be float32, got dtype {ref.dtype_name}")
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
    return ref.host_array() if ref.on_host else ref.device_array()


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


def as_output_array(out: Any, n: int, dim: int) -> Any:
    """A writable float32 [n, dim] view of the first n × dim elements of `out` (see
    output_ref for what is accepted and raised)."""
    ref = output_ref(out, n, dim)
    array = _array_of(ref)
    if not ref.contiguous:
        return array
    return array.reshape(-1)[: n * dim].reshape(n, dim)


def _require_float32(array: Any, what: str) -> None:
    if array.dtype != _FLOAT32:
        raise OutputBufferError(f"{what} must be float32, got dtype {array.dtype.name}")


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


def output_view(out: Any, n: int, dim: int, device_id: int | None = None) -> Any:
    """`out` as the GPU tier writes it: float32 [n, dim], C-contiguous, a writable NumPy
    array or a CuPy array on device `device_id` (not checked when None). Returns `out`.
    Raises OutputBufferError, or DeviceError for an array on another device.
    """
    on_device = not isinstance(out, np.ndarray)
    if on_device and not _is_cupy_array(out):
        raise OutputBufferError(f"out must be a NumPy or CuPy array, got {type(out).__name__}")
    _require_float32(out, "out")
    if out.shape != (n, dim):
        raise OutputBufferError(f"out must have shape [{n}, {dim}], got {list(out.shape)}")
    _require_dense_writable(out, "out")
    if on_device and device_id is not None and out.device.id != device_id:
        raise DeviceError(
            f"out is on device {out.device.id} but the GPU table is on device {device_id}"
        )
    return out


def device_output_view(out: Any, n: int, dim: int, device_id: int) -> Any:
    """output_view for a kernel's own output: only a CuPy array on `device_id` will do."""
    if not _is_cupy_array(out):
        raise OutputBufferError(
            f"out must be a CuPy array on device {device_id}, got {type(out).__name__}"
        )
    return output_view(out, n, dim, device_id)
