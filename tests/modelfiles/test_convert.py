"""`hps convert` between every pair of formats: the same keys and the same bits back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps.errors import ModelFileError
from hps.modelfiles.convert import convert
from hps.modelfiles.formats import ReadOptions, open_model
from hps.modelfiles.inspect import inspect_model
from tests.conftest import make_table, write_table
from tests.modelfiles.formats.conftest import upload
from tests.support.s3_server import S3Server

#: destination name → the format it is written in
TARGETS = {
    "t.parquet": "parquet",
    "t.npz": "numpy",
    "npfolder": "numpy",
    "t.safetensors": "safetensors",
    "hugectr": "sparse_folder",
}


def read_all(path: str) -> tuple[np.ndarray, np.ndarray]:
    with open_model(path, ReadOptions(chunk_bytes=4096)) as reader:
        chunks = list(reader.chunks())
    return np.concatenate([k for k, _ in chunks]), np.concatenate([r for _, r in chunks])


def assert_same_bits(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]
                     ) -> None:
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))


@pytest.fixture
def awkward_table(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Keys over the whole int64 range; rows with -0.0, infinities, NaN and subnormals."""
    keys, rows = make_table(rng, 3000, 8)
    keys[:3] = [np.iinfo(np.int64).min, -1, np.iinfo(np.int64).max]
    rows[0] = [-0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, np.finfo(np.float32).max, 0.0]
    return keys, rows


def test_every_pair_round_trips_bit_for_bit(tmp_path: Path,
                                            awkward_table: tuple[np.ndarray, np.ndarray]) -> None:
    origin = str(write_table(tmp_path / "origin", *awkward_table))
    for first, first_format in TARGETS.items():
        a = str(tmp_path / "a" / first)
        (tmp_path / "a").mkdir(exist_ok=True)
        report = convert(origin, a, "numpy" if first == "npfolder" else None)
        assert (report.num_keys, report.non_finite_values) == (3000, 3)
        with open_model(a) as reader:
            assert reader.format == first_format
        assert_same_bits(read_all(a), awkward_table)
        for second in TARGETS:
            if second == first:
                continue
            b = str(tmp_path / "b" / f"{first.replace('.', '_')}-{second}")
            (tmp_path / "b").mkdir(exist_ok=True)
            b += "" if "." not in second else second[second.index("."):]
            convert(a, b, "numpy" if second == "npfolder" else None)
            assert_same_bits(read_all(b), awkward_table)


def test_float16_and_bfloat16_widen_exactly(tmp_path: Path, rng: np.random.Generator) -> None:
    import torch
    from safetensors.torch import save_file

    weight = torch.randn(1000, 4).to(torch.bfloat16)
    save_file({"weight": weight}, tmp_path / "bf16.safetensors")
    convert(str(tmp_path / "bf16.safetensors"), str(tmp_path / "out.parquet"))
    keys, rows = read_all(str(tmp_path / "out.parquet"))
    np.testing.assert_array_equal(keys, np.arange(1000))
    np.testing.assert_array_equal(rows, weight.to(torch.float32).numpy())


def test_from_s3(tmp_path: Path, rng: np.random.Generator, s3_server: S3Server) -> None:
    keys, rows = make_table(rng, 2000, 16)
    np.savez_compressed(tmp_path / "t.npz", keys=keys, vectors=rows)
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, tmp_path / "t.npz", "m/t.npz")
    from hps.modelfiles.source import SourceOptions

    convert(f"s3://{bucket}/m/t.npz", str(tmp_path / "t.safetensors"),
            source_options=SourceOptions(s3_endpoint=s3_server.endpoint))
    assert_same_bits(read_all(str(tmp_path / "t.safetensors")), (keys, rows))


def test_a_failed_conversion_leaves_no_destination(tmp_path: Path,
                                                   rng: np.random.Generator) -> None:
    from tests.modelfiles.formats.test_parquet import write_corrupt

    source = tmp_path / "src.parquet"
    write_corrupt(source, *make_table(rng, 4000, 4))
    (tmp_path / "out.safetensors").write_bytes(b"the previous file")
    with pytest.raises(ModelFileError, match=r"src\.parquet: cannot read the Parquet data"):
        convert(str(source), str(tmp_path / "out.safetensors"),
                options=ReadOptions(chunk_bytes=1024),  # chunks were written before the fault
                force=True)
    assert (tmp_path / "out.safetensors").read_bytes() == b"the previous file"
    assert not (tmp_path / "out.safetensors.partial").exists()


def test_inspect_counts_duplicates_and_non_finite(tmp_path: Path,
                                                  rng: np.random.Generator) -> None:
    keys, rows = make_table(rng, 1000, 4)
    keys[10:13] = keys[0]
    rows[5, 1] = np.nan
    np.savez(tmp_path / "t.npz", keys=keys, vectors=rows)
    report = inspect_model(str(tmp_path / "t.npz"))
    assert (report.format, report.num_keys, report.vec_size) == ("numpy", 1000, 4)
    assert (report.duplicate_keys, report.non_finite_values, report.valid) == (3, 1, False)
    assert (report.key_min, report.key_max) == (int(keys.min()), int(keys.max()))


def test_remote_destination_is_refused(tmp_path: Path, rng: np.random.Generator) -> None:
    folder = write_table(tmp_path / "t", *make_table(rng, 10, 4))
    with pytest.raises(ModelFileError, match="writes local files only"):
        convert(str(folder), "s3://bucket/t.parquet")
