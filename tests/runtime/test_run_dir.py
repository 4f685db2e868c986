"""hps/runtime/run_dir.py with hps/runtime/shm_files.py: a run folder is this user's own,
mode 0700; what this user left at its name (a file, a link, a folder) is replaced, what
another user planted there is refused with one line and left alone, and `hps serve
--workers 2` says so in one line, exit 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hps.errors import HPSError
from hps.runtime import run_dir
from tests.conftest import model_config, write_table
from tests.support.strangers import Stranger, stranger  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]


def _file(path: Path) -> None:
    path.write_text("planted")


def _link(path: Path) -> None:
    target = path.parent / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("not hps's")
    path.symlink_to(target)


def _folder(path: Path) -> None:
    path.mkdir(mode=0o777)
    (path / "inside").write_text("planted")


PLANTS: dict[str, Callable[[Path], None]] = {"file": _file, "link": _link, "folder": _folder}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_what_this_user_left_at_the_name_is_replaced(tmp_path: Path, plant: str) -> None:
    path = tmp_path / f"hps-mp-{os.getpid()}"
    PLANTS[plant](path)
    made = run_dir.create_run_dir(tmp_path)
    assert made == path and path.is_dir() and not path.is_symlink()
    assert path.stat().st_mode & 0o777 == 0o700 and list(path.iterdir()) == []
    if plant == "link":  # the link went, not what it named
        assert (tmp_path / "elsewhere" / "keep").read_text() == "not hps's"


@pytest.mark.parametrize("plant", list(PLANTS))
def test_what_another_user_planted_is_refused_and_left(
        tmp_path: Path, plant: str, stranger: Stranger) -> None:  # noqa: F811
    path = tmp_path / f"hps-mp-{os.getpid()}"
    PLANTS[plant](path)
    stranger.owns(path)
    with pytest.raises(HPSError) as raised:
        run_dir.create_run_dir(tmp_path)
    said = str(raised.value)
    assert "\n" not in said and str(path) in said and f"user {stranger.uid}" in said
    assert "is in the way" in said and "HPS_SHM_DIR" in said
    assert os.lstat(path).st_uid == stranger.uid  # left as it was


def test_a_private_run_folder_is_0700_and_checked(tmp_path: Path) -> None:
    made = run_dir.create_run_dir(tmp_path, private=True)
    assert made.name.startswith(f"hps-mp-{os.getpid()}-")
    assert made.stat().st_mode & 0o777 == 0o700 and made.stat().st_uid == os.geteuid()


def test_dead_runs_of_this_user_go_another_users_stay(
        tmp_path: Path, stranger: Stranger) -> None:  # noqa: F811
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ours, theirs = tmp_path / f"hps-mp-{dead.pid}", tmp_path / f"hps-mp-{dead.pid}-x"
    ours.mkdir()
    theirs.mkdir()
    (theirs / "segment").write_text("theirs")
    stranger.owns(theirs)
    assert run_dir.remove_dead_runs(tmp_path) == [ours]
    assert not ours.exists() and (theirs / "segment").exists()


def test_serve_with_workers_says_one_line(tmp_path: Path, stranger: Stranger) -> None:  # noqa: F811
    """The supervisor's run folder is named after its PID: the plant is made by the
    process that then runs the `hps` command, as a user's shell would run it."""
    rng = np.random.default_rng(3)
    keys = rng.choice(1 << 30, 100, replace=False).astype(np.int64)
    write_table(tmp_path / "t0", keys, rng.standard_normal((100, 8)).astype(np.float32))
    config = tmp_path / "ps.json"
    config.write_text(json.dumps({"supportlonglong": True, "volatile_db": {"type": "hash_map"},
                                  "models": [model_config([str(tmp_path / "t0")], [8])]}))
    shm = tmp_path / "shm"
    shm.mkdir()
    code = (
        "import os, sys\n"
        f"path = {str(shm)!r} + f'/hps-mp-{{os.getpid()}}'\n"
        "os.mkdir(path)\n"
        f"{stranger.chown_line('path')}\n"
        "sys.argv = ['hps', 'serve', sys.argv[1], '--port', '0', '--workers', '2']\n"
        "from hps.tools.cli import main\n"
        "main()\n")
    done = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HPS_SHM_DIR": str(shm),
                               "COLUMNS": "300"})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot make the run folder: "), \
        done.stderr
    assert "Traceback" not in done.stderr and f"user {stranger.uid}" in lines[0]
