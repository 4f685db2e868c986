"""Lookups with host keys of a GPU model (hps/server/http_path.py, host_device.py): over
HTTP every row is answered exactly on either path, the choice and its timings are in the
log and in `GET /v1/models/{model}`, `http_lookup_path` forces each path, and the workers
of `hps serve --workers N` spread their host-key lookups over every deployed device."""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.http import create_app
from hps.http.serve import ServerThread
from hps.server import HierarchicalParameterServer
from hps.server.host_device import host_device
from hps.server.http_path import BY_SIZE, GPU, HOST, SIZES
from tests.conftest import make_table, model_config, write_table

pytestmark = pytest.mark.gpu

DIM = 32
PATHS = {"gpu": {GPU}, "host": {HOST}, "auto": {GPU, HOST, BY_SIZE}}


def _config(file: Path, **extra: Any) -> dict[str, Any]:
    model = model_config([str(file)], [DIM], gpucache=True, gpucacheper=1.0,
                         cache_refresh_percentage_per_iteration=1.0, hit_rate_threshold=1.0,
                         **extra)
    return {"supportlonglong": True, "models": [model], "volatile_db": {"type": "hash_map"}}


def _request(url: str, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body, headers or {})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


@contextmanager
def _served(config: dict[str, Any]) -> Iterator[tuple[str, HierarchicalParameterServer]]:
    server = HierarchicalParameterServer(config, load=False)
    thread = ServerThread(create_app(server))
    url = thread.start()
    try:
        deadline = time.monotonic() + 120
        while _request(url, "GET", "/readyz")[0] != 200:
            assert time.monotonic() < deadline, "not ready within 120 s"
            time.sleep(0.05)
        yield url, server
    finally:
        thread.stop()
        server.close()


@pytest.mark.parametrize("asked", ["auto", "gpu", "host"])
def test_every_row_over_http_on_the_path_chosen_and_shown(
        tmp_path: Path, rng: np.random.Generator, caplog: pytest.LogCaptureFixture,
        asked: str) -> None:
    keys, rows = make_table(rng, 20_000, DIM)
    write_table(tmp_path / "t", keys, rows)
    expected = dict(zip(keys.tolist(), range(keys.size), strict=True))
    with caplog.at_level(logging.INFO, logger="hps"), \
            _served(_config(tmp_path / "t", http_lookup_path=asked)) as (url, server):
        status, body = _request(url, "GET", "/v1/models/m")
        assert status == 200
        shown = json.loads(body)["tables"][0]["http_lookup"]
        assert shown["path"] in PATHS[asked], shown
        assert shown["device"] == 0
        if asked == "auto":
            assert shown["reason"] == "measured"
            assert shown["sizes"] == list(SIZES) and len(shown["gpu_us"]) == len(SIZES)
            assert all(t > 0 for t in shown["gpu_us"] + shown["host_us"])
        else:
            assert shown["reason"] == f"http_lookup_path {asked}" and "sizes" not in shown
        lines = [r.getMessage() for r in caplog.records
                 if "HTTP lookups (host keys) take the" in r.getMessage()]
        assert len(lines) == 1 and "model 'm' table 'sparse_embedding0'" in lines[0]
        if asked == "auto":
            assert "4096 keys GPU" in lines[0]
        answered = 0
        for size in (1, 16, 300, 2000, 5000):
            batch = np.concatenate([rng.choice(keys, size), np.array([-7, -9], np.int64)])
            want = np.full((batch.size, DIM), 0.5, np.float32)
            want[:size] = rows[[expected[k] for k in batch[:size].tolist()]]
            status, body = _request(url, "POST", "/v1/models/m/tables/0/lookup",
                                    batch.astype("<i8").tobytes(),
                                    {"Content-Type": "application/octet-stream"})
            assert status == 200
            np.testing.assert_array_equal(
                np.frombuffer(body, "<f4").reshape(batch.size, DIM), want)
            status, body = _request(url, "POST", "/v1/models/m/tables/0/lookup",
                                    json.dumps({"keys": batch.tolist()}).encode(),
                                    {"Content-Type": "application/json"})
            assert status == 200
            np.testing.assert_array_equal(np.array(json.loads(body)["vectors"], np.float32),
                                          want)
            answered += 2
        counts = server.describe()[0]["tables"][0]["http_lookup"]["answered"]
        assert counts[GPU] + counts[HOST] == answered
        if asked != "auto":  # the override answers every size on its path
            assert counts[asked] == answered


def test_both_paths_answer_alike_with_misses_and_narrow_keys(
        tmp_path: Path, rng: np.random.Generator) -> None:
    keys, rows = make_table(rng, 20_000, DIM)
    write_table(tmp_path / "t", keys, rows)
    config = _config(tmp_path / "t")
    config["models"][0]["gpucacheper"] = 0.25  # a quarter cached: misses fetched
    answers: dict[str, list[np.ndarray]] = {}
    for asked in ("gpu", "host"):
        config["models"][0]["http_lookup_path"] = asked
        with HierarchicalParameterServer(config) as server:
            picks = np.random.default_rng(5)
            got = []
            for size in (1, 64, 3000, 20_000):
                batch = np.concatenate([picks.choice(keys, size), [-3, 2**62]])
                got.append(server.lookup_http("m", 0, batch))
                np.testing.assert_array_equal(got[-1], server.lookup("m", 0, batch))
            small = keys[(keys >= 0) & (keys < 2**31)][:100]
            for dtype in (np.int32, np.uint32, np.uint64):
                got.append(server.lookup_http("m", 0, small.astype(dtype)))
            out = np.empty((small.size, DIM), np.float32)
            got.append(server.lookup_http("m", 0, small, out))
            answers[asked] = got
    for on_gpu, on_host in zip(answers["gpu"], answers["host"], strict=True):
        np.testing.assert_array_equal(on_gpu, on_host)


def test_each_worker_index_answers_on_its_device_and_says_so(
        tmp_path: Path, rng: np.random.Generator, cp: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    devices = list(range(int(cp.cuda.runtime.getDeviceCount())))  # every visible one
    keys, rows = make_table(rng, 5000, DIM)
    write_table(tmp_path / "t", keys, rows)
    config = _config(tmp_path / "t", http_lookup_path="gpu")
    config["models"][0]["deployed_device_list"] = devices
    workers = 2 * len(devices)
    for worker in range(len(devices) + 1):  # each device, then the first again
        server = HierarchicalParameterServer(config, load=False)
        server.worker, server.workers = worker, workers
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hps"), server:
            server.load_model(server.config.models[0])
            device = host_device(devices, worker)
            assert device == devices[worker % len(devices)]
            np.testing.assert_array_equal(server.lookup_http("m", 0, keys[:100]), rows[:100])
            looked = {d: g.stats()["lookups"] for d, g in server.model("m").tables[0].gpu.items()}
            assert looked[device] == 1 and sum(looked.values()) == 1, looked
            said = [r.getMessage() for r in caplog.records]
            assert any(f"worker {worker} of {workers} answers lookups with host keys (HTTP, "
                       f"gRPC) on GPU {device}" in line for line in said), said


def test_hps_serve_workers_spread_over_every_deployed_device(
        tmp_path: Path, rng: np.random.Generator, cp: Any) -> None:
    from tests.http.test_workers import serve, stop, write_run

    devices = list(range(int(cp.cuda.runtime.getDeviceCount())))
    keys, rows = make_table(rng, 5000, DIM)
    write_table(tmp_path / "t", keys, rows)
    config = _config(tmp_path / "t")
    config["models"][0]["deployed_device_list"] = devices
    workers = max(2, len(devices))  # a worker a device (two on one)
    served = serve(*write_run(tmp_path, config), "--workers", str(workers))
    try:
        for worker in range(workers):
            line = (f"worker {worker} of {workers} answers lookups with host keys (HTTP, "
                    f"gRPC) on GPU {devices[worker % len(devices)]}")
            if not any(line in seen for seen in served.seen):
                served.wait_for(line, timeout=60)
        for _ in range(4 * workers):  # connections land on any worker: each answers right
            status, body = _request(served.url, "POST", "/v1/models/m/tables/0/lookup",
                                    keys[:300].astype("<i8").tobytes(),
                                    {"Content-Type": "application/octet-stream"})
            assert status == 200
            np.testing.assert_array_equal(np.frombuffer(body, "<f4").reshape(300, DIM),
                                          rows[:300])
    finally:
        stop(served)
