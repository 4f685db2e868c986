"""Parameter-server configuration: HugeCTR's `ps.json` (or YAML, or a dict) → typed config.

Every key of HugeCTR's HPS config is accepted with HugeCTR's default and meaning (HugeCTR's
`ps.json` documentation). Keys `hps` does not know are reported as `UnknownConfigKeyWarning`
with their path and the nearest known key, so a misspelling never passes silently; a near
miss of a known key the same block lacks is a ConfigError naming both, before anything
loads (hps/config_keys.py). A bad value raises `ConfigError`
naming the key path and the expected form. Types are strict where JSON has them: a string
for a boolean, integer or number key ("yes", "256") is an error, not converted.
`deployed_device_list` may be left out of a model without a GPU cache (`gpucache`: false).

The same objects can be built in Python:

    PSConfig(models=[ModelConfig(model="m", sparse_files=["/m/t0"], ...)])
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hps.config_file import read_config_file
from hps.config_keys import AT_TOP, IN_MODELS, report, unknown_keys
from hps.config_keys import UnknownConfigKeyWarning as UnknownConfigKeyWarning  # re-exported
from hps.errors import ConfigError
from hps.gate.settings import ValidationConfig
from hps.host_answers import refuse_host_path
from hps.modelfiles.formats.spec import TableSpec
from hps.rows.storage_types import StorageName, StorageType, storage_type
from hps.runtime.strict_scalars import StrictSection

UNBOUNDED = 2**63 - 1
#: widest vector a table may have (floats): a 4 MiB row
MAX_VEC_SIZE = 1 << 20


class VolatileDBConfig(StrictSection):
    """`volatile_db`: the in-process hash map or Redis (Cluster) tier."""

    type: Literal["hash_map", "parallel_hash_map", "multi_process_hash_map", "redis_cluster",
                  "disabled"] = "hash_map"
    address: str = "127.0.0.1:7000"
    user_name: str = "default"
    password: str = ""
    num_partitions: int = Field(16, ge=1, le=65536)
    num_node_connections: int = Field(5, ge=1)
    enable_tls: bool = False
    tls_ca_certificate: str = "cacertbundle.crt"
    tls_client_certificate: str = "client_cert.pem"
    tls_client_key: str = "client_key.pem"
    tls_server_name_identification: str = "redis.localhost"
    max_batch_size: int = Field(65536, ge=1)
    overflow_margin: int = Field(UNBOUNDED, ge=1)
    overflow_policy: Literal["evict_random", "evict_least_used", "evict_oldest"] = "evict_random"
    overflow_resolution_target: float = Field(0.8, gt=0.0, le=1.0)
    initial_cache_rate: float = Field(1.0, ge=0.0, le=1.0)
    cache_missed_embeddings: bool = False
    refresh_time_after_fetch: bool = False
    update_filters: list[str] = Field(default_factory=lambda: ["^hps_.+$"])
    # Redis only (not in HugeCTR): seconds a socket read/write and a connect may take (a
    # slower Redis counts as down); the reconnect backoff while it is down (first wait,
    # doubling up to the max); batches `cache_missed_embeddings` may queue, then dropped.
    socket_timeout: float = Field(1.0, gt=0.0)
    connect_timeout: float = Field(1.0, gt=0.0)
    reconnect_backoff: float = Field(0.1, gt=0.0)
    reconnect_backoff_max: float = Field(5.0, gt=0.0)
    async_queue_size: int = Field(64, ge=1)
    # multi_process_hash_map (hps/tiers/hash_map/shared.py): rows of a shared table beyond
    # a load's, as a share of them, for keys online updates add later
    shared_headroom: float = Field(0.1, ge=0.0, le=16.0)

    @field_validator("type", mode="before")
    @classmethod
    def _alias_type(cls, value: Any) -> Any:
        return "redis_cluster" if value == "redis" else value

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"

    @property
    def is_redis(self) -> bool:
        return self.type == "redis_cluster"


class PersistentDBConfig(StrictSection):
    """`persistent_db`: the RocksDB tier."""

    type: Literal["rocks_db", "disabled"] = "disabled"
    path: str = "/tmp/rocksdb"
    num_threads: int = Field(16, ge=1)
    read_only: bool = False
    max_batch_size: int = Field(65536, ge=1)
    update_filters: list[str] = Field(default_factory=lambda: ["^hps_.+$"])
    #: MiB of write-ahead log kept; past it every table's rows written since the last
    #: flush are flushed into table files (RocksDB's max_total_wal_size): what a restart
    #: after a crash, and each new secondary instance of a follower worker, replays
    max_wal_mb: int = Field(64, ge=1)

    @field_validator("type", mode="before")
    @classmethod
    def _alias_type(cls, value: Any) -> Any:
        return "rocks_db" if value in ("rocksdb", "rocks") else value

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


class HttpConfig(StrictSection):
    """`http` (an hps extension): what `hps serve` accepts from the network.

    allowed_sources      URI prefixes (or local folders) a reload or an added model may
                         read from, beyond `hps serve --allow-root` (by default the folders
                         holding the configured models' folders). Anything else: 403.
    allowed_hosts        Host header values admin routes accept (names or addresses, no
                         port). None: the loopback names and the address the server is
                         bound to. A deployment behind a load balancer lists its service
                         names. Guards against DNS rebinding.
    header_timeout       seconds a client may take to send a request's headers
    body_timeout         seconds a client may take between two parts of a request body
    keep_alive_timeout   seconds an idle keep-alive connection stays open
    max_connections      connections served at once; further ones are closed at once
    grpc_port            the port of the KServe v2 gRPC service beside HTTP (`hps serve
                         --grpc-port`; Triton's is 8001); None: no gRPC
    workers              worker processes on the port (`--workers`, "auto"; docs/workers.md)
    require_models       a model failing to load at start stops the server (`--require-models`)
    """

    allowed_sources: list[str] = Field(default_factory=list)
    allowed_hosts: list[str] | None = None
    header_timeout: float = Field(10.0, gt=0.0)
    body_timeout: float = Field(30.0, gt=0.0)
    keep_alive_timeout: float = Field(5.0, gt=0.0)
    max_connections: int = Field(512, ge=1)
    grpc_port: int | None = Field(None, ge=0, le=65535)
    workers: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = 1
    require_models: bool = False


class UpdateSourceConfig(StrictSection):
    """`update_source`: where online updates come from (hps/updates, docs/updates.md).

    HugeCTR's keys keep HugeCTR's meaning: `type` "kafka_message_queue" reads Kafka at
    `brokers`; `poll_timeout_ms` is how long one poll waits for messages,
    `max_commit_interval` how many messages one round applies before it commits (so a
    crash re-applies at most that many), `failure_backoff_ms` the first wait after a
    failure, `metadata_refresh_interval_ms` how often new topics (streams) are looked for,
    `max_batch_size` the rows a publisher puts in one message, `receive_buffer_size` the
    socket receive buffer of the Kafka client.

    hps extensions: `type` "redis_stream" reads Redis Streams at `address` (with
    `user_name` / `password`); `group` is the consumer group (one per serving replica,
    default "hps-<host name>"); `key_bytes` is the key width of a message (default 8 with
    `supportlonglong`, else 4; 8 on a uint32 server accepts int64 keys in [0, 2**32));
    `gpu_cache_insert` also inserts updated keys a GPU cache does not hold (default: only
    rows it holds are overwritten); `failure_backoff_max_ms` caps the retry waits;
    `stream_maxlen` lets a Redis publisher trim each stream to about that many entries;
    `min_round_interval_ms` paces a busy stream's rounds (consumer.py `_pace`; 0: none);
    `kafka_options` are librdkafka settings given to the Kafka consumer and producer as
    they are (`security.protocol`, `sasl.*`, `session.timeout.ms`, ...)."""

    type: Literal["kafka_message_queue", "redis_stream", "null"] = "null"
    brokers: str = "127.0.0.1:9092"
    metadata_refresh_interval_ms: int = Field(30000, ge=1)
    receive_buffer_size: int = Field(262144, ge=1)
    poll_timeout_ms: int = Field(500, ge=0)
    max_batch_size: int = Field(8192, ge=1)
    failure_backoff_ms: int = Field(50, ge=1)
    max_commit_interval: int = Field(32, ge=1)
    address: str = "127.0.0.1:6379"
    user_name: str = "default"
    password: str = ""
    group: str | None = Field(None, min_length=1, max_length=200)
    key_bytes: Literal[4, 8] | None = None
    gpu_cache_insert: bool = False
    failure_backoff_max_ms: int = Field(5000, ge=1)
    stream_maxlen: int | None = Field(None, ge=1)
    min_round_interval_ms: int = Field(50, ge=0, le=60_000)
    kafka_options: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _null_type(cls, value: Any) -> Any:
        return "null" if value is None else value

    @property
    def enabled(self) -> bool:
        return self.type != "null"


def _devices_schema(schema: dict[str, Any]) -> None:
    """ModelConfig's JSON schema says what `_devices_without_cache` reads:
    deployed_device_list may be left out only with gpucache: false."""
    schema["required"] = [k for k in schema.get("required", ()) if k != "deployed_device_list"]
    schema["anyOf"] = [{"required": ["deployed_device_list"]},
                       {"required": ["gpucache"], "properties": {"gpucache": {"const": False}}}]


class ModelConfig(StrictSection):
    """One model: its tables, their widths and sources, and the lookup limits.

    A `sparse_files` entry is a path or URI (HugeCTR's form; the format comes from the
    suffix or the folder's contents), or an object `{"path": …, "format": …, options}`
    (see hps.modelfiles.formats.spec.TableSpec): Parquet, NumPy and safetensors files as well.
    """

    model_config = ConfigDict(json_schema_extra=_devices_schema)

    model: str = Field(pattern=r"^[A-Za-z0-9_-]{1,120}$")
    sparse_files: list[str | TableSpec] = Field(min_length=1)
    dense_file: str = ""
    embedding_table_names: list[str] = Field(default_factory=list, validate_default=True)
    embedding_vecsize_per_table: list[int]
    maxnum_catfeature_query_per_table_per_sample: list[int]
    default_value_for_each_table: list[float] = Field(default_factory=list,
                                                      validate_default=True)
    deployed_device_list: list[int]
    max_batch_size: int = Field(64, ge=1)
    hit_rate_threshold: float = Field(0.9, ge=0.0)
    gpucache: bool = True
    gpucacheper: float = Field(0.2, gt=0.0, le=1.0)
    # hps extensions: vectors with NaN or infinity are refused at load unless this is set;
    # the load gate's limits for this model, over the top-level section's
    allow_non_finite_vectors: bool = False
    validation: ValidationConfig | None = None
    # hps extension: the type the in-process hash map and the GPU tables store rows in
    # (hps/rows/storage_types.py); Redis and RocksDB keep HugeCTR's float32 rows
    embedding_storage_dtype: StorageName = "float32"
    cache_refresh_percentage_per_iteration: float = Field(0.0, ge=0.0)
    embedding_cache_type: Literal["dynamic", "static", "uvm"] = "dynamic"
    # hps extension: the GPU MiB of a uvm table (index + hot rows; unset: gpucacheper)
    gpu_memory_budget_mb: float | None = Field(None, gt=0.0)
    use_static_table: bool = False
    # hps extensions: hot-key sampling (unset: 1 lookup in 16, 32 with GPU caches:
    # server/key_sketch.py HOT_EVERY*), warm-ups (server/warm_up.py)
    hot_key_sampling: int | None = Field(None, ge=0, le=1 << 20)
    warm_from: str | None = Field(None, min_length=1)
    warm_timeout: float = Field(30.0, gt=0.0, le=3600.0)
    # hps extension: "row_wise": each table's GPU cache in `gpu_shards` by key hash
    gpu_sharding: Literal["replicated", "row_wise"] = "replicated"
    gpu_shards: int | None = Field(None, ge=1, le=64)
    # hps extension: keys of each device's hot copy of its peers' heaviest rows (unset:
    # hps/gpu/hot_rows.py HOT_ROWS; 0: none), filled from the hot-key sketch at most every
    # `gpu_hot_rows_refresh_seconds` (0: on demand only; hps/server/hot_fill.py)
    gpu_hot_rows: int | None = Field(None, ge=0, le=1 << 26)
    gpu_hot_rows_refresh_seconds: float = Field(1.0, ge=0.0, le=86400.0)
    # hps extension: "host": one GPU table a device for every process of the host serving
    # the model (CUDA IPC, hps/gpu/shared_cache.py); "process": one per process
    gpu_cache_scope: Literal["process", "host"] = "process"
    # hps extension: what answers a lookup with host keys (HTTP, gRPC) of a GPU table:
    # "auto" (measured at load), "gpu", "host" (hps/server/http_path.py, host_answers.py)
    http_lookup_path: Literal["auto", "gpu", "host"] = "auto"
    num_of_worker_buffer_in_pool: int = Field(1, ge=1)
    num_of_refresher_buffer_in_pool: int = Field(1, ge=1)
    thread_pool_size: int = Field(16, ge=1)
    init_ec: bool = True
    use_context_stream: bool = True
    enable_pagelock: bool = False
    fp8_quant: bool = False
    refresh_delay: float = Field(0.0, ge=0.0)
    refresh_interval: float = Field(0.0, ge=0.0)
    maxnum_des_feature_per_sample: int = Field(26, ge=0)
    label_dim: int = 1
    slot_num: int = 0

    @model_validator(mode="before")
    @classmethod
    def _devices_without_cache(cls, data: Any) -> Any:
        # the device list places GPU caches; a model without one is served from the host
        # tiers, and device 0 is only the id its host lookups report
        # (left missing otherwise: reported with the block's other errors, _MISSING_HINTS)
        if isinstance(data, dict) and "deployed_device_list" not in data and (
                data.get("gpucache") is False):
            return {**data, "deployed_device_list": [0]}
        return data

    @field_validator("sparse_files", mode="before")
    @classmethod
    def _table_specs(cls, value: Any) -> Any:
        # objects become TableSpecs here, so a bad one gets TableSpec's own message rather
        # than one per member of the str | TableSpec union; unknown keys were warned about
        if not isinstance(value, list):
            return value
        specs = []
        for i, entry in enumerate(value):
            if isinstance(entry, dict):
                known = {k: v for k, v in entry.items() if k in TableSpec.field_names()}
                try:
                    entry = TableSpec(**known)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"sparse_files[{i}]: {exc}") from None
            specs.append(entry)
        return specs

    @field_validator("embedding_table_names", "default_value_for_each_table")
    @classmethod
    def _one_per_table(cls, value: list[Any], info: ValidationInfo) -> list[Any]:
        # HugeCTR's defaults for a list left out or empty: one entry per table (sparse_files
        # comes first, so it is validated here; absent when it was refused)
        files = info.data.get("sparse_files")
        if value or files is None:
            return value
        if info.field_name == "embedding_table_names":
            return [f"sparse_embedding{i}" for i in range(len(files))]
        return [0.0] * len(files)

    @model_validator(mode="after")
    def _per_table_lists(self) -> ModelConfig:
        n = len(self.sparse_files)
        for key in (
            "embedding_table_names",
            "embedding_vecsize_per_table",
            "maxnum_catfeature_query_per_table_per_sample",
            "default_value_for_each_table",
        ):
            got = len(getattr(self, key))
            if got != n:
                raise ValueError(
                    f"{key} has {got} entries but sparse_files has {n}: one per table expected"
                )
        if len(set(self.embedding_table_names)) != n:
            raise ValueError("embedding_table_names must be unique within a model")
        for key in ("embedding_vecsize_per_table", "maxnum_catfeature_query_per_table_per_sample"):
            if any(v <= 0 for v in getattr(self, key)):
                raise ValueError(f"{key} entries must be positive integers")
        wide = [v for v in self.embedding_vecsize_per_table if v > MAX_VEC_SIZE]
        if wide:  # a row must fit a load chunk; such a width is a typo, not a model
            raise ValueError(f"embedding_vecsize_per_table entries must be at most "
                             f"{MAX_VEC_SIZE:,} (a 4 MiB row), got {wide[0]:,}")
        if any(not math.isfinite(v) for v in self.default_value_for_each_table):
            raise ValueError("default_value_for_each_table entries must be finite numbers")
        if self.hot_key_sampling and self.hot_key_sampling & (self.hot_key_sampling - 1):
            raise ValueError(f"hot_key_sampling: 0 or a power of two, not {self.hot_key_sampling}")
        if not self.deployed_device_list:
            raise ValueError("deployed_device_list must name at least one device id (it may "
                             "be left out when gpucache is false)")
        if self.gpu_sharding == "row_wise" and self.cache_type == "uvm":
            raise ValueError("gpu_sharding row_wise is not available for the uvm cache type "
                             "(its index holds every key on each device); use dynamic or static")
        if self.gpu_cache_scope == "host" and (self.gpu_sharding == "row_wise"
                                               or self.cache_type == "uvm"):
            raise ValueError("gpu_cache_scope host is available for replicated dynamic and "
                             "static GPU tables; not with gpu_sharding row_wise or the uvm "
                             "cache type (its rows live in this process's host memory)")
        if self.gpu_shards is not None and self.gpu_shards < len(self.deployed_device_list):
            raise ValueError(f"gpu_shards ({self.gpu_shards}) must be at least the number of "
                             f"deployed devices ({len(self.deployed_device_list)}): each "
                             "device serves its keys from a shard of its own")
        if self.allow_non_finite_vectors and self.storage.compact:
            raise ValueError(
                f"allow_non_finite_vectors cannot be combined with embedding_storage_dtype "
                f"{self.embedding_storage_dtype!r}: compact rows hold finite values only "
                "(use float32 storage to serve NaN or infinity)")
        return self

    @property
    def cache_type(self) -> str:
        """The effective cache type (`use_static_table` forces "static", as in HugeCTR)."""
        return "static" if self.use_static_table else self.embedding_cache_type

    @property
    def storage(self) -> StorageType:
        """The StorageType of `embedding_storage_dtype` (hps/rows/storage_types.py)."""
        return storage_type(self.embedding_storage_dtype)

    @property
    def num_tables(self) -> int:
        return len(self.sparse_files)

    def table_spec(self, table_id: int) -> TableSpec:
        """Table `table_id`'s sparse_files entry as a TableSpec (strings take defaults)."""
        return TableSpec.of(self.sparse_files[table_id])

    def max_keys_per_lookup(self, table_id: int) -> int:
        """max_batch_size × maxnum_catfeature_query_per_table_per_sample[table_id]."""
        return self.max_batch_size * self.maxnum_catfeature_query_per_table_per_sample[table_id]


class PSConfig(StrictSection):
    """The whole parameter-server config (the contents of `ps.json`).

    `s3_endpoint` is an hps extension (HugeCTR has no such key): the endpoint URL of an
    S3-compatible store (MinIO, Ceph, LocalStack…), e.g. "http://minio:9000", used for
    every s3:// and https://…amazonaws.com URI in `sparse_files`. When absent, the
    AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL environment variables apply, else AWS itself.
    `source_connect_timeout` and `source_read_timeout` (hps extensions, seconds) bound how
    long a remote model source (S3, HDFS) may take to connect and to answer: a load or
    reload naming an unreachable one fails after a few of these. `source_redirect_hosts`
    (an hps extension) lists the hosts a WebHDFS read may be redirected to besides the
    URI's own (its DataNodes); other redirects are refused. `http` holds what
    `hps serve` accepts from the network (`HttpConfig`).
    """

    supportlonglong: bool = True
    fuse_embedding_table: bool = False
    models: list[ModelConfig] = Field(min_length=1)
    volatile_db: VolatileDBConfig = Field(default_factory=VolatileDBConfig)
    persistent_db: PersistentDBConfig = Field(default_factory=PersistentDBConfig)
    update_source: UpdateSourceConfig = Field(default_factory=UpdateSourceConfig)
    s3_endpoint: str | None = None
    source_connect_timeout: float = Field(3.0, gt=0.0)
    source_read_timeout: float = Field(30.0, gt=0.0)
    source_redirect_hosts: list[str] = Field(default_factory=list)
    http: HttpConfig = Field(default_factory=HttpConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)

    @field_validator("volatile_db", mode="before")
    @classmethod
    def _volatile_without_type(cls, value: Any) -> Any:
        # HugeCTR: an absent block means the hash map, a block without "type" disables it.
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": "disabled"}
        return value

    @model_validator(mode="after")
    def _unique_models(self) -> PSConfig:
        names = [m.model for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique, repeated: {', '.join(dupes)}")
        for m in self.models:  # a host path asked for where the tiers answer otherwise
            refuse_host_path(m, self.volatile_db, self.persistent_db)
        return self

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.model == name:
                return m
        raise KeyError(name)


# -- loading and key checks ---------------------------------------------------------------

_SECTIONS: dict[str, type[BaseModel]] = {
    "volatile_db": VolatileDBConfig,
    "persistent_db": PersistentDBConfig,
    "update_source": UpdateSourceConfig,
}


def _check_keys(raw: dict[str, Any]) -> None:
    """Every unknown key of `raw`, its sections, models and table entries reported at
    once (hps/config_keys.py: a misspelt known key, or one of the other level that it
    lacks, raises ConfigError; others warn)."""
    models = raw.get("models")
    blocks = [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []
    into_models = {k: IN_MODELS for k in ModelConfig.model_fields
                   if not all(k in m for m in blocks)}
    found = unknown_keys(raw, tuple(PSConfig.model_fields), "", into_models)
    for section, cls in _SECTIONS.items():
        if isinstance(raw.get(section), dict):
            found += unknown_keys(raw[section], tuple(cls.model_fields), f"{section}.")
    to_top = {k: AT_TOP for k in PSConfig.model_fields if k not in raw}
    for i, m in enumerate(models if isinstance(models, list) else []):
        if isinstance(m, dict):
            found += unknown_keys(m, tuple(ModelConfig.model_fields), f"models[{i}].", to_top)
            files = m.get("sparse_files")
            for j, entry in enumerate(files if isinstance(files, list) else []):
                if isinstance(entry, dict):
                    found += unknown_keys(entry, TableSpec.field_names(),
                                          f"models[{i}].sparse_files[{j}].")
    report(found)


#: names an error's location; the default spells it as a ps.json key path
PathNamer = Callable[[tuple[Any, ...]], str]


def _json_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


#: what a missing key's error adds, by key
_MISSING_HINTS = {"deployed_device_list": ": the GPU ids whose caches serve the model, e.g. "
                                          "[0] (it may be left out with gpucache: false)"}


def _format_errors(exc: ValidationError, name_path: PathNamer = _json_path) -> str:
    lines = []
    for err in exc.errors():
        path = name_path(tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "required key is missing" + _MISSING_HINTS.get(str(err["loc"][-1]), "")
        elif "input" in err and err["type"] != "value_error":
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{path or '<config>'}: {msg}")
    return "invalid ps config:\n  " + "\n  ".join(lines)


def parse_config(raw: dict[str, Any], base_dir: str | os.PathLike[str] | None = None, *,
                 name_path: PathNamer = _json_path) -> PSConfig:
    """Validate a dict of ps.json contents. Relative local paths resolve from `base_dir`.

    `name_path` spells the location of a bad value in the ConfigError (the default is the
    ps.json key path; the HugeCTR config objects name their own attributes instead).
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"a ps config must be a mapping, got {type(raw).__name__}")
    _check_keys(raw)
    try:
        config = PSConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, name_path)) from None
    if base_dir is not None:
        config = _resolve_paths(config, Path(base_dir))
    return config


def _resolve_paths(config: PSConfig, base: Path) -> PSConfig:
    """`config` with its relative local paths resolved from `base` (copies of the blocks
    that change; the paths are not validated again). They come out absolute whatever
    `base` is (a config named relative to the working directory): the config travels,
    to the workers of `hps serve --workers N` as a file in their run folder, and a path
    still relative there would name the run folder's (a RocksDB store made afresh under
    /dev/shm instead of the one named)."""
    base = Path(os.path.abspath(base))

    def resolve(path: str) -> str:
        return str(base / path) if "://" not in path and not os.path.isabs(path) else path

    update: dict[str, Any] = {"models": [m.model_copy(update={"sparse_files": [
        resolve(f) if isinstance(f, str) else dataclasses.replace(f, path=resolve(f.path))
        for f in m.sparse_files
    ]}) for m in config.models]}
    db = config.persistent_db
    if db.enabled and not os.path.isabs(db.path):
        update["persistent_db"] = db.model_copy(update={"path": str(base / db.path)})
    http = config.http
    if http.allowed_sources:
        update["http"] = http.model_copy(update={
            "allowed_sources": [resolve(s) for s in http.allowed_sources]})
    return config.model_copy(update=update)


def parse_model_block(raw: Any) -> ModelConfig:
    """One model block of ps.json (as `POST /v1/models` sends it), validated strictly.

    Unlike a config file, where unknown keys are warned about and ignored, an unknown key
    here is a ConfigError naming it, as is every bad value.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"a model block must be a mapping, got {type(raw).__name__}")
    fields = set(ModelConfig.model_fields)
    unknown = [str(k) for k in raw if k not in fields]
    if unknown:
        near = difflib.get_close_matches(unknown[0], fields, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ConfigError(f"unknown key {unknown[0]!r} in the model block{hint}")
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc).replace("invalid ps config", "invalid model "
                                                      "block", 1)) from None


def load_config(source: str | os.PathLike[str] | dict[str, Any] | PSConfig) -> PSConfig:
    """A PSConfig from a ps.json / YAML path, a dict of the same contents, or a PSConfig.

    Relative paths inside a config file resolve from the file's folder.
    """
    if isinstance(source, PSConfig):
        return source
    if isinstance(source, dict):
        return parse_config(source)
    path = Path(source)
    raw = read_config_file(path)
    return parse_config(raw, base_dir=path.parent)


def config_to_json(config: PSConfig, *, defaults: bool = False) -> dict[str, Any]:
    """The ps.json contents equivalent to `config` (`parse_config` of it gives it back).

    Without `defaults`, keys equal to their default are left out, except each database
    block's `type`: a `volatile_db` block without one would mean "disabled" (HugeCTR)."""
    raw = config.model_dump(mode="json", exclude_defaults=not defaults)
    for section in ("volatile_db", "persistent_db", "update_source"):
        if section in raw:
            raw[section] = {"type": getattr(config, section).type, **raw[section]}
    return raw
