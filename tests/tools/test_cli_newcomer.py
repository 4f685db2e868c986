"""What a newcomer meets in the first hour of `hps`, run as a user runs it (subprocesses):
a misspelt key stops the run, a lookup writes no store unasked, nothing slow is silent,
every printed hint works, every help names every choice."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import write_table
from tests.tools.test_cli import ROOT, hps, write_config


@pytest.mark.parametrize("command", [["load"], ["lookup", "-m", "m", "--", "1"]])
def test_a_misspelt_key_stops_the_command_before_anything_loads(
        two_tables: dict[str, Any], command: list[str]) -> None:
    model = two_tables["config"]["models"][0]
    model["embeding_table_names"] = model.pop("embedding_table_names", ["a", "b"])
    config = write_config(two_tables)
    result = hps(command[0], str(config), *command[1:])
    assert result.returncode == 2, result.stderr
    assert ("'models[0].embeding_table_names' is not a config key: did you mean "
            "'models[0].embedding_table_names'?") in " ".join(result.stderr.split())
    assert not (two_tables["dir"] / "rocks").exists()  # nothing was opened nor loaded


def _snapshot(folder: Path) -> dict[str, Any]:
    """Size and modification time of the store's folder and of every file in it,
    rocksdict's own settings file included."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in [folder, *sorted(folder.rglob("*"))]}


def test_lookup_writes_no_store_unless_asked(two_tables: dict[str, Any]) -> None:
    config = write_config(two_tables)
    store = two_tables["dir"] / "rocks"
    (k0, v0), _ = two_tables["tables"]
    lookup = ["lookup", str(config), "-m", "m", "--json", "--", str(k0[0]), str(k0[7])]
    # no store yet: the files are read into memory, and no store is created
    fresh = hps(*lookup)
    assert fresh.returncode == 0, fresh.stderr
    np.testing.assert_array_equal(np.array(json.loads(fresh.stdout)["vectors"], np.float32),
                                  v0[[0, 7]])
    assert f"there is no RocksDB store at {store} yet" in fresh.stderr
    assert "--write-store" in fresh.stderr
    assert not store.exists()
    # a store that holds the model is read read-only: not a byte of it changes, and it
    # answers with what it holds, not with files that changed since
    assert hps("load", str(config)).returncode == 0
    write_table(two_tables["dir"] / "t0", k0, v0 + 1.0)
    before = _snapshot(store)
    stored = hps(*lookup)
    assert stored.returncode == 0, stored.stderr
    np.testing.assert_array_equal(np.array(json.loads(stored.stdout)["vectors"], np.float32),
                                  v0[[0, 7]])
    assert _snapshot(store) == before and stored.stderr == ""
    # --read-only, kept for the scripts that pass it, is the same
    assert hps(*lookup[:4], "--read-only", *lookup[4:]).stdout == stored.stdout
    # --write-store loads the changed files into the store first
    written = hps(*lookup[:4], "--write-store", *lookup[4:])
    assert written.returncode == 0, written.stderr
    np.testing.assert_array_equal(np.array(json.loads(written.stdout)["vectors"], np.float32),
                                  v0[[0, 7]] + 1.0)
    assert _snapshot(store) != before


def test_lookup_help_says_what_it_writes() -> None:
    text = " ".join(hps("lookup", "-h").stdout.split())
    assert "--read-only / --write-store" in text and "[default: read-only]" in text
    assert "no store is created" in text and "writes no store unless --write-store" in text


def test_a_piped_demo_says_each_step_as_it_starts(tmp_path: Path) -> None:
    # a numba cache of its own: this demo compiles, as the first run on a machine does
    env = {"COLUMNS": "", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    done = subprocess.run([sys.executable, "-m", "hps.tools.cli", "demo", "--scale", "0.05",
                           "--folder", str(tmp_path / "demo")], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    assert lines[0] == "compiling what the demo runs (first run only) …", lines[:3]
    order = [next(i for i, line in enumerate(lines) if line.startswith(start)) for start in (
        "compiled functions: ", "Writing a 50,000-key model", "loading demo/user_item: 30,000 keys",
        "loading demo/user_item: done, 30,000 keys in", "loading demo/item_category: 20,000",
        "loading demo/item_category: done", "all looked-up vectors match")]
    assert order == sorted(order), lines
    # the next run reads what the first compiled from numba's cache: it never says it
    # compiles (a slow read says "reading compiled code from numba's cache" instead)
    again = subprocess.run([sys.executable, "-m", "hps.tools.cli", "demo", "--scale", "0.05",
                            "--folder", str(tmp_path / "demo")], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stdout
    assert not [line for line in again.stdout.splitlines() if line.startswith("compiling")
                or " compiled, " in line], again.stdout
    assert "read from numba's cache in" in again.stdout


def test_plain_progress_lines_say_keys_rate_and_what_remains() -> None:
    from hps.tools.cli.progress import LineProgress

    lines: list[str] = []
    heard = threading.Condition()

    def say(line: str) -> None:
        with heard:
            lines.append(line)
            heard.notify_all()

    def wait_for(text: str) -> str:
        with heard:
            assert heard.wait_for(lambda: any(text in line for line in lines), timeout=30)
        return next(line for line in lines if text in line)

    progress = LineProgress(say=say, every=0.05)
    try:
        progress.start_table("hps_et.demo.user_item", 1000, 4 << 20)
        assert lines == ["loading demo/user_item: 1,000 keys, 4 MiB …"]
        progress.advance(500, 2 << 20)
        line = wait_for("500 of 1,000 keys (50%)")
        assert line.startswith("loading demo/user_item: ") and "keys/s, about" in line
        assert line.endswith(" s left")
        progress.advance(500, 2 << 20)
        wait_for("all 1,000 keys read, writing them")
        progress.finish_table("hps_et.demo.user_item", 2.0)
        assert lines[-1] == "loading demo/user_item: done, 1,000 keys in 2.0 s (500 keys/s)"
    finally:
        progress.close()


def test_quiet_progress_says_only_what_takes_a_while() -> None:
    from hps.tools.cli.progress import LineProgress

    lines: list[str] = []
    progress = LineProgress(say=lines.append, every=0.05, quiet=True)
    try:
        progress.start_table("hps_et.m.t", 10, 100)
        progress.finish_table("hps_et.m.t", 0.01)
        assert lines == []  # done before a line was due
        progress.start_table("hps_et.m.t", 10, 100)
        progress.advance(4, 40)
        for _ in range(3000):  # a tick is due every 0.05 s: at most 30 s
            if lines:
                break
            threading.Event().wait(0.01)
        progress.finish_table("hps_et.m.t", 1.0)
        assert lines[0].startswith("loading m/t: 4 of 10 keys (40%)")
        assert lines[-1] == "loading m/t: done, 10 keys in 1.0 s (10 keys/s)"
    finally:
        progress.close()


def test_hps_beside_a_writer_prints_ways_to_read_that_run_as_printed(
        two_tables: dict[str, Any]) -> None:
    """`HPS("ps.json")` in a second process beside one that holds the store for writing
    (as `hps serve` does) fails naming the config's own `hps lookup` line and the Python
    steps; both, pasted as printed in the same folder, read the store."""
    folder = two_tables["dir"]
    write_config(two_tables)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(folder),
           "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from hps import HierarchicalParameterServer; "
         "s = HierarchicalParameterServer('ps.json'); print('open', flush=True); "
         "sys.stdin.read(); s.close()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=folder, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        second = subprocess.run([sys.executable, "-c", "from hps import HPS; HPS('ps.json')"],
                                capture_output=True, text=True, cwd=folder, env=env,
                                timeout=300)
        assert second.returncode == 1
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("hps.errors.StoreInUseError: ") and "--read-only" not in last
        assert f"process {holder.pid}" in last
        shell = re.search(r"From a shell: `([^`]+)`", last)
        python = re.search(r"from Python: `([^`]+)`", last)
        assert shell is not None and python is not None, last
        assert shell.group(1) == "hps lookup ps.json -m m -- 0"
        looked_up = subprocess.run(["bash", "-c", shell.group(1)], capture_output=True,
                                   text=True, cwd=folder, env=env, timeout=300)
        assert looked_up.returncode == 0, looked_up.stderr
        assert looked_up.stdout.startswith("0: [")
        opened = subprocess.run(
            [sys.executable, "-c", f"{python.group(1)}; print(hps.lookup([0], 'm', 0).shape)"],
            capture_output=True, text=True, cwd=folder, env=env, timeout=300)
        assert opened.returncode == 0, opened.stderr
        assert opened.stdout.strip() == "(1, 8)"
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
