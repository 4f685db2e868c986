"""HugeCTR's Python configuration objects (`hugectr.inference`), as front ends of PSConfig:
here `InferenceParams` (one model) and `ParameterServerConfig` (the whole config), and
`as_ps_config` / `dump_json` for any config source; the enums are enums.py's, the
database blocks databases.py's, what every object shares base.py's.

Code that built its HPS configuration as Python objects runs with the import changed:

    from hps.inference import HPS, InferenceParams, ParameterServerConfig
    ps_config = ParameterServerConfig(
        emb_table_name={"m": ["t0", "t1"]}, embedding_vec_size={"m": [1, 16]},
        max_feature_num_per_sample_per_emb_table={"m": [2, 26]},
        inference_params_array=[InferenceParams(model_name="m", max_batchsize=64, ...)])
    hps = HPS(ps_config)

The classes keep HugeCTR's keyword names, positional order and defaults (HugeCTR
v23–24's `hugectr.inference`); the enums answer to both spellings of its member names
(`DatabaseType_t.redis_cluster` and `DatabaseType_t.RedisCluster`, as pybind exported
them). `ParameterServerConfig.to_config()` is the PSConfig (ps.json) it stands for and
`ParameterServerConfig.from_config(...)` goes the other way; converting back and forth
gives the same PSConfig.

- Options that have no effect in `hps` (`use_cuda_graph`, `use_mixed_precision`,
  `network_file`, the shared-memory hash map's sizes, ...) are accepted; when given a
  value other than HugeCTR's default they are logged once per process as ignored.
- Options that contradict each other raise ConfigError when the ParameterServerConfig is
  built (as HugeCTR's constructor threw on inconsistent maps): a model missing from a
  map, per-table lists of InferenceParams that differ from the maps, one model with
  64-bit keys beside one without, a database block on an InferenceParams that differs
  from the ParameterServerConfig's (HugeCTR silently overwrote it), `use_static_table`
  with a non-static `embedding_cache_type`, a `device_id` outside `deployed_devices`.
- ps.json keys HugeCTR's objects have no argument for (`s3_endpoint`, the Redis timeouts,
  ...) go in the keyword-only `hps_options` dict of the matching object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from hps.config import PSConfig, config_to_json, load_config, parse_config
from hps.errors import ConfigError
from hps.hugectr.base import Params, hps_options_of, json_value, merge_options, report_ignored
from hps.hugectr.databases import (
    PersistentDatabaseParams,
    UpdateSourceParams,
    VolatileDatabaseParams,
)
from hps.hugectr.enums import EmbeddingCacheType_t, member_of


class _Required:
    def __repr__(self) -> str:
        return "<required>"


#: the default of InferenceParams' arguments that HugeCTR gives no default (pybind lets
#: required arguments follow defaulted ones; Python does not)
REQUIRED: Any = _Required()

#: InferenceParams' per-table lists → (ParameterServerConfig map, ps.json key)
_TABLE_LISTS = {
    "embedding_table_names": ("emb_table_name", "embedding_table_names"),
    "embedding_vecsize_per_table": ("embedding_vec_size", "embedding_vecsize_per_table"),
    "maxnum_catfeature_query_per_table_per_sample": (
        "max_feature_num_per_sample_per_emb_table",
        "maxnum_catfeature_query_per_table_per_sample"),
}
_DATABASES = ("volatile_db", "persistent_db", "update_source")


@dataclass
class InferenceParams(Params):
    """One model: HugeCTR's `InferenceParams`, in its argument order with its defaults.

    `model_name`, `max_batchsize`, `hit_rate_threshold`, `dense_model_file`,
    `sparse_model_files`, `use_gpu_embedding_cache`, `cache_size_percentage` and
    `i64_input_key` are required (TypeError when missing), as in HugeCTR.
    """

    model_name: str = REQUIRED
    max_batchsize: int = REQUIRED
    hit_rate_threshold: float = REQUIRED
    dense_model_file: str = REQUIRED
    sparse_model_files: list[str] = REQUIRED
    device_id: int = 0
    use_gpu_embedding_cache: bool = REQUIRED
    cache_size_percentage: float = REQUIRED
    i64_input_key: bool = REQUIRED
    use_mixed_precision: bool = False
    scaler: float = 1.0
    use_algorithm_search: bool = True
    use_cuda_graph: bool = True
    number_of_worker_buffers_in_pool: int = 2
    number_of_refresh_buffers_in_pool: int = 1
    thread_pool_size: int = 16
    cache_refresh_percentage_per_iteration: float = 0.0
    deployed_devices: list[int] = field(default_factory=lambda: [0])
    default_value_for_each_table: list[float] = field(default_factory=lambda: [0.0])
    volatile_db: VolatileDatabaseParams = field(default_factory=VolatileDatabaseParams)
    persistent_db: PersistentDatabaseParams = field(default_factory=PersistentDatabaseParams)
    update_source: UpdateSourceParams = field(default_factory=UpdateSourceParams)
    maxnum_des_feature_per_sample: int = 26
    refresh_delay: float = 0.0
    refresh_interval: float = 0.0
    maxnum_catfeature_query_per_table_per_sample: list[int] = field(
        default_factory=lambda: [26])
    embedding_vecsize_per_table: list[int] = field(default_factory=lambda: [128])
    embedding_table_names: list[str] = field(default_factory=lambda: [""])
    network_file: str = ""
    label_dim: int = 1
    slot_num: int = 10
    non_trainable_params_file: str = ""
    use_static_table: bool = False
    embedding_cache_type: EmbeddingCacheType_t = EmbeddingCacheType_t.Dynamic
    use_context_stream: bool = True
    fuse_embedding_table: bool = False
    use_hctr_cache_implementation: bool = True
    init_ec: bool = True
    enable_pagelock: bool = False
    fp8_quant: bool = False
    hps_options: dict[str, Any] = field(default_factory=dict, kw_only=True)

    _JSON: ClassVar[dict[str, str]] = {
        "model_name": "model",
        "max_batchsize": "max_batch_size",
        "hit_rate_threshold": "hit_rate_threshold",
        "dense_model_file": "dense_file",
        "sparse_model_files": "sparse_files",
        "use_gpu_embedding_cache": "gpucache",
        "cache_size_percentage": "gpucacheper",
        "number_of_worker_buffers_in_pool": "num_of_worker_buffer_in_pool",
        "number_of_refresh_buffers_in_pool": "num_of_refresher_buffer_in_pool",
        **{name: name for name in (
            "thread_pool_size", "cache_refresh_percentage_per_iteration",
            "default_value_for_each_table", "maxnum_des_feature_per_sample", "refresh_delay",
            "refresh_interval", "label_dim", "slot_num", "use_static_table",
            "embedding_cache_type", "use_context_stream", "init_ec", "enable_pagelock",
            "fp8_quant")},
        "deployed_devices": "deployed_device_list",
    }
    # HugeCTR's ParameterServerConfig forced fuse_embedding_table off; device_id was
    # overwritten by each of deployed_devices in turn
    _IGNORED: ClassVar[tuple[str, ...]] = (
        "use_mixed_precision", "scaler", "use_algorithm_search", "use_cuda_graph",
        "network_file", "non_trainable_params_file", "use_hctr_cache_implementation",
        "fuse_embedding_table")

    def __post_init__(self) -> None:
        missing = [f.name for f in fields(self) if getattr(self, f.name) is REQUIRED]
        if missing:
            raise TypeError("InferenceParams() missing required argument(s): "
                            + ", ".join(repr(n) for n in missing))
        self.embedding_cache_type = member_of(
            EmbeddingCacheType_t, self.embedding_cache_type,
            f"InferenceParams({self.model_name!r}).embedding_cache_type")

    def _where(self, index: int) -> str:
        return f"inference_params_array[{index}] (model {self.model_name!r})"

    def _check(self, index: int, maps: dict[str, Mapping[str, Any]],
               databases: dict[str, Params]) -> None:
        """Raise ConfigError where this model's options contradict each other or the maps."""
        where = self._where(index)
        for attr, (map_name, _) in _TABLE_LISTS.items():
            mine = getattr(self, attr)
            theirs = maps[map_name][self.model_name]
            if isinstance(theirs, (list, tuple)) and isinstance(self.sparse_model_files, list) \
                    and len(theirs) != len(self.sparse_model_files):
                raise ConfigError(
                    f"ParameterServerConfig.{map_name}[{self.model_name!r}] has {len(theirs)} "
                    f"entries but {where} has {len(self.sparse_model_files)} "
                    "sparse_model_files: one entry per table expected")
            if mine != self._default(attr) and list(mine) != list(theirs):
                raise ConfigError(f"{where}: {attr}={mine!r} contradicts "
                                  f"ParameterServerConfig.{map_name}[{self.model_name!r}]="
                                  f"{list(theirs)!r}")
        for name in _DATABASES:
            mine = getattr(self, name)
            if mine != self._default(name) and mine != databases[name]:
                raise ConfigError(
                    f"{where}: its {name} differs from ParameterServerConfig.{name}; the "
                    f"ParameterServerConfig's applies to every model (HugeCTR overwrote the "
                    f"model's silently): set it there")
        if self.use_static_table and self.embedding_cache_type not in (
                EmbeddingCacheType_t.Dynamic, EmbeddingCacheType_t.Static):
            raise ConfigError(f"{where}: use_static_table=True contradicts "
                              f"embedding_cache_type={self.embedding_cache_type.name}")
        devices = self.deployed_devices
        if self.device_id != 0 and isinstance(devices, list) and self.device_id not in devices:
            raise ConfigError(f"{where}: device_id={self.device_id} is not one of "
                              f"deployed_devices={devices}")

    def _model_json(self, index: int, maps: dict[str, Mapping[str, Any]]) -> dict[str, Any]:
        raw = {key: json_value(getattr(self, attr)) for attr, key in self._JSON.items()}
        for map_name, key in _TABLE_LISTS.values():
            raw[key] = list(maps[map_name][self.model_name])
        defaults, tables = raw["default_value_for_each_table"], raw["sparse_files"]
        if isinstance(defaults, list) and isinstance(tables, list) and len(defaults) == 1:
            raw["default_value_for_each_table"] = defaults * len(tables)  # HugeCTR broadcast
        merge_options(raw, self.hps_options, self._where(index), self._JSON)
        return raw


# ps.json key → how the error of a ParameterServerConfig names it
_MODEL_ATTR = {key: attr for attr, key in InferenceParams._JSON.items()}
_TABLE_MAP = {key: map_name for map_name, key in _TABLE_LISTS.values()}
_SECTION_ATTR = {
    "volatile_db": {k: a for a, k in VolatileDatabaseParams._JSON.items()},
    "persistent_db": {k: a for a, k in PersistentDatabaseParams._JSON.items()},
    "update_source": {k: a for a, k in UpdateSourceParams._JSON.items()},
}


@dataclass
class ParameterServerConfig(Params):
    """HugeCTR's `ParameterServerConfig`: per-model maps of table names, widths and keys
    per sample, the models' InferenceParams, and the databases every model shares.

    Validated when built: contradictions and bad values raise ConfigError naming the
    argument; see the module docstring.
    """

    emb_table_name: dict[str, list[str]]
    embedding_vec_size: dict[str, list[int]]
    max_feature_num_per_sample_per_emb_table: dict[str, list[int]]
    inference_params_array: list[InferenceParams]
    volatile_db: VolatileDatabaseParams = field(default_factory=VolatileDatabaseParams)
    persistent_db: PersistentDatabaseParams = field(default_factory=PersistentDatabaseParams)
    update_source: UpdateSourceParams = field(default_factory=UpdateSourceParams)
    hps_options: dict[str, Any] = field(default_factory=dict, kw_only=True)

    _JSON: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self._validated()

    # -- to ps.json -----------------------------------------------------------------------

    def _maps(self) -> dict[str, Mapping[str, Any]]:
        maps = {name: getattr(self, name) for name, _ in _TABLE_LISTS.values()}
        for name, value in maps.items():
            if not isinstance(value, Mapping):
                raise ConfigError(f"ParameterServerConfig.{name} must be a dict "
                                  f"{{model name: [one entry per table]}}, got "
                                  f"{type(value).__name__}")
        return maps

    def _params(self) -> list[InferenceParams]:
        params = self.inference_params_array
        if not isinstance(params, (list, tuple)) or not all(
                isinstance(p, InferenceParams) for p in params):
            raise ConfigError("ParameterServerConfig.inference_params_array must be a list "
                              "of InferenceParams")
        return list(params)

    def _check(self, params: list[InferenceParams], maps: dict[str, Mapping[str, Any]]
               ) -> None:
        names = [p.model_name for p in params]
        for map_name, value in maps.items():
            missing = [n for n in names if n not in value]
            extra = sorted(str(k) for k in value if k not in names)
            if missing or extra:
                raise ConfigError(
                    f"ParameterServerConfig.{map_name} must have one entry per model of "
                    f"inference_params_array; missing: {missing or 'none'}, "
                    f"not a model: {extra or 'none'}")
        databases = {name: getattr(self, name) for name in _DATABASES}
        for index, p in enumerate(params):
            p._check(index, maps, databases)
        if len({bool(p.i64_input_key) for p in params}) > 1:
            raise ConfigError("inference_params_array: i64_input_key differs between models; "
                              "one server reads one key type (ps.json's supportlonglong)")

    def to_json(self) -> dict[str, Any]:
        """The ps.json contents this configuration stands for (not yet validated)."""
        params, maps = self._params(), self._maps()
        self._check(params, maps)
        raw: dict[str, Any] = {
            "supportlonglong": bool(params[0].i64_input_key) if params else True,
            "models": [p._model_json(i, maps) for i, p in enumerate(params)],
            "volatile_db": self.volatile_db.to_json(),
            "persistent_db": self.persistent_db.to_json(),
            "update_source": self.update_source.to_json(),
        }
        merge_options(raw, self.hps_options, "ParameterServerConfig", {})
        return raw

    def _error_path(self, loc: tuple[Any, ...]) -> str:
        """A ps.json error location, spelled as the HugeCTR argument it came from."""
        if not loc:
            return "ParameterServerConfig"
        head, rest = loc[0], loc[1:]
        if head == "models" and rest and isinstance(rest[0], int):
            index = rest[0]
            p = self.inference_params_array[index]
            if len(rest) == 1:
                return p._where(index)
            key, tail = rest[1], "".join(f"[{part}]" for part in rest[2:])
            if key in _TABLE_MAP:
                return f"ParameterServerConfig.{_TABLE_MAP[key]}[{p.model_name!r}]{tail}"
            return f"{p._where(index)}.{_MODEL_ATTR.get(key, key)}{tail}"
        if head in _SECTION_ATTR and rest:
            return f"{head}.{_SECTION_ATTR[head].get(rest[0], rest[0])}"
        if head == "supportlonglong":
            return "inference_params_array[*].i64_input_key"
        return ".".join(str(part) for part in loc)

    def _validated(self) -> PSConfig:
        return parse_config(self.to_json(), name_path=self._error_path)

    def to_config(self) -> PSConfig:
        """The PSConfig this stands for; logs HugeCTR options it ignores (once each).

        Raises ConfigError for contradicting options and bad values.
        """
        config = self._validated()
        report_ignored(self._given_ignored())
        return config

    def _given_ignored(self) -> dict[str, Any]:
        given: dict[str, Any] = {}
        for part in (*self._params(), self.volatile_db, self.persistent_db, self.update_source):
            given.update(part._given_ignored())
        return given

    # -- from ps.json ---------------------------------------------------------------------

    @classmethod
    def from_config(cls, source: str | os.PathLike[str] | dict[str, Any] | PSConfig
                    ) -> ParameterServerConfig:
        """The HugeCTR objects equivalent to a PSConfig, ps.json/YAML path or dict."""
        config = load_config(source)
        volatile = VolatileDatabaseParams.from_section(config.volatile_db)
        persistent = PersistentDatabaseParams.from_section(config.persistent_db)
        updates = UpdateSourceParams.from_section(config.update_source)
        maps: dict[str, dict[str, list[Any]]] = {name: {} for name, _ in _TABLE_LISTS.values()}
        mapped = [*InferenceParams._JSON.values(), *(key for _, key in _TABLE_LISTS.values())]
        params = []
        for model in config.models:
            raw = model.model_dump(mode="json")
            kwargs = {attr: raw[key] for attr, key in InferenceParams._JSON.items()}
            for attr, (map_name, key) in _TABLE_LISTS.items():
                kwargs[attr] = maps[map_name][model.model] = list(raw[key])
            # HugeCTR's ParameterServerConfig gave every model its own database blocks
            params.append(InferenceParams(
                **kwargs, i64_input_key=config.supportlonglong, volatile_db=volatile,
                persistent_db=persistent, update_source=updates,
                hps_options=hps_options_of(model, mapped)))
        return cls(
            emb_table_name=maps["emb_table_name"],
            embedding_vec_size=maps["embedding_vec_size"],
            max_feature_num_per_sample_per_emb_table=maps[
                "max_feature_num_per_sample_per_emb_table"],
            inference_params_array=params,
            volatile_db=volatile,
            persistent_db=persistent,
            update_source=updates,
            hps_options=hps_options_of(config, ("supportlonglong", "models", *_DATABASES)),
        )


def as_ps_config(source: Any) -> PSConfig:
    """A PSConfig from a ParameterServerConfig, a PSConfig, a dict, or a ps.json/YAML path."""
    if isinstance(source, ParameterServerConfig):
        return source.to_config()
    return load_config(source)


def dump_json(source: Any, *, defaults: bool = False) -> dict[str, Any]:
    """The ps.json equivalent to any config source (see `as_ps_config`)."""
    return config_to_json(as_ps_config(source), defaults=defaults)
