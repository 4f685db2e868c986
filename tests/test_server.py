"""The lookup path over real tiers: in-process hash map over RocksDB on temp dirs."""

from __future__ import annotations

import copy
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from hps import (
    HPS,
    BatchTooLargeError,
    DeviceError,
    KeyTypeError,
    ModelFileError,
    OutputBufferError,
    UnknownModelError,
    UnknownTableError,
)
from hps.config import parse_model_block
from hps.server import HierarchicalParameterServer
from tests.conftest import make_table, model_config, write_table


def unknown_keys(known: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    keys = rng.integers(2**41, 2**42, size=n, dtype=np.int64)
    assert not np.isin(keys, known).any()
    return keys


def test_hugectr_round_trip(two_tables: dict[str, Any], rng: np.random.Generator) -> None:
    """HugeCTR-style usage: folders written with NumPy, config as a dict, both lookup calls."""
    with HPS(two_tables["config"]) as hps:
        for table_id, (keys, vectors) in enumerate(two_tables["tables"]):
            rows = rng.integers(0, len(keys), size=500)
            np.testing.assert_array_equal(hps.lookup(keys[rows], "m", table_id), vectors[rows])
            # lookup_fromdlpack with legacy capsules, output shaped (1, n × dim) as HugeCTR's tests
            dim = vectors.shape[1]
            key_tensor = torch.from_numpy(keys[rows].reshape(20, 25))
            out = torch.zeros(1, rows.size * dim)
            key_capsule, out_capsule = to_dlpack(key_tensor), to_dlpack(out)
            hps.lookup_fromdlpack(key_capsule, out_capsule, "m", table_id)
            got = from_dlpack(out_capsule).reshape(rows.size, dim).numpy()  # capsule still usable
            np.testing.assert_array_equal(got, vectors[rows])
            # __dlpack__ objects and NumPy arrays work too
            out2 = torch.zeros(rows.size, dim)
            hps.lookup_fromdlpack(key_tensor, out2, "m", table_id)
            np.testing.assert_array_equal(out2.numpy(), vectors[rows])


def test_unknown_keys_get_default_and_duplicates_alike(
    two_tables: dict[str, Any], rng: np.random.Generator
) -> None:
    keys, vectors = two_tables["tables"][1]
    with HPS(two_tables["config"]) as hps:
        missing = unknown_keys(keys, 10, rng)
        batch = np.concatenate([keys[:5], missing, keys[:5], missing[:3]])
        got = hps.lookup(batch, "m", "sparse_embedding1")  # table by name too
        np.testing.assert_array_equal(got[:5], vectors[:5])
        assert np.all(got[5:15] == 0.5)
        np.testing.assert_array_equal(got[15:20], got[:5])
        assert np.all(got[20:] == 0.5)
        stats = hps.server.model("m").table(1).stats.as_dict()
        assert stats["defaults"] == 13 and stats["keys"] == 23


@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_initial_cache_rate(two_tables: dict[str, Any], rate: float,
                            rng: np.random.Generator) -> None:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"]["initial_cache_rate"] = rate
    keys, vectors = two_tables["tables"][0]
    with HierarchicalParameterServer(config) as server:
        held = server.volatile.size("hps_et.m.sparse_embedding0")
        assert held == pytest.approx(rate * len(keys), abs=2)
        assert server.persistent.size("hps_et.m.sparse_embedding0") == len(keys)
        np.testing.assert_array_equal(server.lookup("m", 0, keys), vectors)
        stats = server.model("m").table(0).stats.as_dict()
        assert stats["volatile_hits"] == held and stats["persistent_hits"] == len(keys) - held


def test_cache_missed_embeddings(two_tables: dict[str, Any]) -> None:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"].update(initial_cache_rate=0.0, cache_missed_embeddings=True)
    keys, vectors = two_tables["tables"][0]
    with HierarchicalParameterServer(config) as server:
        assert server.volatile.size("hps_et.m.sparse_embedding0") == 0
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:100]), vectors[:100])
        assert server.volatile.size("hps_et.m.sparse_embedding0") == 100
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:100]), vectors[:100])
        assert server.model("m").table(0).stats.as_dict()["volatile_hits"] == 100


@pytest.mark.parametrize("disabled", ["volatile_db", "persistent_db"])
def test_single_tier(two_tables: dict[str, Any], disabled: str) -> None:
    config = copy.deepcopy(two_tables["config"])
    config[disabled] = {"type": "disabled"}
    keys, vectors = two_tables["tables"][1]
    with HPS(config) as hps:
        np.testing.assert_array_equal(hps.lookup(keys, "m", 1), vectors)


def test_several_models(tmp_path: Path, rng: np.random.Generator) -> None:
    models, arrays = [], {}
    for name in ("ranker", "retriever"):
        k, v = make_table(rng, 500, 4)
        write_table(tmp_path / name, k, v)
        models.append(model_config([str(tmp_path / name)], [4], name=name))
        arrays[name] = (k, v)
    config = {"models": models, "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "db")}}
    with HPS(config) as hps:
        for name, (k, v) in arrays.items():
            np.testing.assert_array_equal(hps.lookup(k, name, 0), v)


def test_bad_input_raises_and_changes_nothing(two_tables: dict[str, Any]) -> None:
    keys, _ = two_tables["tables"][0]
    with HPS(two_tables["config"]) as hps:
        out = np.full((10, 8), 9.0, np.float32)
        cases = [
            (UnknownModelError, "no model named 'nope'", dict(model_name="nope")),
            (UnknownTableError, "has no table 2", dict(table_id=2)),
            (UnknownTableError, "has no table 'x'", dict(table_id="x")),
            (KeyTypeError, "must be integers", dict(keys=keys[:10].astype(np.float64))),
            (OutputBufferError, "float32", dict(out_tensor=np.zeros((10, 8), np.float64))),
            (OutputBufferError, "are needed", dict(out_tensor=np.zeros((9, 8), np.float32))),
            (DeviceError, r"device_id 3 is not in deployed_device_list \[0\]", dict(device_id=3)),
        ]
        for error, match, change in cases:
            args = dict(keys=keys[:10], out_tensor=out, model_name="m", table_id=0)
            args.update(change)
            with pytest.raises(error, match=match):
                hps.lookup_fromdlpack(**args)
            assert np.all(out == 9.0)
        too_many = np.zeros(1024 * 32 + 1, np.int64)
        with pytest.raises(BatchTooLargeError, match="32769 keys exceed the limit of 32768"):
            hps.lookup(too_many, "m", 0)
        assert hps.lookup(np.zeros(0, np.int64), "m", 0).shape == (0, 8)


def test_malformed_model_changes_nothing(two_tables: dict[str, Any]) -> None:
    config = copy.deepcopy(two_tables["config"])
    config["models"][0]["embedding_vecsize_per_table"] = [8, 32]  # table 1 is really 16 wide
    with pytest.raises(ModelFileError, match="16 wide but embedding_vecsize_per_table says 32"):
        HPS(config)
    from hps.config import PersistentDBConfig
    from hps.tiers.rocksdb.tier import RocksDBTier

    db = RocksDBTier(PersistentDBConfig(type="rocks_db", path=config["persistent_db"]["path"]))
    try:
        assert "hps_et.m.sparse_embedding0" not in db.tables()
    finally:
        db.close()


def test_restart_reuses_rocksdb_unless_files_change(two_tables: dict[str, Any]) -> None:
    config = two_tables["config"]
    keys, vectors = two_tables["tables"][0]
    with HierarchicalParameterServer(config) as first:
        assert not first.model("m").table(0).source.reused
    with HierarchicalParameterServer(config) as second:
        assert second.model("m").table(0).source.reused
        np.testing.assert_array_equal(second.lookup("m", 0, keys), vectors)
    # a retrained model with the same sizes is detected by its modification time
    new_vectors = vectors + 1
    write_table(two_tables["dir"] / "t0", keys, new_vectors)
    os.utime(two_tables["dir"] / "t0" / "emb_vector", ns=(1, 1))
    with HierarchicalParameterServer(config) as third:
        assert not third.model("m").table(0).source.reused
        np.testing.assert_array_equal(third.lookup("m", 0, keys), new_vectors)


def test_read_only_rocksdb_serves_a_filled_store(two_tables: dict[str, Any]) -> None:
    config = copy.deepcopy(two_tables["config"])
    HierarchicalParameterServer(config).close()
    config["persistent_db"]["read_only"] = True
    config["volatile_db"]["initial_cache_rate"] = 0.0
    keys, vectors = two_tables["tables"][1]
    with HPS(config) as hps:
        np.testing.assert_array_equal(hps.lookup(keys, "m", 1), vectors)


def test_gpu_cache_request_without_cuda_warns_once(
    two_tables: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    config = copy.deepcopy(two_tables["config"])
    config["models"][0]["gpucache"] = True
    with caplog.at_level(logging.WARNING, logger="hps"):
        with HPS(config) as hps:
            keys, vectors = two_tables["tables"][0]
            np.testing.assert_array_equal(hps.lookup(keys[:10], "m", 0), vectors[:10])
    warnings = [r for r in caplog.records if "GPU cache" in r.getMessage()]
    assert len(warnings) == 1 and "served from the database tiers" in warnings[0].getMessage()


def test_model_added_with_a_gpu_cache_without_cuda_warns_once(
    two_tables: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A model added at runtime asking for a GPU cache, to a server started without any:
    the same one warning, and it serves from the tiers."""
    config = copy.deepcopy(two_tables["config"])
    block = {**config["models"][0], "model": "added", "gpucache": True}
    with HierarchicalParameterServer(config) as server:
        with caplog.at_level(logging.WARNING, logger="hps"):
            server.add_model(parse_model_block(block))
            server.unload_model("added")
            server.add_model(parse_model_block(block))
        keys, vectors = two_tables["tables"][0]
        np.testing.assert_array_equal(server.lookup("added", 0, keys[:10]), vectors[:10])
        assert not server.gpu_enabled
    warnings = [r for r in caplog.records if "GPU cache" in r.getMessage()]
    assert len(warnings) == 1 and "added" in warnings[0].getMessage()


def test_concurrent_lookups(two_tables: dict[str, Any]) -> None:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"].update(initial_cache_rate=0.2, cache_missed_embeddings=True,
                                 overflow_margin=100)
    errors: list[str] = []
    with HPS(config) as hps:
        def worker(seed: int) -> None:
            local = np.random.default_rng(seed)
            for _ in range(30):
                table = int(local.integers(0, 2))
                keys, vectors = two_tables["tables"][table]
                rows = local.integers(0, len(keys), size=200)
                if not np.array_equal(hps.lookup(keys[rows], "m", table), vectors[rows]):
                    errors.append(f"wrong vectors in thread {seed}")

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
