"""What the sharded rows time against (hps/tools/bench/gpu_sharded.py, gpu_hot_fill.py):
power-law draws of a table's rows, a synced call's rate, and the rate of a plain gather
kernel reading a peer's rows over NVLink (the link bound's part)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def power_law(rng: np.random.Generator, size: int, n: int, alpha: float = 1.1) -> np.ndarray:
    """`n` row indexes of a table of `size` rows drawn by Zipf(`alpha`) rank."""
    ranks = rng.zipf(alpha, size * 2)
    ranks = ranks[ranks <= size][:n] - 1
    while ranks.size < n:  # zipf draws beyond the table are dropped; draw again
        more = rng.zipf(alpha, n)
        ranks = np.r_[ranks, more[more <= size] - 1][:n]
    return ranks


def peer_gather_rate(remote: Any, index: list[Any], out: Any, n: int, dim: int,
                     seconds: float) -> float:
    """Rows/s of a plain gather kernel on cuda:0 reading the rows of `index` from the
    table copy on cuda:1 (peer access): what NVLink gives a row gather."""
    import cupy as cp

    from hps.gpu import kernels
    from hps.gpu.sharded_query import peers_reachable

    if not peers_reachable(cp, 0, {0, 1}):
        return float("nan")
    launch = kernels.Launch(kernels.function("rows.cu", "dense_gather", 0, DIM=dim),
                            "ptr i64 ptr ptr")
    threads = n * (dim // 4)
    blocks = min(-(-threads // 256), kernels.multiprocessors(0) * 16)

    def gather(i: int) -> None:
        import torch

        stream = torch.cuda.current_stream(0).cuda_stream
        launch(blocks, 256, stream, index[i % 4].data_ptr(), n, remote.data_ptr(),
               out.data_ptr())

    return rate(gather, n, seconds)


def rate(call: Any, n: int, seconds: float, warm: int = 3) -> float:
    """keys/s of `call(i)` looped for `seconds`, a sync after each call, after `warm`
    calls untimed."""
    import torch

    sync = torch.cuda.current_stream().synchronize
    for i in range(warm):
        call(i)
    sync()
    done, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        call(i)
        sync()
        done += n
        i += 1
    return done / (time.perf_counter() - start)
