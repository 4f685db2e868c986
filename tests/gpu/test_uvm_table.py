"""UvmEmbeddingTable (hps/gpu/uvm_table.py): every key exact whether its row is in GPU or
mapped host memory, before and after promotion, under concurrent lookups, updates and
passes; placement and counts slot for slot against tests/support/uvm_reference.py; the uvm
cache type through GpuEmbeddingTable and the server; memory figures and config errors."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from hps.config import ModelConfig
from hps.errors import ConfigError
from hps.gpu.dynamic_cache import EMPTY_KEY
from hps.gpu.open import uvm_gpu_rows
from hps.gpu.static_table import SMALL_BATCH
from hps.gpu.uvm_table import NO_ROW, UvmEmbeddingTable, region_shift
from tests.support.uvm_reference import UvmReference

gpu = pytest.mark.gpu


def _keys(rng: np.random.Generator, n: int) -> np.ndarray:
    """n distinct keys, the empty-slot key and -1 among them."""
    return np.r_[rng.choice(2**62, n - 2, replace=False) - 2**61, EMPTY_KEY, -1].astype(
        np.int64)


def _table(n: int, dim: int, gpu_rows: int, grouped: bool | None = None,
           **kw: Any) -> UvmEmbeddingTable:
    """grouped True: every batch reads its host rows grouped by region (4 KiB regions: a
    small table has many); False: none does (the direct reads); None: the table's default
    threshold."""
    kw.setdefault("promotion_interval", 0)  # passes run when a test says
    if grouped is not None:
        kw["grouped_reads_from"] = 1 if grouped else 2**31
    if grouped:
        kw["read_region_bytes"] = 4096
    return UvmEmbeddingTable(n, dim, gpu_rows=gpu_rows, **kw)


def _slots_of(state: dict[str, Any], keys: np.ndarray) -> np.ndarray:
    """The slot of each key, read from the table's own index (the special slot last)."""
    slot_keys = state["keys"]
    held = np.flatnonzero(slot_keys != EMPTY_KEY)
    lookup = dict(zip(slot_keys[held].tolist(), held.tolist(), strict=True))
    if state["special"]:
        lookup[EMPTY_KEY] = slot_keys.size
    return np.array([lookup[k] for k in keys.tolist()], dtype=np.int64)


def _query(cp: Any, table: UvmEmbeddingTable, keys: np.ndarray, default: float = 0.5
           ) -> tuple[np.ndarray, np.ndarray]:
    out = cp.empty((keys.size, table.dim), dtype=np.float32)
    positions, _ = table.query(cp.asarray(keys), out, default_value=default)
    return out.get(), np.sort(positions.get())


def _check_copies(state: dict[str, Any], rows_of_slot: dict[int, np.ndarray]) -> None:
    """Every GPU row's owner links back to it and both copies equal the expected row."""
    owner, gpu_row = state["owner"], state["gpu_row"]
    for row in np.flatnonzero(owner != NO_ROW).tolist():
        slot = int(owner[row])
        assert gpu_row[slot] == row
        np.testing.assert_array_equal(state["gpu_rows"][row], rows_of_slot[slot])
    for slot, want in rows_of_slot.items():
        np.testing.assert_array_equal(state["host_rows"][slot], want)


@gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dim,batch,huge", [(16, 1000, True), (3, 1000, False),
                                            (64, SMALL_BATCH + 3000, True),
                                            (64, SMALL_BATCH + 3000, False), (128, 700, True)])
def test_every_key_exact_hot_or_cold(cp: Any, rng: np.random.Generator, seed: int, dim: int,
                                     batch: int, huge: bool, grouped: bool) -> None:
    n = max(batch, 5000)
    keys = _keys(rng, n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    gpu_rows = n // 4
    with _table(n, dim, gpu_rows, grouped, huge_pages=huge) as table:
        kind = table.memory_stats()["host_memory_kind"]
        assert kind == "cudaHostAlloc" if not huge else kind in ("cudaHostAlloc",
                                                                 "registered huge pages")
        for start in range(0, n, 1700):  # chunk by chunk, as warm-up does
            table.build(keys[start:start + 1700], rows[start:start + 1700])
        assert table.size() == n
        state = table.state()
        slots = _slots_of(state, keys)
        # file order: the first gpu_rows keys built have the GPU rows, in that order
        np.testing.assert_array_equal(state["gpu_row"][slots[:gpu_rows]], np.arange(gpu_rows))
        assert (state["gpu_row"][slots[gpu_rows:]] == NO_ROW).all()
        _check_copies(state, dict(zip(slots.tolist(), rows, strict=True)))
        absent = rng.choice(2**61, 300) + 2**61 + 1  # disjoint from the built keys
        query = np.r_[rng.choice(keys, batch - 300), absent].astype(np.int64)
        rng.shuffle(query)
        got, missed = _query(cp, table, query, default=7.0)
        expected = dict(zip(keys.tolist(), rows, strict=True))
        is_absent = np.isin(query, absent)
        np.testing.assert_array_equal(missed, np.flatnonzero(is_absent), err_msg=f"seed={seed}")
        assert (got[is_absent] == 7.0).all()
        np.testing.assert_array_equal(
            got[~is_absent], np.stack([expected[k] for k in query[~is_absent].tolist()]))
        np.testing.assert_array_equal(np.sort(table.dump(0, table.num_sets).get()),
                                      np.sort(keys))


@gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("gpu_rows,max_moves", [(300, None), (300, 50), (1, None)])
def test_counts_and_passes_match_the_reference(cp: Any, rng: np.random.Generator, seed: int,
                                               gpu_rows: int, max_moves: int | None,
                                               grouped: bool) -> None:
    n, dim = 3000, 8
    keys = _keys(rng, n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    # passes alone: the reference replays them (lookups' promotions: test_uvm_promotion.py)
    with _table(n, dim, gpu_rows, grouped, max_moves=max_moves,
                promote_on_lookup=False) as table:
        table.build(keys, rows)
        state = table.state()
        slots = _slots_of(state, keys)
        ref = UvmReference.from_state(state)
        rows_of_slot = dict(zip(slots.tolist(), rows, strict=True))
        moved_total = 0
        for rnd in range(6):
            # a skewed draw whose hot keys change between rounds; repeats within a batch
            weights = rng.permutation(n).astype(np.float64) ** (4 + rnd)
            draw = rng.choice(n, 4000, p=weights / weights.sum())
            got, missed = _query(cp, table, keys[draw])
            assert missed.size == 0
            np.testing.assert_array_equal(got, rows[draw])
            ref.access(slots[draw])
            state = table.state()
            np.testing.assert_array_equal(state["hits"], ref.hits, err_msg=f"seed={seed}")
            moved = table.promote()
            assert moved == ref.promote(table.max_moves), f"seed={seed} round {rnd}"
            moved_total += moved
            state = table.state()
            np.testing.assert_array_equal(state["gpu_row"], ref.gpu_row, err_msg=f"seed={seed}")
            np.testing.assert_array_equal(state["owner"], ref.owner)
            np.testing.assert_array_equal(state["hits"], ref.hits)
            _check_copies(state, rows_of_slot)
            got, _ = _query(cp, table, keys)  # every key, after the moves
            np.testing.assert_array_equal(got, rows)
            ref.access(slots)
        assert moved_total > 0
        assert table.memory_stats()["rows_moved"] == moved_total


@gpu
def test_seeded_counts_place_rows(cp: Any, rng: np.random.Generator) -> None:
    n, dim, gpu_rows = 2000, 4, 100
    keys = _keys(rng, n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    with _table(n, dim, gpu_rows) as table:
        table.build(keys, rows)
        counts = np.zeros(n, np.uint32)
        hot = rng.choice(n, gpu_rows, replace=False)
        counts[hot] = 1000 + rng.integers(0, 100, gpu_rows)
        table.seed_hits(keys, counts)
        state = table.state()
        ref = UvmReference.from_state(state)
        cold_hot = int((hot >= gpu_rows).sum())  # the first gpu_rows keys built are placed
        assert table.promote() == ref.promote(table.max_moves) == cold_hot
        state = table.state()
        np.testing.assert_array_equal(state["gpu_row"], ref.gpu_row)
        slots = _slots_of(state, keys)
        assert (state["gpu_row"][slots[hot]] != NO_ROW).all()
        got, _ = _query(cp, table, keys)
        np.testing.assert_array_equal(got, rows)


@gpu
def test_update_rewrites_both_copies(cp: Any, rng: np.random.Generator) -> None:
    n, dim, gpu_rows = 4000, 16, 1000
    keys = _keys(rng, n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    with _table(n, dim, gpu_rows) as table:
        table.build(keys, rows)
        changed = rng.choice(n, 1500, replace=False)  # hot and cold keys
        new = rng.standard_normal((changed.size, dim)).astype(np.float32)
        absent = np.arange(2**61 + 5, 2**61 + 25, dtype=np.int64)
        assert table.update(np.r_[keys[changed], absent],
                            np.r_[new, np.ones((absent.size, dim), np.float32)]) == 1500
        rows[changed] = new
        got, _ = _query(cp, table, keys)
        np.testing.assert_array_equal(got, rows)
        state = table.state()
        _check_copies(state, dict(zip(_slots_of(state, keys).tolist(), rows, strict=True)))
        # promote cold updated keys: their GPU copies come from the updated host rows
        cold = changed[changed >= gpu_rows][:200]
        for _ in range(4):
            table.query(cp.asarray(keys[cold]), cp.empty((cold.size, dim), np.float32))
        assert table.promote() > 0
        got, _ = _query(cp, table, keys)
        np.testing.assert_array_equal(got, rows)
        # a key built again gets both copies rewritten
        rows[:10] += 1
        table.build(keys[:10], rows[:10])
        got, _ = _query(cp, table, keys)
        np.testing.assert_array_equal(got, rows)


@gpu
@pytest.mark.parametrize("huge,grouped", [(True, False), (False, False), (True, True)])
def test_exact_under_concurrent_lookups_updates_and_passes(cp: Any, rng: np.random.Generator,
                                                           seed: int, huge: bool,
                                                           grouped: bool) -> None:
    """Row of key i at version v: every float i * 1000 + v. A lookup must see whole rows of
    the right key at a version already written, whatever moves and writes run."""
    n, dim, gpu_rows = 4000, 32, 400
    keys = _keys(rng, n)
    ids = np.arange(n, dtype=np.float32)

    def rows_at(version: int, which: np.ndarray) -> np.ndarray:
        return np.repeat((ids[which] * 1000 + version)[:, None], dim, axis=1)

    versions = np.zeros(n, np.int64)
    with _table(n, dim, gpu_rows, grouped, huge_pages=huge) as table:
        table.build(keys, rows_at(0, np.arange(n)))
        stop = threading.Event()
        errors: list[str] = []
        lookups = [0]

        def reader(worker: int) -> None:
            local = np.random.default_rng(seed + worker)
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                while not stop.is_set():
                    # reader 0: the keys built first (GPU rows at first), readers 1
                    # and 2: fewer keys, each hotter, built later: they get promoted
                    first, span = ((0, 600), (2000, 50), (3000, 50))[worker]
                    hot = first + local.integers(0, span, 3000)
                    got, missed = _query(cp, table, keys[hot])
                    written = versions.max()
                    v = got - (ids[hot] * 1000)[:, None]
                    if missed.size or not (got == got[:, :1]).all() or \
                            not ((v >= 0) & (v <= written + 1)).all():
                        errors.append(f"reader {worker} saw a wrong row (seed={seed})")
                        return
                    lookups[0] += 1

        threads = [threading.Thread(target=reader, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        try:
            moved = 0
            for version in range(1, 30):
                which = rng.choice(n, 500, replace=False)
                versions[which] = version
                table.update(keys[which], rows_at(version, which))
                moved += table.promote()
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors[0]
        assert lookups[0] > 0 and moved + table.lookup_promotions() > 0
        got, _ = _query(cp, table, keys)
        np.testing.assert_array_equal(got[:, 0], ids * 1000 + versions)


@gpu
def test_background_passes_promote_hot_keys(cp: Any, rng: np.random.Generator) -> None:
    n, dim, gpu_rows = 3000, 8, 100
    keys = _keys(rng, n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    with UvmEmbeddingTable(n, dim, gpu_rows=gpu_rows, promotion_interval=0.01) as table:
        table.build(keys, rows)
        hot = keys[-50:]  # built last: cold at first
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got, _ = _query(cp, table, hot)
            np.testing.assert_array_equal(got, rows[-50:])
            state = table.state()
            if (state["gpu_row"][_slots_of(state, hot)] != NO_ROW).all():
                break
            time.sleep(0.005)
        state = table.state()
        assert (state["gpu_row"][_slots_of(state, hot)] != NO_ROW).all()
        assert table.memory_stats()["promotion_passes"] > 0


@gpu
def test_memory_figures(cp: Any) -> None:
    n, dim, gpu_rows = 1_000_000, 64, 100_000
    free_before = cp.cuda.runtime.memGetInfo()[0]
    with _table(n, dim, gpu_rows) as table:
        stats = table.memory_stats()
        assert stats["memory_bytes"] == UvmEmbeddingTable.device_bytes_required(n, dim, gpu_rows)
        assert stats["host_memory_bytes"] == (table.num_slots + 1) * dim * 4
        assert stats["gpu_rows"] == gpu_rows and stats["gpu_rows_used"] == 0
        used = free_before - cp.cuda.runtime.memGetInfo()[0]
        # the device holds the index and the hot rows, not the host rows
        assert stats["memory_bytes"] <= used < stats["memory_bytes"] + stats[
            "host_memory_bytes"] // 2


def _model(**extra: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "model": "m", "sparse_files": ["/nowhere"], "embedding_vecsize_per_table": [16],
        "maxnum_catfeature_query_per_table_per_sample": [1], "deployed_device_list": [0],
        "embedding_cache_type": "uvm",
    }
    return ModelConfig(**{**fields, **extra})


@gpu
def test_gpu_rows_from_the_budget(cp: Any) -> None:
    n = 1_000_000
    assert uvm_gpu_rows(_model(gpucacheper=0.1), n, 16, 0) == 100_000
    index = UvmEmbeddingTable.index_bytes(n)
    rows = uvm_gpu_rows(_model(gpu_memory_budget_mb=(index + 2**20) / 2**20), n, 16, 0)
    assert rows == 2**20 // UvmEmbeddingTable.gpu_row_bytes(16)
    total = cp.cuda.runtime.memGetInfo()[1]
    with pytest.raises(ConfigError, match="more than device 0 has"):
        uvm_gpu_rows(_model(gpu_memory_budget_mb=total / 2**20 + 1), n, 16, 0)


def test_budget_smaller_than_the_index_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not hold the index"):
        uvm_gpu_rows(_model(gpu_memory_budget_mb=1), 10_000_000, 16, 0)


def test_too_little_host_memory_is_a_config_error() -> None:
    # 2**30 keys of dim 1024 need terabytes of pinned memory: refused before any allocation
    with pytest.raises(ConfigError, match="pinned host memory"):
        UvmEmbeddingTable(2**30, 1024, gpu_rows=10)


@gpu
def test_uvm_through_the_lookup_path(cp: Any, rng: np.random.Generator) -> None:
    from hps.gpu.table import GpuEmbeddingTable

    dim, n = 16, 3000
    keys = _keys(rng, n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    fetched: list[np.ndarray] = []

    def fetch(asked: np.ndarray) -> np.ndarray:
        fetched.append(asked)
        return np.full((asked.size, dim), 0.25, np.float32)

    with GpuEmbeddingTable(_model(gpucacheper=0.1, hit_rate_threshold=0.5), 0, n, 0,
                           fetch) as table:
        assert table.mode == "uvm"
        assert table.warm_up([(keys[i:i + 1000], rows[i:i + 1000])
                              for i in range(0, n, 1000)]) == n
        query = np.r_[keys, [2**61 + 3]].astype(np.int64)
        out = cp.empty((query.size, dim), dtype=np.float32)
        table.lookup(cp.asarray(query), out)
        np.testing.assert_array_equal(out.get()[:n], rows)
        assert (out.get()[n] == 0.25).all()
        # held keys never reach the host path, hot or cold; the absent one does
        assert len(fetched) == 1 and fetched[0].tolist() == [2**61 + 3]
        stats = table.stats()
        assert stats["mode"] == "uvm" and stats["size"] == n
        assert stats["gpu_rows"] == 300 and stats["host_memory_bytes"] > 0


def test_reference_pass_by_hand() -> None:
    """The model's pass on a worked example: the hottest cold key takes the coldest GPU
    row; the next candidate does not beat its victim by PROMOTE_FACTOR; counts halve."""
    ref = UvmReference(gpu_row=[0, 1, NO_ROW, NO_ROW, NO_ROW, NO_ROW], owner=[0, 1],
                       hits=[5, 0, 3, 1, 4, 0])
    assert ref.promote(max_moves=10) == 1
    assert ref.gpu_row.tolist() == [0, NO_ROW, NO_ROW, NO_ROW, 1, NO_ROW]
    assert ref.owner.tolist() == [0, 4]
    assert ref.hits.tolist() == [2, 0, 1, 0, 2, 0]
    ref.access(np.array([2, 2, 2, 2, 2, 2]))  # 1 + 6 = 7 > 2 × 2: takes row 0 or 1
    ref.place(np.array([3]), first_row=0)  # row 0 is taken: placement leaves it
    assert ref.gpu_row[3] == NO_ROW
    assert ref.promote(max_moves=1) == 1
    assert ref.gpu_row[2] == 0 and ref.owner.tolist() == [2, 4]


def test_region_shift() -> None:
    """Regions of at most the bytes asked (one row at least), and at most 32768 of them."""
    assert region_shift(22_222_224, 256) == 13  # 2 MiB of 256-byte rows
    assert region_shift(1000, 256, 4096) == 4
    assert region_shift(1000, 5000, 4096) == 0  # a row larger than the region
    assert region_shift(10, 72) == 14  # 2 MiB // 72 = 29127 rows: 2^14 of them fit
    for rows, row_bytes in ((2**33, 256), (10**9, 72), (2**31, 16)):
        shift = region_shift(rows, row_bytes)
        assert (rows >> shift) + 1 <= 32768 < (rows >> (shift - 1)) + 1
