"""The database blocks of HugeCTR's configuration: `VolatileDatabaseParams`,
`PersistentDatabaseParams` and `UpdateSourceParams`, each one block of ps.json
(`volatile_db`, `persistent_db`, `update_source`), with HugeCTR's arguments, order and
defaults.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from hps.config import UNBOUNDED
from hps.hugectr.base import Params
from hps.hugectr.enums import (
    DatabaseOverflowPolicy_t,
    DatabaseType_t,
    UpdateSourceType_t,
    member_of,
)

#: HugeCTR's "no limit" for overflow_margin (size_t max); ps.json's is UNBOUNDED
SIZE_MAX = 2**64 - 1


B = TypeVar("B", bound="_Block")
#: attribute → its enum (a class attribute named `type` hides the builtin in class bodies)
_EnumArgs = dict[str, type[Enum]]


class _Block(Params):
    """An object that is one block of ps.json (`volatile_db`, `persistent_db`,
    `update_source`): its enum arguments taken as members, written and read as that block."""

    #: attribute → its enum (given as a member, its ps.json string or either name)
    _ENUMS: ClassVar[_EnumArgs] = {}

    def __post_init__(self) -> None:
        for attr, enum in self._ENUMS.items():
            where = f"{type(self).__name__}.{attr}"
            setattr(self, attr, member_of(enum, getattr(self, attr), where))

    def to_json(self) -> dict[str, Any]:
        """This object's block of ps.json."""
        return self._section_json(type(self).__name__)

    @classmethod
    def from_section(cls: type[B], section: BaseModel) -> B:
        """The object that stands for a typed config block (hps.config)."""
        return cls(**cls._kwargs_from(section))


def _default_partitions() -> int:
    return min(16, os.cpu_count() or 1)


@dataclass
class VolatileDatabaseParams(_Block):
    """`volatile_db`: the in-process hash map or Redis (Cluster)."""

    type: DatabaseType_t = DatabaseType_t.parallel_hash_map
    address: str = "127.0.0.1:7000"
    user_name: str = "default"
    password: str = ""
    num_partitions: int = field(default_factory=_default_partitions)
    allocation_rate: int = 256 << 20
    shared_memory_size: int = 16 << 30
    shared_memory_name: str = "hctr_mp_hash_map_database"
    shared_memory_auto_remove: bool = True
    num_node_connections: int = 5
    max_batch_size: int = 65536
    enable_tls: bool = False
    tls_ca_certificate: str = "cacertbundle.crt"
    tls_client_certificate: str = "client_cert.pem"
    tls_client_key: str = "client_key.pem"
    tls_server_name_identification: str = "redis.localhost"
    overflow_margin: int = SIZE_MAX
    overflow_policy: DatabaseOverflowPolicy_t = DatabaseOverflowPolicy_t.evict_random
    overflow_resolution_target: float = 0.8
    initialize_after_startup: bool = True
    initial_cache_rate: float = 1.0
    cache_missed_embeddings: bool = False
    update_filters: list[str] = field(default_factory=lambda: ["^hps_.+$"])
    hps_options: dict[str, Any] = field(default_factory=dict, kw_only=True)

    _JSON: ClassVar[dict[str, str]] = {name: name for name in (
        "type", "address", "user_name", "password", "num_partitions", "num_node_connections",
        "max_batch_size", "enable_tls", "tls_ca_certificate", "tls_client_certificate",
        "tls_client_key", "tls_server_name_identification", "overflow_margin",
        "overflow_policy", "overflow_resolution_target", "initial_cache_rate",
        "cache_missed_embeddings", "update_filters")}
    _IGNORED: ClassVar[tuple[str, ...]] = (
        "allocation_rate", "shared_memory_size", "shared_memory_name",
        "shared_memory_auto_remove", "initialize_after_startup")

    _ENUMS: ClassVar[_EnumArgs] = {
        "type": DatabaseType_t, "overflow_policy": DatabaseOverflowPolicy_t}

    def to_json(self) -> dict[str, Any]:
        """The `volatile_db` block of ps.json."""
        raw = super().to_json()
        if isinstance(self.overflow_margin, int) and self.overflow_margin >= UNBOUNDED:
            raw["overflow_margin"] = UNBOUNDED
        return raw

    @classmethod
    def from_section(cls, section: BaseModel) -> VolatileDatabaseParams:
        params = super().from_section(section)
        if params.overflow_margin >= UNBOUNDED:
            params.overflow_margin = SIZE_MAX
        return params


@dataclass
class PersistentDatabaseParams(_Block):
    """`persistent_db`: RocksDB (HugeCTR calls its type argument `backend`)."""

    backend: DatabaseType_t = DatabaseType_t.disabled
    path: str = field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "rocksdb"))
    num_threads: int = 16
    read_only: bool = False
    max_batch_size: int = 65536
    initialize_after_startup: bool = True
    update_filters: list[str] = field(default_factory=lambda: ["^hps_.+$"])
    hps_options: dict[str, Any] = field(default_factory=dict, kw_only=True)

    _JSON: ClassVar[dict[str, str]] = {
        "backend": "type", "path": "path", "num_threads": "num_threads",
        "read_only": "read_only", "max_batch_size": "max_batch_size",
        "update_filters": "update_filters"}
    _IGNORED: ClassVar[tuple[str, ...]] = ("initialize_after_startup",)
    _ENUMS: ClassVar[_EnumArgs] = {"backend": DatabaseType_t}


@dataclass
class UpdateSourceParams(_Block):
    """`update_source`: where online updates come from."""

    type: UpdateSourceType_t = UpdateSourceType_t.null
    brokers: str = "127.0.0.1:9092"
    metadata_refresh_interval_ms: int = 30_000
    receive_buffer_size: int = 256 * 1024
    poll_timeout_ms: int = 500
    max_batch_size: int = 8192
    failure_backoff_ms: int = 50
    max_commit_interval: int = 32
    hps_options: dict[str, Any] = field(default_factory=dict, kw_only=True)

    _JSON: ClassVar[dict[str, str]] = {name: name for name in (
        "type", "brokers", "metadata_refresh_interval_ms", "receive_buffer_size",
        "poll_timeout_ms", "max_batch_size", "failure_backoff_ms", "max_commit_interval")}
    _ENUMS: ClassVar[_EnumArgs] = {"type": UpdateSourceType_t}
