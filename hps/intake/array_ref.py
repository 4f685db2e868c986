"""Where an array lives, read once per call from whatever produced it.

`array_ref(obj, what)` describes a lookup's keys or output without copying and without
building a CuPy or NumPy array: the address, shape, dtype, device, contiguity and, for
CUDA arrays, the stream the producer works on. The reading is one small adapter per
producer type, chosen on the first object of that type and cached (type → adapter), so a
call pays a dict lookup and a few attribute reads:

- torch tensors: `data_ptr()`, `get_device()`, `is_contiguous()`; the stream is torch's
  current raw stream of the tensor's device (torch._C._cuda_getCurrentRawStream, the
  query torch.compile's generated code makes; no Stream object is built), so work on the
  caller's stream needs no event at all. Tensors on any CUDA device work from any thread,
  whatever the current device: nothing is exported through `__dlpack__`, whose device
  check raises a raw BufferError for tensors off the current device;
- CuPy arrays: their pointer, flags and device; the stream is CuPy's current stream;
- NumPy arrays: host arrays, kept as they are;
- DLPack capsules (`torch.utils.dlpack.to_dlpack(t)`, HugeCTR's calling style): the
  DLTensor is read in place (one compiled call, hps/runtime/raw_memory.py, for the common
  capsule; ctypes for the rest) and the capsule is not consumed (HugeCTR's
  callers read their output capsule again afterwards); the caller orders its stream
  (HugeCTR's contract), the work runs on CuPy's current stream;
- any other `__dlpack__` producer (JAX, …): `__dlpack__(stream=s)` with the stream the
  work will run on, so the producer orders its own work before it (the DLPack contract);
- lists, tuples, ranges and scalars: `np.asarray`.

Errors: KeyTypeError for what is no array; DeviceError for arrays on devices other than
the CPU and CUDA, and where a producer refuses to export (BufferError and the like).
Nothing raw escapes. Checks of dtype, size and layout are hps/intake/keys.py's.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.errors import DeviceError, KeyTypeError

HOST = -1  # ArrayRef.device of host memory

# DLPack device types (dlpack.h)
_CPU, _CUDA, _CUDA_HOST, _CUDA_MANAGED = 1, 2, 3, 13
_HOST_DEVICES = (_CPU, _CUDA_HOST)
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                 10: "rocm", 13: "cuda_managed", 14: "oneapi"}
_READ_ONLY_FLAG = 1
_DL_KINDS = {0: "i", 1: "u", 2: "f", 6: "b"}  # DLPack type code → NumPy kind
_DL_BFLOAT = 4  # kDLBfloat


class ArrayRef:
    """One array as a kernel or a copy needs it.

    ptr: address of the first element; shape, size (elements), dtype (NumPy; None for a
    dtype NumPy lacks, such as bfloat16, named by `alien_dtype`); device: CUDA device id or
    HOST; contiguous: C-contiguous; strides: in bytes, None when contiguous; writable;
    stream: the producer's stream for CUDA arrays (None: CuPy's current stream of the
    device); array: the NumPy or CuPy array itself where there is one; owner: what keeps
    the memory alive.
    """

    __slots__ = ("ptr", "shape", "size", "dtype", "alien_dtype", "device", "contiguous",
                 "strides", "writable", "stream", "array", "owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], size: int, dtype: np.dtype[Any] | None,
                 alien_dtype: str, device: int, contiguous: bool,
                 strides: tuple[int, ...] | None, writable: bool, stream: int | None,
                 array: Any, owner: Any) -> None:
        self.ptr = ptr
        self.shape = shape
        self.size = size
        self.dtype = dtype
        self.alien_dtype = alien_dtype
        self.device = device
        self.contiguous = contiguous
        self.strides = strides
        self.writable = writable
        self.stream = stream
        self.array = array
        self.owner = owner

    @property
    def dtype_name(self) -> str:
        """The dtype's name, for messages (NumPy computes names slowly: not on the path)."""
        return self.dtype.name if self.dtype is not None else self.alien_dtype

    @property
    def on_host(self) -> bool:
        return self.device == HOST

    def where(self) -> str:
        """'host' or 'cuda:<id>', for messages."""
        return "host" if self.device == HOST else f"cuda:{self.device}"

    def host_array(self) -> np.ndarray:
        """A NumPy view of host memory (no copy)."""
        if isinstance(self.array, np.ndarray):
            return self.array
        if self.size == 0:
            return np.empty(self.shape, self.dtype)
        view = _InterfaceView(self, "__array_interface__")
        return np.asarray(view)

    def device_array(self) -> Any:
        """A CuPy view of device memory (no copy; stream ordering is the caller's)."""
        if self.array is not None and not isinstance(self.array, np.ndarray):
            return self.array
        cupy = cupy_module()
        with cupy.cuda.Device(self.device):
            if self.size == 0:
                return cupy.empty(self.shape, self.dtype)
            return cupy.asarray(_InterfaceView(self, "__cuda_array_interface__"))


class _InterfaceView:
    """Exposes an ArrayRef through NumPy's or CUDA's array interface; keeps its owner."""

    def __init__(self, ref: ArrayRef, attribute: str) -> None:
        self._owner = ref.owner
        if ref.dtype is None:
            raise KeyTypeError(f"dtype {ref.dtype_name} has no NumPy equivalent")
        interface = {"data": (ref.ptr, not ref.writable), "shape": ref.shape,
                     "typestr": ref.dtype.str, "strides": ref.strides, "version": 3}
        if attribute == "__cuda_array_interface__":
            interface["stream"] = None  # ordered by the caller of the lookup
        setattr(self, attribute, interface)


def cupy_module() -> Any:
    try:
        import cupy
    except ImportError:
        raise DeviceError(
            "the array is on a CUDA device but CuPy is not installed: pip install 'hps-server[gpu]'"
        ) from None
    return cupy


# -- NumPy ------------------------------------------------------------------------------

def _numpy_ref(a: np.ndarray, what: str) -> ArrayRef:
    flags = a.flags
    contiguous = flags.c_contiguous
    return ArrayRef(a.ctypes.data if a.size else 0, a.shape, a.size, a.dtype, "", HOST,
                    contiguous, None if contiguous else a.strides, flags.writeable, None, a, a)


def _sequence_ref(obj: Any, what: str) -> ArrayRef:
    if isinstance(obj, (list, tuple)) and not obj:
        array = np.empty(0, np.int64)  # NumPy would read [] as float64
    else:
        try:
            array = np.asarray(obj)
        except (ValueError, TypeError) as exc:
            raise KeyTypeError(f"{what}: cannot read {type(obj).__name__} as an array: "
                               f"{exc}") from None
    _check_python_ints(obj, array, what)
    if array.dtype == object:
        raise KeyTypeError(f"{what}: expected numbers, got a {type(obj).__name__} of objects")
    return _numpy_ref(array, what)


_INT64_MAX = 2**63 - 1


def _check_python_ints(obj: Any, array: np.ndarray, what: str) -> None:
    """Python ints are keys only within int64. NumPy holds a list with 2**63 as uint64
    (which would wrap), one mixing it with negatives as float64 (which would round) and
    one beyond uint64 as objects: KeyTypeError naming the range for each."""
    out_of_range = bool(array.dtype == np.uint64 and array.size
                        and int(array.max()) > _INT64_MAX)
    if not out_of_range and array.dtype.kind in "fO":
        try:  # floats stay floats (refused by the dtype check); big ints raise here
            np.asarray(obj, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            # (an error path: a look at each value names the cause right)
            out_of_range = all(isinstance(k, int)
                               for k in np.ravel(np.asarray(obj, dtype=object)))
    if out_of_range:
        raise KeyTypeError(f"{what} must be integers within the int64 range "
                           "[-2**63, 2**63 - 1]; one is outside it")


# -- CuPy -------------------------------------------------------------------------------

_cupy_stream_ptr: Callable[[], int] | None = None


def _cupy_ref(a: Any, what: str) -> ArrayRef:
    memory = a.data
    device = memory.device_id
    contiguous = a.flags.c_contiguous
    return ArrayRef(memory.ptr, a.shape, a.size, a.dtype, "", device, contiguous,
                    None if contiguous else a.strides, True, cupy_stream(device), a, a)


def cupy_stream(device: int) -> int:
    """CuPy's current stream on `device`, as a pointer."""
    global _cupy_stream_ptr
    cupy = sys.modules["cupy"]
    if _cupy_stream_ptr is None:
        _cupy_stream_ptr = getattr(cupy.cuda.stream, "get_current_stream_ptr", None) or (
            lambda: int(cupy.cuda.get_current_stream().ptr))
    if cupy.cuda.runtime.getDevice() == device:
        return _cupy_stream_ptr()
    return int(cupy.cuda.get_current_stream(device).ptr)


# -- torch ------------------------------------------------------------------------------

_torch_dtypes: dict[Any, np.dtype[Any] | None] = {}
_raw_stream: Callable[[int], int] | None = None


def _torch_setup() -> None:
    """The torch dtype table and the raw-stream query, once."""
    global _raw_stream
    torch = sys.modules["torch"]
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "bool"):
        if hasattr(torch, name):
            _torch_dtypes[getattr(torch, name)] = np.dtype(name)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # older torch: through the Stream object
        def raw(device: int) -> int:
            return int(torch.cuda.current_stream(device).cuda_stream)
    _raw_stream = raw


def torch_stream_reader() -> Callable[[int], int]:
    """`f(device) -> int`: torch's current raw stream of a CUDA device (`device_pair`,
    hps/intake/keys.py, reads it without the checks of this module)."""
    if _raw_stream is None:
        _torch_setup()
    return _raw_stream  # type: ignore[return-value]


def _torch_ref(t: Any, what: str) -> ArrayRef:
    if _raw_stream is None:
        _torch_setup()
    dtype = _torch_dtypes.get(t.dtype)
    alien = "" if dtype is not None else str(t.dtype).replace("torch.", "")
    if t.is_cuda:
        device = t.get_device()
        stream: int | None = _raw_stream(device)  # type: ignore[misc]
    elif t.device.type == "cpu":
        device, stream = HOST, None
    else:
        raise DeviceError(f"{what}: tensors on device {t.device} are not supported "
                          "(expected CPU or CUDA)")
    contiguous = t.is_contiguous()
    strides = None if contiguous else tuple(s * t.element_size() for s in t.stride())
    return ArrayRef(t.data_ptr(), tuple(t.shape), t.numel(), dtype, alien, device, contiguous,
                    strides, True, stream, None, t)


# -- DLPack capsules and other __dlpack__ producers ---------------------------------------

# DLTensor: data (void*), device (int32 type, int32 id), ndim int32, dtype (u8 code, u8 bits,
# u16 lanes), shape (int64*), strides (int64*), byte_offset uint64
_DLTENSOR = struct.Struct("=QiiiBBHQQQ")
_VERSIONED_HEADER = 8 + 8 + 8 + 8  # version (2 × u32), manager_ctx, deleter, flags

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


# DLPack dtype word (code | bits << 8 | lanes << 16) → NumPy dtype, for the compiled reader
_DL_WORDS = {code | bits << 8 | 1 << 16: np.dtype(f"{kind}{bits // 8}")
             for code, kind in ((0, "i"), (1, "u"), (2, "f")) for bits in (8, 16, 32, 64)
             if not (kind == "f" and bits == 8)}
_DL_WORDS[6 | 8 << 8 | 1 << 16] = np.dtype(bool)
_capsule_fields: Callable[..., tuple[int, ...]] | None = None
_capsule_name_bytes: Any = None
_fast_capsules: bool | None = None  # None: not decided yet (see _compiled_capsules)


def _compiled_capsules() -> bool:
    """Whether capsules are read by hps/runtime/raw_memory.py's compiled reader: decided on the
    first capsule (the reader confirms the interpreter's capsule layout once)."""
    global _fast_capsules, _capsule_fields, _capsule_name_bytes
    from hps.runtime import raw_memory

    _capsule_fields = raw_memory.capsule_fields
    _capsule_name_bytes = raw_memory.DLTENSOR_NAME
    _fast_capsules = raw_memory.capsules_readable()
    return _fast_capsules


def capsules_compiled() -> bool:
    """Whether this interpreter's capsules are read by hps/runtime/raw_memory.py's compiled
    readers (decided on the first capsule)."""
    return bool(_fast_capsules or (_fast_capsules is None and _compiled_capsules()))


def _fast_capsule_ref(capsule: Any, stream: int | None, owner: Any) -> ArrayRef | None:
    """The common capsule (legacy name, up to 2 dimensions, contiguous, a CPU or CUDA
    array of a NumPy dtype) read by one compiled call; None for the rest."""
    ndim, data, dev_type, dev_id, word, d0, d1, contiguous = _capsule_fields(  # type: ignore[misc]
        id(capsule), _capsule_name_bytes)
    dtype = _DL_WORDS.get(word)
    if ndim < 0 or not contiguous or dtype is None:
        return None
    if dev_type == _CUDA or dev_type == _CUDA_MANAGED:
        device = dev_id
    elif dev_type == _CPU or dev_type == _CUDA_HOST:
        device = HOST
    else:
        return None
    shape = (d0, d1) if ndim == 2 else (d0,) if ndim == 1 else ()
    return ArrayRef(data, shape, d0 * d1, dtype, "", device, True, None, True, stream, None,
                    capsule if owner is None else (capsule, owner))


def _capsule_ref(capsule: Any, what: str, stream: int | None = None,
                 owner: Any = None) -> ArrayRef:
    if _fast_capsules or (_fast_capsules is None and _compiled_capsules()):
        ref = _fast_capsule_ref(capsule, stream, owner)
        if ref is not None:
            return ref
    try:  # a legacy capsule: one ctypes call
        address, flags = _capsule_pointer(capsule, b"dltensor"), 0
    except ValueError:  # another name: versioned, consumed or no DLPack capsule
        address, flags = _other_capsule(capsule, what)
    (data, dev_type, dev_id, ndim, code, bits, lanes, shape_p, strides_p,
     offset) = _DLTENSOR.unpack(ctypes.string_at(address, _DLTENSOR.size))
    dtype: np.dtype[Any] | None
    if (code, bits, lanes) == (_DL_BFLOAT, 16, 1):  # NumPy has none: named, not typed
        dtype, alien, itemsize = None, "bfloat16", 2
    elif code not in _DL_KINDS or lanes != 1 or bits % 8:
        raise KeyTypeError(f"{what}: unsupported DLPack dtype (code {code}, {bits} bits, "
                           f"{lanes} lanes)")
    else:
        dtype = _DL_DTYPES.get((code, bits)) or _dl_dtype(code, bits)
        alien, itemsize = "", dtype.itemsize
    shape = _int64s(ndim).unpack(ctypes.string_at(shape_p, 8 * ndim)) if ndim else ()
    size = 1
    for d in shape:
        size *= d
    strides = None
    contiguous = True
    if ndim and strides_p:
        elements = _int64s(ndim).unpack(ctypes.string_at(strides_p, 8 * ndim))
        strides = tuple(s * itemsize for s in elements)
        contiguous = _c_contiguous(shape, strides, itemsize)
        if contiguous:
            strides = None
    if dev_type in _HOST_DEVICES:
        device = HOST
    elif dev_type in (_CUDA, _CUDA_MANAGED):
        device = dev_id
    else:
        kind = _DEVICE_NAMES.get(dev_type, str(dev_type))
        raise DeviceError(f"{what}: arrays on device type {kind!r} are not supported "
                          "(expected CPU or CUDA)")
    return ArrayRef((data or 0) + offset, shape, size, dtype, alien, device, contiguous,
                    strides, not flags & _READ_ONLY_FLAG, stream, None,
                    capsule if owner is None else (capsule, owner))


_DL_DTYPES: dict[tuple[int, int], np.dtype[Any]] = {}
_INT64S: dict[int, struct.Struct] = {}


def _dl_dtype(code: int, bits: int) -> np.dtype[Any]:
    dtype = np.dtype(f"{_DL_KINDS[code]}{bits // 8}") if code != 6 else np.dtype(bool)
    _DL_DTYPES[(code, bits)] = dtype
    return dtype


def _int64s(n: int) -> struct.Struct:
    packer = _INT64S.get(n)
    if packer is None:
        packer = _INT64S[n] = struct.Struct(f"={n}q")
    return packer


def _other_capsule(capsule: Any, what: str) -> tuple[int, int]:
    """(DLTensor address, flags) of a versioned capsule; KeyTypeError for the rest."""
    raw_name = _capsule_name(capsule)
    name = raw_name.decode() if raw_name else ""
    if name == "dltensor_versioned":
        base = _capsule_pointer(capsule, raw_name)
        return base + _VERSIONED_HEADER, ctypes.c_uint64.from_address(base + 24).value
    if name.startswith("used_"):
        raise KeyTypeError(
            f"{what}: the DLPack capsule was already consumed (a capsule can be imported "
            "once); pass the tensor itself or a fresh capsule"
        )
    raise KeyTypeError(f"{what}: not a DLPack capsule (capsule name {name!r})")


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], item: int) -> bool:
    expected = item
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _dlpack_ref(obj: Any, what: str) -> ArrayRef:
    """Any `__dlpack__` producer: exported onto the stream the work will run on."""
    try:
        dev_type, dev_id = obj.__dlpack_device__()
        if dev_type in (_CUDA, _CUDA_MANAGED):
            cupy = cupy_module()
            stream = int(cupy.cuda.get_current_stream(int(dev_id)).ptr)
            # DLPack: 1 names CUDA's legacy default stream (0 is not allowed)
            capsule = obj.__dlpack__(stream=stream or 1)
            return _capsule_ref(capsule, what, stream, obj)
        return _capsule_ref(obj.__dlpack__(), what, None, obj)
    except (BufferError, RuntimeError, TypeError) as exc:
        raise DeviceError(f"{what}: {type(obj).__name__} could not be exported through "
                          f"DLPack: {exc}") from None


# -- type → adapter ---------------------------------------------------------------------

_Adapter = Callable[[Any, str], ArrayRef]
_adapters: dict[type, _Adapter] = {}


def _adapter_for(kind: type) -> _Adapter | None:
    if issubclass(kind, np.ndarray):
        return _numpy_ref
    if is_subclass_of(kind, "cupy", "ndarray"):
        return _cupy_ref
    if is_subclass_of(kind, "torch", "Tensor"):
        return _torch_ref
    if kind.__name__ == "PyCapsule":
        return _capsule_ref
    if hasattr(kind, "__dlpack__") and hasattr(kind, "__dlpack_device__"):
        return _dlpack_ref
    if issubclass(kind, (list, tuple, range, int, np.integer)):
        return _sequence_ref
    return None


def is_subclass_of(kind: type, module: str, name: str) -> bool:
    """Whether `kind` subclasses `module.name` (False while `module` is not imported)."""
    mod = sys.modules.get(module)  # an instance of it means the module is imported
    base = getattr(mod, name, None) if mod is not None else None
    return isinstance(base, type) and issubclass(kind, base)


def array_ref(obj: Any, what: str) -> ArrayRef:
    """The ArrayRef of `obj` (see the module docstring); `what` ('keys', 'output') names
    it in errors."""
    adapter = _adapters.get(type(obj))
    if adapter is None:
        adapter = _adapter_for(type(obj))
        if adapter is None:
            raise KeyTypeError(
                f"{what}: expected a NumPy/CuPy array, an object with __dlpack__ (e.g. a "
                f"torch tensor) or a DLPack capsule, got {type(obj).__name__}"
            )
        if adapter is not _sequence_ref:
            _adapters[type(obj)] = adapter
    return adapter(obj, what)
