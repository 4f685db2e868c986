"""`hps bench load --format torch|dcp`: PyTorch's files written as a training job writes
them (hps/tools/bench/load_files.py: `torch.save`, and DCP saved by two processes with gloo
on loopback, row-wise and column-wise) read back exactly (a column-wise table a few rows
at a time: hps/modelfiles/formats/dcp.py COLUMN_CHUNK_BYTES), and measured beside
safetensors in the same run (hps/tools/bench/load.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps.modelfiles.formats import dcp, open_model
from hps.modelfiles.formats.spec import TableSpec
from hps.tools.bench import load_files
from hps.tools.bench.load import bench_load_formats
from tests.tools.test_cli import hps


@pytest.mark.parametrize("sharding", ["row-wise", "column-wise"])
def test_dcp_written_by_two_ranks_reads_back_exactly(tmp_path: Path, rng: np.random.Generator,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     sharding: str) -> None:
    rows = rng.standard_normal((1001, 6)).astype(np.float32)  # odd: uneven shards
    np.save(tmp_path / "rows.npy", rows)
    load_files.write_dcp(str(tmp_path / "ckpt"), str(tmp_path / "rows.npy"), sharding)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    spec = TableSpec(path=str(tmp_path / "ckpt"), tensor=load_files.TORCH_TENSOR)
    with open_model(spec) as reader:
        assert reader.format == "dcp"
        chunks = list(reader.chunks(chunk_keys=300))
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), np.arange(1001))
    np.testing.assert_array_equal(np.concatenate([r for _, r in chunks]), rows)
    if sharding == "column-wise":  # put together a few rows at a time, still exact
        monkeypatch.setattr(dcp, "COLUMN_CHUNK_BYTES", 4 * 6 * 100)
        with open_model(spec) as reader:
            chunks = list(reader.chunks(chunk_keys=300))
        assert max(len(k) for k, _ in chunks) == 100
        np.testing.assert_array_equal(np.concatenate([r for _, r in chunks]), rows)
    with pytest.raises(ValueError, match="sharding must be one of"):
        load_files.write_dcp(str(tmp_path / "other"), str(tmp_path / "rows.npy"), "diagonal")


def test_torch_state_reads_back_exactly(tmp_path: Path, rng: np.random.Generator) -> None:
    rows = rng.standard_normal((500, 4)).astype(np.float32)
    load_files.write_torch_state(str(tmp_path / "table.pt"), rows)
    with open_model(TableSpec(path=str(tmp_path / "table.pt"), format="torch",
                              tensor=load_files.TORCH_TENSOR)) as reader:
        ((keys, got),) = list(reader.chunks(chunk_keys=1000))
    np.testing.assert_array_equal(keys, np.arange(500))
    np.testing.assert_array_equal(got, rows)


def test_pytorch_files_are_measured_beside_safetensors(tmp_path: Path) -> None:
    rows = bench_load_formats(["torch", "dcp"], num_keys=20_000, dim=8, rounds=1,
                              path=str(tmp_path))
    assert [r["name"] for r in rows] == ["sparse_folder", "safetensors", "torch",
                                         "dcp row-wise", "dcp column-wise"]
    for r in rows:
        assert r["num_keys"] == 20_000 and r["keys_per_s"] > 0
        for prefix in ("", "safetensors_"):
            assert all(r[f"{prefix}{m}"] > 0 for m in ("ratio", "best_ratio", "cpu_ratio"))
    assert rows[1]["safetensors_ratio"] == 1.0
    assert not list(tmp_path.iterdir())  # the work folder is removed


def test_bench_load_command_takes_torch_and_dcp(tmp_path: Path) -> None:
    result = hps("bench", "load", "--format", "dcp", "--keys", "5000", "--dim", "4",
                 "--rounds", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("safetensors", "dcp row-wise", "dcp column-wise"):
        assert name in result.stdout
    assert "safetensors ratio" in result.stdout and "dcp column-wise: " in result.stdout
