"""The floor with several workers: the bare ASGI app (bare_asgi.py) in N processes on one
port, accepting as `hps serve --workers N` accepts.

uvicorn's own `--workers N` leaves each new connection to whichever worker wakes first,
which takes every connection waiting: a benchmark's kept-alive client connections then
land on a few of the floor's workers, and the floor reads lower, and more unevenly from
run to run, than the HTTP stack allows. `hps serve --workers N` spreads connections over
its workers (hps/http/accept_share.py); this floor spreads them the same way, so that
the two differ by the service alone.

    HPS_BARE_DIM=64 python -m hps.tools.bench.bare_workers --port 8001 --workers 8

The process binds and listens, starts the workers (fresh interpreters that inherit the
socket) and stops them on SIGTERM or SIGINT. `$HPS_BARE_FOLDER`, where set, is the folder
of the workers' connection board, whose heartbeats say when every worker accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_FD_ENV, _INDEX_ENV, _FOLDER_ENV, _WORKERS_ENV = (
    "HPS_BARE_FD", "HPS_BARE_INDEX", "HPS_BARE_FOLDER", "HPS_BARE_WORKERS")


def _worker() -> None:
    import uvicorn

    from hps.http.accept_share import ConnectionBoard, SharedAccept
    from hps.http.serve import DrainingServer

    sock = socket.socket(fileno=int(os.environ[_FD_ENV]))
    board = ConnectionBoard(Path(os.environ[_FOLDER_ENV]), int(os.environ[_WORKERS_ENV]))
    server = DrainingServer(uvicorn.Config("hps.tools.bench.bare_asgi:app",
                                           log_level="warning", access_log=False))
    server.shared_accept = SharedAccept(sock, board, int(os.environ[_INDEX_ENV]),
                                        lambda: len(server.server_state.connections))
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    from hps.http.serve import bind_socket

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    sock = bind_socket(args.host, args.port)
    sock.listen(2048)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: stopping.append(signum))
    with contextlib.ExitStack() as stack:
        # the board's folder: the caller's (to see every worker accepting), else a new one
        folder = os.environ.get(_FOLDER_ENV) or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="hps-bare-workers-"))
        env = {**os.environ, _FD_ENV: str(sock.fileno()), _FOLDER_ENV: folder,
               _WORKERS_ENV: str(args.workers)}
        workers = [subprocess.Popen([sys.executable, "-m", "hps.tools.bench.bare_workers",
                                     "--worker"], env={**env, _INDEX_ENV: str(i)},
                                    pass_fds=(sock.fileno(),))
                   for i in range(args.workers)]
        try:
            while not stopping and all(w.poll() is None for w in workers):
                time.sleep(0.2)  # a signal ends it early
        finally:
            for w in workers:
                if w.poll() is None:
                    w.terminate()
            for w in workers:
                stop(w, 10.0)
            sock.close()


def stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM `proc` (if it runs) and wait `timeout` seconds, then SIGKILL it."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def every_worker_accepting(folder: Path, workers: int, timeout: float) -> None:
    """Wait until each of `workers` workers whose connection board is in `folder`
    accepts (hps/http/accept_share.py): one answer on the port says only that one does,
    and a worker not accepting yet when the clients connect would get none of them."""
    from hps.http.accept_share import ConnectionBoard

    board = ConnectionBoard(folder, workers)
    try:
        deadline = time.monotonic() + timeout
        while board.responsive() < workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{workers - board.responsive()} of {workers} workers "
                                   f"not accepting within {timeout} s")
            time.sleep(0.01)
    finally:
        board.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        main()
