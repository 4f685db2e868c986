"""Reloads: a new version swaps in atomically; a failed load leaves the old one serving;
a replaced version is dropped when its last lookup is done (reference counts, no timer)."""

from __future__ import annotations

import copy
import random
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import ModelFileError, UnknownModelError
from hps.server import STAGING_SUFFIX, HierarchicalParameterServer
from hps.server.loader import LoadProgress
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
    with HierarchicalParameterServer(config, chunk_bytes=4096) as s:
        yield s


def stored(server: Any) -> dict[str, list[str]]:
    """The tables each tier holds, by tier name."""
    return {tier.name: sorted(tier.tables()) for tier in server.tiers}


def served_names(server: Any) -> list[str]:
    return sorted(t.storage_name for t in server.model("m").tables)


def test_reload_swaps_in_the_new_version(server: Any, two_tables: dict[str, Any]) -> None:
    files, new_vectors = new_version(two_tables, "v2")
    keys = two_tables["tables"][0][0]
    loaded = server.reload_model("m", files)
    np.testing.assert_array_equal(server.lookup("m", 0, keys), new_vectors[0])
    table = loaded.tables[0]
    assert table.source.uri == files[0] and table.storage_name.endswith(STAGING_SUFFIX)
    # no lookup held the old version: its tables went with the reload
    assert server.registry.retiring == 0
    assert stored(server) == {"hash_map": served_names(server),
                              "rocksdb": served_names(server)}
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
        wait_for(lambda: "old" in seen)
        server.reload_model("m", files)
        count = len(seen)
        wait_for(lambda: len(seen) > count + 2)  # lookups that started after the swap
    finally:
        stop.set()
        thread.join()
    assert "mixed" not in seen and seen[0] == "old" and seen[-1] == "new"


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout * 100)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not met")


def test_a_held_version_outlives_its_replacement(server: Any, two_tables: dict[str, Any]
                                                 ) -> None:
    """A lookup in flight keeps reading the version it started on, however many reloads
    come meanwhile; the version is dropped when that lookup is done."""
    keys, old_vectors = two_tables["tables"][0]
    held = server.registry.acquire("m")  # what a lookup does for its duration
    v1_names = [t.storage_name for t in held.tables]
    files2, new2 = new_version(two_tables, "v2")
    server.reload_model("m", files2)
    assert server.registry.retiring == 1
    for tier in server.tiers:  # the held version's rows are all still there
        vectors, found = tier.fetch(v1_names[0], keys[:100])
        assert found.all() or tier.name == "hash_map"
        np.testing.assert_array_equal(vectors[found], old_vectors[:100][found])
    # the next reload needs the held version's storage names: it waits for the lookup
    files3, new3 = new_version(two_tables, "v3")
    third = threading.Thread(target=server.reload_model, args=("m", files3))
    third.start()
    np.testing.assert_array_equal(server.lookup("m", 0, keys), new2[0])
    assert third.is_alive() and set(v1_names) <= set(server.persistent.tables())
    held.refs.release()
    third.join(timeout=60)
    assert not third.is_alive()
    np.testing.assert_array_equal(server.lookup("m", 0, keys), new3[0])
    assert server.wait_retired(timeout=30)
    assert stored(server) == {"hash_map": served_names(server),
                              "rocksdb": served_names(server)}


def test_any_sequence_of_reloads_leaves_one_version(
    server: Any, two_tables: dict[str, Any]
) -> None:
    """Reloads back to back, some failing, under lookups from several threads: every
    lookup is answered whole from one version, and in the end exactly the served
    version's tables are stored, nothing else."""
    versions = [([str(two_tables["dir"] / "t0"), str(two_tables["dir"] / "t1")],
                 [v for _, v in two_tables["tables"]])]
    versions += [new_version(two_tables, f"v{i}") for i in (2, 3)]
    keys = two_tables["tables"][0][0][:256]
    accepted = [vecs[0][:256] for _, vecs in versions]
    errors: list[BaseException] = []
    wrong: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                got = server.lookup("m", 0, keys)
            except BaseException as exc:  # noqa: BLE001 - recorded, asserted below
                errors.append(exc)
                return
            if not any(np.array_equal(got, a) for a in accepted):
                wrong.append(1)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for r in readers:
        r.start()
    pick = random.Random()
    try:
        for _ in range(12):
            files, _ = pick.choice(versions)
            if pick.random() < 0.25:
                with pytest.raises(RuntimeError, match="injected"):
                    server.reload_model("m", files, progress=FailAfter(chunks=2))
            else:
                server.reload_model("m", files)
    finally:
        stop.set()
        for r in readers:
            r.join()
    assert errors == [] and wrong == []
    assert server.wait_retired(timeout=30)
    assert server.registry.retiring == 0
    assert stored(server) == {"hash_map": served_names(server),
                              "rocksdb": served_names(server)}


def test_failed_first_load_leaves_nothing(two_tables: dict[str, Any]) -> None:
    with HierarchicalParameterServer(two_tables["config"], load=False,
                                     chunk_bytes=4096) as server:
        with pytest.raises(RuntimeError, match="injected"):
            server.load_model(server.config.models[0], progress=FailAfter(chunks=3))
        assert stored(server) == {"hash_map": [], "rocksdb": []}
        server.load_model(server.config.models[0])  # and a second try works
        keys, vectors = two_tables["tables"][1]
        np.testing.assert_array_equal(server.lookup("m", 1, keys), vectors)


def test_unload_drops_the_tables(server: Any) -> None:
    server.unload_model("m")
    assert stored(server) == {"hash_map": [], "rocksdb": []}
    with pytest.raises(UnknownModelError):
        server.lookup("m", 0, np.arange(3))


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
    # the tiers first: opening them loads their compiled kernels, a one-time cost
    server = HierarchicalParameterServer(config, chunk_bytes=chunk, load=False)
    tracemalloc.start()
    try:
        server.load_model(server.config.models[0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with server:
        assert server.persistent.size("hps_et.big.sparse_embedding0") == n
    model_bytes = n * (8 + 4 * dim)
    assert peak < 8 * chunk, f"peak {peak / 2**20:.1f} MiB, model {model_bytes / 2**20:.0f} MiB"
