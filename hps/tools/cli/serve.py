"""`hps serve`: one config's models over HTTP until Ctrl-C (the server extra: hps.http).

`serve_config` is the one way the command line starts the server (`hps demo --serve`
too), each model's load shown on stderr as it goes (progress.py): a port already taken
is one line and exit status 1, before anything says "serving"; any other HPSError one
line and exit status 2 (with --require-models, a model that failed to load at start
too, after its own line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hps.errors import BindError, HPSError
from hps.tools.cli.root import console, fail

#: the default of --max-body-bytes
DEFAULT_MAX_BODY = 16 << 20


def serve(
    config: Path = typer.Argument(..., help="ps.json or YAML config."),
    host: str = typer.Option(
        "127.0.0.1", help="Address to bind; 0.0.0.0 serves every interface."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port (0: any free one)."),
    token: Optional[str] = typer.Option(
        None, envvar="HPS_TOKEN", show_envvar=True,
        help="Bearer token every route but /healthz and /readyz requires."),
    max_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY, help="Largest request body accepted (413 above)."),
    lookup_threads: Optional[int] = typer.Option(
        None, min=0, help="Threads lookups run on; 0: on the event loop. Default: 0 when "
        "every tier is in memory (hash map, no RocksDB; a GPU cache or not), else 2."),
    access_log: bool = typer.Option(False, "--access-log/--no-access-log",
                                    help="Log every request."),
    allow_root: Optional[list[str]] = typer.Option(
        None, "--allow-root", help="A folder or URI prefix models added at runtime (POST "
        "/v1/models) may be read from; repeatable. Default: the folders holding the "
        "config's model folders."),
    grpc_port: Optional[int] = typer.Option(
        None, min=0, max=65535, help="Also serve KServe v2 over gRPC (tritonclient.grpc) "
        "on this port (Triton's is 8001). Default: the config's http.grpc_port; none."),
    workers: Optional[str] = typer.Option(
        None, help="Worker processes answering on the port, over one table in shared "
        "memory (docs/workers.md); \"auto\": one per usable core. Default: the config's "
        "http.workers; 1."),
    require_models: Optional[bool] = typer.Option(
        None, "--require-models/--no-require-models", help="Exit (status 2) when a model "
        "fails to load at start, instead of serving on without it with /readyz at 503: "
        "for an orchestrator that restarts what exits. Default: the config's "
        "http.require_models; off."),
) -> None:
    """Serve lookups over HTTP (/v1 and KServe v2), metrics, health.

    Lookups: binary and JSON on /v1, and the KServe v2 / Triton protocol on /v2 (inputs
    KEYS, NUMKEYS; output OUTPUT0). Binds at once and loads the models in the
    background: /healthz answers now, /readyz
    turns 200 when every model is loaded, and a working curl line is printed then. A
    model that fails to load is one line here.
    """
    serve_config(config, host=host, port=port, token=token or None,
                 max_body_bytes=max_body_bytes, lookup_threads=lookup_threads,
                 access_log=access_log, allow_roots=allow_root or None,
                 grpc_port=grpc_port, workers=workers, require_models=require_models)


def serve_config(config: Path, *, host: str, port: int, token: str | None,
                 max_body_bytes: int, access_log: bool, lookup_threads: int | None = None,
                 allow_roots: list[str] | None = None,
                 grpc_port: int | None = None, workers: str | None = None,
                 require_models: bool | None = None) -> None:
    """Serve `config` until Ctrl-C; errors as one line (see the module's docstring)."""
    try:
        from hps.http import serve as run_server
        from hps.tools.cli.progress import load_progress

        run_server(str(config), host=host, port=port, token=token,
                   max_body_bytes=max_body_bytes, access_log=access_log,
                   lookup_threads=lookup_threads,
                   echo=_echo_plain, allow_roots=allow_roots, grpc_port=grpc_port,
                   workers=workers, require_models=require_models,
                   load_progress=lambda model: load_progress())
    except BindError as exc:  # one line, exit 1, before anything says "serving"
        fail(exc, code=1)
    except HPSError as exc:
        fail(exc)


def _echo_plain(text: str) -> None:
    # no markup, no wrapping: the curl line must stay copy-pasteable
    console.print(text, markup=False, highlight=False, soft_wrap=True)
