"""What `hps serve --workers N` needs to know about GPU caches: which models get them,
which they cannot serve, and whether NVIDIA's MPS daemon will let the workers' kernels run
side by side (docs/workers.md#gpu-caches)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from hps.config import ModelConfig, PSConfig
from hps.errors import ConfigError
from hps.runtime import mps

log = logging.getLogger("hps.http.workers")


def gpu_caches_wanted(config: PSConfig) -> list[str]:
    """The models that would get GPU caches here (gpucache: true on a machine with a
    CUDA device and CuPy)."""
    wants = [m.model for m in config.models if m.gpucache]
    return wants if wants and cuda_here() else []


def cuda_here() -> bool:
    """Whether GPU caches are made on this machine (a CUDA device and CuPy)."""
    try:
        from hps.gpu.table import cuda_available
    except ImportError:
        return False
    return bool(cuda_available())


def check_gpu_caches(config: PSConfig, wanted: Sequence[str], workers: int) -> None:
    """ConfigError for GPU caches that `workers` processes cannot each keep: a uvm table
    holds every row in pinned host memory of its process (N copies of the table). The
    others (dynamic and static caches) are one per worker on each device, so the log
    says what they cost."""
    refuse_uvm(m for m in config.models if m.model in wanted)
    if wanted:
        shared = [m.model for m in config.models
                  if m.model in wanted and m.gpu_cache_scope == "host"]
        own = [name for name in wanted if name not in shared]
        if own:
            log.info("models %s: each of the %d workers keeps its own GPU caches (their "
                     "device memory counts %d times; gpu_cache_scope host shares one); online "
                     "updates reach every worker's caches (docs/workers.md)", ", ".join(own),
                     workers, workers)
        if shared:
            log.info("models %s: the %d workers share one GPU cache per device "
                     "(gpu_cache_scope host, docs/gpu-cache.md)", ", ".join(shared), workers)
        if not mps_daemon_found():
            log.warning(
                "no MPS control daemon found (%s): the workers' GPU kernels will take turns "
                "on the GPU in time slices (8 processes on one H100: 0.17x of one's keys/s). "
                "Start it with `hps mps start` before `hps serve` (docs/workers.md#gpu-caches)",
                mps_pipe_directory())


def refuse_uvm(models: Iterable[ModelConfig]) -> None:
    """ConfigError naming the models of `models` with a uvm GPU table (asked for where
    GPU caches are made): with several workers each process would pin the whole table."""
    uvm = [m.model for m in models if m.gpucache and m.cache_type == "uvm"]
    if uvm:
        raise ConfigError(
            f"--workers > 1 with uvm GPU tables (models {', '.join(uvm)}) is not served: "
            "a uvm table keeps every row in pinned host memory of its process, so N "
            "workers would hold the table N times. Serve them with one worker, or use "
            "embedding_cache_type dynamic (each worker keeps its own cache)")


def mps_pipe_directory() -> Path:
    """Where NVIDIA's MPS control daemon keeps its pipes (hps/runtime/mps.py)."""
    return mps.pipe_directory()


def mps_daemon_found() -> bool:
    """Whether an MPS control daemon answers in its pipe directory (hps/runtime/mps.py)."""
    return mps.daemon_found()
