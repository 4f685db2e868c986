"""The HTTP lookup service: a FastAPI app over a `HierarchicalParameterServer`.

`create_app(server, token=..., host=...)` builds the app; `serve(config, ...)` runs it
with uvicorn (what `hps serve` does). Needs the `server` extra:
`pip install 'hps-server[server]'`.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    from hps.errors import MissingExtraError

    raise MissingExtraError(exc.name or "fastapi", "server", "the HTTP service") from None

from hps.http.app import create_app
from hps.http.serve import serve

__all__ = ["create_app", "serve"]
