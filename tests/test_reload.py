"""Reloads: a new version swaps in atomically; a failed load leaves the old one serving."""

from __future__ import annotations

import copy
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import ModelFileError
from hps.loader import LoadProgress
from hps.server import STAGING_SUFFIX, HierarchicalParameterServer
from tests.conftest import write_table


class FailAfter(LoadProgress):
    """Injects a failure after `chunks` chunks have been written."""

    def __init__(self, chunks: int) -> None:
        self.left = chunks

    def advance(self, keys: int, num_bytes: int) -> None:
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("injected failure mid-load")


def new_version(two_tables: dict[str, Any], name: str) -> tuple[list[str], list[np.ndarray]]:
    files, vectors = [], []
    for i, (keys, old) in enumerate(two_tables["tables"]):
        folder = write_table(two_tables["dir"] / name / f"t{i}", keys, old * 2 + 1)
        files.append(str(folder))
        vectors.append(old * 2 + 1)
    return files, vectors


@pytest.fixture
def server(two_tables: dict[str, Any]) -> Any:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"]["initial_cache_rate"] = 0.5
    with HierarchicalParameterServer(config, chunk_bytes=4096, drop_grace_seconds=0.05) as s:
        yield s


def test_reload_swaps_in_the_new_version(server: Any, two_tables: dict[str, Any]) -> None:
    files, new_vectors = new_version(two_tables, "v2")
    keys = two_tables["tables"][0][0]
    loaded = server.reload_model("m", files)
    np.testing.assert_array_equal(server.lookup("m", 0, keys), new_vectors[0])
    table = loaded.tables[0]
    assert table.source.uri == files[0] and table.storage_name.endswith(STAGING_SUFFIX)
    time.sleep(0.3)  # the old version's tables are dropped after the grace period
    assert "hps_et.m.sparse_embedding0" not in server.persistent.tables()
    # the next reload goes back to HugeCTR's own table name
    files3, _ = new_version(two_tables, "v3")
    assert server.reload_model("m", files3).tables[0].storage_name == "hps_et.m.sparse_embedding0"


def test_failed_reload_leaves_the_old_version_serving(
    server: Any, two_tables: dict[str, Any]
) -> None:
    files, _ = new_version(two_tables, "v2")
    keys, vectors = two_tables["tables"][1]
    with pytest.raises(RuntimeError, match="injected failure"):
        server.reload_model("m", files, progress=FailAfter(chunks=3))
    np.testing.assert_array_equal(server.lookup("m", 1, keys), vectors)
    first_version = two_tables["config"]["models"][0]["sparse_files"][1]
    assert server.model("m").tables[1].source.uri == first_version
    leftovers = [n for n in server.persistent.tables() if n.endswith(STAGING_SUFFIX)]
    assert leftovers == []


def test_reload_from_bad_files_names_the_file(server: Any, two_tables: dict[str, Any]) -> None:
    files, _ = new_version(two_tables, "v2")
    emb = Path(files[1]) / "emb_vector"
    emb.write_bytes(emb.read_bytes()[:-64])
    with pytest.raises(ModelFileError, match=f"{files[1]}/emb_vector"):
        server.reload_model("m", files)
    keys, vectors = two_tables["tables"][1]
    np.testing.assert_array_equal(server.lookup("m", 1, keys), vectors)


def test_lookups_during_reload_see_one_version_whole(
    server: Any, two_tables: dict[str, Any]
) -> None:
    files, new_vectors = new_version(two_tables, "v2")
    keys, old_vectors = two_tables["tables"][0]
    seen: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            got = server.lookup("m", 0, keys)
            if np.array_equal(got, old_vectors):
                seen.append("old")
            elif np.array_equal(got, new_vectors[0]):
                seen.append("new")
            else:
                seen.append("mixed")

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        time.sleep(0.05)
        server.reload_model("m", files)
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert "mixed" not in seen and seen[0] == "old" and seen[-1] == "new"


def test_load_memory_is_bounded_by_chunks(tmp_path: Path, rng: np.random.Generator) -> None:
    """A model 40× the chunk size loads with a few chunks of Python-side memory."""
    n, dim, chunk = 160_000, 64, 1 << 20  # 41 MiB of vectors, 1 MiB chunks
    keys = np.arange(n, dtype=np.int64) * 7919
    write_table(tmp_path / "big", keys, rng.standard_normal((n, dim), dtype=np.float32))
    config = {
        "models": [{"model": "big", "sparse_files": [str(tmp_path / "big")],
                    "embedding_vecsize_per_table": [dim],
                    "maxnum_catfeature_query_per_table_per_sample": [1],
                    "deployed_device_list": [0], "gpucache": False}],
        "volatile_db": {"type": "disabled"},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "db")},
    }
    tracemalloc.start()
    try:
        server = HierarchicalParameterServer(config, chunk_bytes=chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with server:
        assert server.persistent.size("hps_et.big.sparse_embedding0") == n
    model_bytes = n * (8 + 4 * dim)
    assert peak < 8 * chunk, f"peak {peak / 2**20:.1f} MiB, model {model_bytes / 2**20:.0f} MiB"
