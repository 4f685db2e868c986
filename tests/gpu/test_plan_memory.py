"""`hps plan`'s bytes per GPU against what nvidia-smi shows a process holding once the model
is loaded and looked up from every device (its CUDA context measured before and listed
apart): replicated and sharded, dynamic and static, over every GPU of the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

KEYS, DIM, LOOKUP = 1 << 21, 64, 2000

LAYOUTS = {
    "replicated dynamic": {"gpucacheper": 0.5},
    "replicated static": {"embedding_cache_type": "static"},
    "sharded dynamic": {"gpu_sharding": "row_wise", "gpucacheper": 0.5},
    "sharded static": {"gpu_sharding": "row_wise", "embedding_cache_type": "static"},
}


def _used_mib(pid: int) -> dict[int, int]:
    """MiB that process `pid` holds on each GPU, by nvidia-smi."""
    def query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines()]

    index = {uuid: int(i) for i, uuid in query("gpu=index,uuid")}
    return {index[uuid]: int(mib) for p, uuid, mib in query(
        "compute-apps=pid,gpu_uuid,used_memory") if int(p) == pid}


def _child(config_path: str) -> None:
    """A fresh process: contexts on every device, then the model loaded and looked up from
    every device; prints {device: [context MiB, loaded MiB]}."""
    import cupy as cp

    from hps.api import HPS

    config = json.loads(Path(config_path).read_text())
    devices = config["models"][0]["deployed_device_list"]
    for d in devices:
        with cp.cuda.Device(d):
            cp.zeros(1).sum()
    context = _used_mib(os.getpid())
    hps = HPS(config)
    keys = np.fromfile(Path(config["models"][0]["sparse_files"][0]) / "key", np.int64)[:LOOKUP]
    for d in devices:
        with cp.cuda.Device(d):
            out = cp.empty((LOOKUP, DIM), cp.float32)
            hps.lookup_fromdlpack(cp.asarray(keys), out, "m", 0)
            cp.cuda.Device(d).synchronize()
    loaded = _used_mib(os.getpid())
    print(json.dumps({d: [context[d], loaded[d]] for d in devices}))
    hps.close()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hps import write_sparse_model

    folder = tmp_path_factory.mktemp("plan") / "t0"
    rng = np.random.default_rng(0)
    write_sparse_model(folder, rng.choice(2**40, KEYS, replace=False).astype(np.int64),
                       rng.standard_normal((KEYS, DIM)).astype(np.float32))
    return folder


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_plans_bytes_per_gpu_are_what_the_process_holds(
        cp: Any, tmp_path: Path, model_folder: Path, layout: str) -> None:
    devices = list(range(cp.cuda.runtime.getDeviceCount()))
    config = {"supportlonglong": True, "volatile_db": {"type": "hash_map"}, "models": [{
        "model": "m", "sparse_files": [str(model_folder)], "embedding_vecsize_per_table": [DIM],
        "maxnum_catfeature_query_per_table_per_sample": [LOOKUP],
        "deployed_device_list": devices, "max_batch_size": 1, "gpucache": True,
        **LAYOUTS[layout]}]}
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "hps.tools.cli", "plan", str(path), "--json"],
        capture_output=True, text=True, check=True, env=env).stdout)
    kind = "GPU static table" if "static" in layout else "GPU dynamic cache"
    tiers = plan["tables"][0]["memory"]
    planned = sum(t["by_storage"]["float32"] for t in tiers
                  if t["tier"].startswith((kind, "GPU query buffers")))
    run = subprocess.run([sys.executable, "-c", "import sys; from tests.gpu.test_plan_memory "
                          "import _child; _child(sys.argv[1])", str(path)],
                         capture_output=True, text=True, env=env, cwd=Path.cwd(), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    held = json.loads(run.stdout.strip().splitlines()[-1])
    for device, (context, loaded) in held.items():
        took = (loaded - context) * 2**20
        assert abs(took - planned) <= 0.1 * planned, (
            f"{layout}, GPU {device}: the plan says {planned / 2**20:.1f} MiB, the process "
            f"took {took / 2**20:.0f} MiB beside its {context} MiB context")
