"""What one refusal under overload costs the server: its CPU per 503 `overloaded`.

Clients that ignore `Retry-After` send refusals by the thousand a second, and each takes
event-loop time the admitted lookups need (docs/http.md, "Overload and deadlines"). This
serves one table in this process (uvicorn from a thread, as `hps serve` configures it;
one lookup thread, held, with one admitted lookup waiting, so every further lookup is
shed), then one client *process* sends `count` binary lookups over one keep-alive
connection (the raw client of hps/tools/bench/raw_http.py) and every answer must be 503.
It prints the server process's CPU per refusal (user + system, `time.process_time`; the
held threads sleep), the client's wall time per refusal, and how many the connection
answered itself (hps/http/direct.py) rather than an ASGI task.

    python -m hps.tools.bench.refusals [--count 20000]    (or hps bench http --refusals)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hps.tools.bench.http import MODEL, TABLE, one_table_config
from hps.tools.bench.raw_http import RawConnection, prepare

#: the client process: `count` refusals after a few hundred to warm both sides; prints
#: its wall seconds over the counted ones
_CLIENT = """
import sys, time
from hps.tools.bench.raw_http import RawConnection, prepare
host, port, path, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
conn = RawConnection(host, port)
request = prepare(f"{host}:{port}", path, bytes(1024),
                  {"Content-Type": "application/octet-stream"})
for _ in range(500):
    assert conn.exchange(request).status == 503
began = time.perf_counter()
for _ in range(count):
    status = conn.exchange(request).status
    if status != 503:
        raise SystemExit(f"answered {status}, not 503")
print(time.perf_counter() - began)
"""
_WARM = 500
#: seconds the client may take (20,000 refusals take about 3 s on 2 cores)
CLIENT_TIMEOUT_S = 120.0


def bench_refusals(count: int = 20_000, dim: int = 64) -> dict[str, Any]:
    """Server CPU and client wall time per refusal over `count` refused lookups."""
    from hps.http import create_app
    from hps.http.app import ServiceApp
    from hps.http.serve import ServerThread
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.server import HierarchicalParameterServer
    from hps.tools.bench.tiers import make_table

    tmp = Path(tempfile.mkdtemp(prefix="hps-bench-refusals-"))
    try:
        keys, vectors = make_table(10_000, dim, seed=0)
        write_sparse_model(tmp / TABLE, keys, vectors)
        (tmp / "ps.json").write_text(json.dumps(one_table_config(dim, 128)))
        server = HierarchicalParameterServer(str(tmp / "ps.json"))
        # one lookup may be in (the bound); the delay rule never decides
        app = create_app(server, lookup_threads=1, max_queued_lookups=1,
                         queue_target_s=3600.0)
        hot = app.hot_routes if isinstance(app, ServiceApp) else None
        if hot is None:
            raise RuntimeError("create_app gave an app without hot routes")
        serving = ServerThread(app)
        host, port = serving.start().removeprefix("http://").rsplit(":", 1)
        path = f"/v1/models/{MODEL}/tables/{TABLE}/lookup"
        state = app.state.hps
        # the admitted lookup stays in for the whole run: past the lookup limit
        # (LOOKUP_WAIT_S, 4 s) it would be given up, the queue would empty, and each of
        # the client's lookups would then wait that limit (a run on a busy 2-core machine
        # took longer than 4 s and never ended)
        state.lookups.wait_s = 3600.0
        release = threading.Event()
        state.executor.submit(release.wait)  # the one lookup thread, held
        admitted = prepare(f"{host}:{port}", path, keys[:128].astype("<i8").tobytes(),
                           {"Content-Type": "application/octet-stream"})

        def wait_for_the_thread() -> None:  # the lookup admitted before the refusals
            with RawConnection(host, int(port)) as conn:
                conn.exchange(admitted)

        waiting = threading.Thread(target=wait_for_the_thread)
        waiting.start()
        try:
            while state.queued_lookups < 1:
                time.sleep(0.01)
            direct_before = hot.refused_directly
            cpu_before = time.process_time()
            try:
                client = subprocess.run(
                    [sys.executable, "-c", _CLIENT, host, port, path, str(count)],
                    capture_output=True, text=True, env=os.environ, check=False,
                    timeout=CLIENT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the client did not end its {count:,} refusals within "
                                   f"{CLIENT_TIMEOUT_S:.0f} s") from None
            cpu = time.process_time() - cpu_before
            if client.returncode != 0:
                raise RuntimeError(f"the client failed: {client.stderr[-1000:]}")
            refused_directly = hot.refused_directly - direct_before
        finally:
            release.set()
            waiting.join()
            serving.stop()
            server.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "count": count,
        # the warm-up's refusals are in the server's CPU too
        "server_cpu_us_per_refusal": cpu / (count + _WARM) * 1e6,
        "client_wall_us_per_refusal": float(client.stdout.split()[0]) / count * 1e6,
        "warmup": _WARM,
        "refused_directly": refused_directly,  # the warm-up's included
        "client": "one process, raw keep-alive connection (TCP_NODELAY)",
    }


def print_refusals(say: Callable[[str], None] = print) -> dict[str, Any]:
    """`bench_refusals` with its defaults, its figures in one line through `say`;
    returns them."""
    result = bench_refusals()
    say(f"{result['count']:,} refusals: server CPU "
        f"{result['server_cpu_us_per_refusal']:.1f} µs a refusal, client wall "
        f"{result['client_wall_us_per_refusal']:.1f} µs; answered by the connection: "
        f"{result['refused_directly']:,} of {result['count'] + result['warmup']:,} (the "
        f"warm-up's {result['warmup']} included); client: {result['client']}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000)
    args = parser.parse_args(argv)
    print(json.dumps(bench_refusals(args.count), indent=2))


if __name__ == "__main__":
    main()
