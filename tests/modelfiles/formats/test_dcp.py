"""torch.distributed.checkpoint folders written by real 2-process saves (gloo on
loopback, torch.multiprocessing spawn): tables sharded row-wise and column-wise over the
ranks, and one on a single rank, reassembled while streaming and served exactly through
HPS.lookup, locally and from S3; `hps inspect` / `hps convert` on them; bad checkpoints
refused."""

from __future__ import annotations

import os
import pickle
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from hps.errors import ModelFileError, SourceNotFoundError
from hps.modelfiles.formats import open_model
from hps.modelfiles.formats.spec import TableSpec
from tests.modelfiles.formats.conftest import assert_loads_nothing, assert_served, ps_config, upload
from tests.support.s3_server import S3Server
from tests.tools.test_cli import hps


def tables() -> dict[str, torch.Tensor]:
    """The full tables every rank starts from (the same seed on each)."""
    g = torch.Generator().manual_seed(7)
    return {
        "rows.weight": torch.randn(2001, 8, generator=g),  # odd: the shards are uneven
        "cols.weight": torch.randn(600, 6, generator=g),
        "half.weight": torch.randn(301, 4, generator=g).to(torch.bfloat16),
        "plain.weight": torch.randn(50, 4, generator=g),
    }


def save_rank(rank: int, world: int, path: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = tables()
        model = {
            "rows.weight": distribute_tensor(full["rows.weight"], mesh, [Shard(0)]),
            "cols.weight": distribute_tensor(full["cols.weight"], mesh, [Shard(1)]),
            "half.weight": distribute_tensor(full["half.weight"], mesh, [Shard(0)]),
            "plain.weight": full["plain.weight"],
        }
        dcp.save({"model": model, "step": 3}, checkpoint_id=path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(save_rank, args=(2, str(path), port), nprocs=2)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp",
                                                      "__1_0.distcp"]
    return path


def as_float32(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy()


@pytest.mark.parametrize("name", ["rows.weight", "cols.weight", "half.weight", "plain.weight"])
def test_each_layout_reassembled_exactly(checkpoint: Path, name: str) -> None:
    expected = as_float32(tables()[name])
    spec = TableSpec(path=str(checkpoint), tensor=f"model.{name}", key_offset=100)
    with open_model(spec) as reader:
        assert (reader.format, reader.num_keys, reader.vec_size) == ("dcp", *expected.shape)
        for step in (1, 97, 1000, 5000):  # ranges inside one shard and across shards
            got = list(reader.chunks(chunk_keys=step))
            assert max(len(k) for k, _ in got) <= step
            np.testing.assert_array_equal(np.concatenate([k for k, _ in got]),
                                          np.arange(100, 100 + len(expected)))
            np.testing.assert_array_equal(np.concatenate([r for _, r in got]), expected)


def test_sharded_tables_served(tmp_path: Path, checkpoint: Path) -> None:
    for name, dim in [("rows.weight", 8), ("cols.weight", 6)]:
        expected = as_float32(tables()[name])
        entry = {"path": str(checkpoint), "tensor": f"model.{name}"}
        assert_served(ps_config(tmp_path / name, entry, dim),
                      np.arange(len(expected), dtype=np.int64), expected)


def test_served_from_s3(tmp_path: Path, checkpoint: Path, s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, checkpoint, "m/ckpt")
    entry = {"path": f"s3://{bucket}/m/ckpt", "tensor": "model.cols.weight",
             "key_offset": 7}
    expected = as_float32(tables()["cols.weight"])
    assert_served(ps_config(tmp_path, entry, 6, s3=s3_server),
                  np.arange(7, 7 + len(expected), dtype=np.int64), expected)


def test_inspect_and_convert(tmp_path: Path, checkpoint: Path) -> None:
    shown = hps("inspect", str(checkpoint), "--tensor", "model.rows.weight")
    assert shown.returncode == 0, shown.stderr
    assert "dcp" in shown.stdout and "2,001" in shown.stdout
    done = hps("convert", str(checkpoint), str(tmp_path / "out.safetensors"),
               "--tensor", "model.cols.weight")
    assert done.returncode == 0, done.stderr
    with open_model(str(tmp_path / "out.safetensors")) as reader:
        ((keys, got),) = list(reader.chunks(chunk_keys=10_000))
    np.testing.assert_array_equal(keys, np.arange(600))
    np.testing.assert_array_equal(got, as_float32(tables()["cols.weight"]))


def test_choice_of_tensor(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(ModelFileError, match=r"cannot tell which tensor .*model\.rows\.weight "
                                             r"\[2001, 8\]"):
        open_model(str(checkpoint))
    assert_loads_nothing(tmp_path, {"path": str(checkpoint), "tensor": "model.nope"}, 8,
                         r"has no tensor 'model\.nope' \(tensors: .*step")
    assert_loads_nothing(tmp_path, {"path": str(checkpoint), "tensor": "step"}, 8,
                         r"'step' is not a 2-D tensor")
    assert_loads_nothing(tmp_path, {"path": str(checkpoint), "tensor": "model.rows.weight"},
                         4, "rows are 8 wide but")


def test_broken_checkpoints_are_refused(tmp_path: Path, checkpoint: Path) -> None:
    lost = tmp_path / "lost"
    shutil.copytree(checkpoint, lost)
    (lost / "__1_0.distcp").unlink()
    assert_loads_nothing(tmp_path, {"path": str(lost), "tensor": "model.rows.weight"}, 8,
                         r"__1_0\.distcp' does not exist", error=SourceNotFoundError)
    cut = tmp_path / "cut"
    shutil.copytree(checkpoint, cut)
    data = (cut / "__0_0.distcp").read_bytes()
    (cut / "__0_0.distcp").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelFileError):
        open_model(TableSpec(path=str(cut), tensor="model.rows.weight"))

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("echo pwned",))

    evil = tmp_path / "evil"
    shutil.copytree(checkpoint, evil)
    (evil / ".metadata").write_bytes(pickle.dumps(Evil()))
    assert_loads_nothing(tmp_path, {"path": str(evil), "tensor": "model.rows.weight"}, 8,
                         r"holds a (posix|os)\.system object, which DCP's metadata does not")
