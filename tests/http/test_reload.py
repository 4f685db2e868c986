"""POST /v1/models/{model}/reload: re-read the files, swap atomically, keep serving on failure."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_table
from tests.http.conftest import DIMS, MODEL, TABLE_NAMES, Live, start, write_model


@pytest.fixture
def live_own(tmp_path: Path) -> Iterator[Live]:
    """A server over a model of the test's own (the test rewrites its files); reloads may
    read anywhere under tmp_path (http.allowed_sources)."""
    model = write_model(tmp_path / "v1", seed=5)
    model.config["http"] = {"allowed_sources": [str(tmp_path)]}
    yield from start(model)


def _vectors(live: Live, table: int, keys: np.ndarray) -> np.ndarray:
    answer = live.lookup_binary(table, keys)
    assert answer.status_code == 200, answer.text
    return np.frombuffer(answer.content, "<f4").reshape(len(keys), DIMS[table])


def test_reload_rereads_the_files(live_own: Live) -> None:
    keys = live_own.model.keys[0][:20]
    np.testing.assert_array_equal(_vectors(live_own, 0, keys), live_own.model.vectors[0][:20])
    loads = live_own.metric("hps_model_loads_total", model=MODEL)
    assert loads == 1.0  # the first load
    new = live_own.model.vectors[0] + 1.0
    write_table(live_own.model.dir / TABLE_NAMES[0], live_own.model.keys[0], new)
    answer = live_own.client.post(f"/v1/models/{MODEL}/reload")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == MODEL
    assert [t["name"] for t in body["tables"]] == TABLE_NAMES
    assert body["tables"][0]["source"]["uri"] == str(live_own.model.dir / TABLE_NAMES[0])
    np.testing.assert_array_equal(_vectors(live_own, 0, keys), new[:20])
    assert live_own.metric("hps_model_loads_total", model=MODEL) == loads + 1


def test_reload_from_new_uris(live_own: Live, tmp_path: Path) -> None:
    v2 = write_model(tmp_path / "v2", seed=6)
    files = [str(v2.dir / t) for t in TABLE_NAMES]
    answer = live_own.client.post(f"/v1/models/{MODEL}/reload", json={"sparse_files": files})
    assert answer.status_code == 200, answer.text
    assert [t["source"]["uri"] for t in answer.json()["tables"]] == files
    np.testing.assert_array_equal(_vectors(live_own, 1, v2.keys[1][:9]), v2.vectors[1][:9])
    info = live_own.client.get(f"/v1/models/{MODEL}").json()
    assert [t["source"]["uri"] for t in info["tables"]] == files
    # a plain reload keeps the new sources
    assert live_own.client.post(f"/v1/models/{MODEL}/reload").json()["tables"][1][
        "source"]["uri"] == files[1]


@pytest.mark.parametrize(("files", "status", "kind"), [
    (["/nowhere/a", "/nowhere/b"], 403, "forbidden"),
    # missing, under a root: one answer whatever form names the path (test_admin.py)
    (["{tmp}/nowhere/a", "{tmp}/nowhere/b"], 404, "source_not_found"),
    (["only-one"], 422, "config"),
    (["relative/a", "relative/b"], 422, "config"),
])
def test_failed_reload_keeps_the_old_version(live_own: Live, files: list[str], status: int,
                                             kind: str, tmp_path: Path) -> None:
    keys = live_own.model.keys[1][:7]
    loads = live_own.metric("hps_model_loads_total", model=MODEL)
    files = [f.format(tmp=tmp_path) for f in files]
    answer = live_own.client.post(f"/v1/models/{MODEL}/reload", json={"sparse_files": files})
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["kind"] == kind
    assert live_own.metric("hps_model_loads_total", model=MODEL) == loads  # no new version
    np.testing.assert_array_equal(_vectors(live_own, 1, keys), live_own.model.vectors[1][:7])
    assert live_own.client.get("/readyz").status_code == 200


def test_reload_of_truncated_files_is_refused(live_own: Live) -> None:
    vectors = live_own.model.dir / TABLE_NAMES[1] / "emb_vector"
    vectors.write_bytes(vectors.read_bytes()[:-4])
    answer = live_own.client.post(f"/v1/models/{MODEL}/reload")
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["kind"] == "model_file"
    keys = live_own.model.keys[1][-3:]
    np.testing.assert_array_equal(_vectors(live_own, 1, keys), live_own.model.vectors[1][-3:])


def test_bad_reload_body(live_own: Live) -> None:
    answer = live_own.client.post(f"/v1/models/{MODEL}/reload", json={"sparse": []})
    assert answer.status_code == 422
    assert answer.json()["error"]["kind"] == "bad_request"


def test_reloads_back_to_back_keep_the_model_served(live_own: Live, tmp_path: Path) -> None:
    """Reloads within 2 s of each other keep the tables being served (a fixed drop timer
    would delete them: every lookup 404 while /readyz said 200). A version is dropped when
    no lookup holds it, so any number of reloads in a row keep serving the latest."""
    versions = [write_model(tmp_path / f"v{i}", seed=20 + i) for i in range(3)]
    for round_ in range(6):
        v = versions[round_ % 3]
        files = [str(v.dir / t) for t in TABLE_NAMES]
        answer = live_own.client.post(f"/v1/models/{MODEL}/reload",
                                      json={"sparse_files": files})
        assert answer.status_code == 200, answer.text
        for table in (0, 1):
            keys = v.keys[table][:50]
            np.testing.assert_array_equal(_vectors(live_own, table, keys),
                                          v.vectors[table][:50])
    assert live_own.client.get("/readyz").status_code == 200
    assert live_own.server.wait_retired(timeout=30)
    served = sorted(t.storage_name for t in live_own.server.model(MODEL).tables)
    assert sorted(live_own.server.volatile.tables()) == served


def test_reload_from_other_formats(live_own: Live, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    v2 = write_model(tmp_path / "v2", seed=7)
    keys0, rows0 = v2.keys[0], v2.vectors[0]
    column = pa.FixedSizeListArray.from_arrays(pa.array(rows0.reshape(-1)), DIMS[0])
    pq.write_table(pa.table({"id": keys0, "emb": column}), tmp_path / "t0.parquet")
    np.savez(tmp_path / "t1.npz", keys=v2.keys[1], vectors=v2.vectors[1])
    files = [{"path": str(tmp_path / "t0.parquet"), "key_column": "id", "vector_column": "emb"},
             str(tmp_path / "t1.npz")]
    answer = live_own.client.post(f"/v1/models/{MODEL}/reload", json={"sparse_files": files})
    assert answer.status_code == 200, answer.text
    assert [t["source"]["uri"] for t in answer.json()["tables"]] == [
        str(tmp_path / "t0.parquet"), str(tmp_path / "t1.npz")]
    np.testing.assert_array_equal(_vectors(live_own, 0, keys0[:11]), rows0[:11])
    np.testing.assert_array_equal(_vectors(live_own, 1, v2.keys[1][-5:]), v2.vectors[1][-5:])
    for bad, message in (({"path": "/x.parquet", "key_colum": "id"}, "unknown key(s) key_colum"),
                         ({"path": "/x.parquet", "tensor": "w", "format": "parquet"},
                          "tensor do(es) not apply to format 'parquet'")):
        refused = live_own.client.post(f"/v1/models/{MODEL}/reload",
                                       json={"sparse_files": [bad, files[1]]})
        assert refused.status_code == 422 and refused.json()["error"]["kind"] == "config"
        assert message in refused.text
    outside = live_own.client.post(f"/v1/models/{MODEL}/reload", json={"sparse_files": [
        {"path": "/etc/t0.parquet", "key_column": "id"}, files[1]]})
    assert outside.status_code == 403, outside.text  # objects meet the allowed roots too
    np.testing.assert_array_equal(_vectors(live_own, 0, keys0[:11]), rows0[:11])


def test_a_reload_without_sources_reads_the_config_file_again(tmp_path: Path) -> None:
    """A server started from a config file: a plain reload loads the model's block of
    the file as it is now; sources a reload body named persist over the file's; a file
    that is no valid config now is a 422 naming it, and the served version stays."""
    model = write_model(tmp_path / "v1", seed=5)
    model.config["http"] = {"allowed_sources": [str(tmp_path)]}
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(model.config))
    v2, v3 = write_model(tmp_path / "v2", seed=6), write_model(tmp_path / "v3", seed=7)
    for live in start(model, config_file=str(path)):
        # the file names other folders and another default value: the reload reads both
        edited = json.loads(path.read_text())
        edited["models"][0]["sparse_files"] = [str(v2.dir / t) for t in TABLE_NAMES]
        edited["models"][0]["default_value_for_each_table"] = [7.0, 7.0]
        path.write_text(json.dumps(edited))
        answer = live.client.post(f"/v1/models/{MODEL}/reload")
        assert answer.status_code == 200, answer.text
        assert [t["source"]["uri"] for t in answer.json()["tables"]] == \
            edited["models"][0]["sparse_files"]
        np.testing.assert_array_equal(_vectors(live, 1, v2.keys[1][:5]), v2.vectors[1][:5])
        assert (_vectors(live, 0, np.array([-(2**62) + 1])) == 7.0).all()
        # sources a body names persist over the file's
        named = [str(v3.dir / t) for t in TABLE_NAMES]
        assert live.client.post(f"/v1/models/{MODEL}/reload",
                                json={"sparse_files": named}).status_code == 200
        again = live.client.post(f"/v1/models/{MODEL}/reload")
        assert [t["source"]["uri"] for t in again.json()["tables"]] == named
        # a file broken since: 422 naming it, the version served stays
        path.write_text('{"models": [')
        broken = live.client.post(f"/v1/models/{MODEL}/reload")
        assert broken.status_code == 422, broken.text
        assert str(path) in broken.json()["error"]["message"]
        np.testing.assert_array_equal(_vectors(live, 1, v3.keys[1][:5]), v3.vectors[1][:5])
