"""Which path answers a lookup with host keys (hps/server/http_path.py, host_answers.py,
host_device.py): the decision on given timings, the config's override and its checks, the
device each worker's host-key lookups take, and what a CPU server says of its tables."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from hps.config import load_config, parse_model_block
from hps.errors import ConfigError
from hps.host_answers import host_path_differs
from hps.server import HierarchicalParameterServer
from hps.server.host_device import host_device, spread_line
from hps.server.http_path import (
    BY_SIZE,
    GPU,
    GPU_MARGIN,
    HOST,
    PROBES,
    RECHECK,
    SIZES,
    HttpPath,
    chosen,
    decide,
    size_bounds,
    timed_keys,
    unmeasured,
    without_measuring,
)
from tests.conftest import make_table, model_config, write_table


def test_each_size_takes_the_path_measured_faster_the_gpu_only_by_a_margin() -> None:
    assert decide([1.0, 1.0, 1.0], [2.0, 1.0, 0.5]) == (False, True, True)
    assert decide([5e-5], [2e-4]) == (False,)
    # near (the GPU path ahead by less than GPU_MARGIN): the host path
    assert GPU_MARGIN == 0.8
    assert decide([0.9, 0.81, 0.79, 0.5], [1.0, 1.0, 1.0, 1.0]) == (True, True, False, False)
    # as the bench measured it serving (µs): 145 on the GPU, 158.5 on the host
    assert decide([145.2e-6], [158.5e-6]) == (True,)


def test_serving_probes_a_gpu_path_only_a_little_ahead_keep_the_host_path() -> None:
    route = chosen(SIZES, [1e-3, 1e-3, 1e-3, 1e-4], [1e-6, 1e-6, 1e-6, 1.5e-4], device=0)
    assert route.host[3] is False  # 4,096 keys: the GPU path at load, 1.5x faster
    timed = {False: 1.45e-4, True: 1.585e-4}  # serving: the GPU 0.92x the host's
    for _ in range(2 * PROBES):
        host, probe = route.pick(4000)
        route.took(probe, host, timed[host])
    assert route.host[3] is True and route.path == HOST


def test_each_request_size_takes_the_path_of_the_nearest_measured_size() -> None:
    assert size_bounds(SIZES) == (4, 64, 1024)
    route = chosen(SIZES, [1e-5, 2e-5, 4e-5, 1e-4], [4e-6, 2e-5, 1e-4, 2e-3], device=3,
                   label="model 'm' table 't'")
    assert route.path == BY_SIZE and route.host == (True, True, False, False)
    assert route.reason == "measured" and route.device == 3
    assert route.gpu_us == pytest.approx((10.0, 20.0, 40.0, 100.0))
    shown = route.as_dict()
    assert shown["paths"] == [HOST, HOST, GPU, GPU] and shown["sizes"] == list(SIZES)
    # within CLOSE (3x) of each other at load: timed again while serving; 20x apart: not
    assert shown["probed"] == [True, True, True, False]
    assert shown["served_us"] == [None] * 4 and shown["device"] == 3
    line = route.line()
    assert "model 'm' table 't': HTTP lookups (host keys) take the path by size (GPU 3)" \
        in line
    assert "4096 keys GPU 100.0 µs host 2000.0 µs -> gpu" in line
    assert "1 keys GPU 10.0 µs host 4.0 µs -> host" in line
    everywhere = chosen([1, 16], [1e-3, 1e-3], [1e-6, 1e-6], device=0)
    assert everywhere.path == HOST
    nowhere = chosen([1, 16], [1e-6, 1e-6], [1e-3, 1e-3], device=0)
    assert nowhere.path == GPU and nowhere.pick(9) == (False, -1)  # 1000x: never probed
    assert nowhere.answered() == {GPU: 1, HOST: 0}


def test_serving_times_both_paths_again_and_the_faster_takes_the_size(
        caplog: pytest.LogCaptureFixture) -> None:
    route = chosen(SIZES, [1e-3, 1e-3, 4e-5, 1e-3], [1e-6, 1e-6, 1e-4, 1e-6], device=0,
                   label="model 'm' table 't'")
    assert route.host[2] is False  # 256 keys: the GPU path at load, 2.5x faster
    timed = {False: 3e-4, True: 1e-4}  # serving: the host path 3x faster
    with caplog.at_level(logging.INFO, logger="hps"):
        for _ in range(2 * PROBES):
            host, probe = route.pick(200)  # the nearest measured size: 256
            assert probe == 2
            route.took(probe, host, timed[host])
    assert route.host == (True, True, True, True) and route.path == HOST
    assert route.as_dict()["served_us"][2] == [300.0, 100.0]
    assert route.as_dict()["served_cpu_us"] == [None] * 4  # no CPU times were given
    said = [r.getMessage() for r in caplog.records]
    assert said == ["model 'm' table 't': lookups of about 256 host keys now take the host "
                    "tiers (serving: GPU 300.0 µs, host 100.0 µs, medians of 16 each)"]
    # probed again only RECHECK lookups of that size later
    assert [route.pick(256) for _ in range(RECHECK)] == [(True, -1)] * RECHECK
    assert route.pick(256)[1] == 2
    assert route.answered()[HOST] >= RECHECK
    idle = unmeasured(device=1)  # no key to time at load: the GPU until serving times it
    assert idle.path == GPU and idle.as_dict()["probed"] == [True] * len(SIZES)
    assert idle.pick(1) == (False, 0) and idle.pick(1) == (False, 0)
    idle.took(0, False, 1.0)
    assert idle.pick(1) == (True, 0)  # the path timed fewer times


def test_timed_keys_repeat_the_held_keys_to_the_size() -> None:
    held = np.array([5, 7, 9], np.int64)
    assert timed_keys(held, 7).tolist() == [5, 7, 9, 5, 7, 9, 5]
    assert timed_keys(held, 2).tolist() == [5, 7]


def _model(**extra: object):  # type: ignore[no-untyped-def]
    return parse_model_block(model_config(["/m/t"], [8], gpucache=True, **extra))


def test_the_override_and_the_cases_where_the_host_tiers_would_answer_otherwise() -> None:
    config = load_config({"models": [model_config(["/m/t"], [8], gpucache=True)]})
    volatile, persistent = config.volatile_db, config.persistent_db
    assert host_path_differs(config.models[0], volatile, persistent) is None
    measured = without_measuring(config.models[0], volatile, persistent, True, 1)
    assert measured is None  # auto over a hash map of every row: measured
    gpu = without_measuring(_model(http_lookup_path="gpu"), volatile, persistent, True, 1)
    assert gpu is not None and (gpu.path, gpu.reason, gpu.device) == (
        GPU, "http_lookup_path gpu", 1)
    assert gpu.pick(1) == gpu.pick(10**6) == (False, -1)  # never timed: asked for
    host = without_measuring(_model(http_lookup_path="host"), volatile, persistent, True, 1)
    assert host is not None and (host.path, host.reason) == (HOST, "http_lookup_path host")
    assert host.pick(1) == host.pick(10**6) == (True, -1)
    cpu = without_measuring(_model(http_lookup_path="gpu"), volatile, persistent, False, None)
    assert cpu is not None and (cpu.path, cpu.reason) == (HOST, "no GPU cache")
    # where the host tiers may answer otherwise, auto keeps the GPU path and says why
    compact = without_measuring(_model(embedding_storage_dtype="int8"), volatile, persistent,
                                True, 0)
    assert compact is not None and compact.path == GPU and "int8" in compact.reason
    redis = load_config({"models": [model_config(["/m/t"], [8], gpucache=True)],
                         "volatile_db": {"type": "redis_cluster"}})
    assert "Redis" in str(host_path_differs(redis.models[0], redis.volatile_db,
                                            redis.persistent_db))
    rocks = load_config({"models": [model_config(["/m/t"], [8], gpucache=True)],
                         "volatile_db": {"type": "redis_cluster"},
                         "persistent_db": {"type": "rocks_db", "path": "/tmp/r"}})
    assert host_path_differs(rocks.models[0], rocks.volatile_db, rocks.persistent_db) is None
    bounded = load_config({"models": [model_config(["/m/t"], [8], gpucache=True)],
                           "volatile_db": {"type": "hash_map", "overflow_margin": 1000}})
    assert "overflow_margin" in str(host_path_differs(
        bounded.models[0], bounded.volatile_db, bounded.persistent_db))
    none = load_config({"models": [model_config(["/m/t"], [8], gpucache=True)],
                        "volatile_db": {"type": "disabled"}})
    assert "only copy" in str(host_path_differs(none.models[0], none.volatile_db,
                                                none.persistent_db))


def test_the_config_refuses_a_host_path_the_tiers_would_answer_otherwise() -> None:
    with pytest.raises(ConfigError, match=r"http_lookup_path.*'auto', 'gpu' or 'host'"):
        load_config({"models": [model_config(["/m/t"], [8], http_lookup_path="cpu")]})
    with pytest.raises(ConfigError, match="http_lookup_path 'host' would answer otherwise "
                                          r"than its GPU cache: its rows are stored as int8"):
        load_config({"models": [model_config(["/m/t"], [8], gpucache=True,
                                             embedding_storage_dtype="int8",
                                             http_lookup_path="host")]})
    with pytest.raises(ConfigError, match="Redis, with no persistent tier"):
        load_config({"models": [model_config(["/m/t"], [8], gpucache=True,
                                             http_lookup_path="host")],
                     "volatile_db": {"type": "redis_cluster"}})
    for path in ("auto", "gpu", "host"):  # over a hash map of every row: each is taken
        config = load_config({"models": [model_config(["/m/t"], [8], gpucache=True,
                                                      http_lookup_path=path)]})
        assert config.models[0].http_lookup_path == path
    # without a GPU cache there is nothing to answer otherwise: "host" is what it does
    load_config({"models": [model_config(["/m/t"], [8], embedding_storage_dtype="int8",
                                         http_lookup_path="host")]})
    assert parse_model_block(model_config(["/m/t"], [8])).http_lookup_path == "auto"


@pytest.mark.parametrize("devices", [[0], [0, 1], [2, 3, 0, 1], list(range(8))])
def test_workers_spread_their_host_key_lookups_over_the_deployed_devices(
        devices: list[int]) -> None:
    chosen_devices = [host_device(devices, worker) for worker in range(2 * len(devices))]
    assert chosen_devices == devices * 2  # worker i: deployed[i % n], every device
    assert host_device(devices, 0) == devices[0]  # one process: the first, as before
    line = spread_line("m", devices, 1, 8)
    assert f"worker 1 of 8 answers lookups with host keys (HTTP, gRPC) on GPU " \
           f"{devices[1 % len(devices)]}" in line
    assert "this process answers" in spread_line("m", devices, 0, None)


def test_a_cpu_server_says_its_tables_take_the_host_path_and_counts_them(
        tmp_path: Path, rng: np.random.Generator, caplog: pytest.LogCaptureFixture) -> None:
    keys, vectors = make_table(rng, 500, 8)
    write_table(tmp_path / "t", keys, vectors)
    config = {"models": [model_config([str(tmp_path / "t")], [8], http_lookup_path="gpu")],
              "volatile_db": {"type": "hash_map"}}
    with caplog.at_level(logging.DEBUG, logger="hps"), \
            HierarchicalParameterServer(config) as server:
        route = server.model("m").tables[0].http_path
        assert isinstance(route, HttpPath) and (route.path, route.reason) == (
            HOST, "no GPU cache")
        got = server.lookup_http("m", 0, keys[:50])
        np.testing.assert_array_equal(got, vectors[:50])
        out = np.empty((20, 8), np.float32)
        assert server.lookup_http("m", 0, keys[:20].astype(np.int64), out) is out
        np.testing.assert_array_equal(out, vectors[:20])
        narrow = server.lookup_http("m", 0, np.array([1, 2], np.int32))  # no such keys
        np.testing.assert_array_equal(narrow, np.full((2, 8), 0.5, np.float32))
        assert server.lookup_http("m", 0, keys[:0]).shape == (0, 8)
        (table,) = server.describe()[0]["tables"]
        assert table["http_lookup"] == {"path": HOST, "reason": "no GPU cache",
                                        "answered": {GPU: 0, HOST: 3}}
    assert any("table 'sparse_embedding0': HTTP lookups (host keys) take the host tiers: "
               "no GPU cache" in r.getMessage() for r in caplog.records)


def test_a_model_added_at_run_time_asking_for_a_host_path_that_differs_is_refused(
        tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 100, 8)
    write_table(tmp_path / "t", keys, vectors)
    config = {"models": [model_config([str(tmp_path / "t")], [8])],
              "volatile_db": {"type": "hash_map"}}
    with HierarchicalParameterServer(config) as server:
        block = parse_model_block(model_config(
            [str(tmp_path / "t")], [8], name="added", gpucache=True,
            embedding_storage_dtype="int8", http_lookup_path="host"))
        with pytest.raises(ConfigError, match="model 'added': http_lookup_path 'host' would "
                                              "answer otherwise than its GPU cache"):
            server.add_model(block)
        assert sorted(server.models) == ["m"]  # nothing loaded, nothing recorded
        assert [m.model for m in server.config.models] == ["m"]


def test_serving_shows_each_paths_cpu_time_beside_its_wall_time() -> None:
    """The probes' CPU time on the calling thread is kept beside their wall time (a GPU
    path whose wait spins costs a saturated server CPU its wall time hides); the
    decision still rests on the wall time."""
    route = chosen(SIZES, [1e-3, 1e-3, 0.5e-4, 1e-3], [1e-6, 1e-6, 1.2e-4, 1e-6], device=0)
    cost = {False: (0.7e-4, 2.0e-4), True: (1.1e-4, 1.0e-4)}  # (wall, CPU) per path
    for _ in range(2 * PROBES):
        host, probe = route.pick(256)
        route.took(probe, host, *cost[host])
    shown = route.as_dict()
    assert shown["served_us"][2] == [70.0, 110.0]
    assert shown["served_cpu_us"][2] == [200.0, 100.0]
    assert route.host[2] is False  # the GPU path, faster by the wall clock
