"""The `hps` command, run as a user runs it: subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def hps(*args: str, cwd: Path | None = None, columns: int = 200,
        pythonpath: str = str(ROOT)) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hps.tools.cli", *args], capture_output=True, text=True, cwd=cwd,
        timeout=300, env={"COLUMNS": str(columns), "PATH": "/usr/bin:/bin",
                          "HOME": str(cwd or "/tmp"), "PYTHONPATH": pythonpath},
    )


def write_config(two_tables: dict[str, Any]) -> Path:
    path = two_tables["dir"] / "ps.json"
    path.write_text(json.dumps(two_tables["config"]))
    return path


def test_demo_writes_loads_and_checks(tmp_path: Path) -> None:
    result = hps("demo", "--scale", "0.02", "--folder", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr
    assert "keys loaded" in result.stdout and "20,000" in result.stdout
    assert "0 mismatches" in result.stdout and "match the model files" in result.stdout
    assert (tmp_path / "demo" / "ps.json").exists()
    assert (tmp_path / "demo" / "user_item" / "key").stat().st_size == 12_000 * 8


def test_load_then_lookup(two_tables: dict[str, Any]) -> None:
    config = write_config(two_tables)
    loaded = hps("load", str(config))
    assert loaded.returncode == 0, loaded.stderr
    assert "hps_et.m.sparse_embedding0" in loaded.stdout and "3,000" in loaded.stdout
    keys, vectors = two_tables["tables"][1]
    result = hps("lookup", str(config), "--model", "m", "--table", "1", "--json", "--",
                 str(keys[0]), str(keys[5]), "12345678901234")
    assert result.returncode == 0, result.stderr
    got = np.array(json.loads(result.stdout)["vectors"], np.float32)
    np.testing.assert_array_equal(got[:2], vectors[[0, 5]])
    assert np.all(got[2] == 0.5)
    pretty = hps("lookup", str(config), "-m", "m", "-t", "sparse_embedding1", "--", str(keys[0]))
    assert pretty.returncode == 0 and f"{keys[0]}:" in pretty.stdout


def test_lookup_errors_are_readable(two_tables: dict[str, Any]) -> None:
    config = write_config(two_tables)
    result = hps("lookup", str(config), "--model", "nope", "1")
    assert result.returncode == 2
    assert "no model named 'nope'" in result.stderr and "Traceback" not in result.stderr
    missing = hps("load", str(two_tables["dir"] / "absent.json"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_inspect(two_tables: dict[str, Any]) -> None:
    keys, _ = two_tables["tables"][0]
    result = hps("inspect", str(two_tables["dir"] / "t0"))
    assert result.returncode == 0, result.stderr
    assert "3,000" in result.stdout and "width" in result.stdout and "yes" in result.stdout
    assert f"{keys.min():,}" in result.stdout
    # what a GPU cache of the table would take, extra slots included (hps/gpu/open.py)
    from hps.gpu.open import cache_memory_bytes

    mib = cache_memory_bytes(keys.size, 8, 0.5) / 2**20
    assert "gpucacheper 0.5" in result.stdout and f"{mib:,.1f} MiB per device" in result.stdout
    emb = two_tables["dir"] / "t0" / "emb_vector"
    emb.write_bytes(emb.read_bytes()[:-4])
    bad = hps("inspect", str(two_tables["dir"] / "t0"), "--width", "8")
    assert bad.returncode == 1 and "invalid" in bad.stderr


@pytest.mark.parametrize("command", [[], ["tier-fetch"]], ids=["bare", "tier-fetch"])
def test_bench_runs_small(tmp_path: Path, command: list[str]) -> None:
    # bare `hps bench` runs tier-fetch: the tiers' own calls beside their baselines
    result = hps("bench", *command, "--keys", "50000", "--batch", "4096", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "searchsorted" in result.stdout.lower() and "multi_get" in result.stdout.lower()


def test_version_and_short_help() -> None:
    import hps as package

    version = hps("--version")
    assert version.returncode == 0 and version.stdout.strip() == (
        f"hps {package.__version__} (distribution hps-server)")
    for argv in (["-h"], ["demo", "-h"], ["serve", "-h"], ["bench", "http", "-h"]):
        shown = hps(*argv, columns=80)
        assert shown.returncode == 0, shown.stderr
        assert "Usage:" in shown.stdout and "<bool>" not in shown.stdout
        assert max(len(line) for line in shown.stdout.splitlines()) <= 80


def test_tables_fit_80_columns_with_human_labels(two_tables: dict[str, Any]) -> None:
    config = write_config(two_tables)
    loaded = hps("load", str(config), columns=80)
    assert loaded.returncode == 0, loaded.stderr
    lines = loaded.stdout.splitlines()
    boxed = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert boxed and max(len(line) for line in boxed) <= 80  # sources: whole paths below
    assert "…" not in loaded.stdout  # nothing cut
    row = next(line for line in boxed if "sparse_embedding0" in line)
    assert "3,000" in row and "in-process" in loaded.stdout and "RocksDB" in loaded.stdout
    assert f"{two_tables['dir'] / 't0'}" in loaded.stdout  # the source, whole
    bench = hps("bench", "--keys", "20000", "--batch", "1000", columns=80,
                cwd=two_tables["dir"])
    assert bench.returncode == 0, bench.stderr
    assert max(len(line) for line in bench.stdout.splitlines()) <= 80
    for label in ("ours, keys/s", "baseline, keys/s", "ours / baseline", "peak RSS"):
        assert label in bench.stdout
    assert "keys_per_s" not in bench.stdout


def test_warnings_are_log_records(two_tables: dict[str, Any]) -> None:
    config = two_tables["config"]
    # a misspelt key beside the one it resembles: UnknownConfigKeyWarning
    config["models"][0].update(gpucachepr=0.5, gpucacheper=0.5)
    path = write_config(two_tables)
    loaded = hps("load", str(path), columns=200)
    assert loaded.returncode == 0, loaded.stderr
    line = next(x for x in loaded.stderr.splitlines() if "UnknownConfigKeyWarning" in x)
    assert "WARNING" in line and "gpucacheper" in line
    assert "warnings.warn" not in loaded.stderr  # not Python's own warning format


def test_demo_serve_checks_the_server_extra_first(tmp_path: Path) -> None:
    # a fastapi that cannot be imported stands for an install without the server extra
    shadow = tmp_path / "shadow" / "fastapi"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError(\"No module named 'fastapi'\", name='fastapi')\n")
    done = hps("demo", "--serve", "--scale", "0.01", "--folder", str(tmp_path / "demo"),
               pythonpath=f"{tmp_path / 'shadow'}:{ROOT}")
    assert done.returncode == 2
    assert "pip install 'hps-server[server]'" in done.stderr
    assert not (tmp_path / "demo").exists()  # nothing written: it stopped before the demo


def test_convert_and_inspect_any_format(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    keys = rng.choice(10**12, 2000, replace=False).astype(np.int64)
    rows = rng.standard_normal((2000, 8)).astype(np.float32)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), 8)
    pq.write_table(pa.table({"id": keys, "emb": vectors}), tmp_path / "t.parquet")
    described = hps("inspect", str(tmp_path / "t.parquet"), "--key-column", "id",
                    "--vector-column", "emb")
    assert described.returncode == 0, described.stderr
    assert "parquet" in described.stdout and "2,000" in described.stdout
    assert f"{keys.min():,}" in described.stdout
    converted = hps("convert", str(tmp_path / "t.parquet"), str(tmp_path / "out.safetensors"),
                    "--key-column", "id", "--vector-column", "emb")
    assert converted.returncode == 0, converted.stderr
    assert "2,000 keys" in converted.stderr  # the progress bar
    back = hps("convert", str(tmp_path / "out.safetensors"), str(tmp_path / "folder"))
    assert back.returncode == 0, back.stderr
    np.testing.assert_array_equal(np.fromfile(tmp_path / "folder" / "key", "<i8"), keys)
    np.testing.assert_array_equal(
        np.fromfile(tmp_path / "folder" / "emb_vector", "<f4").reshape(-1, 8), rows)
    wrong = hps("inspect", str(tmp_path / "t.parquet"), "--tensor", "weight")
    assert wrong.returncode == 1 and "tensor do(es) not apply to format 'parquet'" in wrong.stderr


def test_convert_checks_before_it_reads(two_tables: dict[str, Any], tmp_path: Path) -> None:
    source = str(two_tables["dir"] / "t0")
    unknown = hps("convert", source, str(tmp_path / "x.csv"))
    assert unknown.returncode == 2 and "name the format with --to" in unknown.stderr
    assert not (tmp_path / "x.csv").exists()
    named = hps("convert", source, str(tmp_path / "x.csv"), "--to", "parquet")
    assert named.returncode == 0, named.stderr
    assert "writing " in named.stderr and "reading" not in named.stderr  # the progress bar
    (tmp_path / "x.parquet").write_bytes(b"keep me")
    exists = hps("convert", source, str(tmp_path / "x.parquet"))
    assert exists.returncode == 2 and "pass --force to replace it" in exists.stderr
    assert (tmp_path / "x.parquet").read_bytes() == b"keep me"
    forced = hps("convert", source, str(tmp_path / "x.parquet"), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "x.parquet").read_bytes()[:4] == b"PAR1"
    # a pyarrow that cannot be imported stands for an install without the parquet extra
    shadow = tmp_path / "shadow" / "pyarrow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError(\"No module named 'pyarrow'\", name='pyarrow')\n")
    missing = hps("convert", source, str(tmp_path / "y.parquet"),
                  pythonpath=f"{tmp_path / 'shadow'}:{ROOT}")
    assert missing.returncode == 2 and "pip install 'hps-server[parquet]'" in missing.stderr
    assert "writing Parquet" in missing.stderr and "keys" not in missing.stderr  # no bar
    assert not (tmp_path / "y.parquet").exists()


def test_bench_counts_read_one_way(tmp_path: Path) -> None:
    from hps.tools.cli.key_counts import parse_count, parse_counts

    assert [parse_count(t) for t in ("100000", "100k", "1M", "2_000_000", "1.5k")] == [
        100_000, 100_000, 1_000_000, 2_000_000, 1_500]
    assert parse_counts("1,256,16k") == [1, 256, 16_000]
    for bad in ("0", "-5", "1.5", "lots", "1e400", "nan", "inf", ""):
        with pytest.raises(ValueError, match="not a key count"):
            parse_count(bad)
    # every bench command reads its counts through it: a bad one is refused at once
    for argv in (["tiers", "--keys", "x"], ["updates", "--rows", "lots"],
                 ["http", "--batch", "64,0"], ["gpu", "--slots", "1.5"]):
        done = hps("bench", *argv, cwd=tmp_path)
        assert done.returncode == 2 and "not a key count: " in done.stderr, done.stderr


@pytest.mark.parametrize("argv", [["redis", "--keys", "1k"], ["http", "--keys", "1k"],
                                  ["soak", "--minutes", "0.01"],
                                  ["updates", "--rows", "1k", "--table-keys", "1k"]],
                         ids=["redis", "http", "soak", "updates"])
def test_bench_without_redis_server_names_the_fix(tmp_path: Path, argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hps.tools.cli", "bench", *argv],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={"PATH": str(tmp_path), "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
             "COLUMNS": "200"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'redis-server' is not on PATH: install it" in done.stderr
    assert "Traceback" not in done.stderr


def test_pickled_pytorch_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"\x80\x04not really a pickle")
    result = hps("convert", str(tmp_path / "model.pt"), str(tmp_path / "out.parquet"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "pickled PyTorch file" in result.stderr and "save_file(" in result.stderr
    assert not (tmp_path / "out.parquet").exists()


def test_bench_load_prints_each_format_beside_the_sparse_folder(tmp_path: Path) -> None:
    result = hps("bench", "load", "--format", "parquet", "--format", "safetensors",
                 "--keys", "20000", "--dim", "8", "--rounds", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("sparse_folder", "parquet", "safetensors"):
        assert name in result.stdout
    assert "parquet: " in result.stdout and "keys/s, sparse folder" in result.stdout
    unknown = hps("bench", "load", "--format", "csv", "--keys", "100", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "'csv' is not one of parquet, numpy, safetensors, torch, dcp" in unknown.stderr


def test_lookup_of_keys_beyond_int64_is_one_line(two_tables: dict[str, Any]) -> None:
    """A key past int64 is a one-line error, not an OverflowError traceback."""
    config = write_config(two_tables)
    for key in ("9223372036854775808", "-9223372036854775809", "99999999999999999999999"):
        result = hps("lookup", str(config), "--model", "m", "--", key)
        assert result.returncode != 0
        assert "int64 range" in result.stderr + result.stdout
        assert "Traceback" not in result.stderr
    result = hps("lookup", str(config), "--model", "m", "--table", "²", "--", "1")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "has no table '²'" in result.stderr + result.stdout


def test_bench_http_prints_every_path_and_plots(tmp_path: Path) -> None:
    picture = tmp_path / "http.png"
    done = hps("bench", "http", "--keys", "5000", "--batch", "64,256", "--clients", "2",
               "--seconds", "0.3", "--rounds", "1", "--no-pin", "--plot", str(picture),
               cwd=tmp_path, columns=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in ("v1 binary lookup", "v2 binary infer", "v1 JSON lookup",
                 "redis HMGET (direct)", "bare uvicorn (floor)", "one client alone"):
        assert path in done.stdout
    for ratio in ("v1 binary / redis", "v2 binary / redis", "v1 binary / bare floor"):
        assert f"keys/s, {ratio}: " in done.stdout
    assert "client: http.client, one keep-alive connection per thread" in done.stdout
    cpu_rows = [line for line in done.stdout.splitlines() if "server CPU µs/req" in line]
    # per batch size: the HTTP and the gRPC tables, of many clients and of one client
    assert len(cpu_rows) == 8 and not any("nan" in line for line in cpu_rows), cpu_rows
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_checks_the_plot_extra_first(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    done = hps("bench", "http", "--plot", str(tmp_path / "x.png"), cwd=tmp_path,
               pythonpath=f"{tmp_path / 'shadow'}:{ROOT}")
    assert done.returncode == 2 and "pip install 'hps-server[plot]'" in done.stderr
    assert "table of" not in done.stdout  # stopped before the benchmark


@pytest.mark.parametrize("command", ["tiers", "storage"])
@pytest.mark.parametrize("batches", ["1,x", "0", ""])
def test_bench_batches_must_be_key_counts(tmp_path: Path, command: str, batches: str) -> None:
    done = hps("bench", command, "--batches", batches, cwd=tmp_path)
    assert done.returncode == 2 and "'--batches': takes positive key counts" in done.stderr
    assert "Traceback" not in done.stderr
    assert "loading a table" not in done.stdout  # refused before any load


def test_bench_load_prints_the_scale_curve(tmp_path: Path) -> None:
    result = hps("bench", "load", "--keys", "20k,40k", "--dim", "8", "--rounds", "1",
                 cwd=tmp_path, columns=200)
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [line[0] for line in lines] == ["20,000", "40,000"]
    for line in lines:
        keys_per_s, rss_over_raw, writer_keys_per_s = (
            float(line[2].replace(",", "")), float(line[4]), float(line[6].replace(",", "")))
        assert keys_per_s > 0 and writer_keys_per_s > 0 and rss_over_raw > 0
    bad = hps("bench", "load", "--keys", "lots", cwd=tmp_path)
    assert bad.returncode == 2 and "not a key count" in bad.stderr
