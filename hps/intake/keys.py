"""The intake of lookups: keys and output buffers from any array producer, checked by the
general path, or read by one of its shortcuts for the common cases.

Accepted: NumPy and CuPy arrays, torch tensors, objects implementing `__dlpack__` (JAX
arrays, …) and legacy DLPack capsules (`torch.utils.dlpack.to_dlpack(t)`); where they
live is read by hps/intake/array_ref.py (one cached adapter per producer type, no copy).
Capsules are read, never consumed: HugeCTR's callers read their output capsule again
after `lookup_fromdlpack`.

Keys of any shape count as their flattened elements; integer keys are widened to int64.
Outputs must be writable with at least n × dim elements; a contiguous output's shape is
otherwise free (HugeCTR's tests pass `(1, n × dim)`), a strided one must be (n, dim).

Output dtypes (`check_output_dtype`, the one rule): float32 always; float16 or bfloat16
only for a table that stores that type (`embedding_storage_dtype`,
hps/rows/storage_types.py), whose rows are then written as stored, without widening. A
float16 or bfloat16 output of a table stored otherwise is an OutputBufferError: narrowing
there would hide a precision loss the model's config does not ask for. NumPy has no
bfloat16: such outputs (torch tensors, DLPack producers) are handed to the tiers as
uint16 arrays of the same memory, holding the bits.

This is the one place keys and outputs are checked. `key_ref` and `output_ref` check what
a user passes, as ArrayRefs (the GPU lookup path works on those); `as_key_array` and
`as_output_array` turn it into NumPy or CuPy arrays; `key_view`, `output_view` and
`device_output_view` check arrays already in the form the GPU tier (hps/gpu/) works on,
int64 [n] keys and float32 [n, dim] outputs as NumPy or CuPy arrays.

Beside that general path sit its two shortcuts, for the forms nearly every lookup brings;
each reads only what its case needs and answers "not mine" for everything else, which
then takes the general path (that checks it and explains what it refuses), so they decide
nothing a user could see except speed:

- `plain_host_keys` / `plain_host_output`: a 1-D C-contiguous NumPy int64 key array (and
  a writable C-contiguous float32 [n, dim] NumPy output), for a table without a GPU cache;
- `device_pair(keys, out)`: int64 keys and a float32 output (or, for a table of compact
  rows, the storage's own float16 / bfloat16), both C-contiguous on one CUDA device, from
  one producer (two torch tensors, two CuPy arrays or two DLPack capsules), read as one
  tuple

      (keys address, key count, output address, output elements, device, stream,
       output type)

  the output type being hps/rows/gpu_layout.py's code (0 float32, 1 float16, 2 bfloat16;
  CuPy has no bfloat16). Whether the table may write that output type is the caller's
  check (a float16 output of a float32 table goes the general path, which refuses it).
  Streams are the producers' own, as in hps/intake/array_ref.py: torch's current raw
  stream of the device, CuPy's current stream of the device (also for capsules, whose
  producer orders its own stream: HugeCTR's contract).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.errors import BatchTooLargeError, DeviceError, KeyTypeError, OutputBufferError
from hps.intake.array_ref import (
    ArrayRef,
    array_ref,
    capsules_compiled,
    cupy_stream,
    is_subclass_of,
    torch_stream_reader,
)
from hps.rows.gpu_layout import OUTPUT_CODES
from hps.rows.storage_types import BFLOAT16, FLOAT32, StorageType

# np.dtype of a builtin type is one object: `is` holds (the shortcuts compare so)
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
            "keys must be integers (int64, uint64, int32, uint32 or narrower), "
            f"got dtype {ref.dtype_name}"
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


def host_key_array(ref: ArrayRef) -> np.ndarray:
    """key_array on the host: CUDA keys copied over (the host tiers' form)."""
    keys = key_array(ref)
    return keys.get() if is_device_array(keys) else keys  # type: ignore[no-any-return]


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


# -- the shortcuts of the general path (see the module docstring) -------------------------

# Shortcut of key_ref + output_ref for host arrays: skips the reading of producers and
# devices (array_ref) and the ArrayRef it builds; on the HTTP routes those layers were
# about a tenth of a 1,024-key lookup's time.

def plain_host_keys(keys: Any) -> bool:
    """Whether `keys` is the common host form: a 1-D C-contiguous NumPy int64 array.

    A table without a GPU cache serves such keys without the general path. Every other
    form takes the general path, which checks it and raises as documented; so do empty
    and oversize batches (the caller's check)."""
    return (type(keys) is np.ndarray and keys.dtype is _INT64 and keys.ndim == 1
            and keys.flags.c_contiguous)


def plain_host_output(out: Any, n: int, dim: int) -> bool:
    """Whether `out` is a writable C-contiguous NumPy float32 [n, dim] array."""
    if type(out) is not np.ndarray or out.dtype is not _FLOAT32 or out.shape != (n, dim):
        return False
    flags = out.flags
    return flags.c_contiguous and flags.writeable


# Shortcut of key_ref + output_ref for CUDA arrays (device_pair): skips the twelve-field
# ArrayRef per array, the attributes the common case never uses (shapes, strides, the
# output's stream) and four layers of checks. On the GPU machines a Python call or a
# torch attribute read costs 0.15-0.3 µs, and that reading was a third of the public
# call's cost above the kernel's.

Pair = tuple[int, int, int, int, int, int, int]

# CuPy's output dtypes (CuPy has no bfloat16, and a uint16 output is not read as one)
_OUT_FLOAT32, _OUT_FLOAT16 = OUTPUT_CODES["float32"], OUTPUT_CODES["float16"]

_torch_int64: Any = None
_torch_outputs: dict[Any, int] = {}  # torch output dtype → output type
_torch_stream: Any = None  # torch_stream_reader(), once torch is in use


def _torch_pair(keys: Any, out: Any) -> Pair | None:
    global _torch_int64, _torch_stream
    if _torch_int64 is None:
        torch = sys.modules["torch"]
        _torch_outputs.update({getattr(torch, name): code for name, code in OUTPUT_CODES.items()})
        _torch_int64 = torch.int64
        _torch_stream = torch_stream_reader()
    out_type = _torch_outputs.get(out.dtype)
    if (out_type is None or keys.dtype is not _torch_int64 or not keys.is_cuda
            or not out.is_cuda):
        return None
    device = keys.get_device()
    if out.get_device() != device or not keys.is_contiguous() or not out.is_contiguous():
        return None
    return (keys.data_ptr(), keys.numel(), out.data_ptr(), out.numel(), device,
            _torch_stream(device), out_type)


def _cupy_pair(keys: Any, out: Any) -> Pair | None:
    # `_c_contiguous`: CuPy's own flag, a readonly attribute of every CuPy ndarray (where
    # `flags` builds a Flags object per read); _reader_for checks that it is there
    if keys.dtype is not _INT64 or not keys._c_contiguous or not out._c_contiguous:
        return None
    dtype = out.dtype
    if dtype is _FLOAT32:
        out_type = _OUT_FLOAT32
    elif dtype is _FLOAT16:
        out_type = _OUT_FLOAT16
    else:
        return None
    key_memory = keys.data
    out_memory = out.data
    device = key_memory.device_id
    if out_memory.device_id != device:
        return None
    return (key_memory.ptr, keys.size, out_memory.ptr, out.size, device,
            cupy_stream(device), out_type)


# (raw_memory.capsule_pair, its name argument) where it reads this interpreter's capsules
_capsule_pair_reader: Any = False


def _capsule_pair(keys: Any, out: Any) -> Pair | None:
    global _capsule_pair_reader
    if _capsule_pair_reader is False:
        from hps.runtime import raw_memory

        compiled = capsules_compiled()
        _capsule_pair_reader = ((raw_memory.capsule_pair, raw_memory.DLTENSOR_NAME)
                                if compiled else None)
    if _capsule_pair_reader is None:  # this interpreter's capsules are read through ctypes
        return None
    read, name = _capsule_pair_reader
    keys_data, n, out_data, out_size, device, out_type = read(id(keys), id(out), name)
    if device < 0:
        return None
    return (keys_data, n, out_data, out_size, device, cupy_stream(device), out_type)


def _reader_for(kind: type) -> Callable[[Any, Any], Pair | None] | None:
    if is_subclass_of(kind, "torch", "Tensor"):
        return _torch_pair
    if is_subclass_of(kind, "cupy", "ndarray"):
        return _cupy_pair if hasattr(kind, "_c_contiguous") else None
    if kind.__name__ == "PyCapsule":
        return _capsule_pair
    return None


# producer type → its pair reader (None: no fast reading for that type)
_readers: dict[type, Callable[[Any, Any], Pair | None] | None] = {}


def device_pair(keys: Any, out: Any) -> Pair | None:
    """(keys address, key count, output address, output elements, device, stream, output
    type) for int64 keys and a float32, float16 or bfloat16 output, both C-contiguous on
    one CUDA device and of one producer type; None otherwise (the general path serves
    it)."""
    kind = type(keys)
    if type(out) is not kind:
        return None
    try:
        reader = _readers[kind]
    except KeyError:
        reader = _readers[kind] = _reader_for(kind)
    return reader(keys, out) if reader is not None else None


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
