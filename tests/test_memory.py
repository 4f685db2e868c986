"""The README's memory claims, measured as the process's resident memory (RSS) in a fresh
process: a load needs a few chunks beyond what the tiers hold, whatever the model size;
the in-process tier holds at most 1.5× the raw key and vector bytes.

Anonymous RSS (`RssAnon`: heap and anonymous mappings; the page cache of the model
files and of RocksDB's own files is the kernel's and is left out) is sampled every few
milliseconds while the model loads, in a subprocess that does nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_table

ROOT = Path(__file__).resolve().parents[1]
N, DIM, CHUNK = 100_000, 256, 2 << 20
RAW = N * (8 + 4 * DIM)  # 98 MiB of keys and vectors

PROBE = """
import json, sys, threading
from hps.server import HierarchicalParameterServer

def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

config, chunk = json.loads(sys.argv[1]), int(sys.argv[2])
server = HierarchicalParameterServer(config, load=False, chunk_bytes=chunk)
before = anon()
peak, stop = [before], threading.Event()

def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon())
        stop.wait(0.002)

sampler = threading.Thread(target=sample)
sampler.start()
server.load_model(server.config.models[0])
stop.set()
sampler.join()
after = anon()
print(json.dumps({"before": before, "peak": max(peak[0], after), "after": after}))
server.close()
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    write_table(folder / "t0", np.arange(N, dtype=np.int64) * 7919,
                rng.standard_normal((N, DIM), dtype=np.float32))
    return folder


def measure(model: Path, volatile: str, persistent: bool) -> dict[str, int]:
    config = {
        "models": [{"model": "big", "sparse_files": [str(model / "t0")],
                    "embedding_vecsize_per_table": [DIM],
                    "maxnum_catfeature_query_per_table_per_sample": [1],
                    "deployed_device_list": [0], "gpucache": False}],
        "volatile_db": {"type": volatile},
        "persistent_db": ({"type": "rocks_db", "path": str(model / f"db-{volatile}")}
                          if persistent else {"type": "disabled"}),
    }
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(config), str(CHUNK)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_load_needs_a_few_chunks_beyond_what_the_tiers_hold(model: Path) -> None:
    """RocksDB alone: the peak during the load exceeds what stays after it (RocksDB's
    write buffers and table metadata) by a few chunks, for a model 49× the chunk."""
    rss = measure(model, "disabled", persistent=True)
    transient = rss["peak"] - rss["after"]
    assert transient <= 6 * CHUNK, (
        f"peak {rss['peak'] / 2**20:.0f} MiB, after {rss['after'] / 2**20:.0f} MiB: "
        f"{transient / 2**20:.1f} MiB beyond what RocksDB keeps, chunks of "
        f"{CHUNK / 2**20:.0f} MiB, model {RAW / 2**20:.0f} MiB")


def test_the_in_process_tier_holds_at_most_1_5x_the_raw_bytes(model: Path) -> None:
    rss = measure(model, "hash_map", persistent=False)
    held = rss["after"] - rss["before"]
    assert held <= 1.5 * RAW, f"{held / 2**20:.0f} MiB for {RAW / 2**20:.0f} MiB raw"
    assert rss["peak"] - rss["after"] <= 6 * CHUNK
