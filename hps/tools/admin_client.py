"""The client side of `hps models`: a running server's model routes over plain HTTP.

Standard library only (`urllib`), so `hps models` works without the server extra;
`urllib.request` and `yaml` are imported by the calls that use them, not by the `hps`
command's start (which reads DEFAULT_URL).
`model_block(path, name)` reads the model block to add from a ps.json / YAML file (one
block, or a whole config and the model's name) with its relative paths made absolute,
as the server requires; `absolute_sources` does the same for the files of a reload.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hps.errors import ConfigError, HPSError

DEFAULT_URL = "http://127.0.0.1:8000"


class ServerRequestError(HPSError):
    """The server refused a request (its error message), or could not be reached."""

    kind = "server_request"


def call(url: str, method: str, path: str, token: str | None = None,
         body: Any = None, timeout: float = 3600.0) -> Any:
    """`method path` on the server at `url`; the JSON answer, or ServerRequestError."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as exc:
        raise ServerRequestError(f"{method} {path}: {exc.code} {_message(exc.read())}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerRequestError(f"no hps server answers at {url} ({reason}); start one "
                                 "with `hps serve`, or pass --url") from None


def _message(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]
    return str(error.get("message", error) if isinstance(error, dict) else error)


def absolute_sources(sources: list[Any], base: Path) -> list[Any]:
    """`sparse_files` entries with relative local paths resolved from `base` (URIs and
    absolute paths kept; an entry that is an object has its `path` resolved)."""
    def absolute(source: str) -> str:
        return source if "://" in source or os.path.isabs(source) else str(base / source)

    return [absolute(f) if isinstance(f, str) else
            {**f, "path": absolute(f["path"])} if isinstance(f, dict)
            and isinstance(f.get("path"), str) else f
            for f in sources]


def model_block(path: Path, name: str | None = None) -> dict[str, Any]:
    """The model block to add: `path` holds one, or a config with `models` (pick `name`
    when there are several). Relative `sparse_files` resolve from the file's folder."""
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        yaml_file = path.suffix.lower() in (".yaml", ".yml")
        raw = yaml.safe_load(text) if yaml_file else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid JSON or YAML: {exc}") from None
    if isinstance(raw, dict) and isinstance(raw.get("models"), list):
        models = [m for m in raw["models"] if isinstance(m, dict)]
        names = [str(m.get("model")) for m in models]
        if name is None and len(models) == 1:
            raw = models[0]
        elif name in names:
            raw = models[names.index(name)]
        else:
            raise ConfigError(f"{path} holds models {', '.join(names)}: pick one with --model")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a model block (an object)")
    files = raw.get("sparse_files")
    if isinstance(files, list):
        raw = {**raw, "sparse_files": absolute_sources(files, path.resolve().parent)}
    return raw
