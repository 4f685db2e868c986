"""`/docs`: Swagger UI served from the package, so the page works on a host without internet.

FastAPI's own `/docs` page loads Swagger UI's script and style from a CDN (and `/redoc`
loads ReDoc from one): offline both are blank. Here the page is FastAPI's
(`get_swagger_ui_html`), with its assets answered by the service itself from the
`swagger-ui-bundle` package (the `server` extra): `/docs/swagger-ui-bundle.js`,
`/docs/swagger-ui.css` and `/docs/favicon-32x32.png`, nothing else of that folder. Like
`/openapi.json`, these need no token. `/redoc` is not served (ReDoc has no such package).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

DOCS_PATH = "/docs"
#: the files of Swagger UI the page loads, by name, with their media types
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
_MISSING = ("the /docs page needs the swagger-ui-bundle package: "
            "pip install 'hps-server[server]'")


def asset_folder() -> Path | None:
    """The folder of Swagger UI's files; None when swagger-ui-bundle is not installed."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return Path(swagger_ui_path)


def add_docs_page(app: FastAPI) -> None:
    """Serve `/docs` and its assets on `app` (built with `docs_url=None`)."""
    folder = asset_folder()

    async def docs() -> Response:
        if folder is None:
            return _missing()
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
            swagger_js_url=f"{DOCS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_PATH}/favicon-32x32.png")

    app.add_api_route(DOCS_PATH, docs, methods=["GET"], include_in_schema=False,
                      response_class=HTMLResponse)
    for name, media_type in ASSETS.items():
        app.add_api_route(f"{DOCS_PATH}/{name}", _asset(folder, name, media_type),
                          methods=["GET"], include_in_schema=False)


def _missing() -> Response:
    return JSONResponse({"error": {"kind": "missing_extra", "message": _MISSING}},
                        status_code=501)


def _asset(folder: Path | None, name: str,
           media_type: str) -> Callable[[], Awaitable[Response]]:
    async def asset() -> Response:
        if folder is None:
            return _missing()
        # the bundle does not change while the package is installed: a day of caching
        return FileResponse(folder / name, media_type=media_type,
                            headers={"Cache-Control": "public, max-age=86400"})

    return asset
