"""Models added or reloaded over HTTP are read beneath the allowed roots by open file
descriptors: a file linked out of its folder is refused without a word about it (when
the model is added, and when a plain reload reads its files again), and a linked folder
swapped between inside and outside targets while adds run never serves data from
outside."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.http.conftest import DIMS, MODEL, TABLE_NAMES, Live, ModelFiles, start, write_model

SMALL = (300, 200)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Live]:
    yield from start(write_model(tmp_path / "models" / "m", seed=3, sizes=SMALL),
                     allow_roots=[str(tmp_path / "models")])


def _block(files: ModelFiles, name: str, sparse_files: list[str]) -> dict[str, Any]:
    return {**files.config["models"][0], "model": name, "sparse_files": sparse_files}


def linked_out(tmp_path: Path) -> tuple[ModelFiles, Path]:
    """A model outside the root (its emb_vector files mode 600) and a folder inside the
    root whose key files are copies and whose emb_vector files link to the outside ones."""
    outside = write_model(tmp_path / "elsewhere", seed=9, sizes=SMALL)
    inside = tmp_path / "models" / "sneaky"
    for table in TABLE_NAMES:
        (inside / table).mkdir(parents=True)
        shutil.copy(outside.dir / table / "key", inside / table / "key")
        os.chmod(outside.dir / table / "emb_vector", 0o600)
        (inside / table / "emb_vector").symlink_to(outside.dir / table / "emb_vector")
    return outside, inside


def _sizes(files: ModelFiles) -> list[str]:
    return [str(os.path.getsize(files.dir / t / "emb_vector")) for t in TABLE_NAMES]


def test_a_file_linked_out_of_its_folder_is_refused(served: Live, tmp_path: Path) -> None:
    outside, inside = linked_out(tmp_path)
    files = [str(inside / t) for t in TABLE_NAMES]
    added = served.client.post("/v1/models", json=_block(outside, "sneaky", files))
    reloaded = served.client.post(f"/v1/models/{MODEL}/reload", json={"sparse_files": files})
    for answer in (added, reloaded):
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["kind"] == "source_access"
        assert not any(size in answer.text for size in _sizes(outside))
    assert [m["model"] for m in served.client.get("/v1/models").json()["models"]] == [MODEL]
    keys = served.model.keys[0][:50]
    assert np.array_equal(np.frombuffer(served.lookup_binary(0, keys).content, "<f4")
                          .reshape(-1, DIMS[0]), served.model.expected(0, keys))


def test_the_config_s_own_links_are_trusted(tmp_path: Path) -> None:
    """Startup models are the operator's: a link out of the roots is read as before."""
    outside, inside = linked_out(tmp_path)
    trusted = write_model(tmp_path / "models" / "m", seed=3, sizes=SMALL)
    trusted.config["models"][0]["sparse_files"] = [str(inside / t) for t in TABLE_NAMES]
    for live in start(trusted, allow_roots=[str(tmp_path / "models")]):
        keys = outside.keys[1][:20]
        got = np.frombuffer(live.lookup_binary(1, keys).content, "<f4").reshape(-1, DIMS[1])
        assert np.array_equal(got, outside.vectors[1][:20])
        reloaded = live.client.post(f"/v1/models/{MODEL}/reload")  # so is a plain reload
        assert reloaded.status_code == 200, reloaded.text


def link_out(folder: Path, outside: ModelFiles, names: tuple[str, ...]) -> None:
    """Replace the files `names` of each table of `folder` by links to `outside`'s (mode
    600): what a file swapped after a model was added looks like."""
    for table in TABLE_NAMES:
        for name in names:
            os.chmod(outside.dir / table / name, 0o600)
            (folder / table / name).unlink()
            (folder / table / name).symlink_to(outside.dir / table / name)


def test_a_plain_reload_of_an_added_model_stays_beneath_the_root(served: Live,
                                                                  tmp_path: Path) -> None:
    """The files a request named are read beneath the root again by a reload that names
    none: a vector file swapped for a link out (same size) is refused, not served."""
    inside = write_model(tmp_path / "models" / "added", seed=5, sizes=SMALL)
    outside = write_model(tmp_path / "elsewhere", seed=9, sizes=SMALL)
    files = [str(inside.dir / t) for t in TABLE_NAMES]
    assert served.client.post("/v1/models", json=_block(inside, "added", files)
                              ).status_code == 201
    link_out(inside.dir, outside, ("emb_vector",))
    for body in ({}, {"json": {}}):
        answer = served.client.post("/v1/models/added/reload", **body)
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["kind"] == "source_access"
        assert not any(size in answer.text for size in _sizes(outside))
    for table in (0, 1):  # the version read before the swap serves on
        keys = inside.keys[table][:50]
        got = served.lookup_binary(table, keys, model="added")
        assert got.status_code == 200, got.text
        assert np.array_equal(np.frombuffer(got.content, "<f4").reshape(-1, DIMS[table]),
                              inside.expected(table, keys))


def test_swapping_a_linked_folder_never_serves_outside_data(served: Live,
                                                            tmp_path: Path) -> None:
    inside = write_model(tmp_path / "models" / "in", seed=5, sizes=SMALL)
    outside = write_model(tmp_path / "elsewhere", seed=9, sizes=SMALL)
    swing = tmp_path / "models" / "swing"
    swing.symlink_to("in")
    stop = threading.Event()

    def flip() -> None:
        targets = [str(outside.dir), "in"]
        i = 0
        while not stop.is_set():
            fresh = tmp_path / "models" / f".swing{i % 2}"
            fresh.symlink_to(targets[i % 2])
            os.replace(fresh, swing)  # atomic: the link always exists
            i += 1

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    statuses: dict[int, int] = {}
    served_rows = 0
    try:
        files = [str(swing / t) for t in TABLE_NAMES]
        ends = time.monotonic() + 4.0
        while time.monotonic() < ends or not statuses.get(201):
            answer = served.client.post("/v1/models", json=_block(inside, "swing", files))
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
            assert answer.status_code in (201, 403, 404), answer.text
            if answer.status_code == 201:
                for table in (0, 1):
                    keys = np.concatenate([inside.keys[table][:40], outside.keys[table][:40]])
                    got = served.lookup_binary(table, keys, model="swing")
                    assert got.status_code == 200, got.text
                    assert np.array_equal(np.frombuffer(got.content, "<f4")
                                          .reshape(-1, DIMS[table]),
                                          inside.expected(table, keys))
                    served_rows += keys.size
                assert served.client.delete("/v1/models/swing").status_code == 200
            assert time.monotonic() < ends + 30, statuses
    finally:
        stop.set()
        flipper.join(timeout=10)
    assert served_rows and statuses.get(403), statuses
