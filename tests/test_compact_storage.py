"""`embedding_storage_dtype` through the public calls (HPS.lookup, lookup_fromdlpack) on
the host path, against real RocksDB files and a real redis-server: what each storage type
serves (the NumPy reference decode, hps/rows/storage_types.py), which outputs it accepts, what a
load refuses, and the process memory a compact table saves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hps import HPS, ModelFileError, OutputBufferError
from hps.rows.storage_types import decode, encode, error_bound, storage_type
from tests.conftest import make_table, model_config, write_table

ROOT = Path(__file__).resolve().parents[1]
COMPACT = ("float16", "bfloat16", "int8")
ALL = ("float32", *COMPACT)
DIM = 16
DEFAULT = 0.5


def _config(folder: Path, storage: str, *, rocksdb: bool = True, rate: float = 1.0,
            volatile: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": [model_config([str(folder / "t0")], [DIM],
                                embedding_storage_dtype=storage)],
        "volatile_db": volatile or {"type": "hash_map", "initial_cache_rate": rate},
    }
    if rocksdb:
        config["persistent_db"] = {"type": "rocks_db", "path": str(folder / f"rocks-{storage}")}
    return config


@pytest.fixture
def table(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray, np.ndarray]:
    keys, vectors = make_table(rng, 3000, DIM)
    vectors[:5] = [3.0] * DIM  # constant rows
    vectors[5, ::2], vectors[5, 1::2] = 6e4, -6e4  # a wide range float16 still holds
    vectors[6] = np.float32(2.0**-20)  # small values
    write_table(tmp_path / "t0", keys, vectors)
    return tmp_path, keys, vectors


def _expected(storage: str, vectors: np.ndarray, keys: np.ndarray, query: np.ndarray,
              exact: np.ndarray | None = None) -> np.ndarray:
    """Rows a lookup of `query` serves: the reference decode of the table's rows, exact
    float32 rows where `exact` (keys only RocksDB holds), the default elsewhere."""
    position = {int(k): i for i, k in enumerate(keys)}
    out = np.full((query.size, DIM), DEFAULT, np.float32)
    for j, k in enumerate(query.tolist()):  # building the expectation, not the lookup
        if k in position:
            row = vectors[position[k]][None, :]
            held_exactly = exact is not None and k in exact
            out[j] = row[0] if held_exactly else decode(storage, encode(storage, row), DIM)[0]
    return out


@pytest.mark.parametrize("storage", ALL)
def test_lookups_serve_the_reference_decode(table: tuple[Path, np.ndarray, np.ndarray],
                                            storage: str) -> None:
    folder, keys, vectors = table
    query = np.concatenate([keys[:7], keys[::-97], keys[:3], [123, -5]])  # repeats, absent
    expected = _expected(storage, vectors, keys, query)
    hps = HPS(_config(folder, storage))
    try:
        got = hps.lookup(query, "m", 0)
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
        out = np.empty((query.size, DIM), np.float32)
        hps.lookup_fromdlpack(torch.from_numpy(query), torch.from_numpy(out), "m", 0)
        np.testing.assert_array_equal(out, expected)
        held = query[:-2]
        originals = _expected("float32", vectors, keys, held)
        assert (np.abs(got[:-2].astype(np.float64) - originals)
                <= error_bound(storage, originals)).all()
        table_info = hps.server.describe()[0]["tables"][0]
        assert table_info["storage_dtype"] == storage
        assert table_info["tiers"]["hash_map"]["memory_bytes"] > 0
        # RocksDB keeps the files' float32 rows whatever the storage type
        got_rocks, found = hps.server.persistent.fetch(table_info["storage_name"], keys)
        assert found.all()
        np.testing.assert_array_equal(got_rocks, vectors)
    finally:
        hps.server.close()


@pytest.mark.parametrize("storage", COMPACT)
def test_keys_only_rocksdb_holds_come_back_exact(table: tuple[Path, np.ndarray, np.ndarray],
                                                  storage: str) -> None:
    folder, keys, vectors = table
    hps = HPS(_config(folder, storage, rate=0.5))
    try:
        name = hps.server.model("m").tables[0].storage_name
        _, in_hash_map = hps.server.volatile.fetch(name, keys)
        assert 0 < in_hash_map.sum() < keys.size
        only_rocks = set(keys[~in_hash_map].tolist())
        got = hps.lookup(keys, "m", 0)
        np.testing.assert_array_equal(got, _expected(storage, vectors, keys, keys,
                                                     exact=only_rocks))
    finally:
        hps.server.close()


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_16_bit_output_gets_the_stored_bits(table: tuple[Path, np.ndarray, np.ndarray],
                                              storage: str, rate: float) -> None:
    """Keys the hash map holds are written as stored, without widening; keys only RocksDB
    holds and defaults are rounded as the storage rounds."""
    folder, keys, vectors = table
    query = np.concatenate([keys[::7], keys[:4], [99, -99]])
    expected = encode(storage, _expected("float32", vectors, keys, query))
    hps = HPS(_config(folder, storage, rate=rate))
    try:
        if storage == "float16":
            out = np.empty((query.size, DIM), np.float16)
            hps.lookup_fromdlpack(query, out, "m", 0)
            bits = out.view(np.uint16)
        else:  # NumPy has no bfloat16: a torch tensor
            t = torch.empty((query.size, DIM), dtype=torch.bfloat16)
            hps.lookup_fromdlpack(torch.from_numpy(query), t, "m", 0)
            bits = t.view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(bits, expected.view(np.uint16))
    finally:
        hps.server.close()


@pytest.mark.parametrize(("storage", "make", "needle"), [
    ("float32", lambda n: np.empty((n, DIM), np.float16),
     "output must be float32, got dtype float16: a float16 output takes a table stored "
     "as float16"),
    ("float32", lambda n: torch.empty((n, DIM), dtype=torch.bfloat16),
     "output must be float32, got dtype bfloat16: a bfloat16 output takes a table stored"),
    ("int8", lambda n: np.empty((n, DIM), np.float16),
     "output must be float32, got dtype float16"),
    ("float16", lambda n: torch.empty((n, DIM), dtype=torch.bfloat16),
     r"output must be float32 or float16 \(the table stores float16 rows\), got dtype "
     "bfloat16"),
    ("bfloat16", lambda n: np.empty((n, DIM), np.float64),
     "output must be float32 or bfloat16"),
])
def test_other_output_dtypes_are_a_clear_error(table: tuple[Path, np.ndarray, np.ndarray],
                                               storage: str, make: Any, needle: str) -> None:
    folder, keys, _ = table
    hps = HPS(_config(folder, storage, rocksdb=False))
    try:
        out = make(4)
        with pytest.raises(OutputBufferError, match=needle):
            hps.lookup_fromdlpack(keys[:4], out, "m", 0)
    finally:
        hps.server.close()


@pytest.mark.parametrize("storage", COMPACT)
def test_redis_keeps_float32_rows(table: tuple[Path, np.ndarray, np.ndarray],
                                  request: pytest.FixtureRequest, storage: str) -> None:
    """Redis is a shared store: it keeps HugeCTR's float32 rows, so lookups through it
    are exact; a 16-bit output is rounded as the storage rounds."""
    folder, keys, vectors = table
    redis = request.getfixturevalue("redis_server")
    config = _config(folder, storage, volatile={"type": "redis", "address": redis.address})
    hps = HPS(config)
    try:
        query = np.concatenate([keys[:50], [7, 8]])
        expected = _expected("float32", vectors, keys, query)
        np.testing.assert_array_equal(hps.lookup(query, "m", 0), expected)
        name = hps.server.model("m").tables[0].storage_name
        got, found = hps.server.volatile.fetch(name, keys[:50])
        assert found.all()
        np.testing.assert_array_equal(got, vectors[:50])
        if storage == "float16":
            out = np.empty((query.size, DIM), np.float16)
            hps.lookup_fromdlpack(query, out, "m", 0)
            np.testing.assert_array_equal(out, expected.astype(np.float16))
    finally:
        hps.server.close()


@pytest.mark.parametrize("storage", COMPACT)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "range"])
def test_rows_the_type_cannot_hold_fail_the_load(tmp_path: Path, rng: np.random.Generator,
                                                 storage: str, bad: Any) -> None:
    keys, vectors = make_table(rng, 500, DIM)
    value = np.float32(min(storage_type(storage).max_magnitude, 3.4e38)) if bad == "range" \
        else bad
    vectors[321, 5] = value
    write_table(tmp_path / "t0", keys, vectors)
    config = _config(tmp_path, storage)
    what = "NaN or infinity" if bad != "range" else f".*, past the range of {storage}"
    with pytest.raises(ModelFileError, match=f"{tmp_path / 't0'}.*row 321 holds {what}.*"
                                             f"stores its rows as {storage}"):
        HPS(config)
    # float32 storage keeps today's policy: NaN and infinity refused unless allowed,
    # large finite values stored as they are
    if bad == "range":
        hps = HPS(_config(tmp_path, "float32"))
        try:
            np.testing.assert_array_equal(hps.lookup(keys[321:322], "m", 0), vectors[321:322])
        finally:
            hps.server.close()


# -- memory, measured as the process's resident memory ---------------------------------

N, MEMORY_DIM = 1_000_000, 64
SMALL = 200_000  # the warm-up table's keys: large enough to take the big load's paths
PROBE = """
import json, sys
import psutil
from hps.server import HierarchicalParameterServer

server = HierarchicalParameterServer(json.loads(sys.argv[1]), load=False)
process = psutil.Process()
# a small table of the same storage first: what the load compiles (at first use) is
# compiled before the measured load, not counted as the table's
server.load_model(server.config.models[1])
before = process.memory_info().rss
server.load_model(server.config.models[0])
held = process.memory_info().rss - before
name = server.model("big").tables[0].storage_name
print(json.dumps({"rss": held, "memory_bytes": server.volatile.memory_bytes(name)}))
"""


@pytest.fixture(scope="module")
def big_table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("compact-big")
    rng = np.random.default_rng(0)
    write_table(folder / "t0", np.arange(N, dtype=np.int64) * 7919,
                rng.standard_normal((N, MEMORY_DIM), dtype=np.float32))
    write_table(folder / "small", np.arange(SMALL, dtype=np.int64) * 7907,
                rng.standard_normal((SMALL, MEMORY_DIM), dtype=np.float32))
    return folder


def _held(folder: Path, storage: str) -> dict[str, int]:
    model = {"embedding_vecsize_per_table": [MEMORY_DIM],
             "maxnum_catfeature_query_per_table_per_sample": [1],
             "deployed_device_list": [0], "gpucache": False,
             "embedding_storage_dtype": storage}
    config = {"models": [{"model": "big", "sparse_files": [str(folder / "t0")], **model},
                         {"model": "small", "sparse_files": [str(folder / "small")],
                          **model}],
              "volatile_db": {"type": "hash_map"}}
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(config)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    held: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return held


def test_a_compact_table_takes_its_share_of_the_process_memory(big_table: Path) -> None:
    """1M keys of width 64 in a fresh process each: the RSS the load leaves, against
    float32's in the same run. Bytes of the rows: 8 + 256 (float32), 8 + 128 (float16,
    bfloat16: 0.52 of float32), 8 + 72 (int8: 0.30)."""
    held = {storage: _held(big_table, storage) for storage in ALL}
    base = held["float32"]["rss"]
    lines = [f"{s:>8}: RSS +{h['rss'] / 2**20:7.1f} MiB ({h['rss'] / base:.3f}× float32), "
             f"memory_bytes {h['memory_bytes'] / 2**20:7.1f} MiB" for s, h in held.items()]
    print("\n" + "\n".join(lines))
    for storage in ALL:
        expected = held[storage]["memory_bytes"] / held["float32"]["memory_bytes"]
        # the RSS follows what the table counts, give or take the process's own noise
        assert abs(held[storage]["rss"] / base - expected) < 0.08, lines
    assert held["float16"]["memory_bytes"] / held["float32"]["memory_bytes"] < 0.55
    assert held["int8"]["memory_bytes"] / held["float32"]["memory_bytes"] < 0.33
