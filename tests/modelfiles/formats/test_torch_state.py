"""`torch.save` state_dicts (nn.Embedding, nn.EmbeddingBag, TorchRec-style keys) read
without unpickling anything but tensors, served through HPS.lookup locally and from S3;
`hps inspect` / `hps convert` on them; what is not plain tensors is refused."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from hps import HPS
from hps.errors import ModelFileError, UnsupportedFormatError
from hps.modelfiles.formats import open_model
from hps.modelfiles.formats.spec import TableSpec
from tests.modelfiles.formats.conftest import assert_loads_nothing, assert_served, ps_config, upload
from tests.support.s3_server import S3Server
from tests.tools.test_cli import hps


class Model(torch.nn.Module):
    """An nn.Embedding, an nn.EmbeddingBag and an EmbeddingBagCollection's key layout."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(3000, 8, dtype=dtype)
        self.bag = torch.nn.EmbeddingBag(500, 16, dtype=dtype)
        self.ebc = torch.nn.Module()
        self.ebc.embedding_bags = torch.nn.ModuleDict(
            {"t_user": torch.nn.EmbeddingBag(700, 4, dtype=dtype)})
        self.dense = torch.nn.Linear(8, 2)
        for p in self.parameters():
            torch.nn.init.normal_(p)


def rows(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_state_dict_tables_chosen_by_key(tmp_path: Path, dtype: torch.dtype) -> None:
    model = Model(dtype)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    for key, table in [("embedding.weight", model.embedding), ("bag.weight", model.bag),
                       ("ebc.embedding_bags.t_user.weight", model.ebc.embedding_bags["t_user"])]:
        spec = TableSpec(path=str(tmp_path / "model.pt"), tensor=key, key_offset=10)
        with open_model(spec) as reader:
            assert (reader.format, reader.tensor, reader.num_keys) == ("torch", key,
                                                                        table.weight.shape[0])
            got = list(reader.chunks(chunk_keys=111))
        keys = np.concatenate([k for k, _ in got])
        np.testing.assert_array_equal(keys, np.arange(10, 10 + table.weight.shape[0]))
        np.testing.assert_array_equal(np.concatenate([r for _, r in got]), rows(table.weight))


def test_served_exactly_locally(tmp_path: Path) -> None:
    model = Model()
    torch.save(model.state_dict(), tmp_path / "model.pth")
    entry = {"path": str(tmp_path / "model.pth"), "tensor": "embedding.weight",
             "key_offset": 1000}
    assert_served(ps_config(tmp_path, entry, 8), np.arange(1000, 4000, dtype=np.int64),
                  rows(model.embedding.weight))


def test_one_embedding_module_takes_its_only_matrix(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(2500, 4)
    torch.save(emb.state_dict(), tmp_path / "emb.pt")
    assert_served(ps_config(tmp_path, str(tmp_path / "emb.pt"), 4),
                  np.arange(2500, dtype=np.int64), rows(emb.weight))


def test_nested_checkpoint_and_keys_tensor(tmp_path: Path) -> None:
    weight = torch.randn(300, 4)
    keys = torch.randperm(10_000)[:300].to(torch.int64) * 7
    torch.save({"epoch": 3, "model": {"w": weight, "ids": keys}, "lr": 0.1},
               tmp_path / "ckpt.ckpt")
    entry = {"path": str(tmp_path / "ckpt.ckpt"), "tensor": "model.w",
             "keys_tensor": "model.ids"}
    assert_served(ps_config(tmp_path, entry, 4), keys.numpy(), weight.numpy())


def test_served_from_s3(tmp_path: Path, s3_server: S3Server) -> None:
    model = Model()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    s3_server.client().create_bucket(Bucket="torch")
    upload(s3_server, "torch", tmp_path / "model.pt", "m/model.pt")
    entry = {"path": "s3://torch/m/model.pt", "tensor": "bag.weight"}
    assert_served(ps_config(tmp_path, entry, 16, s3=s3_server), np.arange(500, dtype=np.int64),
                  rows(model.bag.weight))


def test_many_matrices_without_a_name_are_refused_with_the_list(tmp_path: Path) -> None:
    torch.save(Model().state_dict(), tmp_path / "model.pt")
    assert_loads_nothing(tmp_path, str(tmp_path / "model.pt"), 8,
                         r"cannot tell which tensor holds the rows .*embedding\.weight \[3000, 8\]")
    assert_loads_nothing(tmp_path, {"path": str(tmp_path / "model.pt"), "tensor": "nope"}, 8,
                         r"has no tensor 'nope' \(tensors: .*bag\.weight")


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_objects_other_than_tensors_are_refused(tmp_path: Path) -> None:
    torch.save({"weight": torch.zeros(10, 4), "evil": Evil()}, tmp_path / "evil.pt")
    assert_loads_nothing(tmp_path, str(tmp_path / "evil.pt"), 4,
                         r"evil\.pt: holds a (__builtin__|builtins)\.print object; "
                         "hps reads only plain tensors")
    torch.save(torch.nn.Embedding(10, 4), tmp_path / "module.pt")  # a whole module pickled
    assert_loads_nothing(tmp_path, str(tmp_path / "module.pt"), 4,
                         r"holds a torch\.nn\.modules\.sparse\.Embedding object")


def test_views_and_wrong_shapes_are_refused(tmp_path: Path) -> None:
    torch.save({"weight": torch.randn(4, 10).t()}, tmp_path / "t.pt")
    assert_loads_nothing(tmp_path, str(tmp_path / "t.pt"), 4,
                         r"strides \[1, 10\] \(a transposed or sliced view\): save it "
                         r"`\.contiguous\(\)`")
    torch.save({"weight": torch.randn(10, 4, dtype=torch.float64)}, tmp_path / "f64.pt")
    assert_loads_nothing(tmp_path, str(tmp_path / "f64.pt"), 4, "rows must be F32, F16 or BF16")
    torch.save({"weight": torch.randn(10, 4)}, tmp_path / "w.pt")
    assert_loads_nothing(tmp_path, str(tmp_path / "w.pt"), 8, "rows are 4 wide but")


def test_broken_files_are_refused(tmp_path: Path) -> None:
    torch.save({"weight": torch.randn(100, 4)}, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    assert_loads_nothing(tmp_path, str(tmp_path / "cut.pt"), 4, "not a torch.save file")
    (tmp_path / "raw.pt").write_bytes(pickle.dumps({"weight": [1.0]}))
    assert_loads_nothing(tmp_path, str(tmp_path / "raw.pt"), 4,
                         r"is a pickled PyTorch file; hps does not unpickle .*pre-1\.6",
                         error=UnsupportedFormatError)
    with pytest.raises(UnsupportedFormatError, match="hps convert reads torch but does not"):
        from hps.modelfiles.formats import open_writer

        open_writer(str(tmp_path / "out.pt"), None, 1, 1)
    with pytest.raises(ModelFileError, match="not a torch.save file"):
        open_model(str(tmp_path / "cut.pt"))


def test_inspect_and_convert(tmp_path: Path) -> None:
    model = Model()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    shown = hps("inspect", str(tmp_path / "model.pt"), "--tensor", "embedding.weight")
    assert shown.returncode == 0, shown.stderr
    assert "torch" in shown.stdout and "3,000" in shown.stdout
    done = hps("convert", str(tmp_path / "model.pt"), str(tmp_path / "out.safetensors"),
               "--tensor", "ebc.embedding_bags.t_user.weight", "--key-offset", "5")
    assert done.returncode == 0, done.stderr
    with open_model(str(tmp_path / "out.safetensors")) as reader:
        ((keys, got),) = list(reader.chunks(chunk_keys=10_000))
    np.testing.assert_array_equal(keys, np.arange(5, 705))
    np.testing.assert_array_equal(got, rows(model.ebc.embedding_bags["t_user"].weight))


def test_config_from_torch_serves_every_table(tmp_path: Path) -> None:
    model = Model()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    made = hps("config", "from-torch", str(tmp_path / "model.pt"), "--model", "m",
               "--stacked-keys", "--keys-per-sample", "64")
    assert made.returncode == 0, made.stderr
    block = json.loads(made.stdout)
    (entry,) = block["models"]
    # "bag" does not say it is an embedding: only the named ones are guessed
    assert entry["embedding_table_names"] == ["embedding", "t_user"]
    assert entry["embedding_vecsize_per_table"] == [8, 4]
    assert [f["key_offset"] for f in entry["sparse_files"]] == [0, 3000]
    config = {**block, "volatile_db": {"type": "hash_map"}}
    entry["gpucache"] = False
    with HPS(config) as server:
        np.testing.assert_array_equal(server.lookup(np.arange(3000), "m", 0),
                                      rows(model.embedding.weight))
        np.testing.assert_array_equal(server.lookup(np.arange(3000, 3700), "m", 1),
                                      rows(model.ebc.embedding_bags["t_user"].weight))
    named = hps("config", "from-torch", str(tmp_path / "model.pt"), "-t", "bag.weight")
    assert json.loads(named.stdout)["models"][0]["embedding_table_names"] == ["bag"]
    wrong = hps("config", "from-torch", str(tmp_path / "model.pt"), "-t", "dense.bias")
    assert wrong.returncode == 2 and "'dense.bias' is not a 2-D tensor" in wrong.stderr
