from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest

from hps import HPS, ConfigError, ModelConfig, PSConfig, UnknownConfigKeyWarning, load_config
from hps.config import config_to_json
from hps.modelfiles.formats.sparse_folder import write_sparse_model


def minimal(**model: object) -> dict:
    m = {
        "model": "m",
        "sparse_files": ["/a", "/b"],
        "embedding_vecsize_per_table": [16, 64],
        "maxnum_catfeature_query_per_table_per_sample": [2, 3],
        "deployed_device_list": [0],
    }
    m.update(model)
    return {"models": [m]}


def test_hugectr_defaults() -> None:
    c = load_config(minimal())
    m = c.models[0]
    assert c.supportlonglong is True
    assert m.embedding_table_names == ["sparse_embedding0", "sparse_embedding1"]
    assert m.default_value_for_each_table == [0.0, 0.0]
    assert (m.max_batch_size, m.hit_rate_threshold) == (64, 0.9)
    assert (m.gpucache, m.gpucacheper) == (True, 0.2)
    assert m.cache_refresh_percentage_per_iteration == 0 and m.embedding_cache_type == "dynamic"
    assert m.max_keys_per_lookup(1) == 64 * 3
    # an absent volatile_db block is the in-process hash map; persistent is off
    assert c.volatile_db.type == "hash_map" and c.volatile_db.num_partitions == 16
    assert c.volatile_db.overflow_resolution_target == 0.8
    assert c.volatile_db.initial_cache_rate == 1.0
    assert c.persistent_db.type == "disabled"


def test_aliases_and_legacy_switches() -> None:
    raw = minimal(use_static_table=True)
    raw["volatile_db"] = {"type": "redis", "address": "127.0.0.1:7000,127.0.0.1:7001"}
    raw["persistent_db"] = {"type": "rocksdb", "path": "/x"}
    c = load_config(raw)
    assert c.volatile_db.type == "redis_cluster" and c.volatile_db.is_redis
    assert c.persistent_db.type == "rocks_db"
    assert c.models[0].cache_type == "static"


def test_volatile_block_without_type_is_disabled() -> None:
    raw = minimal()
    raw["volatile_db"] = {"num_partitions": 4}
    assert load_config(raw).volatile_db.enabled is False


def test_unknown_key_warns_with_path_and_suggestion() -> None:
    # beside the key it resembles (which is given), or resembling none: a warning
    raw = minimal(gpucachepr=0.5, gpucacheper=0.3, zzz=1)
    raw["volatile_db"] = {"type": "hash_map", "overflow_policy": "evict_oldest",
                          "overflow_polcy": "evict_oldest"}
    with pytest.warns(UnknownConfigKeyWarning) as record:
        config = load_config(raw)
    messages = sorted(str(w.message) for w in record)
    assert "models[0].gpucachepr" in messages[0] and "did you mean 'gpucacheper'" in messages[0]
    assert "models[0].zzz" in messages[1] and "docs/configuration.md" in messages[1]
    assert "volatile_db.overflow_polcy" in messages[2] and "overflow_policy" in messages[2]
    assert config.models[0].gpucacheper == 0.3


def test_a_misspelt_key_the_block_lacks_is_an_error() -> None:
    # the known key would silently take its default (HugeCTR's table names): refused,
    # naming both, with every such key of the config in one error
    raw = minimal(embeding_table_names=["user", "item"])
    raw["volatile_db"] = {"type": "hash_map", "overflow_polcy": "evict_oldest"}
    with pytest.raises(ConfigError) as caught:
        load_config(raw)
    message = str(caught.value)
    assert ("'models[0].embeding_table_names' is not a config key: did you mean "
            "'models[0].embedding_table_names'?") in message
    assert "did you mean 'volatile_db.overflow_policy'?" in message
    # in a table's entry too
    entry = minimal(sparse_files=[{"path": "/a.parquet", "key_colum": "id"}, "/b"])
    with pytest.raises(ConfigError, match=r"did you mean 'models\[0\]\.sparse_files\[0\]"
                       r"\.key_column'"):
        load_config(entry)


def test_a_key_of_the_other_level_is_an_error_where_that_level_lacks_it() -> None:
    # an update source inside the model block would never start: refused, with where it
    # belongs; a model key beside "models" likewise, every such key in one error
    raw = minimal(update_source={"type": "redis_stream", "address": "127.0.0.1:6379"})
    raw["gpucacheper"] = 0.5
    with pytest.raises(ConfigError) as caught:
        load_config(raw)
    message = str(caught.value)
    assert ("'models[0].update_source' is ignored here: it is a key at the top level "
            '(beside "models"); move it there') in message
    assert "'gpucacheper' is ignored here: it is a key in each model block" in message
    # where the right level has it too, the stray copy is only warned about
    raw = minimal(update_source={"type": "redis_stream"}, gpucacheper=0.3)
    raw["update_source"] = {"type": "redis_stream", "address": "127.0.0.1:6379"}
    raw["gpucacheper"] = 0.5
    with pytest.warns(UnknownConfigKeyWarning) as record:
        config = load_config(raw)
    assert sorted(str(w.message).split("'")[1] for w in record) == [
        "gpucacheper", "models[0].update_source"]
    assert config.update_source.address == "127.0.0.1:6379"
    assert config.models[0].gpucacheper == 0.3


def test_keys_of_earlier_hugectr_files_stay_warnings() -> None:
    # close to max_batch_size, which the block lacks, but HugeCTR's own earlier keys
    raw = minimal()
    raw["volatile_db"] = {"type": "hash_map", "max_get_batch_size": 100,
                          "max_set_batch_size": 100}
    raw["update_source"] = {"type": "kafka_message_queue", "max_receive_buffer_size": 10}
    with pytest.warns(UnknownConfigKeyWarning) as record:
        load_config(raw)
    assert len(record) == 3


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"max_batch_size": "lots"}, "models[0].max_batch_size"),
        ({"model": "bad name!"}, "models[0].model"),
        ({"embedding_vecsize_per_table": [16]}, "embedding_vecsize_per_table has 1 entries"),
        ({"embedding_cache_type": "lru"}, "models[0].embedding_cache_type"),
        ({"gpucacheper": 1.5}, "models[0].gpucacheper"),
        ({"gpu_memory_budget_mb": -5}, "models[0].gpu_memory_budget_mb"),
        ({"gpu_memory_budget_mb": "a lot"}, "models[0].gpu_memory_budget_mb"),
        ({"embedding_storage_dtype": "fp8"},
         "models[0].embedding_storage_dtype: Input should be 'float32', 'float16', "
         "'bfloat16' or 'int8' (got 'fp8')"),
        ({"embedding_storage_dtype": None}, "models[0].embedding_storage_dtype"),
        ({"embedding_storage_dtype": "int8", "allow_non_finite_vectors": True},
         "allow_non_finite_vectors cannot be combined with embedding_storage_dtype 'int8'"),
        ({"deployed_device_list": []}, "deployed_device_list"),
        ({"default_value_for_each_table": [0.0, float("nan")]}, "finite"),
        ({"embedding_table_names": ["a", "a"]}, "unique"),
    ],
)
def test_bad_values_name_the_key_path(change: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(minimal(**change))
    assert needle in str(err.value)


def test_embedding_storage_dtype() -> None:
    assert load_config(minimal()).models[0].embedding_storage_dtype == "float32"
    for name in ("float16", "bfloat16", "int8"):
        model = load_config(minimal(embedding_storage_dtype=name)).models[0]
        assert model.storage.name == name and model.storage.compact
        # the ps.json a config dumps to says so (it is not the default)
        assert config_to_json(load_config(minimal(embedding_storage_dtype=name)))[
            "models"][0]["embedding_storage_dtype"] == name
    float32 = load_config(minimal(allow_non_finite_vectors=True)).models[0]
    assert not float32.storage.compact and float32.allow_non_finite_vectors


def test_missing_required_key() -> None:
    raw = minimal()
    del raw["models"][0]["maxnum_catfeature_query_per_table_per_sample"]
    needle = r"models\[0\].maxnum_catfeature_query_per_table_per_sample: required"
    with pytest.raises(ConfigError, match=needle):
        load_config(raw)


def test_bad_section_value() -> None:
    raw = minimal()
    raw["volatile_db"] = {"type": "hash_map", "overflow_policy": "evict_all"}
    with pytest.raises(ConfigError, match="volatile_db.overflow_policy"):
        load_config(raw)


def test_duplicate_model_names() -> None:
    raw = minimal()
    raw["models"].append(dict(raw["models"][0]))
    with pytest.raises(ConfigError, match="repeated: m"):
        load_config(raw)


def test_files_json_yaml_and_relative_paths(tmp_path: Path) -> None:
    raw = minimal(sparse_files=["t0", "s3://bucket/t1"])
    raw["persistent_db"] = {"type": "rocks_db", "path": "db"}
    (tmp_path / "ps.json").write_text(json.dumps(raw))
    c = load_config(tmp_path / "ps.json")
    assert c.models[0].sparse_files == [str(tmp_path / "t0"), "s3://bucket/t1"]
    assert c.persistent_db.path == str(tmp_path / "db")
    import yaml

    (tmp_path / "ps.yaml").write_text(yaml.safe_dump(raw))
    assert load_config(tmp_path / "ps.yaml").models[0].sparse_files == c.models[0].sparse_files


def test_a_config_named_relative_to_the_working_directory_gives_absolute_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its paths stay the ones meant wherever the config goes next (the workers of `hps
    serve --workers N` read it from a file in their run folder)."""
    raw = minimal(sparse_files=["t0", "t1"])
    raw["persistent_db"] = {"type": "rocks_db", "path": "db"}
    (tmp_path / "ps.json").write_text(json.dumps(raw))
    monkeypatch.chdir(tmp_path)
    c = load_config("ps.json")
    assert c.models[0].sparse_files == [str(tmp_path / "t0"), str(tmp_path / "t1")]
    assert c.persistent_db.path == str(tmp_path / "db")
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    (elsewhere / "config-0.json").write_text(json.dumps(config_to_json(c)))
    again = load_config(elsewhere / "config-0.json")
    assert again.persistent_db.path == str(tmp_path / "db")
    assert again.models[0].sparse_files == c.models[0].sparse_files


def test_malformed_files(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"models": [}')
    with pytest.raises(ConfigError, match="not valid JSON at line 1"):
        load_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.json")


def test_built_in_python() -> None:
    model = ModelConfig(
        model="m", sparse_files=["/t0"], embedding_vecsize_per_table=[8],
        maxnum_catfeature_query_per_table_per_sample=[4], deployed_device_list=[0],
    )
    config = PSConfig(models=[model])
    assert load_config(config) is config
    assert config.models[0].embedding_table_names == ["sparse_embedding0"]


@pytest.mark.parametrize(
    ("where", "change", "message"),
    [
        ("model", {"gpucache": "yes"},
         "models[0].gpucache: must be true or false, got 'yes' (a string: write true or "
         "false without quotes)"),
        ("model", {"max_batch_size": "256"},
         "models[0].max_batch_size: must be an integer, got '256' (a string: write 256 "
         "without quotes)"),
        ("model", {"gpucacheper": "0.5"}, "models[0].gpucacheper: must be a number, got '0.5'"),
        ("model", {"gpucache": 1}, "models[0].gpucache: must be true or false, got 1"),
        ("model", {"max_batch_size": True}, "models[0].max_batch_size: must be an integer"),
        ("model", {"embedding_vecsize_per_table": [16, "64"]},
         "models[0].embedding_vecsize_per_table: entry [1] must be an integer, got '64'"),
        ("model", {"gpu_memory_budget_mb": "lots"},
         "must be a number, got 'lots' (a string: write a number without quotes)"),
        ("volatile_db", {"num_partitions": "8"}, "volatile_db.num_partitions: must be an integer"),
        ("persistent_db", {"read_only": "false"}, "persistent_db.read_only: must be true or false"),
        ("top", {"supportlonglong": "true"}, "supportlonglong: must be true or false"),
    ],
)
def test_strings_for_booleans_and_numbers_are_refused(where: str, change: dict,
                                                      message: str) -> None:
    raw = minimal(**change) if where == "model" else minimal()
    if where == "top":
        raw.update(change)
    elif where != "model":
        raw[where] = {"type": "hash_map" if where == "volatile_db" else "rocks_db", **change}
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert message in str(err.value)


def test_python_objects_are_strict_too() -> None:
    with pytest.raises(ValueError, match="must be an integer, got '256'"):
        ModelConfig(**{**minimal()["models"][0], "max_batch_size": "256"})
    model = load_config(minimal()).models[0]
    with pytest.raises(ValueError, match="must be true or false"):
        model.gpucache = "no"  # type: ignore[assignment]
    assert model.gpucache is True


def test_numbers_keep_their_json_forms() -> None:
    m = load_config(minimal(max_batch_size=256.0, gpucacheper=1, hit_rate_threshold=1)).models[0]
    assert (m.max_batch_size, m.gpucacheper, m.hit_rate_threshold) == (256, 1.0, 1.0)
    assert load_config(minimal(gpu_memory_budget_mb=None)).models[0].gpu_memory_budget_mb is None


def test_deployed_device_list_is_needed_only_with_a_gpu_cache() -> None:
    without = minimal(gpucache=False)
    del without["models"][0]["deployed_device_list"]
    assert load_config(without).models[0].deployed_device_list == [0]
    with_cache = minimal()
    del with_cache["models"][0]["deployed_device_list"]
    with pytest.raises(ConfigError, match=r"models\[0\]\.deployed_device_list: required key "
                       r"is missing: the GPU ids.*gpucache: false"):
        load_config(with_cache)


def test_a_model_block_missing_its_devices_hears_of_every_other_error_too() -> None:
    from hps.config import parse_model_block

    with pytest.raises(ConfigError) as caught:
        parse_model_block({"model": 5})
    said = str(caught.value)
    for named in ("deployed_device_list: required key is missing: the GPU ids",
                  "model: Input should be a valid string", "sparse_files: required key",
                  "embedding_vecsize_per_table: required key"):
        assert named in said, said


def test_unknown_key_warning_points_at_the_callers_line(tmp_path: Path) -> None:
    raw = minimal(gpucachepr=0.5, gpucacheper=0.5, gpucache=False)
    raw["models"][0]["sparse_files"] = [str(tmp_path / "t0")]
    raw["models"][0].update(embedding_vecsize_per_table=[4],
                            maxnum_catfeature_query_per_table_per_sample=[1])
    write_sparse_model(tmp_path / "t0", np.arange(3, dtype=np.int64),
                       np.zeros((3, 4), np.float32))
    with pytest.warns(UnknownConfigKeyWarning, match="did you mean 'gpucacheper'") as record:
        load_config(raw)
    assert record[0].filename == __file__
    with pytest.warns(UnknownConfigKeyWarning) as record:
        HPS(raw).close()  # through HPS, its server and the config: still this line
    line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    assert (record[0].filename, record[0].lineno) == (__file__, line)
    with pytest.warns(UnknownConfigKeyWarning, match="docs/configuration.md lists every key"):
        load_config(minimal(zzz=1))
