"""Models added and removed at runtime (POST /v1/models, DELETE /v1/models/{model}, `hps
models`), while the other models keep serving; memory of a removed model is returned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from tests.conftest import make_table, write_table
from tests.http.conftest import DIMS, MODEL, TABLE_NAMES, Live, ModelFiles, start, write_model
from tests.support.redis_servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def _block(files: ModelFiles, name: str) -> dict[str, Any]:
    return {**files.config["models"][0], "model": name}


@pytest.fixture
def roots(tmp_path: Path) -> tuple[ModelFiles, ModelFiles]:
    """The served model and one more, both under tmp_path/models (the allowed root)."""
    return (write_model(tmp_path / "models" / "m", seed=3),
            write_model(tmp_path / "models" / "extra", seed=4))


@pytest.fixture
def live_admin(roots: tuple[ModelFiles, ModelFiles], tmp_path: Path) -> Iterator[Live]:
    yield from start(roots[0], allow_roots=[str(tmp_path / "models")])


def _rows(live: Live, model: str, table: int, keys: np.ndarray) -> np.ndarray:
    answer = live.client.post(f"/v1/models/{model}/tables/{table}/lookup",
                              content=keys.astype("<i8").tobytes(),
                              headers={"Content-Type": "application/octet-stream"})
    assert answer.status_code == 200, answer.text
    return np.frombuffer(answer.content, "<f4").reshape(keys.size, DIMS[table])


class Reader:
    """Looks up model `m` in a loop from a thread, checking every answer."""

    def __init__(self, live: Live) -> None:
        self.live, self.done, self.errors, self.count = live, threading.Event(), [], 0
        self.answered = threading.Event()  # its first answer came: it reads throughout
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        # on a loaded machine the add and remove below can finish before the thread's
        # first request does: then nothing would be read while they run
        assert self.answered.wait(30), "the reader got no answer"

    def _run(self) -> None:
        keys = self.live.model.keys[1][:200]
        with httpx.Client(base_url=self.live.url, timeout=30) as client:
            while not self.done.is_set():
                answer = client.post(f"/v1/models/{MODEL}/tables/1/lookup",
                                     content=keys.astype("<i8").tobytes(),
                                     headers={"Content-Type": "application/octet-stream"})
                got = np.frombuffer(answer.content, "<f4") if answer.status_code == 200 else None
                if got is None or not np.array_equal(got.reshape(-1, DIMS[1]),
                                                     self.live.model.vectors[1][:200]):
                    self.errors.append(answer.text[:200])
                self.count += 1
                self.answered.set()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)
        assert self.count > 0 and not self.errors, self.errors[:3]


def test_add_and_remove_while_the_other_model_serves(
        live_admin: Live, roots: tuple[ModelFiles, ModelFiles]) -> None:
    extra = roots[1]
    reader = Reader(live_admin)
    try:
        answer = live_admin.client.post("/v1/models", json=_block(extra, "extra"))
        assert answer.status_code == 201, answer.text
        assert [t["name"] for t in answer.json()["tables"]] == TABLE_NAMES
        keys = extra.keys[1][:50]
        np.testing.assert_array_equal(_rows(live_admin, "extra", 1, keys), extra.vectors[1][:50])
        listed = live_admin.client.get("/v1/models").json()
        assert sorted(m["model"] for m in listed["models"]) == ["extra", MODEL]
        assert live_admin.client.get("/readyz").status_code == 200
        again = live_admin.client.post("/v1/models", json=_block(extra, "extra"))
        assert again.status_code == 409 and again.json()["error"]["kind"] == "model_exists"

        gone = live_admin.client.delete("/v1/models/extra")
        assert gone.status_code == 200 and gone.json() == {"model": "extra", "removed": True}
        missing = live_admin.client.post("/v1/models/extra/tables/0/lookup", json={"keys": [1]})
        assert missing.status_code == 404
        assert live_admin.client.delete("/v1/models/extra").status_code == 404
        assert [m["model"] for m in live_admin.client.get("/v1/models").json()["models"]] == [
            MODEL]
        # added again at once: the new version is served whole, and the removed version's
        # drop does not take its tables
        rewritten = extra.vectors[1] + 2.0
        write_table(extra.dir / TABLE_NAMES[1], extra.keys[1], rewritten)
        assert live_admin.client.post("/v1/models", json=_block(extra, "extra")
                                      ).status_code == 201
        assert live_admin.server.wait_retired(30)
        np.testing.assert_array_equal(_rows(live_admin, "extra", 1, keys), rewritten[:50])
        assert live_admin.client.get("/v2/models/extra/ready").status_code == 200
    finally:
        reader.stop()


def test_two_adds_of_one_name_at_once_one_wins_the_other_gets_409(
        live_admin: Live, roots: tuple[ModelFiles, ModelFiles]) -> None:
    """Both requests pass the route's check before either load is in (the check cannot
    see a load in flight): the loser was refused by the registry with 422 `config`
    ("already served"); it is the 409 `model_exists` the route answers for a taken name."""
    barrier = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def add() -> None:
        with httpx.Client(base_url=live_admin.url, timeout=60) as client:
            barrier.wait()
            answers.append(client.post("/v1/models", json=_block(roots[1], "extra")))

    threads = [threading.Thread(target=add) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    codes = sorted(a.status_code for a in answers)
    assert codes == [201, 409], [a.text for a in answers]
    loser = next(a for a in answers if a.status_code == 409)
    assert loser.json()["error"]["kind"] == "model_exists"
    assert "extra" in loser.json()["error"]["message"]
    keys = roots[1].keys[0][:20]
    np.testing.assert_array_equal(_rows(live_admin, "extra", 0, keys), roots[1].vectors[0][:20])


@pytest.mark.parametrize(("change", "status", "kind"), [
    ({"sparse_files": ["/etc/a", "/etc/b"]}, 403, "forbidden"),
    ({"sparse_files": ["relative/a", "relative/b"]}, 422, "config"),
    ({"gpucachepr": 0.5}, 422, "config"),
    ({"embedding_vecsize_per_table": [8]}, 422, "config"),
    ({"model": "bad name!"}, 422, "config"),
    ({"model": MODEL}, 409, "model_exists"),
])
def test_bad_additions_change_nothing(live_admin: Live, roots: tuple[ModelFiles, ModelFiles],
                                      change: dict[str, Any], status: int, kind: str) -> None:
    answer = live_admin.client.post("/v1/models", json={**_block(roots[1], "extra"), **change})
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["kind"] == kind
    assert [m["model"] for m in live_admin.client.get("/v1/models").json()["models"]] == [MODEL]


def test_escaping_the_root_is_refused(live_admin: Live, roots: tuple[ModelFiles, ModelFiles],
                                      tmp_path: Path) -> None:
    outside = write_model(tmp_path / "elsewhere", seed=9)
    sneaky = [str(roots[1].dir / ".." / ".." / "elsewhere" / t) for t in TABLE_NAMES]
    link = tmp_path / "models" / "link"
    link.symlink_to(outside.dir)
    for files in (sneaky, [str(link / t) for t in TABLE_NAMES]):
        answer = live_admin.client.post("/v1/models", json={**_block(outside, "x"),
                                                            "sparse_files": files})
        assert answer.status_code == 403, answer.text
    assert live_admin.client.post("/v1/models", json=[1]).status_code == 422
    missing = live_admin.client.post("/v1/models", json={
        **_block(roots[1], "x"), "sparse_files": [str(tmp_path / "models" / "no" / t)
                                                  for t in TABLE_NAMES]})
    assert missing.status_code in (404, 422) and missing.json()["error"]["kind"] in (
        "model_file", "source_not_found")


def test_admin_needs_the_token(roots: tuple[ModelFiles, ModelFiles], tmp_path: Path) -> None:
    for live in start(roots[0], token="s3cret", allow_roots=[str(tmp_path / "models")]):
        block = _block(roots[1], "extra")
        assert live.client.post("/v1/models", json=block).status_code == 401
        assert live.client.delete(f"/v1/models/{MODEL}").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert live.client.post("/v1/models", json=block, headers=auth).status_code == 201
        assert live.client.delete("/v1/models/extra", headers=auth).status_code == 200
    for live in start(roots[0], host="0.0.0.0"):  # no token, not loopback: refused
        answer = live.client.post("/v1/models", json=_block(roots[1], "extra"))
        assert answer.status_code == 403 and "token" in answer.json()["error"]["message"]


def _hps(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hps.tools.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_hps_models_cli_and_memory_returned(tmp_path: Path) -> None:
    """`hps models add|list|remove` against `hps serve`; the server's RSS falls back after
    a removal (most of what the model took is returned)."""
    served = write_model(tmp_path / "models" / "m", seed=3)
    rng = np.random.default_rng(5)
    big = tmp_path / "models" / "big"
    keys, vectors = make_table(rng, 400_000, 64)  # 100 MiB of vectors
    write_table(big / "t", keys, vectors)
    (big / "ps.json").write_text(json.dumps({"models": [{
        "model": "big", "sparse_files": ["t"], "embedding_vecsize_per_table": [64],
        "maxnum_catfeature_query_per_table_per_sample": [64], "deployed_device_list": [0],
        "max_batch_size": 16, "gpucache": False}]}))
    config = tmp_path / "ps.json"
    config.write_text(json.dumps(served.config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items() if k != "HPS_TOKEN"},
           "PYTHONPATH": str(ROOT), "COLUMNS": "80", "HPS_URL": url}
    proc = subprocess.Popen([sys.executable, "-m", "hps.tools.cli", "serve", str(config), "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        rss = psutil.Process(proc.pid).memory_info
        before = rss().rss
        added = _hps("models", "add", str(big / "ps.json"), env=env)
        assert added.returncode == 0, added.stderr
        assert "added model big" in added.stdout
        grown = rss().rss
        assert grown - before > 80 << 20  # the model is in the in-process tier
        listed = _hps("models", "list", env=env)
        assert listed.returncode == 0 and "big" in listed.stdout and "400,000" in listed.stdout
        got = httpx.post(f"{url}/v1/models/big/tables/0/lookup", json={"keys": keys[:5].tolist()})
        np.testing.assert_array_equal(np.asarray(got.json()["vectors"], np.float32), vectors[:5])
        removed = _hps("models", "remove", "big", env=env)
        assert removed.returncode == 0 and "removed model big" in removed.stdout
        deadline = time.monotonic() + 30
        while rss().rss - before > 0.3 * (grown - before) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rss().rss - before <= 0.3 * (grown - before), (before, grown, rss().rss)
        again = _hps("models", "remove", "big", env=env)
        assert again.returncode == 2 and "404" in again.stderr and "big" in again.stderr
        outside = _hps("models", "add", str(big / "ps.json"), "--url", "http://127.0.0.1:9",
                       env=env)
        assert outside.returncode == 2 and "no hps server answers" in outside.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_file_uris_and_missing_paths_alike_in_add_and_reload(
        live_admin: Live, roots: tuple[ModelFiles, ModelFiles], tmp_path: Path) -> None:
    """`file:///abs/path` is accepted by adding as by reloading (adding refused it as a
    relative path), and a missing path is one error whatever form names it (it was 422
    `model_file` as a string and 404 `source_not_found` as an object)."""
    uris = [f"file://{roots[1].dir / t}" for t in TABLE_NAMES]
    added = live_admin.client.post("/v1/models", json={**_block(roots[1], "extra"),
                                                       "sparse_files": uris})
    assert added.status_code == 201, added.text
    reloaded = live_admin.client.post("/v1/models/extra/reload", json={"sparse_files": uris})
    assert reloaded.status_code == 200, reloaded.text
    gone = [str(tmp_path / "models" / "no" / t) for t in TABLE_NAMES]
    answers = [
        live_admin.client.post("/v1/models", json={**_block(roots[1], "y"),
                                                   "sparse_files": gone}),
        live_admin.client.post("/v1/models", json={**_block(roots[1], "y"),
                                                   "sparse_files": [{"path": p} for p in gone]}),
        live_admin.client.post(f"/v1/models/{MODEL}/reload", json={"sparse_files": gone}),
        live_admin.client.post(f"/v1/models/{MODEL}/reload",
                               json={"sparse_files": [{"path": p} for p in gone]}),
    ]
    seen = {(a.status_code, a.json()["error"]["kind"]) for a in answers}
    assert seen == {(404, "source_not_found")}, [a.text for a in answers]
