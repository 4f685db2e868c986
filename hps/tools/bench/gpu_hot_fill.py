"""Hot copies that fill themselves (`hps bench gpu --profile sharded`, several devices): 1M
power-law keys (Zipf 1.1 over the table) from cuda:0 on a static table sharded over every
device, served as a server serves it: loaded with its warm-up, the copies empty, no call
of `replicate_hot_rows` or `fill_hot_rows`, the background filler at its default
interval (hps/server/hot_fill.py). Batches are looked up for SECONDS after the load and
again after a reload; each row gives the rate of the last LAST_SECONDS of them against the
link bound of the all-hits rows (`vs_bound`), when the copies were first filled after the
traffic began (`first_fill_s`), the keys they hold, and the wrong rows of a checked batch
after them."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.gpu_public import MODEL

#: seconds of traffic after the load, and after the reload
SECONDS = 10.0
#: the last seconds of them whose rate the row gives
LAST_SECONDS = 2.0


def hot_fill_rows(keys: np.ndarray, rows: np.ndarray, picks: list[np.ndarray],
                  devices: list[int], num_shards: int, bound: float | None
                  ) -> list[dict[str, Any]]:
    """The rows of the module docstring: `picks` (4 batches of row indexes, power-law)
    looked up in turns; `bound` keys/s of the link bound (None: not measured)."""
    import torch

    from hps import write_sparse_model
    from hps.tools.bench.gpu_public import server_over_folder

    n, dim = picks[0].size, rows.shape[1]
    batches = [torch.as_tensor(keys[p], device="cuda:0") for p in picks]
    out = torch.empty((n, dim), device="cuda:0")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        write_sparse_model(Path(tmp) / "t0", keys, rows)
        hps = server_over_folder(Path(tmp), dim, n, 0, gpu_sharding="row_wise",
                                 gpu_shards=num_shards, deployed_device_list=devices)
        try:
            for phase in ("after the load", "after a reload"):
                if phase == "after a reload":
                    hps.server.reload_model(MODEL)
                owner = hps.server.model(MODEL).tables[0].gpu[0].owner
                rate, first = _traffic(hps, owner, batches, out)
                hps.lookup_fromdlpack(batches[0], out, MODEL, 0)
                torch.cuda.synchronize()
                wrong = int((out.cpu().numpy() != rows[picks[0]]).any(axis=1).sum())
                row = {"bench": "sharded", "table": "hot copies filled in the background",
                       "keys": "power-law", "batch": n, "devices": len(devices),
                       "shards": num_shards, "layout": "sharded, one pass", "phase": phase,
                       "M_keys_per_s": rate / 1e6, "first_fill_s": first,
                       "hot_keys_held": [h["keys"] for h in owner.hot.stats()],
                       "wrong_rows": wrong}
                if bound:
                    row["bound_M_keys_per_s"] = bound / 1e6
                    row["vs_bound"] = rate / bound
                results.append(row)
        finally:
            hps.close()
    return results


def _traffic(hps: Any, owner: Any, batches: list[Any], out: Any) -> tuple[float, float | None]:
    """(keys/s over the last LAST_SECONDS of SECONDS of lookups, seconds from the first
    lookup to the copies' first fill, None: not filled), each call synced."""
    import torch

    sync = torch.cuda.current_stream().synchronize
    n = int(batches[0].numel())
    ends: list[float] = []
    start = time.perf_counter()
    first = None
    i = 0
    while time.perf_counter() - start < SECONDS:
        hps.lookup_fromdlpack(batches[i % len(batches)], out, MODEL, 0)
        sync()
        ends.append(time.perf_counter() - start)
        if first is None and owner.hot.filled_at is not None:
            first = ends[-1]
        i += 1
    at = np.asarray(ends)
    last = at[at >= SECONDS - LAST_SECONDS]
    if last.size < 2:
        return n * at.size / at[-1], first
    return n * (last.size - 1) / (last[-1] - last[0]), first


def main(dim: int = 64, table_keys: int = 1 << 22, seconds: float = 1.0) -> None:
    """The rows alone (`python -m hps.tools.bench.gpu_hot_fill`), with the link bound
    measured as the sharded profile measures it: one GPU's rate of the same batches from
    the whole table, or the remote rows at a plain peer gather's rate, the longer."""
    import cupy as cp
    import torch

    from hps import write_sparse_model
    from hps.server.key_sketch import KeySketch
    from hps.tools.bench.gpu_link import peer_gather_rate, power_law, rate
    from hps.tools.bench.gpu_public import server_over_folder

    # the sketch's compiled loop built (or read from numba's cache) before any timing: its
    # first compile holds the GIL for seconds, which a first process's baseline took
    KeySketch().feed(np.arange(64, dtype=np.int64))
    devices = list(range(cp.cuda.runtime.getDeviceCount()))
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    picks = [power_law(rng, table_keys, 1 << 20) for _ in range(4)]
    n = picks[0].size
    index = [torch.as_tensor(p, device="cuda:0") for p in picks]
    out = torch.empty((n, dim), device="cuda:0")
    batches = [torch.as_tensor(keys[p], device="cuda:0") for p in picks]
    with tempfile.TemporaryDirectory() as tmp:
        write_sparse_model(Path(tmp) / "t0", keys, rows)
        whole = server_over_folder(Path(tmp), dim, n, 0)
        try:
            one = rate(lambda i: whole.lookup_fromdlpack(batches[i % 4], out, MODEL, 0), n,
                        seconds)
        finally:
            whole.close()
    remote = torch.as_tensor(rows, device="cuda:1")
    peer = peer_gather_rate(remote, index, out, n, dim, seconds)
    del remote
    shards = len(devices)
    bound = n / max(n / one, n * (shards - 1) / shards / peer)
    print(f"{len(devices)} devices ({torch.cuda.get_device_name(0)}): one GPU "
          f"{one / 1e6:.1f} M keys/s, peer gather {peer / 1e6:.1f} M rows/s, bound "
          f"{bound / 1e6:.1f} M keys/s")
    for row in hot_fill_rows(keys, rows, picks, devices, shards, bound):
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})


if __name__ == "__main__":
    main()
