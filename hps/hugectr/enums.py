"""HugeCTR's enums (`hugectr.inference`'s `DatabaseType_t`, ...), answering to both spellings
of their member names, as pybind exported them: snake_case (`DatabaseType_t.redis_cluster`)
and CamelCase (`DatabaseType_t.RedisCluster`). A member's value is ps.json's string.
"""

from __future__ import annotations

import re
from enum import Enum, EnumMeta
from typing import Any, TypeVar

from hps.errors import ConfigError

#: words HugeCTR's CamelCase member names spell in capitals
_ACRONYMS = {"db": "DB", "uvm": "UVM"}


def _other_spelling(name: str) -> str:
    """The other spelling of a member name: CamelCase for snake_case (rocks_db → RocksDB),
    snake_case for CamelCase (UVM → uvm)."""
    if name.islower():
        return "".join(_ACRONYMS.get(word, word.capitalize()) for word in name.split("_"))
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).lower()


class _TwoSpellings(EnumMeta):
    """HugeCTR's pybind enums answer to two spellings of each member: snake_case
    (`DatabaseType_t.redis_cluster`) and CamelCase (`DatabaseType_t.RedisCluster`). A
    member is declared once, in the spelling HugeCTR lists first (its `name`; its value is
    ps.json's string); the other spelling is resolved here, as an attribute, by
    `Enum[name]` and in `dir()`."""

    def _aliases(cls) -> dict[str, Any]:
        return {_other_spelling(name): member
                for name, member in cls.__dict__.get("_member_map_", {}).items()}

    def __getattr__(cls, name: str) -> Any:
        member = None if name.startswith("_") else cls._aliases().get(name)
        if member is None:
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")
        return member

    def __getitem__(cls, name: str) -> Any:
        member = cls.__members__.get(name) or cls._aliases().get(name)
        if member is None:
            raise KeyError(name)
        return member

    def __dir__(cls) -> list[str]:
        return [*super().__dir__(), *cls._aliases()]


class DatabaseType_t(str, Enum, metaclass=_TwoSpellings):  # noqa: N801 - HugeCTR's name
    """Database backends; the values are ps.json's `type` strings."""

    disabled = "disabled"
    hash_map = "hash_map"
    parallel_hash_map = "parallel_hash_map"
    multi_process_hash_map = "multi_process_hash_map"
    redis_cluster = "redis_cluster"
    rocks_db = "rocks_db"


class DatabaseOverflowPolicy_t(str, Enum, metaclass=_TwoSpellings):  # noqa: N801
    """What a full volatile-database partition evicts."""

    evict_random = "evict_random"
    evict_least_used = "evict_least_used"
    evict_oldest = "evict_oldest"


class UpdateSourceType_t(str, Enum, metaclass=_TwoSpellings):  # noqa: N801
    """Where online updates come from."""

    null = "null"
    kafka_message_queue = "kafka_message_queue"
    redis_stream = "redis_stream"  # hps: Redis Streams (not in HugeCTR)


class EmbeddingCacheType_t(str, Enum, metaclass=_TwoSpellings):  # noqa: N801
    """The GPU cache's kind (`stochastic` is HugeCTR's and is refused by the config)."""

    Dynamic = "dynamic"
    UVM = "uvm"
    Static = "static"
    Stochastic = "stochastic"


E = TypeVar("E", bound=Enum)


def member_of(cls: type[E], value: Any, where: str) -> E:
    """`value` as a member of `cls`: a member, its ps.json string, or either spelling of
    its name."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value]
        except KeyError:
            pass
        try:
            return cls(value)
        except ValueError:
            pass
    names = ", ".join(sorted({m.name for m in cls}))
    raise ConfigError(f"{where}: expected a {cls.__name__} ({names}), got {value!r}")
