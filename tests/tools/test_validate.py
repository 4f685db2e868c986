"""`hps validate`, run as a user runs it (subprocesses): the table it prints and its exit
codes (0 passed, warnings too; 1 refused or unreadable; 2 a usage or config error)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_table, model_config, write_table

ROOT = Path(__file__).resolve().parents[2]


def hps(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hps.tools.cli", *args], capture_output=True, text=True,
        timeout=300, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": "/tmp",
                          "PYTHONPATH": str(ROOT)})


@pytest.fixture
def files(tmp_path: Path, rng: np.random.Generator) -> Path:
    keys, rows = make_table(rng, 5000, 8)
    write_table(tmp_path / "good", keys, rows)
    write_table(tmp_path / "blown", keys, rows * 10)
    bad = rows.copy()
    bad[17, 3] = np.nan
    write_table(tmp_path / "nan", keys, bad)
    write_table(tmp_path / "repeats", np.concatenate([keys, keys[:10]]),
                np.concatenate([rows, rows[:10]]))
    write_table(tmp_path / "other_keys", keys + 2**41, rows)
    return tmp_path


def lines(result: subprocess.CompletedProcess[str], check: str) -> str:
    return next(line for line in result.stdout.splitlines() if f" {check} " in line)


def test_good_files_pass(files: Path) -> None:
    result = hps("validate", str(files / "good"))
    assert result.returncode == 0, result.stderr
    assert "5,000 rows read" in result.stdout
    for check in ("width", "non_finite", "duplicates"):
        assert lines(result, check).rstrip(" │").endswith("ok")


def test_non_finite_rows_are_refused(files: Path) -> None:
    result = hps("validate", str(files / "nan"))
    assert result.returncode == 1
    assert "refused" in lines(result, "non_finite") and "1 row " in lines(result, "non_finite")
    assert "refused: " in result.stderr and "row 17 holds NaN or infinity" in result.stderr
    allowed = files / "ps.json"
    model = model_config([str(files / "nan")], [8])
    allowed.write_text(json.dumps({"models": [model], "validation": {"max_nan_rows": 1}}))
    result = hps("validate", str(files / "nan"), "--config", str(allowed))
    assert result.returncode == 0, result.stderr
    assert "1 row " in lines(result, "non_finite") and "ok" in lines(result, "non_finite")


def test_a_width_other_than_the_configs_is_refused(files: Path) -> None:
    result = hps("validate", str(files / "good"), "--width", "16")
    assert result.returncode == 1
    assert "refused" in lines(result, "width")
    assert "rows are 8 wide but embedding_vecsize_per_table says 16" in result.stderr
    config = files / "ps.json"  # the width of the table whose entry names the files
    config.write_text(json.dumps({"models": [model_config([str(files / "good")], [4])]}))
    result = hps("validate", str(files / "good"), "--config", str(config))
    assert result.returncode == 1 and "says 4" in result.stderr


def test_repeated_keys_are_counted_or_refused(files: Path) -> None:
    result = hps("validate", str(files / "repeats"))
    assert result.returncode == 0, result.stderr
    assert "10 rows" in lines(result, "duplicates") and "last wins" in lines(result,
                                                                              "duplicates")
    config = files / "ps.json"
    config.write_text(json.dumps({"models": [model_config([str(files / "repeats")], [8])],
                                  "validation": {"duplicates": "refuse"}}))
    result = hps("validate", str(files / "repeats"), "--config", str(config))
    assert result.returncode == 1 and "refused" in lines(result, "duplicates")
    assert "repeats key" in result.stderr


def test_drift_against_another_version_warns_or_refuses(files: Path) -> None:
    result = hps("validate", str(files / "blown"), "--against", str(files / "good"))
    assert result.returncode == 0, result.stderr
    assert "10×" in lines(result, "norm_ratio") and "warning" in lines(result, "norm_ratio")
    assert "warning: " in result.stderr and "row norms drifted 10×" in result.stderr
    config = files / "ps.json"
    model = model_config([str(files / "blown")], [8], validation={"drift": "refuse"})
    config.write_text(json.dumps({"models": [model]}))
    result = hps("validate", str(files / "blown"), "--against", str(files / "good"),
                 "--config", str(config))
    assert result.returncode == 1 and "refused" in lines(result, "norm_ratio")
    result = hps("validate", str(files / "other_keys"), "--against", str(files / "good"))
    assert result.returncode == 0
    assert "+100.0%" in lines(result, "key_churn") and "warning" in lines(result, "key_churn")


def test_unreadable_files_and_bad_usage(files: Path) -> None:
    result = hps("validate", str(files / "missing"))
    assert result.returncode == 1 and "invalid:" in result.stderr
    result = hps("validate", str(files / "good"), "--model", "m")
    assert result.returncode == 2 and "--model needs --config" in result.stderr
    config = files / "ps.json"
    config.write_text(json.dumps({"models": [model_config([str(files / "good")], [8])],
                                  "validation": {"drift": "maybe"}}))
    result = hps("validate", str(files / "good"), "--config", str(config))
    assert result.returncode == 2 and "validation.drift" in result.stderr


def test_a_table_far_smaller_than_the_served_one_is_refused(files: Path) -> None:
    keys = np.fromfile(files / "good" / "key", dtype="<i8")
    rows = np.fromfile(files / "good" / "emb_vector", dtype="<f4").reshape(-1, 8)
    write_table(files / "small", keys[:1000], rows[:1000])
    result = hps("validate", str(files / "small"), "--against", str(files / "good"))
    assert result.returncode == 1
    assert "1,000 keys" in lines(result, "size") and "2,500 keys" in lines(result, "size")
    assert "refused" in lines(result, "size")
    assert "validation.min_key_ratio 0.5 asks for 2,500" in result.stderr
    config = files / "ps.json"
    model = model_config([str(files / "small")], [8], validation={"allow_shrink": True})
    config.write_text(json.dumps({"models": [model]}))
    result = hps("validate", str(files / "small"), "--against", str(files / "good"),
                 "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "warning" in lines(result, "size")
