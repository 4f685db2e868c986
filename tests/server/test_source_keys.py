"""Every error about a file or folder a config names says which key named it
(`models[1].sparse_files[1]`): for local files of every format, S3 (moto's server over
HTTP) and HDFS (WebHDFS), missing and cut short alike; and a model added or a reload
body says `sparse_files[i]` of its model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.config import parse_model_block
from hps.errors import ModelFileError, SourceError, SourceNotFoundError
from hps.server import HierarchicalParameterServer
from tests.conftest import write_table
from tests.modelfiles.test_hdfs import FakeWebHdfs, _put_model, webhdfs  # noqa: F401
from tests.support.s3_server import S3Server

KEYS = np.arange(100, dtype=np.int64)
ROWS = np.ones((100, 4), np.float32)


def _config(tmp_path: Path, broken: Any, **top: Any) -> dict[str, Any]:
    """Two models, the second's second table `broken`: the key is models[1].sparse_files[1]."""
    write_table(tmp_path / "good", KEYS, ROWS)
    good = str(tmp_path / "good")

    def block(name: str, files: list[Any]) -> dict[str, Any]:
        return {"model": name, "sparse_files": files, "embedding_table_names": ["a", "b"],
                "embedding_vecsize_per_table": [4, 4], "gpucache": False,
                "maxnum_catfeature_query_per_table_per_sample": [2, 2]}

    return {"models": [block("first", [good, good]), block("second", [good, broken])],
            "volatile_db": {"type": "hash_map"}, **top}


@dataclass
class Refusal:
    kind: type[BaseException]
    message: str


def _refusal(config: dict[str, Any], tmp_path: Path) -> Refusal:
    """What starting a server on `config`, written to a file, raises."""
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    with pytest.raises((SourceError, ModelFileError)) as refused:
        HierarchicalParameterServer(str(path))
    return Refusal(type(refused.value), str(refused.value))


def _write_truncated_sparse(folder: Path) -> None:
    write_table(folder, KEYS, ROWS)
    data = (folder / "emb_vector").read_bytes()
    (folder / "emb_vector").write_bytes(data[:-8])


def _write_bad(tmp_path: Path, name: str) -> Any:
    """An entry of sparse_files that is broken in the way `name` says."""
    where = tmp_path / "broken"
    if name == "missing folder":
        return str(tmp_path / "itmes")
    if name == "cut short":
        _write_truncated_sparse(where)
        return str(where)
    if name == "parquet":
        return str(tmp_path / "items.parquet")
    if name == "numpy":
        where.mkdir()
        np.save(where / "keys.npy", KEYS)  # no vectors.npy beside it
        return {"path": str(where), "format": "numpy"}
    if name == "safetensors":
        (tmp_path / "t.safetensors").write_bytes(b"not safetensors at all")
        return str(tmp_path / "t.safetensors")
    if name == "torch":
        return str(tmp_path / "model.pt")
    if name == "dcp":
        return {"path": str(tmp_path / "ckpt"), "format": "dcp"}
    raise AssertionError(name)


@pytest.mark.parametrize("case", ["missing folder", "cut short", "parquet", "numpy",
                                  "safetensors", "torch", "dcp"])
def test_a_local_file_error_names_the_config_key(tmp_path: Path, case: str) -> None:
    refused = _refusal(_config(tmp_path, _write_bad(tmp_path, case)), tmp_path)
    assert refused.message.startswith("models[1].sparse_files[1]: "), refused.message
    assert refused.message.count("sparse_files[") == 1, refused.message


def test_the_key_comes_before_what_the_modelfiles_say(tmp_path: Path) -> None:
    refused = _refusal(_config(tmp_path, str(tmp_path / "itmes")), tmp_path)
    assert refused.kind is SourceNotFoundError
    assert refused.message == (f"models[1].sparse_files[1]: sparse folder "
                               f"'{tmp_path / 'itmes'}' does not exist")


def test_s3_errors_name_the_config_key(s3_server: S3Server, tmp_path: Path) -> None:
    bucket = s3_server.new_bucket()
    s3_server.put_model(bucket, "m/cut", KEYS, ROWS)
    s3 = s3_server.client()
    body = s3.get_object(Bucket=bucket, Key="m/cut/emb_vector")["Body"].read()
    s3.put_object(Bucket=bucket, Key="m/cut/emb_vector", Body=body[:-8])
    for uri in (f"s3://{bucket}/m/none", f"s3://{bucket}/m/cut", "s3://no-such-bucket/m"):
        refused = _refusal(_config(tmp_path, uri, s3_endpoint=s3_server.endpoint), tmp_path)
        assert refused.message.startswith("models[1].sparse_files[1]: "), refused.message
        assert uri in refused.message, refused.message


def test_hdfs_errors_name_the_config_key(webhdfs: FakeWebHdfs,  # noqa: F811
                                         tmp_path: Path) -> None:
    _put_model(webhdfs, "/models/cut", KEYS, ROWS)
    webhdfs.put("/models/cut/emb_vector", ROWS.tobytes()[:-8])
    for folder in ("/models/none", "/models/cut"):
        uri = f"webhdfs://127.0.0.1:{webhdfs.port}{folder}"
        refused = _refusal(_config(tmp_path, uri), tmp_path)
        assert refused.message.startswith("models[1].sparse_files[1]: "), refused.message


def test_a_model_added_or_reloaded_names_its_own_key(tmp_path: Path) -> None:
    config = _config(tmp_path, str(tmp_path / "good"))
    with HierarchicalParameterServer(config) as server:
        with pytest.raises(SourceNotFoundError) as reloaded:
            server.reload_model("second", sparse_files=[str(tmp_path / "good"),
                                                        str(tmp_path / "gone")])
        assert str(reloaded.value).startswith("sparse_files[1] of model 'second': ")
        added = {**config["models"][0], "model": "third",
                 "sparse_files": [str(tmp_path / "gone"), str(tmp_path / "good")]}
        with pytest.raises(SourceNotFoundError) as refused:
            server.add_model(parse_model_block(added))
        assert str(refused.value).startswith("sparse_files[0] of model 'third': ")
