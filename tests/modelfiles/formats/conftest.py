"""Helpers for the format tests: serve a table through HPS, prove a bad one loads nothing.

Files are written by each format's own library (pyarrow, NumPy, safetensors); the
tables are served through the public `HPS(...).lookup` over the embedded tiers (hash
map over RocksDB), locally or from the moto S3 server (tests/support/s3_server.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import HPS, HierarchicalParameterServer, ModelFileError
from hps.config import ModelConfig
from tests.conftest import make_table, model_config, write_table
from tests.support.s3_server import S3Server


def ps_config(tmp_path: Path, entry: str | dict[str, Any], dim: int, *,
              supportlonglong: bool = True, s3: S3Server | None = None) -> dict[str, Any]:
    """A ps config of one model 'm' with one table read from `entry`."""
    config: dict[str, Any] = {
        "supportlonglong": supportlonglong,
        "models": [model_config([entry], [dim])],  # type: ignore[list-item]
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
    }
    if s3 is not None:
        config["s3_endpoint"] = s3.endpoint
    return config


def assert_served(config: dict[str, Any], keys: np.ndarray, vectors: np.ndarray) -> None:
    """Every key of the table is served bit for bit through HPS.lookup; others get 0.5."""
    with HPS(config) as hps:
        for start in range(0, len(keys), 1024):  # max_batch_size 1024 × 32 keys per lookup
            got = hps.lookup(keys[start : start + 1024], "m", 0)
            np.testing.assert_array_equal(got, vectors[start : start + 1024])
        missing = np.setdiff1d(np.arange(-5, 5, dtype=np.int64) * 104729, keys)
        assert np.all(hps.lookup(missing, "m", 0) == 0.5)
        described = hps.server.describe()[0]["tables"][0]
        assert described["source"]["num_keys"] == len(keys)


def upload(s3: S3Server, bucket: str, local: Path, prefix: str) -> None:
    """Put a file, or every file of a folder, under s3://bucket/prefix."""
    client = s3.client()
    if local.is_dir():
        for path in sorted(local.iterdir()):
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    else:
        client.put_object(Bucket=bucket, Key=prefix, Body=local.read_bytes())


def assert_loads_nothing(tmp_path: Path, entry: str | dict[str, Any], dim: int, match: str,
                         *, supportlonglong: bool = True,
                         error: type[Exception] = ModelFileError) -> None:
    """Loading `entry` beside a served model raises `error` matching `match` and leaves
    no trace: no table of the bad model in either tier, the good model still served."""
    rng = np.random.default_rng()
    keys, vectors = make_table(rng, 500, 4)
    if not supportlonglong:
        keys = rng.choice(2**32, 500, replace=False).astype(np.int64)
    good = write_table(tmp_path / "good", keys, vectors)
    config = ps_config(tmp_path, str(good), 4, supportlonglong=supportlonglong)
    # small chunks: a fault late in the file comes after rows were already written
    with HierarchicalParameterServer(config, chunk_bytes=1024) as server:
        bad = ModelConfig.model_validate(model_config([entry], [dim], name="bad"))
        with pytest.raises(error, match=match):
            server.load_model(bad)
        for tier in (server.volatile, server.persistent):
            assert tier is not None
            assert [t for t in tier.tables() if ".bad." in t] == []
        assert "bad" not in server.models
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:100]), vectors[:100])
