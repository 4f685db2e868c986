"""Intake of lookup keys and output buffers from any array producer.

Accepted: NumPy and CuPy arrays, objects implementing `__dlpack__` (PyTorch tensors, JAX
arrays, …) and legacy DLPack capsules (`torch.utils.dlpack.to_dlpack(t)`).

Capsules are read, never consumed: HugeCTR's callers read their output capsule again
after `lookup_fromdlpack`, so the capsule must keep its name ("dltensor") and its
deleter. The capsule's DLTensor is parsed with ctypes and viewed in place.

Keys of any shape count as their flattened elements; integer keys are widened to int64.
Outputs must be float32, C-contiguous, writable, with at least n × dim elements; their
shape is otherwise free (HugeCTR's tests pass `(1, n × dim)`).

This is the one place keys and outputs are checked. `as_key_array` and `as_output_array`
take what a user passes; `key_view`, `output_view` and `device_output_view` check arrays
already in the form the GPU tier (hps/gpu/) works on, int64 [n] keys and float32 [n, dim]
outputs as NumPy or CuPy arrays, and the GPU modules call them instead of checking
arguments themselves.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.errors import BatchTooLargeError, DeviceError, KeyTypeError, OutputBufferError

# -- DLPack structures (dlpack.h v0.8 / v1.0) ---------------------------------------------

_CPU, _CUDA, _CUDA_HOST, _CUDA_MANAGED = 1, 2, 3, 13
_HOST_DEVICES = (_CPU, _CUDA_HOST)
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                 10: "rocm", 13: "cuda_managed", 14: "oneapi"}
_READ_ONLY_FLAG = 1
_INT64 = np.dtype(np.int64)
_FLOAT32 = np.dtype(np.float32)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# DLPack type code → NumPy kind letter
_DL_KINDS = {0: "i", 1: "u", 2: "f", 6: "b"}


def _is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


@dataclass
class _Tensor:
    """A DLTensor read from a capsule; `owner` keeps the capsule (and memory) alive."""

    ptr: int
    device_type: int
    device_id: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in bytes; None = C-contiguous
    read_only: bool
    owner: Any

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def on_host(self) -> bool:
        return self.device_type in _HOST_DEVICES

    def is_c_contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected = self.dtype.itemsize
        for dim, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


def _read_capsule(capsule: Any, what: str) -> _Tensor:
    raw_name = _capsule_name(capsule)
    name = raw_name.decode() if raw_name else ""
    if name == "dltensor":
        managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, raw_name))
        tensor, flags = managed.dl_tensor, 0
    elif name == "dltensor_versioned":
        versioned = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, raw_name))
        tensor, flags = versioned.dl_tensor, versioned.flags
    elif name.startswith("used_"):
        raise KeyTypeError(
            f"{what}: the DLPack capsule was already consumed (a capsule can be imported "
            "once); pass the tensor itself or a fresh capsule"
        )
    else:
        raise KeyTypeError(f"{what}: not a DLPack capsule (capsule name {name!r})")
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    if code not in _DL_KINDS or lanes != 1 or bits % 8:
        raise KeyTypeError(f"{what}: unsupported DLPack dtype (code {code}, {bits} bits, "
                           f"{lanes} lanes)")
    dtype = np.dtype(f"{_DL_KINDS[code]}{bits // 8}") if code != 6 else np.dtype(bool)
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    strides = None
    if ndim and tensor.strides:
        strides = tuple(tensor.strides[i] * dtype.itemsize for i in range(ndim))
    return _Tensor(
        ptr=(tensor.data or 0) + tensor.byte_offset,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        dtype=dtype,
        shape=shape,
        strides=strides,
        read_only=bool(flags & _READ_ONLY_FLAG),
        owner=capsule,
    )


def _interface(t: _Tensor) -> dict[str, Any]:
    """The array-interface dict (v3) of a DLTensor, shared by NumPy's and CUDA's."""
    return {"data": (t.ptr, t.read_only), "shape": t.shape, "typestr": t.dtype.str,
            "strides": t.strides, "version": 3}


class _HostView:
    """Exposes a host DLTensor through NumPy's array interface and keeps its owner alive."""

    def __init__(self, t: _Tensor) -> None:
        self._owner = t.owner
        self.__array_interface__ = _interface(t)


class _DeviceView:
    """Exposes a CUDA DLPack tensor through `__cuda_array_interface__` for CuPy."""

    def __init__(self, t: _Tensor) -> None:
        self._owner = t.owner
        # stream None: the producer's stream is ordered by the caller (HugeCTR contract)
        self.__cuda_array_interface__ = {**_interface(t), "stream": None}


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise DeviceError(
            "the array is on a CUDA device but CuPy is not installed: pip install 'hps-server[gpu]'"
        ) from None
    return cupy


def _dlpack_tensor(obj: Any, what: str) -> _Tensor:
    """A fresh capsule from `obj.__dlpack__()` (ours to own), parsed."""
    device_type, _ = obj.__dlpack_device__()
    if device_type in (_CUDA, _CUDA_MANAGED):
        # stream=None: the producer must not wait on our stream; we run on the current one
        capsule = obj.__dlpack__(stream=None)
    else:
        capsule = obj.__dlpack__()
    tensor = _read_capsule(capsule, what)
    tensor.owner = (capsule, obj)
    return tensor


def _to_array(obj: Any, what: str) -> Any:
    """NumPy array (host) or CuPy array (CUDA) viewing `obj` without a copy."""
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__.startswith("cupy"):
        return obj
    if _is_capsule(obj):
        tensor = _read_capsule(obj, what)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        tensor = _dlpack_tensor(obj, what)
    elif isinstance(obj, (list, tuple, range)) or np.isscalar(obj):
        return np.asarray(obj)
    else:
        raise KeyTypeError(
            f"{what}: expected a NumPy/CuPy array, an object with __dlpack__ (e.g. a torch "
            f"tensor) or a DLPack capsule, got {type(obj).__name__}"
        )
    if tensor.on_host:
        return np.asarray(_HostView(tensor)) if tensor.size else np.empty(tensor.shape,
                                                                          tensor.dtype)
    if tensor.device_type in (_CUDA, _CUDA_MANAGED):
        cupy = _cupy()
        with cupy.cuda.Device(tensor.device_id):
            if not tensor.size:
                return cupy.empty(tensor.shape, tensor.dtype)
            return cupy.asarray(_DeviceView(tensor))
    name = _DEVICE_NAMES.get(tensor.device_type, str(tensor.device_type))
    raise DeviceError(f"{what}: arrays on device type {name!r} are not supported "
                      "(expected CPU or CUDA)")


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
    array = _to_array(keys, "keys")
    dtype = np.dtype(array.dtype)
    if dtype.kind not in "iu":
        raise KeyTypeError(
            f"keys must be integers (int64, int32 or uint32), got dtype {dtype.name}"
        )
    flat = array.reshape(-1)
    if dtype == np.int64:
        return flat if flat.flags.c_contiguous else flat.copy()
    if dtype == np.uint64:
        return flat.view(np.int64) if flat.flags.c_contiguous else flat.copy().view(np.int64)
    return flat.astype(np.int64)


def as_output_array(out: Any, n: int, dim: int) -> Any:
    """A writable float32 [n, dim] view of the first n × dim elements of `out`.

    Raises OutputBufferError for the wrong dtype, a too-small, non-contiguous or
    read-only buffer.
    """
    array = _to_array(out, "output")
    _require_float32(array, "output")
    if array.size < n * dim:
        raise OutputBufferError(
            f"output holds {array.size} floats but {n} keys × width {dim} = {n * dim} "
            "are needed"
        )
    _require_dense_writable(array, "output")
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
