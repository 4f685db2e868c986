"""/docs works offline: Swagger UI's page names no other host and its assets are served."""

from __future__ import annotations

import re

import httpx

from hps.http.docs_page import ASSETS
from tests.http.conftest import Live


def test_docs_page_loads_nothing_from_elsewhere(live_token: Live) -> None:
    page = httpx.get(live_token.url + "/docs")  # no token: the docs are open
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", page.text)
    assert urls, page.text
    assert not [u for u in urls if "//" in u], urls  # every URL is on this server
    assets = [u for u in urls if u.startswith("/docs/")]
    assert sorted(a.removeprefix("/docs/") for a in assets) == sorted(ASSETS)
    for url in [*assets, "/openapi.json"]:
        answer = httpx.get(live_token.url + url)
        assert answer.status_code == 200, url
        assert len(answer.content) > 500, url
    script = httpx.get(live_token.url + "/docs/swagger-ui-bundle.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert "SwaggerUIBundle" in script.text


def test_only_the_listed_assets_are_served(live_token: Live) -> None:
    # the bundle's folder holds a demo index.html (the petstore) and source maps
    for name in ("index.html", "swagger-ui-bundle.js.map", "../__init__.py"):
        assert httpx.get(f"{live_token.url}/docs/{name}").status_code == 404
    assert httpx.get(live_token.url + "/redoc").status_code == 404  # ReDoc needs a CDN
