"""Running the app under uvicorn: `serve()` (what `hps serve` runs), `run_app` (one
process's app on a bound socket, also a worker's: hps/http/workers.py) and `ServerThread`.

`serve` binds first and loads the models in the background: `/healthz` answers at once,
`/readyz` turns 200 when every model is in, and then a `curl` line that works is printed.
The first compile of a load (numba compiles each function at its first use; the first
run on a machine) is one printed line as it starts, so a slow first load shows why. A
model that fails to load is one printed line naming it and what went wrong; the server
serves on without it (`/readyz` 503), or, told to require every model, stops and raises
`ModelsNotLoadedError`. A port that is taken is a `BindError` before anything is opened or
announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn

from hps.config import PSConfig, load_config
from hps.errors import BindError, ConfigError, ModelsNotLoadedError
from hps.http.accept_share import ConnectionBoard, SharedAccept, shared_accept
from hps.http.app import create_app
from hps.http.connections import uvicorn_options
from hps.http.reload_block import absolute_config_file
from hps.http.state import DEFAULT_MAX_BODY_BYTES, TOKEN_HINT, is_loopback
from hps.runtime.compile_notice import CompileLines
from hps.runtime.compile_on_use import compile_events
from hps.runtime.cores import usable_cores
from hps.server import HierarchicalParameterServer
from hps.server.loader import LoadProgress

log = logging.getLogger("hps.http")
#: what a printed curl line needs when the server requires a token (it reads $HPS_TOKEN)


def base_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server bound to `host:port` at."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host.strip('[]')}]"
    return f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (port 0: any free port), not yet listening.

    Raises BindError naming the address and what to do when the port is taken or the
    address cannot be bound, or the port is not one (the resolver would wrap 99999 to
    34463 and serve there).
    """
    if not 0 <= port <= 65535:
        raise BindError(f"cannot serve on port {port}: a TCP port is 0 to 65535 (0: any "
                        "free one); pick another with --port")
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"cannot serve on {host!r}: not an address of this machine "
                        f"({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        where = base_url(host, port).removeprefix("http://")
        if exc.errno == errno.EADDRINUSE:
            raise BindError(f"cannot serve on {where}: port {port} is in use (another "
                            "hps serve?); pick another with --port") from None
        raise BindError(f"cannot serve on {where}: {exc.strerror}") from None
    return sock


def curl_line(server: HierarchicalParameterServer, url: str, token: bool) -> str:
    """A `curl` command that looks up a few keys of the first table of the first model."""
    model = sorted(server.models)[0] if server.models else server.config.models[0].model
    keys = [1, 2, 3]
    table_name = "0"
    loaded = server.models.get(model)
    if loaded is not None:
        table = loaded.tables[0]
        table_name = table.name
        try:  # real keys from the model's files, so the answer shows real vectors
            from hps.modelfiles.formats import open_model

            with open_model(loaded.config.table_spec(0)) as reader:
                first, _ = next(reader.chunks(3), (np.zeros(0, np.int64), None))
            keys = first.tolist() or keys
        except Exception as exc:  # the line still works: unknown keys get the default
            log.debug("no sample keys for the curl line: %s", exc)
    auth = ' -H "Authorization: Bearer $HPS_TOKEN"' if token else ""
    body = '{"keys": [' + ", ".join(str(k) for k in keys) + "]}"
    return (f"curl -s{auth} -H 'Content-Type: application/json' -d '{body}' "
            f"{url}/v1/models/{model}/tables/{table_name}/lookup")


def serve(
    config: str | Path | PSConfig | dict[str, Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lookup_threads: int | None = None,
    access_log: bool = False,
    log_level: str = "info",
    echo: Callable[[str], None] = print,
    allow_roots: Sequence[str] | None = None,
    grpc_port: int | None = None,
    workers: int | str | None = None,
    require_models: bool | None = None,
    load_progress: Callable[[str], AbstractContextManager[LoadProgress]] | None = None,
) -> None:
    """Serve every model of `config` over HTTP until interrupted (SIGINT/SIGTERM), and
    over gRPC (KServe v2, `hps.http.grpc`) on `grpc_port` (else the config's
    `http.grpc_port`; None: no gRPC), both stopped together.

    `workers` (else the config's `http.workers`; "auto": the usable cores): more than
    one runs that many worker processes on the port over one table in shared memory
    (hps/http/workers.py); one serves from this process.

    `load_progress`: a model's name → a context whose LoadProgress hears that model's
    loads (`hps serve` shows them on stderr); with workers, the supervisor's own step
    (the workers starting: hps/http/workers_ready.py), as model "" (each worker says
    its loads' progress in lines of its own).

    Each model that fails to load is echoed in one line. `require_models` (else the
    config's `http.require_models`): the first such failure stops the server (drained,
    tiers closed) and raises ModelsNotLoadedError naming the models that failed, so an
    orchestrator sees the process exit instead of a server that never gets ready.

    The address is bound first (BindError if the port is taken), then the tiers are set
    up (a bad config or an unreachable Redis fails here, before anything is served);
    models then load in the background. uvicorn logs through `logging` (the caller's
    handlers and format).
    """
    sock = bind_socket(host, port)
    try:
        psconfig = load_config(str(config) if isinstance(config, Path) else config)
        config_file = absolute_config_file(config)
        count = worker_count(psconfig.http.workers if workers is None else workers)
        required = psconfig.http.require_models if require_models is None else require_models
        if count > 1 and required:
            raise ConfigError("--require-models (http.require_models) serves with one "
                              "process: with --workers above 1 the supervisor does not "
                              "stop on a failed load; watch /readyz instead")
        if count > 1:
            from hps.http.workers import supervise

            supervise(psconfig, count, sock, url=base_url(host, int(sock.getsockname()[1])),
                      host=host, token=token,
                      max_body_bytes=max_body_bytes, lookup_threads=lookup_threads,
                      access_log=access_log, log_level=log_level, echo=echo,
                      allow_roots=allow_roots, grpc_port=grpc_port, config_file=config_file,
                      progress=None if load_progress is None else
                      (lambda: load_progress("")))
            return
        server = HierarchicalParameterServer(psconfig, load=False)
    except BaseException:
        sock.close()
        raise
    uv: DrainingServer | None = None

    def announce() -> None:
        while uv is not None and not uv.started and not uv.should_exit:
            time.sleep(0.05)
        if uv is None or not uv.started:
            return
        url = base_url(host, int(sock.getsockname()[1]))
        echo(f"hps: every model is loaded; try{TOKEN_HINT if token else ''}:\n  "
             f"{curl_line(server, url, token is not None)}")

    def on_ready() -> None:
        threading.Thread(target=announce, name="hps-announce", daemon=True).start()

    failed: list[str] = []

    def on_failed(model: str, message: str) -> None:
        failed.append(model)
        if required:
            echo(f"hps: model {model!r} failed to load: {message} (--require-models: "
                 "stopping)")
            if uv is not None:
                uv.should_exit = True
            return
        url = base_url(host, int(sock.getsockname()[1]))
        auth = ' -H "Authorization: Bearer $HPS_TOKEN"' if token else ""
        again = (f"fix {config_file}, then `curl -s{auth} -X POST "
                 f"{url}/v1/models/{model}/reload` loads it again from the file" if config_file
                 else f"POST /v1/models/{model}/reload with the sparse_files to read loads it")
        echo(f"hps: model {model!r} failed to load: {message} (serving on without it: "
             f"/readyz answers 503; {again}; or serve with --require-models to exit "
             "instead)")

    def made(server_: DrainingServer) -> None:
        nonlocal uv
        uv = server_

    def listening(grpc_server: Any) -> None:
        # listen before saying "serving": a client that reads the line and connects at
        # once waits in the backlog until uvicorn accepts, instead of being refused
        sock.listen(2048)
        echo(f"hps: serving on {base_url(host, int(sock.getsockname()[1]))} (models load in "
             "the background; GET /readyz turns 200 when they are in, docs at /docs)")
        if grpc_server is not None:
            echo(f"hps: serving KServe v2 over gRPC on {grpc_server.start()}")

    # said once a compile has run half a second, then a line every 2 s while they go on
    compiling = CompileLines(lambda line: echo(f"hps: {line}"), "compiling what this config "
                             "runs (the first load on this machine; numba caches it)")
    with contextlib.closing(compiling), compile_events(compiling):
        stopped_by = run_app(
            sock, server, host=host, token=token, max_body_bytes=max_body_bytes,
            lookup_threads=lookup_threads, access_log=access_log, log_level=log_level,
            allow_roots=allow_roots, on_ready=on_ready, on_failed=on_failed,
            grpc_port=grpc_port if grpc_port is not None else server.config.http.grpc_port,
            made=made, listening=listening, load_progress=load_progress,
            config_file=config_file)
    if stopped_by:
        echo(f"hps: stopped by {'/'.join(signal.Signals(s).name for s in stopped_by)}: "
             "drained, every tier closed")
    if required and failed:
        raise ModelsNotLoadedError(
            f"{len(failed)} of {len(server.config.models)} models failed to load at start "
            f"({', '.join(failed)}); --require-models stopped the server")


def worker_count(workers: int | str) -> int:
    """The worker processes `workers` asks for ("auto": the usable cores). Raises
    ConfigError for anything but a positive number or "auto"."""
    if workers == "auto":
        return usable_cores()
    try:
        count = int(workers)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or isinstance(workers, bool) or str(count) != str(workers).strip():
        raise ConfigError(f"workers must be a positive number or \"auto\", got {workers!r}")
    return count


def run_app(sock: socket.socket, server: HierarchicalParameterServer, *, host: str,
            token: str | None, max_body_bytes: int, lookup_threads: int | None,
            access_log: bool, log_level: str, allow_roots: Sequence[str] | None,
            on_ready: Callable[[], None] | None, grpc_port: int | None,
            on_failed: Callable[[str, str], None] | None = None,
            made: Callable[[DrainingServer], None] | None = None,
            listening: Callable[[Any], None] | None = None,
            prepare: Callable[[Any], None] | None = None,
            load_progress: Callable[[str], AbstractContextManager[LoadProgress]] | None = None,
            config_file: str | None = None,
            share: tuple[ConnectionBoard, int] | None = None,
            ) -> tuple[int, ...]:
    """Serve `server`'s app on `sock` until a signal drains it, then close the tiers;
    returns the signals that stopped it. `made` gets the uvicorn server once made,
    `listening` the gRPC server (or None) when the socket is to listen, `prepare` the
    app before it serves (a worker merges its metrics there). `config_file`: the config
    file the server was started with (absolute), which reloads read again. `share`: the
    workers' connection board and this worker's index, where several workers accept
    from `sock` (hps/http/accept_share.py)."""
    app = create_app(server, token=token, host=host, max_body_bytes=max_body_bytes,
                     lookup_threads=lookup_threads, on_ready=on_ready, on_failed=on_failed,
                     allow_roots=allow_roots, load_progress=load_progress,
                     config_file=config_file)
    if prepare is not None:
        prepare(app)
    grpc_server = _grpc_server(app, host, grpc_port, sock)
    if token is None and not is_loopback(host):
        log.warning("serving on %s without a token: reads are open to the network, admin "
                    "routes (reload) are refused", host)
    options = uvicorn_options(server.config.http)
    uv = DrainingServer(uvicorn.Config(
        app, access_log=access_log, log_level=log_level, log_config=None,
        lifespan="on", ws="none", timeout_graceful_shutdown=5, **options))
    if share is not None:  # a worker of several: hps accepts, spreading the connections
        board, index = share
        uv.shared_accept = shared_accept(sock, board, index, options["http"])
    if made is not None:
        made(uv)
    if listening is not None:
        listening(grpc_server)
    try:
        uv.run(sockets=[sock])
    finally:
        if grpc_server is not None:  # served through uvicorn's drain; its calls in
            grpc_server.stop(grace=5).wait()  # flight then get as long to finish
        sock.close()
        _close(app.state.hps.loader, server)
    return uv.stopped_by


def _grpc_server(app: Any, host: str, port: int | None, sock: socket.socket) -> Any:
    """The gRPC service of `app`'s state bound to `host:port` (None: none); a taken
    port closes the HTTP socket and raises BindError before anything is served."""
    if port is None:
        return None
    try:
        from hps.http.grpc import GrpcServer

        return GrpcServer(app.state.hps, host, port)
    except BaseException:
        sock.close()
        raise


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or SIGINT drains (connections.py says how) and
    then returns, so `serve` closes every tier and the process exits 0.

    uvicorn raises the signal again once it has drained, with the default handler back:
    the process then died of it (status 143) before the tiers were closed (RocksDB left
    its WAL to replay at the next start). The signals it caught are noted in `stopped_by`
    instead."""

    stopped_by: tuple[int, ...] = ()
    #: where hps accepts the connections itself (a worker of several: accept_share.py)
    shared_accept: SharedAccept | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.shared_accept is None or not sockets:
            await super().startup(sockets)
            return
        await super().startup(sockets=[])  # the lifespan; no listener of uvicorn's
        if self.should_exit:
            return
        config = self.config
        protocol_class = self.shared_accept.counted(config.http_protocol_class)

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> Any:
            # as uvicorn's startup makes each connection's protocol
            return protocol_class(config=config, server_state=self.server_state,
                                  app_state=self.lifespan.state, _loop=_loop)

        self.shared_accept.start(asyncio.get_running_loop(), create_protocol)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.shared_accept is not None:
            self.shared_accept.stop()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:  # before uvicorn's own exit raises them again
                self.stopped_by = tuple(getattr(self, "_captured_signals", ()))
                if hasattr(self, "_captured_signals"):
                    self._captured_signals.clear()


def _close(loader: threading.Thread | None, server: HierarchicalParameterServer) -> None:
    if loader is not None and loader.is_alive():
        # closing RocksDB under a running load could corrupt it; the process exit ends it
        log.warning("a model was still loading at shutdown; the tiers are left to exit")
        return
    server.close()


class ServerThread:
    """uvicorn serving `app` from a thread on a loopback socket bound up front.

    For tests and embedding: `with ServerThread(app) as url: httpx.get(url + "/healthz")`.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", **config: Any) -> None:
        self.sock = bind_socket(host, 0)
        self.port = int(self.sock.getsockname()[1])
        self.url = base_url(host, self.port)
        config.setdefault("log_level", "warning")
        config.setdefault("access_log", False)
        config.setdefault("ws", "none")  # no websockets: nothing to import, nothing to warn
        config.setdefault("lifespan", "on")
        state = getattr(app.state, "hps", None)
        if state is not None:  # the server's own limits on slow and surplus connections
            for key, value in uvicorn_options(state.server.config.http).items():
                config.setdefault(key, value)
        self.server = uvicorn.Server(uvicorn.Config(app, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="hps-uvicorn", daemon=True)

    def start(self, timeout: float = 10.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
