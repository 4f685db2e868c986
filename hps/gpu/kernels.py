"""The one loader of the CUDA sources in `cuda/`: compiled by CuPy (NVRTC) into RawModules.

Each source is compiled once per (device, compile-time constants) and kept for the life
of the process; CuPy's on-disk kernel cache spares the compile on later runs. The
constants are passed as -D options (DIM, GROUP, SET_SIZE, UNROLL; see
cuda/hps_common.cuh). `#include "hps_common.cuh"` lines are replaced by the header's
text before compiling, so CuPy's cache (keyed by source text) sees header changes too.

Sources are found in the installed package (`hps/cuda/`, shipped in the wheel) or, in a
source checkout, in the repository's top-level `cuda/` folder.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from hps.errors import DeviceError, MissingExtraError

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
            options = tuple(f"-D{k}={int(v)}" for k, v in sorted(defines.items()))
            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(code=_source_text(source), options=options)
                mod.compile()
            _modules[key] = mod
    return mod


def function(source: str, name: str, device_id: int, **defines: int) -> Any:
    """One kernel (a `cupy.RawKernel`-like function object) of a module."""
    cupy = cupy_module()
    mod = module(source, device_id, **defines)
    with cupy.cuda.Device(device_id):
        return mod.get_function(name)


@lru_cache(maxsize=None)
def multiprocessors(device_id: int) -> int:
    """Streaming multiprocessor count of a device (sizes the grids)."""
    cupy = cupy_module()
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def grid(device_id: int, threads: int, block: int = 256, waves: int = 16) -> int:
    """Blocks for `threads` threads, capped at `waves` blocks per SM (kernels loop over
    the rest); waves 0: no cap."""
    need = max(1, -(-threads // block))
    return min(need, multiprocessors(device_id) * waves) if waves else need
