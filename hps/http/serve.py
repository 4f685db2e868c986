"""Running the app under uvicorn: `serve()` (what `hps serve` runs) and `ServerThread`.

`serve` binds first and loads the models in the background: `/healthz` answers at once,
`/readyz` turns 200 when every model is in, and then a `curl` line that works is printed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn

from hps.config import PSConfig
from hps.http.app import create_app
from hps.http.state import DEFAULT_LOOKUP_THREADS, DEFAULT_MAX_BODY_BYTES, is_loopback
from hps.server import HierarchicalParameterServer

log = logging.getLogger("hps.http")


def base_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server bound to `host:port` at."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host.strip('[]')}]"
    return f"http://{host}:{port}"


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
            from hps.io.formats import open_model

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
    lookup_threads: int = DEFAULT_LOOKUP_THREADS,
    access_log: bool = False,
    log_level: str = "info",
    echo: Callable[[str], None] = print,
) -> None:
    """Serve every model of `config` over HTTP until interrupted (SIGINT/SIGTERM).

    The tiers are set up first (a bad config or an unreachable Redis fails here, before
    binding); models then load in the background.
    """
    server = HierarchicalParameterServer(
        str(config) if isinstance(config, Path) else config, load=False)
    uv: uvicorn.Server | None = None

    def announce() -> None:
        while uv is not None and not uv.started and not uv.should_exit:
            time.sleep(0.05)
        if uv is None or not uv.started:
            return
        url = base_url(host, bound_port(uv) or port)
        echo(f"hps: every model is loaded; try:\n  {curl_line(server, url, token is not None)}")

    def on_ready() -> None:
        threading.Thread(target=announce, name="hps-announce", daemon=True).start()

    app = create_app(server, token=token, host=host, max_body_bytes=max_body_bytes,
                     lookup_threads=lookup_threads, on_ready=on_ready)
    if token is None and not is_loopback(host):
        log.warning("serving on %s without a token: reads are open to the network, admin "
                    "routes (reload) are refused", host)
    uv = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, access_log=access_log, log_level=log_level,
        lifespan="on", ws="none", timeout_graceful_shutdown=5))
    echo(f"hps: serving on {base_url(host, port)} (models load in the background; "
         "GET /readyz turns 200 when they are in, docs at /docs)")
    try:
        uv.run()
    finally:
        _close(app.state.hps.loader, server)


def _close(loader: threading.Thread | None, server: HierarchicalParameterServer) -> None:
    if loader is not None and loader.is_alive():
        # closing RocksDB under a running load could corrupt it; the process exit ends it
        log.warning("a model was still loading at shutdown; the tiers are left to exit")
        return
    server.close()


def bound_port(uv: uvicorn.Server) -> int | None:
    """The port a started uvicorn server listens on (useful with port 0)."""
    for srv in getattr(uv, "servers", []):
        for sock in srv.sockets:
            return int(sock.getsockname()[1])
    return None


class ServerThread:
    """uvicorn serving `app` from a thread on a loopback socket bound up front.

    For tests and embedding: `with ServerThread(app) as url: httpx.get(url + "/healthz")`.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", **config: Any) -> None:
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = base_url(host, self.port)
        config.setdefault("log_level", "warning")
        config.setdefault("access_log", False)
        config.setdefault("ws", "none")  # no websockets: nothing to import, nothing to warn
        config.setdefault("lifespan", "on")
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
