"""safetensors tables written by `safetensors.torch.save_file` (an nn.Embedding's state,
as PyTorch saves one) and `safetensors.numpy`, served through HPS.lookup locally and
from S3."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from hps.errors import UnsupportedFormatError
from hps.modelfiles.formats import open_model
from tests.modelfiles.formats.conftest import assert_loads_nothing, assert_served, ps_config, upload
from tests.support.s3_server import S3Server


def embedding(num: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.nn.Embedding:
    emb = torch.nn.Embedding(num, dim, dtype=dtype)
    torch.nn.init.normal_(emb.weight)
    return emb


def as_float32(weight: torch.Tensor) -> np.ndarray:
    return weight.detach().to(torch.float32).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nn_embedding_state_local(tmp_path: Path, dtype: torch.dtype) -> None:
    emb = embedding(4000, 8, dtype)
    save_file(emb.state_dict(), tmp_path / "emb.safetensors")
    with open_model(str(tmp_path / "emb.safetensors")) as reader:
        assert (reader.tensor, reader.num_keys, reader.vec_size) == ("weight", 4000, 8)
    keys = np.arange(4000, dtype=np.int64)
    assert_served(ps_config(tmp_path, str(tmp_path / "emb.safetensors"), 8), keys,
                  as_float32(emb.weight))


def test_key_offset_and_named_tensor(tmp_path: Path) -> None:
    bags = {"embedding_bags.t1.weight": embedding(1000, 4).weight.detach(),
            "embedding_bags.t2.weight": embedding(500, 16).weight.detach()}
    save_file(bags, tmp_path / "ebc.safetensors")
    entry = {"path": str(tmp_path / "ebc.safetensors"), "format": "safetensors",
             "tensor": "embedding_bags.t2.weight", "key_offset": 1_000_000}
    keys = np.arange(1_000_000, 1_000_500, dtype=np.int64)
    assert_served(ps_config(tmp_path, entry, 16), keys,
                  as_float32(bags["embedding_bags.t2.weight"]))


def test_keys_tensor_beside_rows_from_s3(tmp_path: Path, rng: np.random.Generator,
                                         s3_server: S3Server) -> None:
    keys = rng.choice(2**40, 3000, replace=False).astype(np.int64)
    rows = rng.standard_normal((3000, 8)).astype(np.float32)
    save_numpy({"ids": keys, "table": rows}, str(tmp_path / "t.safetensors"))
    emb = embedding(2000, 4)
    save_file(emb.state_dict(), tmp_path / "emb.safetensors")
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, tmp_path / "t.safetensors", "m/t.safetensors")
    upload(s3_server, bucket, tmp_path / "emb.safetensors", "m/emb.safetensors")
    entry = {"path": f"s3://{bucket}/m/t.safetensors", "tensor": "table", "keys_tensor": "ids"}
    assert_served(ps_config(tmp_path / "a", entry, 8, s3=s3_server), keys, rows)
    uri = f"s3://{bucket}/m/emb.safetensors"
    assert_served(ps_config(tmp_path / "b", uri, 4, s3=s3_server),
                  np.arange(2000, dtype=np.int64), as_float32(emb.weight))


# -- bad files ----------------------------------------------------------------------------


def rewrite_header(path: Path, edit: dict[str, object]) -> None:
    """Replace tensor entries of a file's header, keeping the data bytes as they were."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.update(edit)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + length :])


def test_header_that_lies_about_offsets_or_shapes(tmp_path: Path) -> None:
    path = tmp_path / "emb.safetensors"
    save_file(embedding(100, 4).state_dict(), path)
    rewrite_header(path, {"weight": {"dtype": "F32", "shape": [100, 4],
                                     "data_offsets": [0, 4000]}})
    assert_loads_nothing(tmp_path, str(path), 4, r"emb\.safetensors: tensor 'weight' has "
                         r"data_offsets \[0, 4000\] outside the 1600 data bytes")
    rewrite_header(path, {"weight": {"dtype": "F32", "shape": [200, 4],
                                     "data_offsets": [0, 1600]}})
    assert_loads_nothing(tmp_path, str(path), 4, r"shape \[200, 4\] F32 needs 3200 bytes but "
                         r"its data_offsets \[0, 1600\] span 1600")
    rewrite_header(path, {"weight": {"dtype": "F32", "shape": [100, 2],
                                     "data_offsets": [0, 800]},
                          "other": {"dtype": "F32", "shape": [100, 2],
                                    "data_offsets": [400, 1200]}})
    assert_loads_nothing(tmp_path, str(path), 2, r"tensor 'other' starts at data byte 400, "
                         "which overlaps the tensor before it")


def test_truncated_and_garbage(tmp_path: Path) -> None:
    path = tmp_path / "emb.safetensors"
    save_file(embedding(100, 4).state_dict(), path)
    blob = path.read_bytes()
    path.write_bytes(blob[:-100])
    assert_loads_nothing(tmp_path, str(path), 4, r"outside the \d+ data bytes of the file")
    path.write_bytes(b"\xff" * 64)
    assert_loads_nothing(tmp_path, str(path), 4, r"the header claims \d+ bytes but the file is")
    path.write_bytes(struct.pack("<Q", 5) + b"{oops")
    assert_loads_nothing(tmp_path, str(path), 4, "the header is not valid JSON")


@pytest.mark.parametrize("shape", [[400], [10, 10, 4]])
def test_rows_must_be_two_dimensional(tmp_path: Path, shape: list[int]) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"weight": torch.zeros(shape)}, path)
    assert_loads_nothing(tmp_path, str(path), 4, rf"tensor 'weight' has shape {shape} "
                         rf"\({len(shape)}-D\); rows must be a 2-D tensor".replace("[", r"\[")
                         .replace("]", r"\]"))


def test_keys_tensor_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_numpy({"keys": np.arange(9, dtype=np.int64), "weight": np.zeros((10, 4), np.float32)},
               str(path))
    assert_loads_nothing(tmp_path, str(path), 4, "keys tensor 'keys' holds 9 keys but rows "
                         "tensor 'weight' holds 10 rows")


def test_keys_out_of_range(tmp_path: Path) -> None:
    path = tmp_path / "emb.safetensors"
    save_file(embedding(100, 4).state_dict(), path)
    entry = {"path": str(path), "key_offset": 2**32 - 50}
    assert_loads_nothing(tmp_path, entry, 4, "key 4294967296 at row 50 is out of range",
                         supportlonglong=False)


@pytest.mark.parametrize("name", ["model.pt", "pytorch_model.bin", "weights.pth"])
def test_pickled_pytorch_is_refused(tmp_path: Path, name: str) -> None:
    # a plain pickle (torch.save's pre-1.6 format); torch.save's zip files are read:
    # tests/modelfiles/formats/test_torch_state.py
    torch.save(embedding(10, 4).state_dict(), tmp_path / name,
               _use_new_zipfile_serialization=False)
    assert_loads_nothing(tmp_path, str(tmp_path / name), 4,
                         r"is a pickled PyTorch file; hps does not unpickle .*save_file\(",
                         error=UnsupportedFormatError)
