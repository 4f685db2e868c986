"""Compiled code: numba set-up shared by every module that has hot loops NumPy cannot express.

`kernel(signatures)` compiles a function for exactly the given signatures, each at its
first use (hps/runtime/compile_on_use.py: a process compiles what its config calls, not
every storage type of every tier), with the GIL released (`nogil`) and the machine code
cached on disk (`cache`): a process that finds the cache loads a kernel in milliseconds,
and a call with other argument types raises TypeError instead of compiling another
version. A command that must not compile inside a timed section calls the functions
once before it (`hps demo` loads a small model first).

Where the cache lives: hps/runtime/numba_cache.py (imported first: it sets numba up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hps.runtime.compile_on_use import on_use
from hps.runtime.numba_cache import numba

F = TypeVar("F", bound=Callable[..., Any])


types = numba.types


def kernel(signatures: Sequence[Any]) -> Callable[[F], F]:
    """`numba.njit(signatures, nogil=True, cache=True)`, each signature compiled at its
    first use; for these types only."""

    def wrap(fn: F) -> F:
        compiled: F = on_use(fn, signatures, nogil=True)
        return compiled

    return wrap


#: compiled calls that move at most this many bytes (rows fetched or written; the miss
#: path's dedupe: 32 bytes a key) keep the GIL, through their `holding_gil` twins. They end
#: within tens of µs, less than what a caller pays when another thread takes the GIL
#: meanwhile (it waits for that thread's next release, as long as its Python runs). H100,
#: HugeCTR's profile with an update stream: docs/gpu-latency.md, "Background work". Past
#: it, releasing pays: `HPS.lookup` from two threads on a CPU table of width 64 (2-core
#: box, three rounds each) made 47-51k lookups/s held against 33-34k released at 256 keys
#: (64 KiB of rows), but 21k against 39-41k at 512 keys and 5k against 14k at 2,048.
HOLD_GIL_BYTES = 64 << 10


def compile_declared(*functions: Any) -> None:
    """Compile every declared signature of `functions` (`kernel`s, `holding_gil`s) now,
    or read it from numba's cache, running none of them: for a path whose first call
    would otherwise compile where nothing may wait for it (after ready)."""
    for function in functions:
        for signature in function.declared:
            function.compile(signature)


def holding_gil(signatures: Sequence[Any]) -> Callable[[F], F]:
    """`kernel` without `nogil`: the twin of a kernel for small batches on a caller's path
    (HOLD_GIL_BYTES). A twin is a function of its own that calls the kernel (numba's disk
    cache keys a function by its code and types, not by `nogil`, so one function cannot be
    cached both ways)."""

    def wrap(fn: F) -> F:
        compiled: F = on_use(fn, signatures)
        return compiled

    return wrap


def by_size(nbytes: int, held: F, released: F) -> F:
    """The twin to call for a batch that moves `nbytes`: `held` up to HOLD_GIL_BYTES."""
    return held if nbytes <= HOLD_GIL_BYTES else released


def array(dtype: Any, ndim: int = 1, *, readonly: bool = False) -> Any:
    """The numba type of a C-contiguous NumPy array (`readonly` also accepts writable ones)."""
    return types.Array(numba.from_dtype(dtype), ndim, "C", readonly=readonly)


def inlined(fn: F) -> F:
    """A small helper compiled into each kernel that calls it (numba `inline="always"`)."""
    compiled: F = numba.njit(inline="always", cache=True)(fn)
    return compiled


def _prefetch_intrinsic() -> Any:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx: Any, arr: Any, index: Any) -> Any:
        if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array_type, index_type = signature.args
            view = context.make_array(array_type)(context, builder, args[0])
            first = context.cast(builder, args[1], index_type, types.intp)
            rest = [context.get_constant(types.intp, 0)] * (array_type.ndim - 1)
            pointer = cgutils.get_item_pointer2(  # type: ignore[no-untyped-call]
                context, builder, data=view.data,
                shape=cgutils.unpack_tuple(builder, view.shape),  # type: ignore[no-untyped-call]
                strides=cgutils.unpack_tuple(builder, view.strides),  # type: ignore[no-untyped-call]
                layout=array_type.layout, inds=[first, *rest])
            byte_pointer = builder.bitcast(pointer, ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [byte_pointer.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module, fnty, "llvm.prefetch.p0")
            # read, high locality, data cache
            builder.call(fn, [byte_pointer, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, index), codegen

    return prefetch


#: `prefetch(array, i)` inside a kernel: ask the CPU to bring the cache line of `array[i]`
#: (its first element for a row of a 2-D array) in ahead of its use. Random probes into
#: large tables wait on memory; several lines in flight at once hide most of that wait.
prefetch = _prefetch_intrinsic()


def _copy_bytes_intrinsic() -> Any:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def copy_bytes(typingctx: Any, dst: Any, dst_at: Any, src: Any, src_at: Any,
                   count: Any) -> Any:
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
                and dst.dtype == types.uint8 and src.dtype == types.uint8
                and dst.ndim == 1 and src.ndim == 1 and dst.layout == "C"
                and src.layout == "C" and dst.mutable):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            dst_type, at_type, src_type, from_type, count_type = signature.args
            i8p = ir.IntType(8).as_pointer()
            i64 = ir.IntType(64)
            dst_view = context.make_array(dst_type)(context, builder, args[0])
            src_view = context.make_array(src_type)(context, builder, args[2])
            to = builder.gep(builder.bitcast(dst_view.data, i8p),
                             [context.cast(builder, args[1], at_type, types.int64)])
            start = builder.gep(builder.bitcast(src_view.data, i8p),
                                [context.cast(builder, args[3], from_type, types.int64)])
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i8p, i64, ir.IntType(1)])
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module, fnty, "llvm.memcpy.p0.p0.i64")
            builder.call(fn, [to, start, context.cast(builder, args[4], count_type,
                                                      types.int64), ir.IntType(1)(0)])
            return context.get_dummy_value()

        return types.void(dst, dst_at, src, src_at, count), codegen

    return copy_bytes


#: `copy_bytes(dst, at, src, start, count)` inside a kernel: dst[at:at + count] =
#: src[start:start + count] for 1-D C-contiguous uint8 arrays that do not overlap, as one
#: memcpy (a slice assignment of a few hundred bytes is a loop of single bytes). No bounds
#: are checked: the caller keeps both ranges inside their arrays.
copy_bytes = _copy_bytes_intrinsic()


def _half_to_float_intrinsic() -> Any:
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def half_to_float(typingctx: Any, bits: Any) -> Any:
        if not isinstance(bits, types.Integer) or bits.bitwidth != 16:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            half = builder.bitcast(args[0], ir.HalfType())
            return builder.fpext(half, ir.FloatType())

        return types.float32(bits), codegen

    return half_to_float


#: `half_to_float(bits)` inside a kernel: the float32 value of IEEE binary16 `bits` (a
#: uint16), exact. numba has no float16 type on the CPU; LLVM widens it with the CPU's own
#: instruction (F16C's vcvtph2ps on x86-64), vectorized across a row.
half_to_float = _half_to_float_intrinsic()

