"""Memory of a model added and removed at runtime, through the admin routes of a real server.

    python -m hps.tools.bench.model_memory [--keys 2000000] [--dim 64] [--cache-type static]

uvicorn serves a small base model (host tiers only) on a loopback port; the client (the
standard library's `http.client`) adds a second model with a GPU cache of every key on
device 0 (`POST /v1/models`), reads some of its keys back (`POST .../lookup`, binary),
removes it (`DELETE /v1/models/{model}`) and waits until the memory settles. Printed at
each step: device memory in use (`cudaMemGetInfo`, the whole device: run it alone) and the
serving process's RSS. `measure` returns the same figures for the GPU tests.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.tiers import current_rss_bytes

BASE, ADDED = "base", "added"


def _rss_bytes() -> int:
    return current_rss_bytes() or 0


def _device_used(cupy: Any) -> int:
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def _request(port: int, method: str, path: str, body: bytes = b"",
             content_type: str = "application/json") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(method, path, body=body or None, headers={"Content-Type": content_type})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _model_block(name: str, folder: Path, dim: int, gpu: bool, cache_type: str
                 ) -> dict[str, Any]:
    block: dict[str, Any] = {
        "model": name, "sparse_files": [str(folder)], "embedding_vecsize_per_table": [dim],
        "maxnum_catfeature_query_per_table_per_sample": [4096], "max_batch_size": 1,
        "default_value_for_each_table": [0.0], "gpucache": gpu, "deployed_device_list": [0],
    }
    if gpu:
        block.update(gpucacheper=1.0,
                     cache_refresh_percentage_per_iteration=1.0,
                     embedding_cache_type=cache_type)
    return block


def measure(keys: int = 2_000_000, dim: int = 64, cache_type: str = "static",
            settle_seconds: float = 30.0) -> dict[str, Any]:
    """Device memory in use and RSS (bytes) before the add, once the added model serves,
    and after its removal (polled until the device memory is back, at most
    settle_seconds); whether its rows were read back right and its route is gone after."""
    import cupy

    from hps import write_sparse_model
    from hps.http import create_app
    from hps.http.serve import ServerThread
    from hps.server import HierarchicalParameterServer

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_keys = np.arange(1000, dtype=np.int64)
        write_sparse_model(root / "base", base_keys,
                           rng.standard_normal((1000, 8), dtype=np.float32))
        table_keys = rng.choice(2**40, keys, replace=False).astype(np.int64)
        rows = rng.standard_normal((keys, dim), dtype=np.float32)
        write_sparse_model(root / ADDED, table_keys, rows)
        config = {"supportlonglong": True,
                  "models": [_model_block(BASE, root / "base", 8, False, cache_type)],
                  "volatile_db": {"type": "hash_map"}}
        server = HierarchicalParameterServer(config, load=True)
        thread = ServerThread(create_app(server, allow_roots=[str(root)]))
        thread.start()
        try:
            cupy.cuda.Device(0).use()
            before = {"gpu": _device_used(cupy), "rss": _rss_bytes()}
            block = _model_block(ADDED, root / ADDED, dim, True, cache_type)
            status, body = _request(thread.port, "POST", "/v1/models", json.dumps(block).encode())
            if status != 201:
                raise RuntimeError(f"POST /v1/models answered {status}: {body[:300]!r}")
            served = {"gpu": _device_used(cupy), "rss": _rss_bytes()}
            picks = rng.integers(0, keys, 4096)
            status, body = _request(thread.port, "POST", f"/v1/models/{ADDED}/tables/0/lookup",
                                    table_keys[picks].astype("<i8").tobytes(),
                                    "application/octet-stream")
            exact = status == 200 and np.array_equal(
                np.frombuffer(body, "<f4").reshape(-1, dim), rows[picks])
            status, body = _request(thread.port, "DELETE", f"/v1/models/{ADDED}")
            if status != 200:
                raise RuntimeError(f"DELETE answered {status}: {body[:300]!r}")
            started = time.monotonic()
            while (_device_used(cupy) > before["gpu"] + (served["gpu"] - before["gpu"]) // 20
                   and time.monotonic() - started < settle_seconds):
                time.sleep(0.1)
            time.sleep(1.0)  # the host side's release (malloc_trim) follows the tables
            after = {"gpu": _device_used(cupy), "rss": _rss_bytes()}
            gone, _ = _request(thread.port, "POST", f"/v1/models/{ADDED}/tables/0/lookup",
                               table_keys[:4].astype("<i8").tobytes(),
                               "application/octet-stream")
            status, body = _request(thread.port, "GET", "/v1/models")
            listed = [m["model"] for m in json.loads(body)["models"]] if status == 200 else None
        finally:
            thread.stop()
            server.close()
    return {"before": before, "served": served, "after": after, "exact": exact,
            "status_after": gone, "models_after": listed,
            "settled_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--cache-type", default="static")
    args = parser.parse_args()
    found = measure(args.keys, args.dim, args.cache_type)
    mib = 2**20
    print(f"model of {args.keys:,} keys, dim {args.dim}, a {args.cache_type} GPU cache of "
          f"every key on device 0; client: http.client")
    print(f"{'':28} {'device MiB in use':>18} {'RSS MiB':>9}")
    for step, label in (("before", "before POST /v1/models"),
                        ("served", "serving the added model"),
                        ("after", "after DELETE, settled")):
        print(f"{label:28} {found[step]['gpu'] / mib:18.0f} {found[step]['rss'] / mib:9.0f}")
    print(f"rows read back exact: {found['exact']}; its lookups after removal answer "
          f"{found['status_after']}; models listed: {found['models_after']}; device memory "
          f"back {found['settled_s']:.1f} s after DELETE")


if __name__ == "__main__":
    main()
