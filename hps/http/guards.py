"""Which requests admin routes (reload, adding and removing models) accept, beyond the
token: the server's own names, and JSON bodies; and the Host every other route of a
loopback server without a token checks.

- Host: the request's `Host` header must name one of the server's names
  (`http.allowed_hosts`; by default the loopback names and the bound address), so a page
  elsewhere cannot reach a loopback server through DNS rebinding. Admin routes always
  check it; the other routes when the server is bound to loopback without a token
  (`check_host`), where nothing else keeps such a page from reading embeddings and
  model names (with a token, the token does; bound to the network, reads are open).
- Origin, when a browser sends one: scheme, host and port must be one of the server's own
  origins (one of its names on the scheme and port the request came in on, or an
  `http.allowed_hosts` entry written as an origin, `https://hps.example`), so a page on
  another port of the same machine (`http://localhost:3000`) cannot post a form to it.
- Body: a request that carries one must say `Content-Type: application/json` (a browser
  cannot send that cross-site without asking first).

Where admin routes may read from is `roots.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from hps.config import PSConfig
from hps.http.errors import Forbidden, UnsupportedMediaType
from hps.http.schemas import JSON

if TYPE_CHECKING:
    from starlette.types import Scope

#: names every server answers to on its own machine
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_WILDCARDS = ("", "0.0.0.0", "::")


class HostNotAllowed(Forbidden):
    """A request whose Host (or an admin request whose Origin) is not one of the
    server's names."""

    kind = "host_not_allowed"


def shown(value: str) -> str:
    """A header value quoted as an error message may show it: its bytes (header values
    arrive decoded as Latin-1) read as the UTF-8 a client sends, with what is not UTF-8
    or not printable (controls, bidi overrides) escaped, so the message neither garbles
    a name nor carries what a terminal or a page would act on."""
    text = value.encode("latin-1", "replace").decode("utf-8", "backslashreplace")
    return "'" + "".join(c if c.isprintable() else c.encode("unicode_escape").decode()
                         for c in text) + "'"


def check_host(headers: Mapping[str, str], hosts: frozenset[str],
               who: str = "this server answers") -> None:
    """HostNotAllowed (403) unless the request's Host names one of `hosts`; `who`
    begins the message (what refuses)."""
    sent = headers.get("host", "")
    if host_of(sent) not in hosts:
        raise HostNotAllowed(
            f"{who} only requests to this server's names "
            f"({', '.join(sorted(hosts))}), not Host {shown(sent) if sent else '(none)'}: "
            "list the name in the config's http.allowed_hosts")


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


_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(value: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin (`http://localhost:8000`), the port made explicit;
    None for what is not an http(s) origin."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port if port is not None else _DEFAULT_PORTS[scheme]


def allowed_origins(config: PSConfig) -> frozenset[tuple[str, str, int]]:
    """The `http.allowed_hosts` entries written as origins (a proxy's `https://name`)."""
    entries = (origin_of(h) for h in config.http.allowed_hosts or () if "://" in h)
    return frozenset(e for e in entries if e is not None)


def check_origin(origin: str, hosts: frozenset[str], listed: frozenset[tuple[str, str, int]],
                 scheme: str, port: int | None) -> None:
    """HostNotAllowed unless `origin` is one of the server's own: one of `hosts` on the
    `scheme` and `port` the request came in on, or one of the `listed` origins."""
    own = origin_of(origin)
    if own is None or not (own in listed or (
            own[1] in hosts and own[0] == scheme and port is not None and own[2] == port)):
        raise HostNotAllowed(f"admin routes refuse requests from pages at {shown(origin)} "
                             f"(this server's origins are {scheme}://<its names>:{port})")


def request_port(scope: Scope) -> int | None:
    """The port a request came in on (None on a Unix socket)."""
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else None


def check_admin_request(headers: Mapping[str, str], hosts: frozenset[str],
                        origins: frozenset[tuple[str, str, int]] = frozenset(),
                        scheme: str = "http", port: int | None = None) -> None:
    """HostNotAllowed (403) for a foreign Host or Origin (`check_origin`; `scheme` and
    `port`: where the request came in), UnsupportedMediaType (415) for a body that is not
    JSON."""
    check_host(headers, hosts, "admin routes answer")
    origin = headers.get("origin")
    if origin == "null":
        raise HostNotAllowed("admin routes refuse requests from opaque origins")
    if origin is not None:
        check_origin(origin, hosts, origins, scheme, port)
    has_body = headers.get("content-length", "0") not in ("", "0") or (
        "transfer-encoding" in headers)
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if has_body and media != JSON:
        raise UnsupportedMediaType(
            f"admin request bodies are {JSON}, got {headers.get('content-type') or 'none'}")
