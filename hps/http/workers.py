"""`hps serve --workers N`: N worker processes answering on one port over one table in
shared memory; `supervise` is the supervisor.

The supervisor binds the port once (serve.py) and starts N worker processes
(hps/http/workers_child.py: a fresh interpreter each, never a fork of a process with
threads, importing the `hps` the supervisor imported: `child_command`), which inherit
the listening socket: each worker accepts from it while it holds no more connections
than the fewest any other holds (hps/http/accept_share.py), so connections opened together
spread over the workers. Worker 0 (the leader) loads the models into the
shared tables (`multi_process_hash_map`, hps/tiers/hash_map/shared.py) and runs the
online updates; the others map the tables it made; models added, reloaded or removed at
runtime reach every worker through the op log (hps/http/workers_ops.py), and `/metrics`
sums the workers (hps/http/workers_metrics.py).

Everything the run shares lies in its run folder (hps/runtime/run_dir.py), named after
the supervisor's PID: removed when the supervisor stops, and by the next start on the
host when the whole server was killed (SIGKILL).

While workers start, and while one started again comes back, the supervisor shows a step
of its own counted in workers ready (hps/http/workers_ready.py).

A worker that dies is started again (RESTART_DELAY seconds later, longer while it keeps
dying before it serves; it maps the tables and replays the op log before it accepts).
A worker that served is started again after RESTART_DELAY however soon it died: every op
waits for the leader, so a leader killed in the middle of one is back at once and
applies it again. A leader that dies LEADER_ATTEMPTS times applying one op (an op that
kills it) has that op failed for it: every worker keeps what it serves, the log goes on.
SIGTERM or SIGINT is passed to every worker, each drains as `hps serve` does
(connections.py) and exits 0; the supervisor then removes the run folder and returns. A
worker that cannot start at all (its error is in the run folder) stops the server with
that error.

Redis as the volatile tier is read by every worker through a pool of its own (the
leader writes it); RocksDB has one writer, the leader, and the other workers read it
through secondary instances (hps/tiers/rocksdb/secondary.py); tables either holds are
dropped once no worker serves them (hps/http/workers_drops.py).

What workers cannot serve yet is refused up front with a ConfigError: a bounded
in-process hash map, and uvm GPU tables (each process would pin the whole table in host
memory; hps/http/workers_gpu.py, which also checks models added at runtime). Every
worker keeps GPU caches of its own (device memory times N); the leader's online updates
reach the others' caches through hps/server/cache_journal.py.

gRPC (`--grpc-port`) is served by every worker on the one port: the supervisor holds it
and each worker's grpcio server binds it with SO_REUSEPORT (hps/http/grpc/server.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from hps.config import UNBOUNDED, PSConfig, config_to_json
from hps.errors import ConfigError, HPSError, TierUnavailableError
from hps.http.state import TOKEN_HINT
from hps.http.workers_gpu import check_gpu_caches, gpu_caches_wanted
from hps.http.workers_oplog import OpLog, initial_ops
from hps.http.workers_ops import FD_ENV, SETUP_FAILED, ack_wait
from hps.http.workers_ready import WorkersComing
from hps.runtime.run_dir import (
    RUN_DIR_ENV,
    create_run_dir,
    remove_process_folders,
    remove_run_dir,
)
from hps.server.loader import LoadProgress
from hps.server.progress_lines import LineProgress

log = logging.getLogger("hps.http.workers")

#: seconds before a worker that died is started again; doubled for each death in a row
#: before it served (a worker that keeps crashing as it starts), up to RESTART_DELAY_MAX
RESTART_DELAY = 0.5
RESTART_DELAY_MAX = 10.0
#: deaths of the leader while it applies one op after which that op is failed
LEADER_ATTEMPTS = 2
#: seconds the workers get to drain and exit after SIGTERM before they are killed
STOP_WAIT = 30.0


def check_workers(config: PSConfig, grpc_port: int | None, workers: int = 2) -> None:
    """ConfigError for what N workers cannot serve yet (see the module docstring), or for
    a `$HPS_WORKER_ACK_WAIT_S` that is no number of seconds; MissingExtraError with
    `grpc_port` when the `grpc` extra is not installed (before any worker starts)."""
    ack_wait()
    check_shareable(config)
    check_gpu_caches(config, gpu_caches_wanted(config), workers)
    if grpc_port is not None:
        import hps.http.grpc  # noqa: F401


def worker_config(config: PSConfig, index: int) -> dict[str, Any]:
    """The ps.json of worker `index`: the volatile hash map shared; update consumers
    only in the leader (it writes the shared rows for every worker)."""
    raw = config_to_json(config)
    if config.volatile_db.enabled and not config.volatile_db.is_redis:
        raw["volatile_db"] = {**raw.get("volatile_db", {}), "type": "multi_process_hash_map"}
    if index != 0:
        raw.pop("update_source", None)
    return raw


def check_shareable(config: PSConfig) -> None:
    """ConfigError naming what `--workers` > 1 cannot serve: a bounded in-process hash
    map (shared memory has a fixed capacity). Redis is shared by nature (each worker has
    its own pool), and RocksDB has one writer, the leader (the others read secondary
    instances: hps/tiers/rocksdb/secondary.py)."""
    db = config.volatile_db
    if db.enabled and not db.is_redis and db.overflow_margin < UNBOUNDED:
        raise ConfigError(
            "--workers > 1 serves the hash map from shared memory, which has a fixed "
            "capacity and no overflow policy: leave volatile_db.overflow_margin unbounded")


def supervise(config: PSConfig, workers: int, sock: socket.socket, *, url: str, host: str,
              token: str | None, max_body_bytes: int, lookup_threads: int | None,
              access_log: bool, log_level: str, echo: Callable[[str], None],
              allow_roots: Sequence[str] | None, grpc_port: int | None,
              config_file: str | None = None,
              progress: Callable[[], AbstractContextManager[LoadProgress]] | None = None
              ) -> None:
    """Serve `config` with `workers` processes on the bound `sock` (reached at `url`)
    until SIGTERM or SIGINT (see the module). Raises ConfigError (before anything
    serves) for a config the workers cannot serve, and a worker's setup error when one
    cannot start. `config_file`: the config file it was started with, which a reload
    without sources reads again in the worker that answers it. `progress`: a context
    whose LoadProgress shows the workers starting (hps/http/workers_ready.py); by
    default lines through `echo`."""
    grpc_port = grpc_port if grpc_port is not None else config.http.grpc_port
    check_workers(config, grpc_port, workers)
    grpc_held = None
    if grpc_port is not None:  # every worker binds it with SO_REUSEPORT while held
        from hps.http.grpc.server import grpc_address, reserve_port

        try:
            grpc_held = reserve_port(host, grpc_port)
        except BaseException:
            sock.close()
            raise
        grpc_port = int(grpc_held.getsockname()[1])
    folder = create_run_dir()
    supervisor = _Supervisor(folder, workers, sock, token)
    supervisor.coming = WorkersComing(supervisor.oplog, progress or _lines(echo),
                                      lambda line: echo(f"hps: {line}"))
    try:
        for index in (0, 1):
            (folder / f"config-{index}.json").write_text(
                json.dumps(worker_config(config, index)))
        (folder / "serve.json").write_text(json.dumps({
            "host": host, "max_body_bytes": max_body_bytes, "lookup_threads": lookup_threads,
            "access_log": access_log, "log_level": log_level,
            "allow_roots": list(allow_roots) if allow_roots else None,
            "grpc_port": grpc_port, "config_file": config_file, "workers": workers}))
        initial_ops(supervisor.oplog, config)
        sock.listen(2048)
        supervisor.start_all()
        supervisor.coming.start(list(range(workers)), f"starting {workers} workers",
                                len(supervisor.oplog.ops()))
        echo(f"hps: serving on {url} with {workers} workers over one shared table (models "
             "load in the background; GET /readyz turns 200 when every worker serves them)")
        if grpc_port is not None:
            echo(f"hps: serving KServe v2 over gRPC on {grpc_address(host, grpc_port)} in "
                 "every worker")

        def ready() -> None:
            if grpc_port is not None:  # "loaded" comes before a worker's gRPC listens
                _wait_for_grpc(folder, supervisor)
            auth = ' -H "Authorization: Bearer $HPS_TOKEN"' if token else ""
            echo(f"hps: every model is loaded in every worker; try{TOKEN_HINT if token else ''}"
                 f": curl -s{auth} {url}/v1/models")

        stopped_by = supervisor.run(ready=ready)
    finally:
        supervisor.coming.close()
        _stop_listening(sock)
        supervisor.stop()
        if grpc_held is not None:
            grpc_held.close()
        remove_run_dir(folder)
    if stopped_by:
        echo(f"hps: stopped by {'/'.join(signal.Signals(s).name for s in stopped_by)}: "
             f"{workers} workers drained, shared memory removed")


def _lines(echo: Callable[[str], None]
           ) -> Callable[[], AbstractContextManager[LoadProgress]]:
    """The supervisor's progress as lines through `echo` (every EVERY_S seconds)."""
    @contextlib.contextmanager
    def lines() -> Iterator[LoadProgress]:
        shown = LineProgress(lambda line: echo(f"hps: {line}"))
        try:
            yield shown
        finally:
            shown.close()

    return lines


def _stop_listening(sock: socket.socket) -> None:
    """Stop the port listening for every worker at once, before they drain.

    The workers share one listening socket, which closes when its last descriptor does.
    Had each process closed its own, a worker still listening while another drained
    took the reconnections of the drained one's clients into its accept queue, and
    closing it then reset those not accepted yet (every kept-alive client got one
    reset). `shutdown` stops the socket itself listening, whoever holds it: a new
    connection is refused from then on, as with `hps serve` alone, and what the workers
    accepted already drains (connections.py)."""
    with contextlib.suppress(OSError):  # not listening (a failed start)
        sock.shutdown(socket.SHUT_RD)
    sock.close()


#: the folder of the run folder where each worker notes that its gRPC server listens
GRPC_LISTENING = "grpc"


def _wait_for_grpc(folder: Path, supervisor: _Supervisor, timeout: float = 60.0) -> None:
    """Until every worker's gRPC server listens (its note in GRPC_LISTENING), a worker
    exits (the supervisor then deals with it) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((folder / GRPC_LISTENING / str(i)).exists() for i in range(supervisor.count)):
            return
        if any(proc.poll() is not None for proc in supervisor.procs.values()):
            return
        time.sleep(0.05)
    log.warning("not every worker serves gRPC %.0f s after its models were loaded", timeout)


#: what a worker runs: hps/http/workers_child.py, with the folder this process imported
#: `hps` from (argv[1]) first on the path, and not the working folder `-c` puts there
_CHILD = ("import sys\n"
          "if sys.path[:1] == ['']:\n"
          "    del sys.path[0]\n"
          "sys.path.insert(0, sys.argv[1])\n"
          "from hps.http.workers_child import main\n"
          "sys.exit(main())\n")


def child_command() -> list[str]:
    """The command line of a worker process: this interpreter, importing the `hps` this
    process imported. `python -m hps.http.workers_child` would put the working folder
    first on its path, and started from a checkout (an `hps/` folder in it) the workers
    imported that instead of the installed package, whose numba cache and code they
    then did not share with the supervisor (a first lookup compiled after ready)."""
    import hps

    return [sys.executable, "-c", _CHILD, str(Path(hps.__file__).resolve().parent.parent)]


class _Supervisor:
    """The worker processes of one run: started, restarted, stopped."""

    def __init__(self, folder: Path, workers: int, sock: socket.socket, token: str | None
                 ) -> None:
        self.folder = folder
        self.count = workers
        self.sock = sock
        self.token = token
        self.oplog = OpLog(folder)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, int] = {}  # starts of each worker so far
        self.quick_deaths: dict[int, int] = {}  # deaths in a row before serving
        self.leader_deaths: dict[int, int] = {}  # op → deaths of the leader applying it
        self._signals: list[int] = []
        #: the workers started and not ready yet, shown as a step (workers_ready.py;
        #: supervise gives it the command's progress)
        self.coming = WorkersComing(self.oplog, lambda: contextlib.nullcontext(LoadProgress()),
                                    log.info)

    def start(self, index: int) -> None:
        env = {**os.environ, RUN_DIR_ENV: str(self.folder), "HPS_WORKER_INDEX": str(index),
               FD_ENV: str(self.sock.fileno())}
        env.pop("HPS_TOKEN", None)
        if self.token is not None:
            env["HPS_TOKEN"] = self.token
        self.procs[index] = subprocess.Popen(child_command(), env=env,
                                             pass_fds=(self.sock.fileno(),))
        self.started[index] = self.started.get(index, 0) + 1

    def start_all(self) -> None:
        for index in range(self.count):
            self.start(index)

    def run(self, ready: Callable[[], None]) -> tuple[int, ...]:
        """Watch the workers until a signal; returns the signals caught."""
        previous = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGTERM, signal.SIGINT)}
        announced = False
        first_ops = len(self.oplog.ops())
        try:
            while not self._signals:
                time.sleep(0.1)
                for index, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None or self._signals:
                        continue
                    self._failed_setup(index, code)
                    if index == 0:
                        self._leader_died()
                    quick = not self.oplog.served(index, proc.pid)
                    self.quick_deaths[index] = self.quick_deaths.get(index, 0) + 1 if quick \
                        else 0
                    delay = min(RESTART_DELAY_MAX,
                                RESTART_DELAY * 2 ** max(0, self.quick_deaths[index] - 1))
                    log.warning("worker %d (pid %d) exited with status %s; starting it again "
                                "in %.1fs", index, proc.pid, code, delay)
                    remove_process_folders(self.folder, proc.pid)  # what it kept for itself
                    time.sleep(delay)
                    self.start(index)
                    self.coming.start([index], f"worker {index} coming back",
                                      len(self.oplog.ops()), again=True)
                self.coming.poll(self.procs)
                if not announced and self.oplog.lowest_ack() >= first_ops and len(
                        self.oplog.live_workers()) == self.count:
                    announced = True
                    ready()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return tuple(self._signals)

    def _leader_died(self) -> None:
        """Fail the op the leader was applying once it died LEADER_ATTEMPTS times on it:
        the followers wait for its outcome, and every later op waits behind it."""
        seq = self.oplog.unfinished()
        if seq is None:
            return
        deaths = self.leader_deaths[seq] = self.leader_deaths.get(seq, 0) + 1
        if deaths < LEADER_ATTEMPTS:
            return
        log.error("op %d: the leader died %d times applying it; failed, every worker keeps "
                  "the models it serves", seq, deaths)
        self.oplog.set_outcome(seq, TierUnavailableError(
            f"worker 0 (the leader) died {deaths} times while it applied this change: "
            "it was given up, and every worker serves what it served before"))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)

    def _failed_setup(self, index: int, code: int) -> None:
        """Raise a worker's setup error (it can never start) as the server's."""
        failure = self.folder / f"failed-{index}"
        if code != SETUP_FAILED or not failure.exists():
            return
        raw = json.loads(failure.read_text())
        error: BaseException = HPSError(f"worker {index} could not start: {raw['message']}")
        if raw.get("error"):
            with contextlib.suppress(Exception):
                error = pickle.loads(base64.b64decode(raw["error"]))  # our own file
        raise error

    def stop(self) -> None:
        """SIGTERM to every worker; each drains and exits. Killed after STOP_WAIT."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT
        for index, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop within %.0fs: killed", index, STOP_WAIT)
                proc.kill()
                proc.wait()
