"""`hps serve --workers N` with GPU caches: each worker keeps its own, and the leader's
online updates reach every worker's caches (hps/server/cache_journal.py). uvm tables,
which would pin the whole table in every worker, are refused before anything starts."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps.config import load_config
from hps.errors import ConfigError
from hps.http.workers_gpu import check_gpu_caches, gpu_caches_wanted, refuse_uvm
from tests.conftest import model_config
from tests.http.conftest import ModelFiles, wait_until
from tests.http.test_workers import (
    Served,
    _lookup,
    load_with_updates_and_a_reload,
    run_with_updates,
    serving,
    streams,  # noqa: F401 - the module's redis-server fixture
)
from tests.support.redis_servers import RedisServer


def test_uvm_tables_are_refused_with_several_workers(tmp_path: Path) -> None:
    config = load_config({"models": [
        model_config([str(tmp_path / "t")], [8], gpucache=True, embedding_cache_type="uvm"),
        model_config([str(tmp_path / "u")], [8], name="dyn", gpucache=True)]})
    with pytest.raises(ConfigError, match="uvm") as caught:
        check_gpu_caches(config, ["m", "dyn"], 2)
    assert "(models m)" in str(caught.value)
    assert "one worker" in str(caught.value)
    check_gpu_caches(config, ["dyn"], 2)  # dynamic caches: one per worker, served
    # a model added or reloaded at runtime is checked alone (ReplicatedServer._check_gpu)
    with pytest.raises(ConfigError, match=r"\(models m\)"):
        refuse_uvm(config.models)
    refuse_uvm(config.models[1:])
    no_cache = load_config({"models": [model_config([str(tmp_path / "v")], [8],
                                                    embedding_cache_type="uvm")]})
    refuse_uvm(no_cache.models)  # no GPU cache asked for: nothing to refuse


def test_gpu_workers_without_an_mps_daemon_are_warned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    config = load_config({"models": [model_config([str(tmp_path / "u")], [8], name="dyn",
                                                  gpucache=True)]})
    pipes = tmp_path / "mps"
    pipes.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipes))
    with caplog.at_level(logging.INFO, logger="hps.http.workers"):
        check_gpu_caches(config, ["dyn"], 4)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "hps mps start" in warned[0] and "0.17x" in warned[0]
    assert any("each of the 4 workers keeps its own GPU caches" in r.getMessage()
               for r in caplog.records)
    os.mkfifo(pipes / "control")  # the daemon's control pipe: found
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hps.http.workers"):
        check_gpu_caches(config, ["dyn"], 4)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    caplog.clear()
    check_gpu_caches(config, [], 4)  # no GPU caches wanted: nothing said
    assert not caplog.records


@pytest.fixture(scope="module")
def gpu_setup(tmp_path_factory: pytest.TempPathFactory, streams: RedisServer  # noqa: F811
              ) -> tuple[ModelFiles, Path, Path]:
    return run_with_updates(tmp_path_factory.mktemp("workers-gpu"), streams.address,
                            gpucache=True, gpucacheper=1.0,
                            cache_refresh_percentage_per_iteration=1.0)


@pytest.fixture(scope="module")
def gpu_served(gpu_setup: tuple[ModelFiles, Path, Path]) -> Iterator[Served]:
    yield from serving(gpu_setup)


@pytest.mark.gpu
def test_every_workers_gpu_cache_serves_the_leaders_updates(
        gpu_served: Served, gpu_setup: tuple[ModelFiles, Path, Path],
        streams: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    model, config, _ = gpu_setup
    assert gpu_caches_wanted(load_config(str(config))) == ["m"]
    # client processes check every answer while the stream rewrites keys and the model
    # reloads; then one more update, which answers on new connections (either worker)
    # must all show within the wait
    load_with_updates_and_a_reload(gpu_served, model, streams.address, tmp_path, clients=3)
    untouched = model.keys[0][-50:]
    assert np.array_equal(_lookup(gpu_served, untouched), model.vectors[0][-50:])
    stats = gpu_served.run_folder() / "gpu-updates"
    assert any(stats.iterdir())  # the leader's rings, which the other worker read
    # a uvm model added at runtime is refused before any worker loads it
    block = {**copy.deepcopy(model.config["models"][0]), "model": "u2",
             "gpucache": True, "embedding_cache_type": "uvm"}
    refused = httpx.post(f"{gpu_served.url}/v1/models", json=block, timeout=60)
    assert refused.status_code == 422 and "uvm" in refused.json()["error"]["message"], \
        refused.text
    assert "u2" not in [m["model"] for m in
                        httpx.get(f"{gpu_served.url}/v1/models").json()["models"]]
    # a prefetch asked of one worker goes into every worker's GPU caches
    keys = model.keys[0][-200:]
    asked = httpx.post(f"{gpu_served.url}/v1/models/m/prefetch",
                       json={"table": "users", "keys": keys.tolist()}, timeout=60)
    assert asked.status_code == 202, asked.text
    job = asked.json()["jobs"][0]["job"]

    def status() -> dict[str, object]:
        return httpx.get(f"{gpu_served.url}/v1/models/m/prefetch/{job}", timeout=60).json()

    wait_until(lambda: status()["status"] == "done", timeout=60)
    parts = status()["workers"]
    assert [(p["worker"], p["found"], p["gpu_inserted"]) for p in parts] == \
        [(0, 200, 200), (1, 200, 200)], parts
    assert np.array_equal(_lookup(gpu_served, keys), model.vectors[0][-200:])
