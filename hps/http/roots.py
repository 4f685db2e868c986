"""Allowed roots: the only places a model added or reloaded over HTTP may be read from.

An admin route that adds a model (`POST /v1/models`) or reloads one from new URIs
(`POST /v1/models/{model}/reload`) reads files the request names; the
server reads only under its allowed roots, so a token holder cannot make it read any
file the process can. A root is a local folder (`/srv/models`) or a URI prefix
(`s3://bucket/models/`). `hps serve --allow-root` sets them, the config's
`http.allowed_sources` adds to them; by default they are the
folders that hold the configured models' folders (for `configs/demo.json`, whose tables
are `models/demo/user_item` and `models/demo/item_category`: `models/`).

Local paths are compared after resolving symbolic links and `..`, so no path escapes its
root; URIs must not contain `..` segments and are compared as text.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from hps.config import PSConfig
from hps.errors import ConfigError, SourceNotFoundError
from hps.http.errors import Forbidden


def is_uri(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def _local(path: str) -> str:
    return os.path.realpath(path.removeprefix("file://"))


def normalise_root(root: str) -> str:
    """A root as compared: a resolved folder, or a URI prefix ending in '/'."""
    if is_uri(root):
        return root if root.endswith("/") else root + "/"
    return _local(root)


def source_path(entry: Any) -> str:
    """The path or URI of a `sparse_files` entry (a string, or a TableSpec's `path`)."""
    return entry if isinstance(entry, str) else str(entry.path)


def default_roots(config: PSConfig) -> list[str]:
    """The folders (or URI prefixes) holding the configured models' table folders."""
    roots = []
    for model in config.models:
        for entry in model.sparse_files:
            source = source_path(entry).rstrip("/")
            if is_uri(source):
                head = source.rsplit("/", 2)[0]
                if "://" in head and head.split("://", 1)[1]:
                    roots.append(head + "/")
            else:
                roots.append(os.path.dirname(os.path.dirname(_local(source))))
    return list(dict.fromkeys(roots))


def is_under(source: str, roots: Iterable[str]) -> bool:
    """Whether `source` (a path or URI) lies under one of `roots` (normalised)."""
    if is_uri(source):
        if "/../" in source + "/" or "/./" in source + "/":
            return False
        return any(is_uri(r) and source.startswith(r) for r in roots)
    path = _local(source)
    return any(not is_uri(r) and (path == r or path.startswith(r.rstrip(os.sep) + os.sep))
               for r in roots)


def check_text(source: str) -> None:
    """ConfigError for an entry no file system or URI means: control characters (a NUL
    made os.stat raise ValueError, a 500), or `file://host/...` (`file://relative/x`
    read a path relative to the server's working folder)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise ConfigError(f"sparse_files entry {source!r} holds a control character")
    if source.startswith("file://"):
        host = urlsplit(source).netloc
        if host not in ("", "localhost"):
            raise ConfigError(f"{source!r}: a file URI names an absolute path, file:///path "
                              f"(here {host!r} stands where the path's root belongs)")


def check_absolute(entries: Sequence[Any]) -> None:
    """ConfigError unless every `sparse_files` entry is an absolute path, a `file:///`
    URI (the same path) or another URI: the one rule of adding and of reloading."""
    relative = [source_path(e) for e in entries
                if not is_uri(source_path(e))
                and not os.path.isabs(source_path(e).removeprefix("file://"))]
    if relative:
        raise ConfigError(f"sparse_files must be absolute paths or URIs, got {relative}")


def check_sources(entries: Sequence[Any], roots: Sequence[str]) -> None:
    """ConfigError for a malformed entry (`check_text`), then Forbidden naming the first
    `sparse_files` entry outside every root, then SourceNotFoundError (404) for a local
    one that does not exist, whether named as a string or an object."""
    for entry in entries:
        check_text(source_path(entry))
    for entry in entries:
        source = source_path(entry)
        if not is_under(source, roots):
            allowed = ", ".join(roots) or "none"
            raise Forbidden(f"{source!r} is not under an allowed root (allowed: {allowed}); "
                            "start the server with --allow-root to read from elsewhere")
    for entry in entries:  # only once all are under a root: nothing is said of others
        source = source_path(entry)
        if not is_uri(source) and not os.path.exists(_local(source)):
            raise SourceNotFoundError(f"{source!r} does not exist")
