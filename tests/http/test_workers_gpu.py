"""`hps serve --workers N` with GPU caches on a machine with CUDA: refused before anything
starts, saying why (one cache per worker would multiply each device's memory by N)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hps.config import load_config
from hps.errors import ConfigError
from hps.http.workers import check_workers, gpu_caches_wanted
from tests.conftest import model_config


@pytest.mark.gpu
def test_gpu_caches_with_several_workers_are_refused(tmp_path: Path) -> None:
    config = load_config({"models": [model_config([str(tmp_path / "t")], [8], gpucache=True),
                                     model_config([str(tmp_path / "u")], [8], name="host")],
                          "http": {"workers": 2}})
    assert gpu_caches_wanted(config) == ["m"]
    with pytest.raises(ConfigError, match="CUDA IPC") as caught:
        check_workers(config, None)
    assert "gpucache: false" in str(caught.value) and "one worker" in str(caught.value)
    host_only = load_config({"models": [model_config([str(tmp_path / "u")], [8])]})
    check_workers(host_only, None)  # models without GPU caches are served by workers
