"""A config file's text read into the mapping `hps.config.parse_config` validates: JSON
(ps.json, HugeCTR's format) or YAML by the file's suffix. Every failure is a ConfigError
naming the file and, for JSON, where in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hps.errors import ConfigError


def read_config_file(path: Path) -> Any:
    """The contents of the config file at `path`, parsed (not validated)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
