"""What every HugeCTR config object shares: its attributes as ps.json keys, the options
`hps` accepts and ignores (logged once per process), and `hps_options`, the ps.json keys
HugeCTR's objects have no argument for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import fields
from enum import Enum
from typing import Any, ClassVar

from pydantic import BaseModel

from hps.errors import ConfigError

log = logging.getLogger("hps")


def json_value(value: Any) -> Any:
    """A value as ps.json holds it (enum members become their strings)."""
    return value.value if isinstance(value, Enum) else value


class Params:
    """What every HugeCTR config object shares: defaults, ignored options, JSON mapping."""

    #: attribute → ps.json key, for the attributes that have one
    _JSON: ClassVar[dict[str, str]] = {}
    #: attributes `hps` accepts and does nothing with
    _IGNORED: ClassVar[tuple[str, ...]] = ()

    hps_options: dict[str, Any]

    @classmethod
    def _default(cls, name: str) -> Any:
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name == name:
                return f.default_factory() if callable(f.default_factory) else f.default
        raise AttributeError(name)

    def _given_ignored(self) -> dict[str, Any]:
        """Ignored options set to something other than HugeCTR's default."""
        return {f"{type(self).__name__}.{name}": getattr(self, name) for name in self._IGNORED
                if getattr(self, name) != self._default(name)}

    def _section_json(self, where: str) -> dict[str, Any]:
        raw = {key: json_value(getattr(self, attr)) for attr, key in self._JSON.items()}
        merge_options(raw, self.hps_options, where, self._JSON)
        return raw

    @classmethod
    def _kwargs_from(cls, section: BaseModel) -> dict[str, Any]:
        raw = section.model_dump(mode="json")
        kwargs = {attr: raw[key] for attr, key in cls._JSON.items()}
        kwargs["hps_options"] = hps_options_of(section, cls._JSON.values())
        return kwargs


def merge_options(raw: dict[str, Any], options: Mapping[str, Any], where: str,
                  mapping: Mapping[str, str]) -> None:
    """Add `hps_options` to ps.json contents; a key HugeCTR has an argument for is refused."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}.hps_options must be a dict of ps.json keys")
    by_key = {key: attr for attr, key in mapping.items()}
    for key in options:
        if key in raw:
            raise ConfigError(
                f"{where}.hps_options[{key!r}] contradicts the argument "
                f"{by_key.get(key, key)!r}: set it there instead"
            )
    raw.update(options)


def hps_options_of(section: BaseModel, mapped: Iterable[str]) -> dict[str, Any]:
    """Fields of a typed config section outside the mapping that differ from the default."""
    skip = set(mapped)
    dumped = section.model_dump(mode="json")
    return {name: dumped[name] for name, info in type(section).model_fields.items()
            if name not in skip
            and getattr(section, name) != info.get_default(call_default_factory=True)}


# -- reporting ignored options ------------------------------------------------------------

_reported: set[str] = set()
_reported_lock = threading.Lock()


def report_ignored(given: dict[str, Any]) -> None:
    """Log the ignored options not logged before in this process, in one warning."""
    with _reported_lock:
        fresh = {name: value for name, value in given.items() if name not in _reported}
        _reported.update(fresh)
    if fresh:
        listed = ", ".join(f"{name}={value!r}" for name, value in fresh.items())
        log.warning("hps ignores these HugeCTR options (they have no effect here): %s", listed)
