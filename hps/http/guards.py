"""Which requests admin routes (reload, adding and removing models) accept, beyond the
token: the server's own names, and JSON bodies.

- Host: the request's `Host` header (and its `Origin`, when a browser sends one) must name
  one of the server's names (`http.allowed_hosts`; by default the loopback names and the
  bound address), so a page elsewhere cannot reach a loopback server through DNS
  rebinding or a cross-site form.
- Body: a request that carries one must say `Content-Type: application/json` (a browser
  cannot send that cross-site without asking first).

Where admin routes may read from is `roots.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from hps.config import PSConfig
from hps.http.errors import Forbidden, UnsupportedMediaType
from hps.http.schemas import JSON

#: names every server answers to on its own machine
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_WILDCARDS = ("", "0.0.0.0", "::")


class HostNotAllowed(Forbidden):
    """An admin request whose Host (or Origin) is not one of the server's names."""

    kind = "host_not_allowed"


def host_of(value: str) -> str:
    """The host part of a `Host` header or an `Origin` (no scheme, no port), lower case."""
    if "://" in value:
        value = urlsplit(value).netloc
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value


def allowed_hosts(config: PSConfig, bound: str) -> frozenset[str]:
    """The Host names admin routes accept: loopback names, the bound address (unless it
    is a wildcard) and `http.allowed_hosts`."""
    names = set(LOOPBACK_NAMES)
    if host_of(bound) not in _WILDCARDS:
        names.add(host_of(bound))
    names.update(host_of(h) for h in config.http.allowed_hosts or ())
    return frozenset(names)


def check_admin_request(headers: Mapping[str, str], hosts: frozenset[str]) -> None:
    """HostNotAllowed (403) for a foreign Host or Origin, UnsupportedMediaType (415) for
    a body that is not JSON."""
    host = host_of(headers.get("host", ""))
    if host not in hosts:
        raise HostNotAllowed(
            f"admin routes answer only requests to this server's names "
            f"({', '.join(sorted(hosts))}), not Host {host or '(none)'!r}: list the name "
            "in the config's http.allowed_hosts")
    origin = headers.get("origin")
    if origin == "null":
        raise HostNotAllowed("admin routes refuse requests from opaque origins")
    if origin is not None and host_of(origin) not in hosts:
        raise HostNotAllowed(f"admin routes refuse requests from pages at {origin!r}")
    has_body = headers.get("content-length", "0") not in ("", "0") or (
        "transfer-encoding" in headers)
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if has_body and media != JSON:
        raise UnsupportedMediaType(
            f"admin request bodies are {JSON}, got {headers.get('content-type') or 'none'}")
