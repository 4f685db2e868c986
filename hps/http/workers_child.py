"""One worker process of `hps serve --workers N` (`workers.child_command` starts it,
importing the supervisor's `hps`; `python -m hps.http.workers_child` runs it too).

Started by the supervisor (hps/http/workers.py) with the listening socket inherited as
descriptor `$HPS_WORKER_FD`, its index in `$HPS_WORKER_INDEX` (0: the leader), the run
folder in `$HPS_RUN_DIR` and the token in `$HPS_TOKEN`. It reads its ps.json and the
serve options from the run folder, builds a `ReplicatedServer` (hps/http/workers_ops.py;
with the hot-rows board of hps/http/workers_hot_rows.py),
applies the ops the leader already completed (a worker started again maps the tables
before it accepts a connection), and serves the app as `hps serve` does (run_app:
uvicorn, the drain on SIGTERM; gRPC too, on the port the supervisor holds, when asked;
its connections accepted as hps/http/accept_share.py spreads them over the workers),
with `/metrics` summed over the workers. A load of its own (or its warm-up) that runs
over 2 s says how far it is on the stderr it shares with the supervisor, a line every 2 s
prefixed `hps worker N:` (hps/server/progress_lines.py; lines, not bars: several processes share the
terminal). A setup error
(a bad config, a tier that cannot open) is written to `failed-<index>` in the run
folder, where the supervisor reads it, and the process exits with status 3.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import socket
import sys
from pathlib import Path
from typing import Any

from hps.http.accept_share import ConnectionBoard
from hps.http.serve import run_app
from hps.http.workers_hot_rows import HotRowsWorkerServer
from hps.http.workers_metrics import MergedRegistry, MetricsDump
from hps.http.workers_oplog import Op, OpLog
from hps.http.workers_ops import FD_ENV, SETUP_FAILED
from hps.runtime.run_dir import RUN_DIR_ENV
from hps.server.progress_lines import LineProgress


def main() -> int:
    folder = Path(os.environ[RUN_DIR_ENV])
    index = int(os.environ["HPS_WORKER_INDEX"])
    options = json.loads((folder / "serve.json").read_text())
    logging.basicConfig(level=getattr(logging, options["log_level"].upper(), logging.INFO),
                        format=f"%(asctime)s hps worker {index} %(levelname)s %(message)s")
    sock = socket.socket(fileno=int(os.environ[FD_ENV]))
    oplog = OpLog(folder)
    lines = _load_lines(index)
    try:
        server = HotRowsWorkerServer(str(folder / f"config-{min(index, 1)}.json"),
                                     oplog=oplog, index=index, workers=options.get("workers"))
        # the first loads are applied from the op log before the app asks for them
        server.unasked = lines
        server.replay()
        oplog.mark_serving(index)  # a death from now on is not a crash at start
    except Exception as exc:
        _write_failure(folder / f"failed-{index}", exc)
        logging.getLogger("hps").error("worker %d could not start: %s", index, exc)
        return SETUP_FAILED
    metrics_folder = folder / "metrics"
    dump: list[MetricsDump] = []

    def prepare(app: object) -> None:
        app.state.hps.versions = server.versions  # type: ignore[attr-defined]
        metrics = app.state.hps.metrics  # type: ignore[attr-defined]
        dump.append(MetricsDump(metrics.registry, metrics_folder, index))

        def applied(op: Op) -> None:  # an op another worker answered: this one's series
            if op.kind == "unload":
                metrics.forget_model(op.model)
            else:
                metrics.model_ready.labels(op.model).set(1)

        server.on_applied = applied

        def peers() -> list[Path]:
            return [metrics_folder / f"{i}.prom" for i in oplog.live_workers() if i != index]

        metrics.registry = MergedRegistry(metrics.registry, peers)

    grpc_port = options.get("grpc_port")
    if grpc_port is not None:  # the port the supervisor holds, shared by every worker
        from hps.http.grpc.server import share_port

        share_port(grpc_port)

    def listening(grpc_server: Any) -> None:
        if grpc_server is not None:  # noted for the supervisor's "loaded in every worker"
            from hps.http.workers import GRPC_LISTENING

            grpc_server.start()
            (folder / GRPC_LISTENING).mkdir(exist_ok=True)
            (folder / GRPC_LISTENING / str(index)).write_text(str(os.getpid()))

    board = ConnectionBoard(folder, int(options["workers"]))
    try:
        run_app(sock, server, host=options["host"], token=os.environ.get("HPS_TOKEN") or None,
                max_body_bytes=options["max_body_bytes"],
                lookup_threads=options["lookup_threads"], access_log=options["access_log"],
                log_level=options["log_level"], allow_roots=options["allow_roots"],
                on_ready=server.initial_loads_done, grpc_port=grpc_port, listening=listening,
                prepare=prepare, config_file=options.get("config_file"),
                share=(board, index))
    finally:
        for d in dump:
            d.close()
        lines.close()
        board.close()
    return 0


def _load_lines(index: int) -> LineProgress:
    """The progress of this worker's loads, said for a table that takes over 2 s."""
    def say(line: str) -> None:
        print(f"hps worker {index}: {line}", file=sys.stderr, flush=True)

    return LineProgress(say, quiet=True)


def _write_failure(path: Path, exc: BaseException) -> None:
    try:
        payload = base64.b64encode(pickle.dumps(exc)).decode()
    except Exception:
        payload = ""
    path.write_text(json.dumps({"message": str(exc), "error": payload}))


if __name__ == "__main__":
    sys.exit(main())
