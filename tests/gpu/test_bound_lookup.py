"""HPS.bind_lookup on a GPU cache (hps/server/bound_lookup.py, hps/gpu/fast_query.py): caller
threads on their own streams, each with its own bound lookups, while misses are fetched
and inserted (each insert closes the table's gate to the fast path) and another thread
looks up through lookup_fromdlpack and updates rows: every output exact against the
model's rows."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.api import HPS
from tests.test_public_path_gpu import MODEL, Table, _config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", [
    {"gpucacheper": 0.25, "hit_rate_threshold": 1.0},  # misses fetched and inserted
    {"gpucacheper": 1.0, "hit_rate_threshold": 1.0},  # every key held
    {"embedding_cache_type": "static"},
])
def test_threads_of_bound_lookups_serve_exact_rows(tmp_path: Path, rng: np.random.Generator,
                                                   mode: dict[str, Any]) -> None:
    import torch

    table = Table(rng, 20_000, 32)
    hps = HPS(_config(tmp_path, table, [0], **mode))
    threads_n, batches, calls = 4, 6, 60
    wrong: list[str] = []
    keys = [[rng.choice(np.concatenate([table.keys, [7, 9]]), 1000) for _ in range(batches)]
            for _ in range(threads_n)]
    stop = threading.Event()

    def caller(t: int) -> None:
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        out = torch.empty((1000, table.dim), device="cuda")
        bound = [hps.bind_lookup(MODEL, 0, torch.as_tensor(k, device="cuda"), out)
                 for k in keys[t]]
        for i in range(calls):
            bound[i % batches]()
            stream.synchronize()
            if not np.array_equal(out.cpu().numpy(), table.expected(keys[t][i % batches])):
                wrong.append(f"thread {t} call {i}")

    def other() -> None:  # the locked path meanwhile, and writes of the same rows
        out = torch.empty((500, table.dim), device="cuda")
        while not stop.is_set():
            k = rng.choice(table.keys, 500)
            hps.lookup_fromdlpack(torch.as_tensor(k, device="cuda"), out, MODEL, 0)
            torch.cuda.current_stream().synchronize()
            if not np.array_equal(out.cpu().numpy(), table.expected(k)):
                wrong.append("lookup_fromdlpack")
            gpu = hps.server.model(MODEL).tables[0].gpu[0]
            held = np.unique(k[:50])
            gpu.update(held, table.expected(held))  # the same rows: every read stays exact

    try:
        side = threading.Thread(target=other)
        side.start()
        workers = [threading.Thread(target=caller, args=(t,)) for t in range(threads_n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        side.join()
    finally:
        hps.close()
    assert not wrong, wrong[:5]
