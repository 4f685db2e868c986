"""Compiled reads of raw addresses, for the places where a Python-level read costs more
than the work it describes: reading a DLPack capsule handed to a lookup, waiting for the
miss count a query kernel writes into mapped pinned host memory, and the address of a
v2 answer's buffer.

- `capsule_fields(id(capsule), DLTENSOR_NAME)` reads a legacy "dltensor" PyCapsule
  (CPython's layout: the object header, then the pointer and the name) and its DLTensor
  in one compiled call:
  about 0.3 µs where ctypes calls, string reads and struct unpacks took 5-6 µs a capsule.
  Use it only where `capsules_readable()`: the layout confirmed at first use against
  ctypes' `PyCapsule_GetPointer` on a capsule made for the purpose (CPython with the GIL,
  64-bit); elsewhere hps/intake/array_ref.py reads capsules through ctypes.
- `capsule_pair(id(keys), id(out), DLTENSOR_NAME)`: both capsules of a lookup read at
  once, for `device_pair` (hps/intake/keys.py): one compiled call instead of two, and no
  Python-level comparison of sixteen fields.
- `wait_while(address, sentinel, spins)` spins on an int32 that a kernel will overwrite,
  with the GIL released, and returns what it read (the sentinel when `spins` ran out).
  The query kernel's last block writes the miss count there after a system-scope fence,
  so the host learns it as soon as the write lands, before the kernel retires and its
  event completes (2-3 µs sooner on an H100); callers fall back to an event wait.
  `wait_while_held` is the same spin with the GIL kept.

- `address_of(buffer)`: where a byte array starts, for hps/http/kserve/encode.py's answers
  (whose values start on a cache line).

The loads are LLVM loads at an integer address: the caller guarantees the address is
readable for as long as the call runs (a capsule the caller holds, a buffer it owns).
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from typing import Any

import numpy as np

from hps.rows.gpu_layout import OUTPUT_CODES
from hps.runtime.compiled import array, holding_gil, kernel, numba, types


def _load_intrinsic(bits: int, atomic: bool) -> Any:
    from llvmlite import ir
    from numba.extending import intrinsic

    result = getattr(types, f"uint{bits}")

    @intrinsic
    def load(typingctx: Any, address: Any) -> Any:
        if not isinstance(address, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            pointer = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            if atomic:  # re-read on every call: a spin loop must see the device's write
                return builder.load_atomic(pointer, "acquire", bits // 8)
            return builder.load(pointer)

        return result(address), codegen

    return load


_u8 = _load_intrinsic(8, False)
_u32 = _load_intrinsic(32, False)
_u64 = _load_intrinsic(64, False)
_u32_acquire = _load_intrinsic(32, True)
_u64_acquire = _load_intrinsic(64, True)


def _fitted(builder: Any, value: Any, bits: int) -> Any:
    """An integer IR value cut or sign-extended to `bits` bits."""
    from llvmlite import ir

    if value.type.width > bits:
        return builder.trunc(value, ir.IntType(bits))
    if value.type.width < bits:
        return builder.sext(value, ir.IntType(bits))
    return value


def _write_intrinsic(bits: int, op: str | None) -> Any:
    """`store(address, value)` of `bits` bits (op None), or the int64 read-modify-write
    `op` returning the old value (sequentially consistent)."""
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def write(typingctx: Any, address: Any, value: Any) -> Any:
        if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            pointer = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            operand = _fitted(builder, args[1], bits)
            if op is None:
                builder.store(operand, pointer)
                return context.get_dummy_value()
            return builder.atomic_rmw(op, pointer, operand, "seq_cst")

        return (types.void if op is None else types.int64)(address, value), codegen

    return write


#: plain stores at an integer address (the other side reads them after a fence or an
#: atomic), and sequentially consistent read-modify-writes of an int64 returning the old
#: value: hps/gpu/fast_query.py's gate between callers and writers
_store32 = _write_intrinsic(32, None)
_store64 = _write_intrinsic(64, None)
_atomic_add64 = _write_intrinsic(64, "add")
_atomic_xchg64 = _write_intrinsic(64, "xchg")

# CPython's PyCapsule: PyObject_HEAD (refcount, type), then pointer, name, context, destructor
_CAPSULE_POINTER, _CAPSULE_NAME, _CAPSULE_SIZE = 16, 24, 48
DLTENSOR_NAME = np.frombuffer(b"dltensor\0", np.uint8).copy()
# capsule_fields' result: (ndim, data + byte_offset, device type, device id, dtype word
# (code | bits << 8 | lanes << 16), shape[0], shape[1], contiguous); ndim is -1 for a
# capsule of another name (consumed, versioned, no DLPack), -2 for more than 2 dimensions
_FIELDS = types.UniTuple(types.int64, 8)


@kernel([_FIELDS(types.int64, numba.typeof(DLTENSOR_NAME))])
def capsule_fields(address: int, name: np.ndarray) -> tuple[int, ...]:
    pointer = np.int64(_u64(address + _CAPSULE_POINTER))
    name_address = np.int64(_u64(address + _CAPSULE_NAME))
    if pointer == 0 or name_address == 0:
        return (-1, 0, 0, 0, 0, 0, 0, 0)
    for i in range(name.size):
        if _u8(name_address + i) != name[i]:
            return (-1, 0, 0, 0, 0, 0, 0, 0)
    # DLTensor: data, device (type, id: int32 each), ndim int32, dtype (u8 code, u8 bits,
    # u16 lanes), shape int64*, strides int64* (NULL: contiguous), byte_offset uint64
    data = np.int64(_u64(pointer))
    device_type = np.int64(_u32(pointer + 8))
    device_id = np.int64(_u32(pointer + 12))
    ndim = np.int64(_u32(pointer + 16))
    dtype_word = np.int64(_u32(pointer + 20))
    shape = np.int64(_u64(pointer + 24))
    strides = np.int64(_u64(pointer + 32))
    offset = np.int64(_u64(pointer + 40))
    if ndim > 2:
        return (-2, 0, 0, 0, 0, 0, 0, 0)
    d0 = np.int64(_u64(shape)) if ndim > 0 else np.int64(1)
    d1 = np.int64(_u64(shape + 8)) if ndim > 1 else np.int64(1)
    contiguous = np.int64(1)
    if strides != 0:  # strides in elements; a dimension of 1 may have any stride
        if ndim == 2 and d1 != 1 and np.int64(_u64(strides + 8)) != 1:
            contiguous = 0
        inner = d1 if ndim == 2 else np.int64(1)
        if ndim >= 1 and d0 != 1 and np.int64(_u64(strides)) != inner:
            contiguous = 0
    return (ndim, data + offset, device_type, device_id, dtype_word, d0, d1, contiguous)


# capsule_pair's result: (keys' data, key count, output's data, output elements, device,
# output type: hps/rows/gpu_layout.py's OUTPUT_CODES, 0 float32, 1 float16, 2 bfloat16)
_PAIR = types.UniTuple(types.int64, 6)
_DL_INT64 = 0 | 64 << 8 | 1 << 16  # DLPack dtype words: code | bits << 8 | lanes << 16
_DL_FLOAT32, _DL_FLOAT16, _DL_BFLOAT16 = 2 | 32 << 8 | 1 << 16, 2 | 16 << 8 | 1 << 16, \
    4 | 16 << 8 | 1 << 16
_DL_CUDA = 2
_OUT_FLOAT32, _OUT_FLOAT16, _OUT_BFLOAT16 = (OUTPUT_CODES[name] for name in
                                             ("float32", "float16", "bfloat16"))


@kernel([_PAIR(types.int64, types.int64, numba.typeof(DLTENSOR_NAME))])
def capsule_pair(keys_address: int, out_address: int, name: np.ndarray) -> tuple[int, ...]:
    """capsule_fields of a lookup's keys and output capsules in one call, reduced to
    what the lookup path's common case needs: int64 keys and a float32, float16 or
    bfloat16 output, both contiguous on one CUDA device. The device is -1 for any other
    pair."""
    k = capsule_fields(keys_address, name)
    o = capsule_fields(out_address, name)
    out_type = -1
    if o[4] == _DL_FLOAT32:
        out_type = _OUT_FLOAT32
    elif o[4] == _DL_FLOAT16:
        out_type = _OUT_FLOAT16
    elif o[4] == _DL_BFLOAT16:
        out_type = _OUT_BFLOAT16
    if (k[0] < 0 or o[0] < 0 or k[4] != _DL_INT64 or out_type < 0
            or k[2] != _DL_CUDA or o[2] != _DL_CUDA or o[3] != k[3]
            or k[7] == 0 or o[7] == 0):
        return (0, 0, 0, 0, -1, 0)
    return (k[1], k[5] * k[6], o[1], o[5] * o[6], k[3], out_type)


@kernel([types.int32(types.int64, types.int32, types.int64)])
def wait_while(address: int, sentinel: int, spins: int) -> int:
    """The int32 at `address` once it differs from `sentinel`, or the sentinel after
    `spins` reads (GIL released throughout)."""
    for _ in range(spins):
        value = np.int32(_u32_acquire(address))
        if value != sentinel:
            return value
    return sentinel


def _wait_while_held(address: int, sentinel: int, spins: int) -> int:
    # wait_while's loop, compiled without nogil (numba's cache would not tell the two
    # builds of one function apart)
    for _ in range(spins):
        value = np.int32(_u32_acquire(address))
        if value != sentinel:
            return value
    return sentinel


#: wait_while with the GIL kept throughout: a short wait that hands no turn to another
#: thread (hps/gpu/device_table.py says when that pays)
wait_while_held = holding_gil([types.int32(types.int64, types.int32, types.int64)])(
    _wait_while_held)

_layout: bool | None = None


@kernel([types.int64(array(np.uint8))])
def address_of(buffer: np.ndarray) -> int:
    """The address of a byte array's first element: 0.2 µs where `buffer.ctypes.data`
    (a ctypes object made per call) takes 1 µs."""
    return buffer.ctypes.data


def capsules_readable() -> bool:
    """Whether capsules have the layout capsule_fields reads, confirmed once on a real one
    (CPython with the GIL, 64-bit)."""
    global _layout
    if _layout is None:
        _layout = _layout_holds()
    return _layout


def _layout_holds() -> bool:
    if (sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED")
            or ctypes.sizeof(ctypes.c_void_p) != 8):
        return False
    probe = np.arange(3, dtype=np.int64)
    capsule = probe.__dlpack__()
    if type(capsule).__basicsize__ != _CAPSULE_SIZE:
        return False
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    try:
        tensor = get(capsule, b"dltensor")
    except ValueError:
        return False
    if ctypes.c_uint64.from_address(tensor).value != probe.ctypes.data:
        return False
    fields = capsule_fields(id(capsule), DLTENSOR_NAME)
    return fields[:2] == (1, probe.ctypes.data) and fields[5] == 3 and fields[7] == 1
