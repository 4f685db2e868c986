"""Hot copies of a sharded static table (hps/gpu/hot_rows.py): each device's copy of its
peers' heaviest rows, filled through the public `HPS.replicate_hot_rows`, read by the one
pass, pulled and pushed, from every device; rows exact against the model with online
updates of copied keys, refills and emptying. A row planted in one copy alone shows which
reads go to the copy and which to the owner. Runs where there are two devices or more."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.gpu.hot_rows import SMALL_BATCH
from hps.gpu.shard_routing import shard_of
from hps.gpu.sharded_query import PUSH_AFTER
from tests.gpu.test_sharded_push import DIM, Model, _server, wrong_rows

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

LARGE = PUSH_AFTER + 1234  # pushed where the memory lets peers write it; reads the copies
SMALL = 1500  # pulled, through the compiled fast path; reads no copy


def _static_server(cp: Any, rng: np.random.Generator, tmp_path: Path, **model: Any
                   ) -> tuple[Any, np.ndarray, Model, list[int]]:
    """A static table sharded over every device; the background filler off unless
    `model` sets its interval (a test that plants rows in a copy keeps them there)."""
    devices = list(range(int(cp.cuda.runtime.getDeviceCount())))
    assert len(devices) >= 2, "run on a machine with two GPUs or more"
    keys = rng.choice(2**40, 200_000, replace=False).astype(np.int64)
    rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    model.setdefault("gpu_hot_rows_refresh_seconds", 0)
    hps = _server(tmp_path, keys, rows, devices, embedding_cache_type="static",
                  init_ec=True, gpucacheper=1.0, **model)
    return hps, keys, Model(keys, rows), devices


def _lookup(cp: Any, hps: Any, device: int, q: np.ndarray) -> np.ndarray:
    with cp.cuda.Device(device):
        out = cp.full((q.size, DIM), np.nan, cp.float32)
        hps.lookup_fromdlpack(cp.asarray(q), out, "m", 0)
        return out.get()  # type: ignore[no-any-return]


def _remote_to(device: int, keys: np.ndarray, devices: list[int]) -> np.ndarray:
    """The keys of `keys` whose shard lives on another device than `device`."""
    return keys[np.asarray(devices)[shard_of(keys, len(devices)) % len(devices)] != device]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_each_device_reads_its_copy_and_the_rows_stay_exact(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    hps, keys, model, devices = _static_server(cp, rng, tmp_path)
    try:
        table = hps.server.model("m").tables[0]
        owner = table.gpu[0].owner
        hot = keys[:20_000]
        answer = hps.replicate_hot_rows("m", 0, np.r_[hot, [2**41 + 5]])  # one in no tier
        assert answer["keys"] == hot.size + 1
        for device in devices:  # each copy holds the hot keys of the other devices' shards
            held = answer["held"][str(device)]
            assert held == _remote_to(device, hot, devices).size
            assert owner.hot.on(device).table.size() == held
        # a copied key's row planted in device 0's copy alone: device 0's reads of it, pulled
        # and pushed, come from the copy; device 1's from the owner, where the row is true
        planted = _remote_to(0, hot, devices)[:50]
        wrong = np.full((planted.size, DIM), 7.0, np.float32)
        owner.hot.on(0).table.update(planted, wrong)
        query0 = table.gpu[0]._one_pass
        others = np.setdiff1d(keys, planted)
        for n, push_after in ((SMALL, PUSH_AFTER), (LARGE, None), (LARGE, PUSH_AFTER)):
            query0.push_after = push_after  # None: pulled
            q = np.r_[planted, rng.choice(others, n - planted.size)]
            pushed = query0.pushed
            got = _lookup(cp, hps, 0, q)
            assert query0.pushed == pushed + (push_after is not None and n > push_after)
            # a small batch reads no copy (SMALL_BATCH)
            want = wrong if n > SMALL_BATCH else model.expected(planted)
            np.testing.assert_array_equal(got[:planted.size], want)
            np.testing.assert_array_equal(got[planted.size:], model.expected(q[planted.size:]))
            np.testing.assert_array_equal(_lookup(cp, hps, 1, q), model.expected(q))
        query0.push_after = PUSH_AFTER
        # filled again: the copy's rows are the shards' once more
        hps.replicate_hot_rows("m", 0, hot)
        for device in devices:
            for n in (SMALL, LARGE):
                q = np.r_[hot[:n // 2], rng.choice(keys, n - min(n // 2, hot.size))]
                q[::50] = rng.integers(2**41, 2**42, q[::50].size)  # in no tier
                np.testing.assert_array_equal(_lookup(cp, hps, device, q), model.expected(q))
        stats = table.gpu[0].stats()
        assert [h["keys"] for h in stats["hot_rows"]] == [
            answer["held"][str(d)] for d in devices]
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_updates_reach_the_copies_while_callers_read_them(
        cp: Any, rng: np.random.Generator, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Online updates of copied keys while every device looks up other copied keys, small
    and large batches, and the copies are filled both by calls and by the background
    filler from the sketch (every tick, hps/server/hot_fill.py): every row exact during
    the updates, and the updated rows exact from every device afterwards, pulled and
    pushed."""
    import torch

    from hps.server import hot_fill

    monkeypatch.setattr(hot_fill, "REFILL_MOVED", 0.0)  # any new traffic refills
    hps, keys, model, devices = _static_server(cp, rng, tmp_path, hot_key_sampling=1,
                                               gpu_hot_rows_refresh_seconds=0.01)
    try:
        server = hps.server
        hot = keys[:40_000]
        hps.replicate_hot_rows("m", 0, hot)
        updated, read = hot[:5_000], np.r_[hot[5_000:], keys[40_000:80_000]]
        errors: list[str] = []
        stop = threading.Event()

        def caller(device: int, seed: int) -> None:
            try:
                torch.cuda.set_device(device)
                r = np.random.default_rng(seed)
                while not stop.is_set():
                    for n in (SMALL, LARGE):
                        bad = wrong_rows(hps, device, r.choice(read, n), model)
                        if bad:
                            errors.append(f"cuda:{device}, {n} keys: {bad} wrong rows")
            except Exception as exc:  # reported below
                errors.append(f"cuda:{device}: {exc!r}")

        threads = [threading.Thread(target=caller, args=(d, 11 + d)) for d in devices]
        for t in threads:
            t.start()
        owner = server.model("m").tables[0].gpu[0].owner
        try:
            rounds, until = 0, time.monotonic() + 4.0
            while rounds < 3 or time.monotonic() < until:
                # each round rewrites every updated key, the copies' too
                model.update_online(server, updated, rng)
                hps.replicate_hot_rows("m", 0, hot[::-1])  # refilled meanwhile, too
                rounds += 1
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert not errors, errors[:10]
        assert owner.hot.sketch_total > 0  # the background filler filled them meanwhile
        for device in devices:
            for n in (SMALL, LARGE):
                q = np.r_[updated[:n // 2], rng.choice(read, n - min(n // 2, updated.size))]
                np.testing.assert_array_equal(_lookup(cp, hps, device, q), model.expected(q))
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_emptied_copies_are_not_read_and_the_sketch_fills_them(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    """Replicated with no keys, a copy holds none and the kernel reads no row of it (a
    row planted there is not returned); replicated with no keys given, the copies take the
    keys lookups asked for most."""
    hps, keys, model, devices = _static_server(cp, rng, tmp_path, hot_key_sampling=1)
    try:
        owner = hps.server.model("m").tables[0].gpu[0].owner
        hot = keys[:1000]
        hps.replicate_hot_rows("m", 0, hot)
        planted = _remote_to(0, hot, devices)[:20]
        owner.hot.on(0).table.update(planted, np.full((planted.size, DIM), 7.0, np.float32))
        assert hps.replicate_hot_rows("m", 0, [])["held"] == {str(d): 0 for d in devices}
        for n in (SMALL, LARGE):  # (the large batch pushed: the peer's mirror is empty too)
            q = np.r_[planted, rng.choice(keys, n - planted.size)]
            np.testing.assert_array_equal(_lookup(cp, hps, 0, q), model.expected(q))
        for _ in range(20):  # every lookup feeds the sketch (hot_key_sampling 1)
            _lookup(cp, hps, 0, np.r_[hot, rng.choice(keys, 500)])
        sketched = hps.server.top_keys("m", 0, "hot", 1 << 20)["keys"]
        answer = hps.replicate_hot_rows("m", 0)
        assert answer["keys"] == sketched.size > 0
        for device in devices:
            copied = owner.hot.on(device).keys
            assert answer["held"][str(device)] == copied.size > 0
            assert np.isin(copied, sketched).all()
            assert np.isin(copied, _remote_to(device, sketched, devices)).all()
        q = np.r_[hot, rng.choice(keys, LARGE)]
        for device in devices:
            np.testing.assert_array_equal(_lookup(cp, hps, device, q), model.expected(q))
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_copies_fill_themselves_after_a_load_and_a_reload(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    """No call fills them: after the load, traffic fills the sketch and the background
    filler the copies with its heaviest keys (those of other devices' shards, on each
    device); a reload's new version starts with empty copies and the filler seeds them
    with the replaced version's heaviest keys before any traffic. Rows exact from every
    device throughout, pulled and pushed."""
    hps, keys, model, devices = _static_server(cp, rng, tmp_path, hot_key_sampling=1,
                                               gpu_hot_rows_refresh_seconds=0.2)
    try:
        hot = keys[:3000]
        owner = hps.server.model("m").tables[0].gpu[0].owner
        assert all(owner.hot.on(d).keys.size == 0 for d in devices)  # empty at load

        def hot_copied(copies: Any) -> float:
            """The least share of the hot keys of its peers' shards a device's copy holds."""
            return min(np.isin(_remote_to(d, hot, devices), copies.on(d).keys).mean()
                       for d in devices)

        # skewed traffic: batches mostly of the hot keys (each sampled key stands for the
        # keys of its stride, so a hot key must be a real share of every batch: beside
        # a batch of uniform keys each hot key was counted below the sketch's purges)
        until = time.monotonic() + 90
        while hot_copied(owner.hot) < 0.9:  # refilled as the sketch learns the hot keys
            assert time.monotonic() < until, (hot_copied(owner.hot), owner.hot.stats())
            for device in devices:
                q = np.r_[rng.choice(hot, LARGE), rng.choice(keys, 2000)]
                np.testing.assert_array_equal(_lookup(cp, hps, device, q), model.expected(q))
        for device in devices:  # each copy holds keys of its peers' shards alone
            assert np.isin(owner.hot.on(device).keys, _remote_to(device, keys, devices)).all()
        for device in devices:
            for n in (SMALL, LARGE):
                q = np.r_[hot, rng.choice(keys, n)]
                np.testing.assert_array_equal(_lookup(cp, hps, device, q), model.expected(q))
        hps.server.reload_model("m")
        fresh = hps.server.model("m").tables[0].gpu[0].owner
        assert fresh is not owner
        until = time.monotonic() + 30
        while not all(fresh.hot.on(d).keys.size for d in devices):  # no traffic: the seed
            assert time.monotonic() < until, fresh.hot.stats()
            time.sleep(0.05)
        assert hot_copied(fresh.hot) >= 0.9
        for device in devices:
            for n in (SMALL, LARGE):
                q = np.r_[hot, rng.choice(keys, n)]
                np.testing.assert_array_equal(_lookup(cp, hps, device, q), model.expected(q))
    finally:
        hps.close()
