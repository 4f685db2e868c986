"""The lookup path's common case, read in the fewest calls.

Nearly every GPU lookup brings int64 keys and a float32 output (or, for a table of
compact rows, the storage's own float16 / bfloat16), both C-contiguous, both on one CUDA
device, from one producer (two torch tensors, two CuPy arrays or two DLPack capsules).
`device_pair(keys, out)` reads exactly what such a call needs, as one tuple:

    (keys address, key count, output address, output elements, device, stream,
     output type)

the output type being hps/rows/gpu_layout.py's code (0 float32, 1 float16, 2 bfloat16;
CuPy has no bfloat16), and returns None for everything else: other dtypes, strides, host
memory, mixed producers, devices that differ. Whether the table may write that output
type is the caller's check (a float16 output of a float32 table goes the general path,
which refuses it). The caller then takes the general path (hps/intake/array_ref.py
`array_ref` with the checks of hps/intake/keys.py), which serves the rest and explains what it
refuses, so this module decides nothing a user could see except speed.

Why a second reader: the general one builds an ArrayRef of twelve fields per array, reads
attributes the common case never uses (shapes, strides, the output's stream) and passes
through four layers of checks. On the GPU machines a Python call or a torch attribute
read costs 0.15-0.3 µs, and that reading was a third of the public call's cost above the
kernel's (issue 11). Streams are the producers' own, as in hps/intake/array_ref.py: torch's
current raw stream of the device, CuPy's current stream of the device (also for capsules,
whose producer orders its own stream: HugeCTR's contract).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.intake import array_ref
from hps.rows.gpu_layout import OUTPUT_CODES

Pair = tuple[int, int, int, int, int, int, int]

_INT64 = np.dtype(np.int64)
# CuPy's output dtypes (np.dtype of a builtin type is one object: `is` holds; CuPy has no
# bfloat16, and a uint16 output is not read as one)
_FLOAT32 = np.dtype(np.float32)
_FLOAT16 = np.dtype(np.float16)
_OUT_FLOAT32, _OUT_FLOAT16 = OUTPUT_CODES["float32"], OUTPUT_CODES["float16"]

_torch_int64: Any = None
_torch_outputs: dict[Any, int] = {}  # torch output dtype → output type
_torch_stream: Any = None  # array_ref.torch_stream_reader(), once torch is in use


def _torch_pair(keys: Any, out: Any) -> Pair | None:
    global _torch_int64, _torch_stream
    if _torch_int64 is None:
        torch = sys.modules["torch"]
        _torch_outputs.update({getattr(torch, name): code for name, code in OUTPUT_CODES.items()})
        _torch_int64 = torch.int64
        _torch_stream = array_ref.torch_stream_reader()
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
            array_ref.cupy_stream(device), out_type)


# (raw_memory.capsule_pair, its name argument) where it reads this interpreter's capsules
_capsule_pair_reader: Any = False


def _capsule_pair(keys: Any, out: Any) -> Pair | None:
    global _capsule_pair_reader
    if _capsule_pair_reader is False:
        from hps.runtime import raw_memory

        compiled = array_ref.capsules_compiled()
        _capsule_pair_reader = ((raw_memory.capsule_pair, raw_memory.DLTENSOR_NAME)
                                if compiled else None)
    if _capsule_pair_reader is None:  # this interpreter's capsules are read through ctypes
        return None
    read, name = _capsule_pair_reader
    keys_data, n, out_data, out_size, device, out_type = read(id(keys), id(out), name)
    if device < 0:
        return None
    return (keys_data, n, out_data, out_size, device, array_ref.cupy_stream(device),
            out_type)


def _reader_for(kind: type) -> Callable[[Any, Any], Pair | None] | None:
    if array_ref.is_subclass_of(kind, "torch", "Tensor"):
        return _torch_pair
    if array_ref.is_subclass_of(kind, "cupy", "ndarray"):
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
