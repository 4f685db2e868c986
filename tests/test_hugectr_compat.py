"""HugeCTR's Python surface: the config objects (hps/hugectr/), `HPS` called as
HugeCTR's tests call it, and `hps config dump`. The flows are HugeCTR's
test/inference/hps scripts re-created on synthetic files (tests/support/hugectr_flows.py); on
this CPU machine the GPU cache types run without a GPU cache (the server says so) and
the test checks what their config becomes. tests/test_hugectr_compat_gpu.py runs the
same flows on a GPU."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hps.inference as hugectr  # what HugeCTR code imports as hugectr.inference
from hps import BatchTooLargeError, ConfigError, HPSError, load_config
from hps.config import ModelConfig, PersistentDBConfig, UpdateSourceConfig, VolatileDBConfig
from hps.hugectr.databases import SIZE_MAX
from hps.hugectr.params import as_ps_config
from tests.support.hugectr_flows import (
    CACHE_TYPES,
    MODEL,
    Model,
    native_lookup,
    ps_config,
    torch_dlpack_lookup,
    write_model,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def model(tmp_path: Path, rng: np.random.Generator) -> Model:
    return write_model(tmp_path / "model", rng)


# -- the objects: HugeCTR's names, order and defaults -------------------------------------

INFERENCE_PARAMS_ORDER = [
    "model_name", "max_batchsize", "hit_rate_threshold", "dense_model_file",
    "sparse_model_files", "device_id", "use_gpu_embedding_cache", "cache_size_percentage",
    "i64_input_key", "use_mixed_precision", "scaler", "use_algorithm_search", "use_cuda_graph",
    "number_of_worker_buffers_in_pool", "number_of_refresh_buffers_in_pool", "thread_pool_size",
    "cache_refresh_percentage_per_iteration", "deployed_devices",
    "default_value_for_each_table", "volatile_db", "persistent_db", "update_source",
    "maxnum_des_feature_per_sample", "refresh_delay", "refresh_interval",
    "maxnum_catfeature_query_per_table_per_sample", "embedding_vecsize_per_table",
    "embedding_table_names", "network_file", "label_dim", "slot_num",
    "non_trainable_params_file", "use_static_table", "embedding_cache_type",
    "use_context_stream", "fuse_embedding_table", "use_hctr_cache_implementation", "init_ec",
    "enable_pagelock", "fp8_quant",
]
VOLATILE_ORDER = [
    "type", "address", "user_name", "password", "num_partitions", "allocation_rate",
    "shared_memory_size", "shared_memory_name", "shared_memory_auto_remove",
    "num_node_connections", "max_batch_size", "enable_tls", "tls_ca_certificate",
    "tls_client_certificate", "tls_client_key", "tls_server_name_identification",
    "overflow_margin", "overflow_policy", "overflow_resolution_target",
    "initialize_after_startup", "initial_cache_rate", "cache_missed_embeddings",
    "update_filters",
]


def _positional(cls: type) -> list[str]:
    return [p.name for p in inspect.signature(cls).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]


def test_argument_order_is_hugectrs() -> None:
    assert _positional(hugectr.InferenceParams) == INFERENCE_PARAMS_ORDER
    assert _positional(hugectr.VolatileDatabaseParams) == VOLATILE_ORDER
    assert _positional(hugectr.PersistentDatabaseParams) == [
        "backend", "path", "num_threads", "read_only", "max_batch_size",
        "initialize_after_startup", "update_filters"]
    assert _positional(hugectr.UpdateSourceParams) == [
        "type", "brokers", "metadata_refresh_interval_ms", "receive_buffer_size",
        "poll_timeout_ms", "max_batch_size", "failure_backoff_ms", "max_commit_interval"]
    assert _positional(hugectr.ParameterServerConfig) == [
        "emb_table_name", "embedding_vec_size", "max_feature_num_per_sample_per_emb_table",
        "inference_params_array", "volatile_db", "persistent_db", "update_source"]
    assert list(inspect.signature(hugectr.HPS.lookup).parameters) == [
        "self", "h_keys", "model_name", "table_id", "device_id"]
    assert list(inspect.signature(hugectr.HPS.lookup_fromdlpack).parameters) == [
        "self", "keys", "out_tensor", "model_name", "table_id", "device_id"]


def test_defaults_are_hugectrs() -> None:
    p = hugectr.InferenceParams("m", 64, 0.9, "", ["/t"], 0, True, 0.2, True)  # as pybind
    assert (p.use_mixed_precision, p.scaler, p.use_cuda_graph) == (False, 1.0, True)
    assert (p.number_of_worker_buffers_in_pool, p.number_of_refresh_buffers_in_pool) == (2, 1)
    assert (p.thread_pool_size, p.deployed_devices, p.default_value_for_each_table) == (
        16, [0], [0.0])
    assert (p.maxnum_des_feature_per_sample, p.slot_num, p.label_dim) == (26, 10, 1)
    assert p.maxnum_catfeature_query_per_table_per_sample == [26]
    assert p.embedding_vecsize_per_table == [128] and p.embedding_table_names == [""]
    assert p.embedding_cache_type is hugectr.EmbeddingCacheType_t.Dynamic and p.init_ec
    v = hugectr.VolatileDatabaseParams()
    assert v.type is hugectr.DatabaseType_t.ParallelHashMap
    assert v.type is hugectr.DatabaseType_t.parallel_hash_map
    assert (v.address, v.user_name, v.max_batch_size) == ("127.0.0.1:7000", "default", 65536)
    assert v.overflow_margin == SIZE_MAX
    assert v.overflow_policy is hugectr.DatabaseOverflowPolicy_t.EvictRandom
    assert (v.allocation_rate, v.shared_memory_size) == (256 << 20, 16 << 30)
    assert v.update_filters == ["^hps_.+$"] and v.initial_cache_rate == 1.0
    d = hugectr.PersistentDatabaseParams()
    assert d.backend is hugectr.DatabaseType_t.Disabled and d.path.endswith("rocksdb")
    assert (d.num_threads, d.read_only, d.max_batch_size) == (16, False, 65536)
    u = hugectr.UpdateSourceParams()
    assert u.type is hugectr.UpdateSourceType_t.Null and u.brokers == "127.0.0.1:9092"
    assert (u.receive_buffer_size, u.poll_timeout_ms, u.max_commit_interval) == (262144, 500, 32)
    # every member name HugeCTR used, in both of its spellings
    assert hugectr.DatabaseType_t.RedisCluster is hugectr.DatabaseType_t.redis_cluster
    assert hugectr.DatabaseType_t.RocksDB is hugectr.DatabaseType_t.rocks_db
    assert (hugectr.UpdateSourceType_t.KafkaMessageQueue
            is hugectr.UpdateSourceType_t.kafka_message_queue)
    assert {m.name for m in hugectr.EmbeddingCacheType_t} == {
        "Dynamic", "UVM", "Static", "Stochastic"}


def test_required_arguments_are_required() -> None:
    with pytest.raises(TypeError, match="'use_gpu_embedding_cache', 'cache_size_percentage'"):
        hugectr.InferenceParams(model_name="m", max_batchsize=1, hit_rate_threshold=1.0,
                                dense_model_file="", sparse_model_files=["/t"],
                                i64_input_key=True)
    with pytest.raises(TypeError):
        hugectr.ParameterServerConfig({"m": ["t"]}, {"m": [4]})  # type: ignore[call-arg]


def test_importable_from_hps_and_hps_inference() -> None:
    """hps.inference holds the names of hugectr.inference that HugeCTR users imported, so
    the import is their only change; each also importable from hps as the same object."""
    import hps

    assert set(hugectr.__all__) == {
        "HPS", "ParameterServerConfig", "InferenceParams", "VolatileDatabaseParams",
        "PersistentDatabaseParams", "UpdateSourceParams", "EmbeddingCacheType_t",
        "DatabaseType_t", "DatabaseOverflowPolicy_t", "UpdateSourceType_t"}
    for name in hugectr.__all__:
        assert getattr(hps, name) is getattr(hugectr, name)


# -- the flows of HugeCTR's tests ---------------------------------------------------------

def test_hpsdlpack_flow(model: Model, rng: np.random.Generator) -> None:
    """hpsdlpack.py: native lookups of a sample, then torch CPU capsules agree with them."""
    cat_input = model.sample(rng, 1)
    assert isinstance(cat_input[0], np.integer)  # the scripts pass NumPy scalars
    with hugectr.HPS(ps_config(model.files)) as server:
        embedding1, embedding2 = native_lookup(server, cat_input)
        assert embedding1.shape == (1, 2, 1) and embedding2.shape == (1, 26, 16)
        assert embedding1.dtype == np.float32
        np.testing.assert_array_equal(embedding1.reshape(2, 1),
                                      model.vectors_of(0, cat_input[:2]))
        np.testing.assert_array_equal(embedding2.reshape(26, 16),
                                      model.vectors_of(1, cat_input[2:]))
        out_put = torch_dlpack_lookup(server, cat_input, "cpu")
        np.testing.assert_array_equal(out_put, embedding2.reshape(1, 26 * 16))


def test_lookup_session_flow_cache_types_agree(model: Model, rng: np.random.Generator) -> None:
    """lookup_session_test.py: Dynamic, UVM and Static give the same vectors. Without a
    GPU each is served from the database tiers; its config still says which cache."""
    cat_input = model.sample(rng, 1)
    results = {}
    for cache_type in CACHE_TYPES:
        config = ps_config(model.files, max_batchsize=10, cache_type=cache_type)
        typed = config.to_config()
        assert typed.models[0].embedding_cache_type == cache_type.value
        assert typed.models[0].cache_type == cache_type.value
        assert hugectr.ParameterServerConfig.from_config(typed).to_config() == typed
        with hugectr.HPS(config) as server:
            results[cache_type] = native_lookup(server, cat_input)
    d1, d2 = results[hugectr.EmbeddingCacheType_t.Dynamic]
    np.testing.assert_array_equal(d2.reshape(26, 16), model.vectors_of(1, cat_input[2:]))
    for cache_type in (hugectr.EmbeddingCacheType_t.UVM, hugectr.EmbeddingCacheType_t.Static):
        s1, s2 = results[cache_type]
        np.testing.assert_array_equal(s1, d1)
        np.testing.assert_array_equal(s2, d2)


def test_full_batches_and_key_forms(model: Model, rng: np.random.Generator) -> None:
    """max_batchsize × keys per sample is the limit; lists of ints, NumPy scalars, arrays
    and tensors all read as keys; keys in no table get the default value."""
    config = ps_config(model.files, max_batchsize=10, default_value_for_each_table=[0.5])
    cat_input = model.sample(rng, 10)
    with hugectr.HPS(config) as server:
        embedding1, embedding2 = native_lookup(server, cat_input, batch_size=10)
        rows = np.asarray(cat_input).reshape(10, -1)
        np.testing.assert_array_equal(embedding2.reshape(260, 16),
                                      model.vectors_of(1, rows[:, 2:].flatten()))
        keys = [int(k) for k in rows[:, 2:].flatten()]
        for form in (keys, tuple(keys), np.asarray(keys), torch.tensor(keys)):
            np.testing.assert_array_equal(server.lookup(form, MODEL, 1),
                                          embedding2.reshape(260, 16))
        np.testing.assert_array_equal(server.lookup(np.int64(keys[0]), MODEL, 1),
                                      embedding2.reshape(260, 16)[:1])
        with pytest.raises(BatchTooLargeError, match="261 keys exceed the limit of 260"):
            server.lookup(keys + [keys[0]], MODEL, 1)
        assert server.lookup([], MODEL, 1).shape == (0, 16)
        absent = int(model.shift[-1] + model.slot_sizes[-1]) + 7  # past every slot
        assert np.all(server.lookup([absent, -absent], MODEL, 0) == 0.5)  # broadcast default
        with pytest.raises(HPSError, match="integers"):
            server.lookup([1.5, 2.5], MODEL, 0)


def test_hps_takes_every_config_form(model: Model, tmp_path: Path) -> None:
    config = ps_config(model.files)
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config.to_json()))
    keys = model.tables[1][0][:5]
    expected = model.vectors_of(1, keys)
    for server in (hugectr.HPS(ps_config=config), hugectr.HPS(hps_json_config_file=str(path)),
                   hugectr.HPS(str(path)), hugectr.HPS(config.to_config())):
        with server:
            np.testing.assert_array_equal(server.lookup(keys, MODEL, 1), expected)
    for bad in ({}, {"ps_config": config, "hps_json_config_file": str(path)}):
        with pytest.raises(ConfigError, match="one config"):
            hugectr.HPS(**bad)


# -- conversions --------------------------------------------------------------------------

def _extended() -> dict[str, Any]:
    """A ps.json with keys HugeCTR's objects have no argument for, and non-defaults."""
    return {
        "supportlonglong": False, "fuse_embedding_table": True, "s3_endpoint": "http://m:9000",
        "models": [{
            "model": "a", "sparse_files": ["/a0", "/a1"], "embedding_vecsize_per_table": [4, 8],
            "maxnum_catfeature_query_per_table_per_sample": [1, 3],
            "default_value_for_each_table": [0.1, 0.2], "deployed_device_list": [1, 2],
            "use_static_table": True, "gpucache": False, "refresh_interval": 5.0,
        }, {
            "model": "b", "sparse_files": ["/b0"], "embedding_table_names": ["x"],
            "embedding_vecsize_per_table": [2], "maxnum_catfeature_query_per_table_per_sample":
            [7], "deployed_device_list": [0], "embedding_cache_type": "uvm",
            "embedding_storage_dtype": "int8",
        }],
        "volatile_db": {"type": "redis_cluster", "address": "h:7000", "password": "p",
                        "overflow_margin": 1000, "overflow_policy": "evict_oldest",
                        "socket_timeout": 2.5, "refresh_time_after_fetch": True},
        "persistent_db": {"type": "rocks_db", "path": "/r", "read_only": True},
        "update_source": {"type": "kafka_message_queue", "brokers": "k:9092"},
    }


@pytest.mark.parametrize("source", [
    *sorted(str(p) for p in (REPO / "configs").glob("*.json")), "extended"])
def test_config_round_trips(source: str) -> None:
    typed = load_config(_extended() if source == "extended" else source)
    objects = hugectr.ParameterServerConfig.from_config(typed)
    assert objects.to_config() == typed
    assert as_ps_config(objects) == typed
    assert hugectr.ParameterServerConfig.from_config(objects.to_config()) == objects
    if source == "extended":
        assert objects.hps_options == {"fuse_embedding_table": True,
                                       "s3_endpoint": "http://m:9000"}
        assert objects.volatile_db.hps_options == {"socket_timeout": 2.5,
                                                   "refresh_time_after_fetch": True}
        assert objects.volatile_db.type is hugectr.DatabaseType_t.RedisCluster
        assert objects.persistent_db.backend is hugectr.DatabaseType_t.RocksDB
        assert objects.inference_params_array[0].i64_input_key is False
        # an hps option HugeCTR never had travels in the model's hps_options
        assert objects.inference_params_array[1].hps_options == {
            "embedding_storage_dtype": "int8"}
        assert objects.emb_table_name == {"a": ["sparse_embedding0", "sparse_embedding1"],
                                          "b": ["x"]}


def test_every_option_maps_or_is_ignored() -> None:
    """A field renamed in our config, or a HugeCTR argument left unhandled, fails here."""
    cases = [(hugectr.InferenceParams, ModelConfig),
             (hugectr.VolatileDatabaseParams, VolatileDBConfig),
             (hugectr.PersistentDatabaseParams, PersistentDBConfig),
             (hugectr.UpdateSourceParams, UpdateSourceConfig)]
    special = {"model_name", "device_id", "i64_input_key", "volatile_db", "persistent_db",
               "update_source", "maxnum_catfeature_query_per_table_per_sample",
               "embedding_vecsize_per_table", "embedding_table_names"}
    for ours, typed in cases:
        for f in dataclasses.fields(ours):
            if f.name == "hps_options" or f.name in ours._IGNORED or f.name in special:
                continue
            assert ours._JSON[f.name] in typed.model_fields, (ours.__name__, f.name)
    assert set(ModelConfig.model_fields) >= {"model", "embedding_vecsize_per_table"}


def test_config_dump_prints_the_equivalent_ps_json(model: Model, tmp_path: Path) -> None:
    script = tmp_path / "make_config.py"
    script.write_text(
        "from tests.support.hugectr_flows import ps_config\n"
        "from hps.inference import EmbeddingCacheType_t\n"
        f"ps_config_uvm = ps_config({model.files!r}, max_batchsize=10,\n"
        "                          cache_type=EmbeddingCacheType_t.UVM)\n"
        "if __name__ == '__main__':\n    raise SystemExit('must not run')\n")
    expected = ps_config(model.files, max_batchsize=10,
                         cache_type=hugectr.EmbeddingCacheType_t.UVM).to_config()
    for source in (str(script), f"{script}:ps_config_uvm"):
        printed = _cli("config", "dump", source)
        assert load_config(json.loads(printed)) == expected
    path = tmp_path / "ps.json"
    path.write_text(printed)
    full = json.loads(_cli("config", "dump", str(path), "--defaults"))
    assert full["volatile_db"]["overflow_policy"] == "evict_random"
    assert load_config(full) == expected
    bad = subprocess.run(_cli_args("config", "dump", f"{script}:nope"), capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "no config named 'nope'" in bad.stderr


def _cli_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "hps.tools.cli", *args]


def _cli(*args: str) -> str:
    result = subprocess.run(_cli_args(*args), capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


# -- ignored and contradicting options ----------------------------------------------------

def test_ignored_options_are_logged_once_per_process(model: Model) -> None:
    """Run in a fresh process: 'once' is per process."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, format='%(levelname)s %(message)s')\n"
        "from tests.support.hugectr_flows import ps_config\n"
        "from hps.inference import VolatileDatabaseParams\n"
        f"files = {model.files!r}\n"
        "for _ in range(3):\n"
        "    ps_config(files, use_cuda_graph=False, network_file='n.json').to_config()\n"
        "ps_config(files, use_cuda_graph=False, use_mixed_precision=True).to_config()\n"
        "ps_config(files, use_cuda_graph=True).to_config()\n"  # HugeCTR's default: silent
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True).stdout.splitlines()
    assert out == [
        "WARNING hps ignores these HugeCTR options (they have no effect here): "
        "InferenceParams.use_cuda_graph=False, InferenceParams.network_file='n.json'",
        "WARNING hps ignores these HugeCTR options (they have no effect here): "
        "InferenceParams.use_mixed_precision=True",
    ]


def test_ignored_database_options_are_named(caplog: pytest.LogCaptureFixture) -> None:
    config = dataclasses.replace(
        ps_config(["/t0", "/t1"]),
        volatile_db=hugectr.VolatileDatabaseParams(shared_memory_size=1 << 20),
        update_source=hugectr.UpdateSourceParams(metadata_refresh_interval_ms=10))
    with caplog.at_level(logging.WARNING, logger="hps"):
        typed = config.to_config()
    # no other test sets it, so this process has not reported it before
    assert "VolatileDatabaseParams.shared_memory_size=1048576" in caplog.text
    # the update consumer uses it (how often new topics are looked for): not ignored
    assert "metadata_refresh_interval_ms" not in caplog.text
    assert typed.update_source.metadata_refresh_interval_ms == 10


def _params(**change: Any) -> hugectr.InferenceParams:
    base = ps_config(["/t0", "/t1"]).inference_params_array[0]
    return dataclasses.replace(base, **change)


CONTRADICTIONS = [
    ("a model missing from a map",
     dict(embedding_vec_size={"other": [1, 16]}), "missing: \\['hps_demo'\\]"),
    ("a map entry per table",
     dict(embedding_vec_size={MODEL: [16]}), "embedding_vec_size\\['hps_demo'\\] has 1 entries"),
    ("per-table lists that differ from the maps",
     dict(inference_params_array=[_params(embedding_vecsize_per_table=[1, 8])]),
     "embedding_vecsize_per_table=\\[1, 8\\] contradicts"),
    ("a model's own database block",
     dict(inference_params_array=[_params(volatile_db=hugectr.VolatileDatabaseParams(
         type=hugectr.DatabaseType_t.redis_cluster))]), "volatile_db differs"),
    ("static table with the UVM cache",
     dict(inference_params_array=[_params(use_static_table=True,
                                          embedding_cache_type=hugectr.EmbeddingCacheType_t.UVM)]),
     "use_static_table=True contradicts embedding_cache_type=UVM"),
    ("device_id outside deployed_devices",
     dict(inference_params_array=[_params(device_id=3)]), "device_id=3 is not one of"),
    ("two key widths",
     dict(inference_params_array=[_params(), _params(model_name="b", i64_input_key=False)],
          emb_table_name={MODEL: ["a", "b"], "b": ["a", "b"]},
          embedding_vec_size={MODEL: [1, 16], "b": [1, 16]},
          max_feature_num_per_sample_per_emb_table={MODEL: [2, 26], "b": [2, 26]}),
     "i64_input_key differs"),
    ("an hps option HugeCTR has an argument for",
     dict(inference_params_array=[_params(hps_options={"max_batch_size": 5})]),
     "contradicts the argument 'max_batchsize'"),
    ("a value the config refuses, named as HugeCTR's argument",
     dict(inference_params_array=[_params(cache_size_percentage=1.5)]),
     "model 'hps_demo'\\)\\.cache_size_percentage: Input should be less than or equal to 1"),
    ("a width the config refuses, named as the map",
     dict(embedding_vec_size={MODEL: [1, 0]}), "entries must be positive"),
    ("the stochastic cache", dict(inference_params_array=[_params(
        embedding_cache_type=hugectr.EmbeddingCacheType_t.Stochastic)]), "embedding_cache_type"),
    ("RocksDB as the volatile database",
     dict(volatile_db=hugectr.VolatileDatabaseParams(type=hugectr.DatabaseType_t.RocksDB)),
     "volatile_db.type: Input should be"),
    ("a hash map as the persistent database",
     dict(persistent_db=hugectr.PersistentDatabaseParams(backend="hash_map")),
     "persistent_db.backend: Input should be"),
]


@pytest.mark.parametrize("case,change,match", CONTRADICTIONS,
                         ids=[c[0] for c in CONTRADICTIONS])
def test_contradicting_options_are_refused(case: str, change: dict[str, Any], match: str
                                           ) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(ps_config(["/t0", "/t1"]), **change)


def test_bad_enum_values_and_unsupported_backends() -> None:
    with pytest.raises(ConfigError, match="expected a DatabaseType_t"):
        hugectr.VolatileDatabaseParams(type="memcached")
    shared = hugectr.VolatileDatabaseParams(type=hugectr.DatabaseType_t.MultiProcessHashMap)
    assert shared.to_json()["type"] == "multi_process_hash_map"  # served: docs/workers.md
    redis = hugectr.VolatileDatabaseParams(type="RedisCluster")
    assert redis.type is hugectr.DatabaseType_t.redis_cluster
