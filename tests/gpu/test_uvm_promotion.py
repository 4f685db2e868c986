"""Promotion on the uvm table's lookup path (hps/gpu/uvm_table.py): the host rows a batch
read for keys accessed MIN_HITS times or more take GPU rows at once, by the rules of
tests/support/uvm_reference.py check_lookup_promotion; never a stale row, whatever updates
and passes race with it; exact vectors for the uvm and dynamic cache types on uniform and
power-law draws."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from hps.config import ModelConfig
from hps.gpu.dynamic_cache import EMPTY_KEY
from hps.gpu.uvm_table import MIN_HITS, NO_ROW, UvmEmbeddingTable
from tests.support.uvm_reference import UvmReference, check_lookup_promotion

gpu = pytest.mark.gpu


def _table(n: int, dim: int, gpu_rows: int, **kw: Any) -> UvmEmbeddingTable:
    """Every batch grouped (so every batch may promote), 4 KiB regions, no passes unless a
    test runs one."""
    kw.setdefault("grouped_reads_from", 1)
    return UvmEmbeddingTable(n, dim, gpu_rows=gpu_rows, promotion_interval=0,
                             read_region_bytes=4096, **kw)


def _slots_of(state: dict[str, Any], keys: np.ndarray) -> np.ndarray:
    slot_keys = state["keys"]
    held = np.flatnonzero(slot_keys != EMPTY_KEY)
    lookup = dict(zip(slot_keys[held].tolist(), held.tolist(), strict=True))
    return np.array([lookup[k] for k in keys.tolist()], dtype=np.int64)


def _query(cp: Any, table: UvmEmbeddingTable, keys: np.ndarray, absent: int = 0
           ) -> np.ndarray:
    """The rows of held `keys`, queried with `absent` keys the table lacks after them
    (misses count in the batch, not in its host reads: a batch promotes only while at most
    half its keys read host rows)."""
    missing = -2 - np.arange(absent, dtype=np.int64)
    out = cp.empty((keys.size + absent, table.dim), dtype=np.float32)
    _, count = table.query(cp.asarray(np.r_[keys, missing]), out, default_value=0.5)
    assert count == absent
    got = out.get()
    assert (got[keys.size:] == 0.5).all()
    return got[:keys.size]


def _check_links(state: dict[str, Any]) -> None:
    """Every GPU row's owner links back to it and holds the owner's host row."""
    for row in np.flatnonzero(state["owner"] != NO_ROW).tolist():
        slot = int(state["owner"][row])
        assert state["gpu_row"][slot] == row
        np.testing.assert_array_equal(state["gpu_rows"][row], state["host_rows"][slot])


@gpu
@pytest.mark.parametrize(("gpu_rows", "dim", "from_output", "storage"), [
    (1, 16, True, "float32"), (40, 16, True, "float32"), (2048, 16, True, "float32"),
    (2048, 13, True, "float32"),  # stored rows padded past the output row (13 in 16)
    (2048, 16, False, "float32"),  # the promoted rows read from host memory again
    (2048, 16, True, "float16"),  # float32 output of 16-bit rows: from host memory
])
def test_a_batch_promotes_its_warm_host_rows(cp: Any, rng: np.random.Generator, seed: int,
                                             gpu_rows: int, dim: int, from_output: bool,
                                             storage: str) -> None:
    n = 20_000
    keys = np.arange(n, dtype=np.int64) * 7 + 11
    # values a float16 row holds exactly, so every storage returns them as given
    rows = rng.standard_normal((n, dim)).astype(np.float16).astype(np.float32)
    with _table(n, dim, gpu_rows, storage=storage) as table:
        table.promote_from_output = from_output
        table.build(keys, rows)
        for rnd in range(4):
            # cold keys read three times (warm), others once (never promoted), a few keys
            # with GPU rows (not so many that every row has more hits than a warm key)
            warm = rng.choice(np.arange(gpu_rows, n), 30, replace=False)
            once = rng.choice(np.setdiff1d(np.arange(gpu_rows, n), warm), 500, replace=False)
            draw = np.r_[np.repeat(warm, 3), once,
                         rng.integers(0, gpu_rows, min(200, gpu_rows // 10))]
            rng.shuffle(draw)
            before = table.state()
            slots = _slots_of(before, keys)
            read = slots[draw][before["gpu_row"][slots[draw]] == NO_ROW]
            np.testing.assert_array_equal(_query(cp, table, keys[draw], draw.size),
                                          rows[draw])
            after = table.state()
            ref = UvmReference.from_state(before)
            ref.access(slots[draw])
            np.testing.assert_array_equal(after["hits"], ref.hits, err_msg=f"seed={seed}")
            budget = max(1, min(gpu_rows, 2 * draw.size) // 32)
            errors = check_lookup_promotion(ref, UvmReference.from_state(after), read, budget)
            assert not errors, f"seed={seed} round {rnd}: {errors[:3]}"
            gained = (before["gpu_row"] == NO_ROW) & (after["gpu_row"] != NO_ROW)
            assert int(gained.sum()) == min(budget, warm.size) or rnd > 0
            _check_links(after)
            np.testing.assert_array_equal(_query(cp, table, keys), rows)
        assert table.lookup_promotions() > 0
        assert table.memory_stats()["rows_promoted_on_lookup"] == table.lookup_promotions()


@gpu
def test_a_promotion_reads_no_output_once_the_call_returns(cp: Any,
                                                           rng: np.random.Generator) -> None:
    """The caller may overwrite its output from another stream as soon as the call returns:
    a promotion that copies rows from the output (float32) has done so by then (it
    publishes the miss count the call waits for), so no GPU row ever holds what the caller
    wrote there. The interleaving is not forced: a regression shows as a GPU row of -7s
    in some runs."""
    n, dim = 20_000, 16
    keys = np.arange(n, dtype=np.int64) * 7 + 11
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    other = cp.cuda.Stream(non_blocking=True)
    with _table(n, dim, 8192) as table:  # 187 rows promoted a batch at most
        table.build(keys, rows)
        for _ in range(30):
            warm = rng.choice(np.arange(8192, n), 1000, replace=False)
            draw = np.repeat(warm, 3)
            batch = cp.asarray(np.r_[keys[draw], -2 - np.arange(draw.size, dtype=np.int64)])
            out = cp.empty((batch.size, dim), dtype=np.float32)
            table.query(batch, out, default_value=0.5)
            with other:
                out.fill(-7.0)  # as soon as the call returns, on another stream
        other.synchronize()
        assert table.lookup_promotions() > 0
        _check_links(table.state())


@gpu
def test_no_promotion_when_switched_off_or_below_min_hits(cp: Any,
                                                         rng: np.random.Generator) -> None:
    n, dim = 5000, 8
    keys = np.arange(n, dtype=np.int64) * 3 + 1
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    with _table(n, dim, 500, promote_on_lookup=False) as off, _table(n, dim, 500) as on, \
            _table(n, dim, 500, grouped_reads_from=1 << 20) as small:
        for table in (off, on, small):
            table.build(keys, rows)
        assert MIN_HITS == 2
        cold = keys[1000:1600]
        # once each, in a batch that promotes (at most half its keys read host rows)
        for table in (on, small):
            np.testing.assert_array_equal(_query(cp, table, cold, cold.size), rows[1000:1600])
        assert on.lookup_promotions() == 0
        # 3 accesses each now; with 300 keys that have GPU rows, the batch promotes 10, but
        # not below grouped_reads_from (small's batches read their host rows at once)
        twice = np.r_[np.repeat(np.arange(1000, 1010), 2), np.arange(300)]
        for table in (off, on, small):
            np.testing.assert_array_equal(_query(cp, table, keys[twice]), rows[twice])
        assert off.lookup_promotions() == 0 and on.lookup_promotions() == 10
        assert small.lookup_promotions() == 0
        state = on.state()
        assert (state["gpu_row"][_slots_of(state, cold[:10])] != NO_ROW).all()


@gpu
def test_promotion_never_serves_a_stale_row(cp: Any, rng: np.random.Generator,
                                            seed: int) -> None:
    """Row of key i at version v: every float i * 1000 + v. A promoting reader churns a
    few GPU rows among many warm keys while the main thread updates keys and runs passes;
    after each update returns, a lookup of its keys must see that version (a promotion
    that copied the older host row and linked it after the update would not)."""
    n, dim, gpu_rows = 6000, 32, 64
    keys = np.arange(n, dtype=np.int64) * 5 + 3
    ids = np.arange(n, dtype=np.float32)

    def rows_at(version: int, which: np.ndarray) -> np.ndarray:
        return np.repeat((ids[which] * 1000 + version)[:, None], dim, axis=1)

    with _table(n, dim, gpu_rows) as table:
        table.build(keys, rows_at(0, np.arange(n)))
        stop = threading.Event()
        errors: list[str] = []

        def reader(worker: int) -> None:
            local = np.random.default_rng(seed + worker)
            with cp.cuda.Stream(non_blocking=True):
                while not stop.is_set():
                    warm = local.choice(n, 300, replace=False)
                    draw = np.repeat(warm, 3)
                    got = _query(cp, table, keys[draw], draw.size)
                    if not (got == got[:, :1]).all() or \
                            not (np.floor(got[:, 0] / 1000) == ids[draw]).all():
                        errors.append(f"reader {worker} saw a torn or wrong row (seed={seed})")
                        return

        threads = [threading.Thread(target=reader, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        versions = np.zeros(n, np.int64)
        try:
            with cp.cuda.Stream(non_blocking=True):
                for version in range(1, 60):
                    which = rng.choice(n, 400, replace=False)
                    assert table.update(keys[which], rows_at(version, which)) == 400
                    versions[which] = version
                    got = _query(cp, table, np.repeat(keys[which], 2))
                    np.testing.assert_array_equal(
                        got[:, 0], np.repeat(ids[which] * 1000 + version, 2),
                        err_msg=f"seed={seed} version {version}")
                    if version % 10 == 0:
                        table.promote()
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors[0]
        assert table.lookup_promotions() > 0
        state = table.state()
        _check_links(state)
        np.testing.assert_array_equal(_query(cp, table, keys)[:, 0], ids * 1000 + versions)


def _model(cache_type: str) -> ModelConfig:
    return ModelConfig(
        model="m", sparse_files=["/nowhere"], embedding_vecsize_per_table=[16],
        maxnum_catfeature_query_per_table_per_sample=[1], deployed_device_list=[0],
        embedding_cache_type=cache_type, gpucacheper=0.1, hit_rate_threshold=1.1)


def _draw(rng: np.random.Generator, n: int, size: int, alpha: float | None) -> np.ndarray:
    """Row numbers: uniform (alpha None) or power-law ranks over a fixed permutation."""
    if alpha is None:
        return rng.integers(0, n, size)
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
    ranks = np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(size)), n - 1)
    return np.random.default_rng(7).permutation(n)[ranks]


@gpu
@pytest.mark.parametrize("cache_type", ["uvm", "dynamic"])
@pytest.mark.parametrize("alpha", [None, 1.05, 1.2, 1.5])
def test_exact_vectors_on_every_workload(cp: Any, rng: np.random.Generator, seed: int,
                                         cache_type: str, alpha: float | None) -> None:
    from hps.gpu.table import GpuEmbeddingTable

    n, dim = 200_000, 16
    keys = np.arange(n, dtype=np.int64) * 7 + 11
    rows = rng.standard_normal((n, dim)).astype(np.float32)

    def fetch(asked: np.ndarray) -> np.ndarray:
        return rows[(asked - 11) // 7]

    with GpuEmbeddingTable(_model(cache_type), 0, n, 0, fetch) as table:
        table.warm_up([(keys[i:i + 50_000], rows[i:i + 50_000]) for i in range(0, n, 50_000)])
        for size in (2000, 100_000, 2000, 100_000, 2000):
            draw = _draw(rng, n, size, alpha)
            out = cp.empty((size, dim), dtype=np.float32)
            table.lookup(cp.asarray(keys[draw]), out)
            np.testing.assert_array_equal(out.get(), rows[draw],
                                          err_msg=f"seed={seed} {cache_type} {alpha} {size}")


def test_check_lookup_promotion_by_hand() -> None:
    """The rules on a worked example: slot 4 (3 hits, read) takes row 1 from slot 1
    (1 hit); slot 5 (1 hit) may not be promoted, slot 3 (not read) neither, and slot 2
    may not take row 0 from slot 0, which has more hits."""
    before = UvmReference(gpu_row=[0, 1, NO_ROW, NO_ROW, NO_ROW, NO_ROW], owner=[0, 1],
                          hits=[5, 1, 3, 4, 3, 1])
    good = UvmReference(gpu_row=[0, NO_ROW, NO_ROW, NO_ROW, 1, NO_ROW], owner=[0, 4],
                        hits=before.hits)
    assert check_lookup_promotion(before, good, np.array([4, 4, 5, 2]), budget=1) == []
    assert check_lookup_promotion(before, good, np.array([5, 2]), budget=1) == [
        "slot 4 promoted without a host read"]
    assert "more than the budget" in check_lookup_promotion(
        before, UvmReference([0, NO_ROW, 1, NO_ROW, NO_ROW, NO_ROW], [0, 2], before.hits),
        np.array([2]), budget=0)[0]
    cold = UvmReference(gpu_row=[0, NO_ROW, NO_ROW, NO_ROW, NO_ROW, 1], owner=[0, 5],
                        hits=before.hits)
    assert check_lookup_promotion(before, cold, np.array([5]), budget=1) == [
        "slot 5 promoted with 1 hits", "slot 5 (1 hits) took row 1 from slot 1 (1 hits)"]
    stolen = UvmReference(gpu_row=[NO_ROW, 1, 0, NO_ROW, NO_ROW, NO_ROW], owner=[2, 1],
                          hits=before.hits)
    assert check_lookup_promotion(before, stolen, np.array([2]), budget=1) == [
        "slot 2 (3 hits) took row 0 from slot 0 (5 hits)"]
    unlinked = UvmReference(gpu_row=[0, NO_ROW, NO_ROW, NO_ROW, NO_ROW, NO_ROW],
                            owner=[0, 1], hits=before.hits)
    assert check_lookup_promotion(before, unlinked, np.array([]), budget=1) == [
        "slot 1 lost row 1 to no promotion", "row 1's owner 1 links to 4294967295"]
