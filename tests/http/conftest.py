"""Fixtures of the HTTP tests: a small model on disk and real uvicorn servers serving it.

Every server here is uvicorn on a free loopback port (`ServerThread`: the socket is bound
before the thread starts, so there is no port race), reached over TCP with httpx.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from hps.http import create_app
from hps.http.serve import ServerThread
from hps.server import HierarchicalParameterServer
from tests.conftest import make_table, model_config, write_table

MODEL = "m"
TABLE_NAMES = ["users", "items"]
DIMS = [8, 64]
DEFAULT_VALUE = 0.5
MAX_KEYS = 1024 * 32  # model_config: max_batch_size 1024 × 32 keys per sample
#: seconds a server may take to say ready: its load runs each lookup path once, which
#: on an empty numba cache (a fresh CI runner) compiles them on a loaded 2-core machine
READY_WAIT = 120.0


@dataclass
class ModelFiles:
    """The model's folder, config and the arrays its files hold (read back from disk)."""

    dir: Path
    config: dict[str, Any]
    keys: list[np.ndarray]
    vectors: list[np.ndarray]

    def expected(self, table: int, keys: np.ndarray) -> np.ndarray:
        """What a lookup must answer: the file's row of each key, else the default."""
        order = np.argsort(self.keys[table])
        sorted_keys = self.keys[table][order]
        pos = np.clip(np.searchsorted(sorted_keys, keys), 0, len(sorted_keys) - 1)
        hit = sorted_keys[pos] == keys
        out = np.full((len(keys), DIMS[table]), DEFAULT_VALUE, dtype=np.float32)
        out[hit] = self.vectors[table][order[pos[hit]]]
        return out

    def sample_keys(self, rng: np.random.Generator, table: int, n: int,
                    unknown: int = 0) -> np.ndarray:
        """`n` keys of the table (with repeats) followed by `unknown` keys it lacks."""
        known = rng.choice(self.keys[table], size=n)
        missing = np.setdiff1d(rng.integers(-(2**62), 2**62, size=unknown + 8),
                               self.keys[table])[:unknown]
        return np.concatenate([known, missing]).astype(np.int64)


def write_model(folder: Path, seed: int = 11, sizes: tuple[int, int] = (3000, 2000)
                ) -> ModelFiles:
    """Two tables (widths 8 and 64) as HugeCTR sparse model folders, plus their config."""
    rng = np.random.default_rng(seed)
    files = []
    for name, n, dim in zip(TABLE_NAMES, sizes, DIMS, strict=True):
        keys, vectors = make_table(rng, n, dim)
        write_table(folder / name, keys, vectors)
        files.append(str(folder / name))
    config = {
        "supportlonglong": True,
        "models": [model_config(files, DIMS, name=MODEL, embedding_table_names=TABLE_NAMES,
                                default_value_for_each_table=[DEFAULT_VALUE] * 2)],
        "volatile_db": {"type": "hash_map", "num_partitions": 4},
    }
    keys = [np.fromfile(folder / t / "key", dtype="<i8") for t in TABLE_NAMES]
    vectors = [np.fromfile(folder / t / "emb_vector", dtype="<f4").reshape(-1, d)
               for t, d in zip(TABLE_NAMES, DIMS, strict=True)]
    return ModelFiles(folder, config, keys, vectors)


@dataclass
class Live:
    """A running server: its base URL, an httpx client on it, the app and the model."""

    url: str
    client: httpx.Client
    app: Any
    server: HierarchicalParameterServer
    model: ModelFiles

    def lookup_binary(self, table: int | str, keys: np.ndarray, model: str = MODEL,
                      **kw: Any) -> httpx.Response:
        return self.client.post(
            f"/v1/models/{model}/tables/{table}/lookup",
            content=np.asarray(keys, dtype="<i8").tobytes(),
            headers={"Content-Type": "application/octet-stream", **kw.pop("headers", {})},
            **kw)

    def lookup_json(self, table: int | str, keys: np.ndarray, **kw: Any) -> httpx.Response:
        return self.client.post(f"/v1/models/{MODEL}/tables/{table}/lookup",
                                json={"keys": np.asarray(keys).tolist()}, **kw)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of GET /metrics (0.0 when absent)."""
        return metric_value(self.client.get("/metrics").text, name, **labels)


def metric_value(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    return write_model(tmp_path_factory.mktemp("http-model"))


def start(model: ModelFiles, **app_options: Any) -> Iterator[Live]:
    """Serve `model` with uvicorn on a free loopback port until the generator closes."""
    server = HierarchicalParameterServer(model.config, load=False)
    app = create_app(server, **app_options)
    thread = ServerThread(app)
    url = thread.start()
    client = httpx.Client(base_url=url, timeout=30)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=READY_WAIT)
        yield Live(url, client, app, server, model)
    finally:
        client.close()
        thread.stop()
        server.close()


#: `with serving(model, **app_options) as live:` — `start` as a context manager
serving = contextlib.contextmanager(start)


@pytest.fixture(scope="module")
def live(model_files: ModelFiles) -> Iterator[Live]:
    """The model served without a token, on loopback (admin routes open)."""
    yield from start(model_files)


@pytest.fixture(scope="module")
def live_workers(model_files: ModelFiles, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Live]:
    """The model served by `hps serve --workers 2` (separate processes: `app` and
    `server` are None), without a token, on loopback."""
    from tests.http.test_workers import serve, stop, write_run

    served = serve(*write_run(tmp_path_factory.mktemp("workers-run"), model_files.config))
    client = httpx.Client(base_url=served.url, timeout=30)
    try:
        yield Live(served.url, client, None, None, model_files)  # type: ignore[arg-type]
    finally:
        client.close()
        stop(served)


@pytest.fixture(scope="module")
def live_token(model_files: ModelFiles) -> Iterator[Live]:
    """The model served with token 's3cret'."""
    yield from start(model_files, token="s3cret")
