"""The one loader of the CUDA sources in `cuda/`: compiled by CuPy (NVRTC) into RawModules.

Each source is compiled once per (device, compile-time constants) and kept for the life
of the process; CuPy's on-disk kernel cache spares the compile on later runs.
`#include "hps_common.cuh"` lines are replaced by the header's text before compiling, so
CuPy's cache (keyed by source text) sees header changes too.

Every compile-time constant reaches the kernels from here, as a -D option; the .cu files
define none of them (they stop with #error when one is missing), so Python and CUDA
cannot disagree:
- the slot layout, the same for every table: SET_SIZE, EMPTY_KEY, RANK_BITS (below);
- per table, from its caller: DIM, the storage type STORAGE and output type OUT_TYPE
  (codes of hps/rows/gpu_layout.py; float32 by default), and the launch shape GROUP,
  UNROLL, HINTS, STAMP_SHIFT, PROBE_WINDOW (defaults below for the kernels that do not
  set them);
- derived here: ROW_BYTES, the bytes of a stored row of DIM in STORAGE
  (hps/rows/gpu_layout.py stored_row_bytes), which the header checks against its own layout.

Sources are found in the installed package (`hps/cuda/`, shipped in the wheel) or, in a
source checkout, in the repository's top-level `cuda/` folder.
"""

from __future__ import annotations

import ctypes
import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from hps.errors import DeviceError, MissingExtraError
from hps.rows.gpu_layout import STORAGE_CODES, stored_row_bytes
from hps.rows.storage_types import storage_type

# The slot layout shared by the Python side and every kernel.
SET_SIZE = 8  # slots per set (dynamic cache) or bucket (static table): 64 B of keys
EMPTY_KEY = 2**63 - 1  # key of a free slot; that key itself lives in a special slot
# A stamp is tick << RANK_BITS | rank: the rank of a key among the keys of its set in one
# insert batch (0 for query hits), so a batch that overflows a set evicts its own earliest
# keys rather than its latest. 44 bits of ticks outlast any server (5 years at 100k/s).
RANK_BITS = 20
_LAYOUT = {"SET_SIZE": SET_SIZE, "EMPTY_KEY": EMPTY_KEY, "RANK_BITS": RANK_BITS}
# Launch-shape constants of kernels that do not choose them: rows.cu (no lane groups),
# the static table's large-batch query (one bucket per probe step), a table's exact LRU.
_TUNING_DEFAULTS = {"GROUP": 4, "UNROLL": 1, "HINTS": 0, "STAMP_SHIFT": 0, "PROBE_WINDOW": 1,
                    "STORAGE": 0, "OUT_TYPE": 0}

# Most keys one launch serves: the kernels number a batch's positions with int32.
MAX_BATCH = 2**31 - 1
_STORAGE_BY_CODE = {code: name for name, code in STORAGE_CODES.items()}

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_lock = threading.Lock()
_modules: dict[tuple[Any, ...], Any] = {}


def cupy_module() -> Any:
    """The `cupy` module, or MissingExtraError naming the 'gpu' extra."""
    try:
        import cupy
    except ImportError:
        raise MissingExtraError("cupy", "gpu", "the GPU embedding cache") from None
    return cupy


def source_dir() -> Path:
    """The folder holding the .cu/.cuh sources."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "cuda", here.parent.parent / "cuda"):
        if (candidate / "hps_common.cuh").is_file():
            return candidate
    raise DeviceError(
        f"CUDA sources of hps not found (looked in {here.parent / 'cuda'} and "
        f"{here.parent.parent / 'cuda'}); the installation is incomplete"
    )


@lru_cache(maxsize=None)
def _source_text(name: str) -> str:
    """A source with its local includes pasted in (each header once)."""
    folder = source_dir()
    seen: set[str] = set()

    def expand(file: str) -> str:
        text = (folder / file).read_text()

        def include(m: re.Match[str]) -> str:
            header = m.group(1)
            if header in seen:
                return ""
            seen.add(header)
            return expand(header)

        return _INCLUDE.sub(include, text)

    return expand(name)


def compile_options(defines: dict[str, int]) -> tuple[str, ...]:
    """The -D options of a compile: the layout constants, the caller's `defines` (DIM,
    storage and output types, launch shape), the tuning defaults for what the caller left
    out and ROW_BYTES. Raises DeviceError when a caller tries to change the layout."""
    fixed = (_LAYOUT.keys() | {"ROW_BYTES"}) & defines.keys()
    if fixed:
        raise DeviceError(f"{sorted(fixed)} are fixed by hps/gpu/kernels.py, not per kernel")
    merged = {**_TUNING_DEFAULTS, **defines, **_LAYOUT}
    if "DIM" in merged:
        storage = _STORAGE_BY_CODE[int(merged["STORAGE"])]
        merged["ROW_BYTES"] = stored_row_bytes(int(merged["DIM"]), storage_type(storage))
    return tuple(f"-D{k}={int(v)}" for k, v in sorted(merged.items()))


def module(source: str, device_id: int, **defines: int) -> Any:
    """The RawModule of `cuda/<source>` for a device and -D constants (compiled once)."""
    key = (source, device_id, tuple(sorted(defines.items())))
    mod = _modules.get(key)
    if mod is not None:
        return mod
    cupy = cupy_module()
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            options = compile_options(defines)
            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(code=_source_text(source), options=options)
                mod.compile()
            _modules[key] = mod
    return mod


def function(source: str, name: str, device_id: int, **defines: int) -> DeviceKernel:
    """One kernel of a module, on device `device_id` (see DeviceKernel)."""
    cupy = cupy_module()
    mod = module(source, device_id, **defines)
    with cupy.cuda.Device(device_id):
        return DeviceKernel(cupy, mod.get_function(name), device_id)


class DeviceKernel:
    """A kernel of one device, whatever the calling thread's current device.

    CuPy's RawKernel looks its CUfunction up for the device current at each use: a launch
    bound (`Launch`) or a kernel called from a thread whose current device was another one
    took that device's handle, and the launch on the table's stream failed with
    CUDA_ERROR_INVALID_HANDLE (keys on cuda:1 from a thread on cuda:0). Here the handle is
    read once, in the device's context, and a call switches to the device when needed.

        fn.kernel.ptr                         # the CUfunction of device_id
        fn((grid,), (block,), args)           # launched on device_id's current stream
    """

    __slots__ = ("kernel", "device_id", "_rt", "_device")

    def __init__(self, cupy: Any, raw: Any, device_id: int) -> None:
        self.device_id = device_id
        self._rt = cupy.cuda.runtime
        self._device = cupy.cuda.Device(device_id)
        with self._device:
            self.kernel = raw.kernel  # cupy.cuda.function.Function in device_id's context

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 shared_mem: int = 0, stream: Any = None) -> None:
        if self._rt.getDevice() == self.device_id:
            self.kernel(grid, block, args, shared_mem, stream)
            return
        with self._device:
            self.kernel(grid, block, args, shared_mem, stream)


@lru_cache(maxsize=None)
def multiprocessors(device_id: int) -> int:
    """Streaming multiprocessor count of a device (sizes the grids)."""
    cupy = cupy_module()
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def resident_blocks(fn: Any, block: int) -> int:
    """Blocks of `block` threads of kernel `fn` (from `function`) that fit one SM at once:
    the grid of a kernel whose blocks loop over their work is this times the SMs."""
    cupy = cupy_module()
    ptr = int(getattr(fn, "kernel", fn).ptr)
    with cupy.cuda.Device(getattr(fn, "device_id", cupy.cuda.runtime.getDevice())):
        return max(1, int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            ptr, block, 0)))


def grid(device_id: int, threads: int, block: int = 256, waves: int = 16) -> int:
    """Blocks for `threads` threads, capped at `waves` blocks per SM (kernels loop over
    the rest); waves 0: no cap."""
    need = max(1, -(-threads // block))
    return min(need, multiprocessors(device_id) * waves) if waves else need


@lru_cache(maxsize=1)
def driver() -> Any:
    """This process's libcuda with the calls the compiled paths make declared (pointers
    as 64-bit integers: the same registers on the x86-64 and AArch64 ABIs): cuLaunchKernel,
    cuEventRecord, cuStreamWaitEvent, cuMemcpyHtoDAsync_v2, cuCtxGetCurrent,
    cuPointerGetAttribute, cuDeviceGet, cuDeviceGetP2PAttribute; None where there is no
    libcuda."""
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    except OSError:
        return None
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32
    for name, argtypes in (("cuLaunchKernel", [u64, u32, u32, u32, u32, u32, u32, u32, u64,
                                               u64, u64]),
                           ("cuEventRecord", [u64, u64]),
                           ("cuStreamWaitEvent", [u64, u64, u32]),
                           ("cuMemcpyHtoDAsync_v2", [u64, u64, u64, u64]),
                           ("cuCtxGetCurrent", [u64]),
                           ("cuPointerGetAttribute", [u64, i32, u64]),
                           ("cuDeviceGet", [u64, i32]),
                           ("cuDeviceGetP2PAttribute", [u64, i32, i32, i32])):
        call = getattr(lib, name)
        call.argtypes, call.restype = argtypes, i32
    return lib


@lru_cache(maxsize=2)
def _held_launcher(nogil: bool = False) -> Any:
    """cuLaunchKernel then cuEventRecord in one compiled call that keeps the GIL, or None
    where libcuda or numba cannot give one (launches then go through CuPy). `nogil`:
    the same call releasing the GIL, for the probes that measure what keeping it gains
    (scripts/probe_two_callers.py --nogil-launch); the lookup path never asks for it.

    Why keep the GIL for a few microseconds of driver calls: with several caller threads,
    every call that releases the GIL (CuPy's launch, CuPy's event record, the runtime's
    device query) is a point where the GIL passes to another thread, and getting it back
    waits for that thread's next release and a futex wake. On the H100, 2 threads on their
    own streams got half of one thread's keys/s through `lookup_fromdlpack` (2,000 keys,
    50.6 -> 27.1 M keys/s, `hps bench gpu --profile threads`); the driver serialises
    launches on its context lock anyway, so holding the GIL over them costs no overlap."""
    lib = driver()
    try:
        from hps.runtime.compiled import numba, types
    except ImportError:
        return None
    if lib is None:
        return None
    cu_launch, cu_record = lib.cuLaunchKernel, lib.cuEventRecord

    def launch_recorded(fn: int, grid: int, block: int, stream: int, params: int,
                        event: int) -> int:
        status = cu_launch(fn, grid, 1, 1, block, 1, 1, 0, stream, params, 0)
        if status == 0 and event != 0:
            status = cu_record(event, stream)
        return status

    # not nogil (the point), not cached (it calls through addresses of this process)
    return numba.njit(types.int32(types.uint64, types.uint32, types.uint32, types.uint64,
                                  types.uint64, types.uint64), nogil=nogil)(launch_recorded)


def held_launcher() -> Any:
    """The compiled launch-then-record call that keeps the GIL (_held_launcher says why),
    for launches bound outside Launch: held(function, grid, block, stream, params, event)
    -> status (event 0: none recorded); None where libcuda or numba cannot give it."""
    return _held_launcher()


class HeldCalls:
    """The driver calls of the miss path that the lookup makes with the GIL held (see
    _held_launcher for why), each falling back to CuPy's runtime call (which releases
    it) where libcuda or numba cannot give them:

        held.copy_to_device(dst, src, nbytes, stream)   # cuMemcpyHtoDAsync
        held.record(event, stream)                      # cuEventRecord
        held.wait(stream, event)                        # cuStreamWaitEvent

    With a background thread busy (online updates applied meanwhile), each release
    in a lookup is a point where that thread takes the GIL and the lookup waits for
    its next release: with 10,000 update rows/s (`hps bench gpu --profile hugectr
    --updates 10000`, H100), the copy of the missed rows took 152 µs in the slowest 2%
    of calls through CuPy, 14 µs here (scripts/probe_gpu_tails.py)."""

    def __init__(self) -> None:
        rt = cupy_module().cuda.runtime
        compiled = _held_calls()
        if compiled is None:
            self.copy_to_device: Any = lambda dst, src, nbytes, stream: rt.memcpyAsync(
                dst, src, nbytes, 1, stream)
            self.record: Any = rt.eventRecord
            self.wait: Any = lambda stream, event: rt.streamWaitEvent(stream, event, 0)
            return
        check = cupy_module().cuda.driver.check_status
        copy, record, wait = compiled

        def copy_to_device(dst: int, src: int, nbytes: int, stream: int) -> None:
            status = copy(dst, src, nbytes, stream)
            if status:
                check(status)

        def record_event(event: int, stream: int) -> None:
            status = record(event, stream)
            if status:
                check(status)

        def wait_event(stream: int, event: int) -> None:
            status = wait(stream, event)
            if status:
                check(status)

        self.copy_to_device = copy_to_device
        self.record = record_event
        self.wait = wait_event


@lru_cache(maxsize=1)
def held_calls() -> HeldCalls:
    """The process's HeldCalls (made on first use)."""
    return HeldCalls()


@lru_cache(maxsize=1)
def _held_calls() -> tuple[Any, Any, Any] | None:
    """cuMemcpyHtoDAsync, cuEventRecord and cuStreamWaitEvent as compiled calls that
    keep the GIL, or None (as _held_launcher)."""
    lib = driver()
    try:
        from hps.runtime.compiled import numba, types
    except ImportError:
        return None
    if lib is None:
        return None
    cu_copy, cu_record = lib.cuMemcpyHtoDAsync_v2, lib.cuEventRecord
    cu_wait = lib.cuStreamWaitEvent

    def copy(dst: int, src: int, nbytes: int, stream: int) -> int:
        return cu_copy(dst, src, nbytes, stream)

    def record(event: int, stream: int) -> int:
        return cu_record(event, stream)

    def wait(stream: int, event: int) -> int:
        return cu_wait(stream, event, 0)

    sig2 = types.int32(types.uint64, types.uint64)
    return (numba.njit(types.int32(types.uint64, types.uint64, types.uint64,
                                   types.uint64))(copy),
            numba.njit(sig2)(record), numba.njit(sig2)(wait))


_Scalar = ctypes.c_uint64 | ctypes.c_int64 | ctypes.c_uint32 | ctypes.c_int32 | ctypes.c_float
_CTYPES: dict[str, type[_Scalar]] = {
    "ptr": ctypes.c_uint64, "i64": ctypes.c_int64, "u64": ctypes.c_uint64,
    "u32": ctypes.c_uint32, "i32": ctypes.c_int32, "f32": ctypes.c_float,
}
_NUMPY = {"ptr": "uint64", "i64": "int64", "u64": "uint64", "u32": "uint32", "i32": "int32",
          "f32": "float32"}


class Launch:
    """One kernel launched through cuLaunchKernel with a reusable parameter block.

    `signature` names the kernel's parameter types in order ("ptr i64 u32 f32 ..."); a
    call takes plain ints (device pointers too) and floats. This spends about a
    microsecond of Python per launch where a CuPy call converts every argument.

    A launch can also be bound: `set(i, value)` fixes parameter i once (a table's
    pointers, a workspace's buffers) and `go(grid, block, stream)` launches with the
    parameters as they stand, so a call sets only what changed. Not thread-safe: one
    Launch per thread (workspaces hold their own), or callers hold a lock.
    """

    def __init__(self, fn: Any, signature: str) -> None:
        cupy = cupy_module()
        self._cp = cupy
        types = signature.split()
        self._values = [_CTYPES[t]() for t in types]
        self._ptrs = (ctypes.c_void_p * len(self._values))(
            *(ctypes.addressof(v) for v in self._values))
        self._params = ctypes.addressof(self._ptrs)
        self._fn = fn
        self._numpy = [getattr(np, _NUMPY[t]) for t in types]
        try:
            self._fptr: int | None = int(getattr(fn, "kernel", fn).ptr)
        except AttributeError:  # a CuPy without the kernel handle: convert per call
            self._fptr = None
        self._launch = cupy.cuda.driver.launchKernel
        self._held = _held_launcher() if self._fptr is not None else None

    @property
    def function_address(self) -> int | None:
        """The kernel's CUfunction, or None (a CuPy without the handle)."""
        return self._fptr

    @property
    def params_address(self) -> int:
        """Where the parameter block (cuLaunchKernel's kernelParams) lives."""
        return self._params

    def set(self, index: int, value: float) -> None:
        """Fixes parameter `index` for the launches that follow."""
        self._values[index].value = value

    @property
    def values(self) -> list[Any]:
        """The parameter cells (ctypes scalars): `values[i].value = x` is set(i, x) without
        the method call, for the few parameters a hot path changes per launch."""
        return self._values

    def go(self, grid: int, block: int, stream_ptr: int) -> None:
        """Launches with the parameters as set."""
        if self._fptr is None:
            args = tuple(t(v.value) for t, v in zip(self._numpy, self._values, strict=True))
            self._fn((grid,), (block,), args, stream=self._cp.cuda.ExternalStream(stream_ptr))
            return
        self._launch(self._fptr, grid, 1, 1, block, 1, 1, 0, stream_ptr, self._params, 0)

    def go_recorded(self, grid: int, block: int, stream_ptr: int, event_ptr: int) -> None:
        """go(), then `event_ptr` recorded on the stream after the kernel, both with the
        GIL held (see _held_launcher) where the driver can be called directly."""
        held = self._held
        if held is None:
            self.go(grid, block, stream_ptr)
            self._cp.cuda.runtime.eventRecord(event_ptr, stream_ptr)
            return
        status = held(self._fptr, grid, block, stream_ptr, self._params, event_ptr)
        if status:
            self._cp.cuda.driver.check_status(status)

    def __call__(self, grid: int, block: int, stream_ptr: int, *args: float) -> None:
        for value, arg in zip(self._values, args, strict=True):
            value.value = arg
        self.go(grid, block, stream_ptr)


def cuda_available() -> bool:
    """Whether CuPy imports and at least one CUDA device is present. Never raises."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False
