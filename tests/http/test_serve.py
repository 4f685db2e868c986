"""`hps serve` and `hps demo --serve` as a user runs them: a process, a port, a curl line."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps.errors import BindError
from hps.http.serve import bind_socket
from tests.http.conftest import MODEL, ModelFiles
from tests.support.redis_servers import free_port


class Process:
    """A CLI process whose output lines are collected by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, text=True, cwd=cwd)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                line = ""
            if line:
                self.seen.append(line)
                if text in line:
                    return line
            if self.proc.poll() is not None and self.lines.empty():
                raise AssertionError(f"exited {self.proc.returncode}:\n{''.join(self.seen)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout} s:\n{''.join(self.seen)}")

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HPS_TOKEN"}
    env["COLUMNS"] = "80"  # a narrow terminal must not wrap the curl line
    env["PYTHONPATH"] = str(ROOT)  # this checkout's hps, from any working directory
    return env


def _run_curl(line: str, env: dict[str, str]) -> dict[str, object]:
    """Run the printed curl line as a shell would (only $HPS_TOKEN is expanded).

    Without a curl binary the line is parsed (-H, -d, the URL) and sent with httpx.
    """
    argv = [a.replace("$HPS_TOKEN", env.get("HPS_TOKEN", "")) for a in shlex.split(line.strip())]
    assert argv[0] == "curl"
    if shutil.which("curl"):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
        assert done.returncode == 0, done.stderr
        text = done.stdout
    else:
        headers = dict(argv[i + 1].split(": ", 1) for i, a in enumerate(argv) if a == "-H")
        body = argv[argv.index("-d") + 1]
        text = httpx.post(argv[-1], content=body, headers=headers, timeout=30).text
    answer = json.loads(text)
    assert isinstance(answer, dict) and "error" not in answer, answer
    return answer


@pytest.fixture
def config_file(tmp_path: Path, model_files: ModelFiles) -> Iterator[Path]:
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(model_files.config))
    yield path


def test_serve_prints_a_working_curl_line(config_file: Path, model_files: ModelFiles,
                                          cli_env: dict[str, str]) -> None:
    port = free_port()
    env = {**cli_env, "HPS_TOKEN": "tok-123"}
    proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", str(config_file),
                    "--port", str(port)], env)
    try:
        proc.wait_for(f"http://127.0.0.1:{port}")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        line = proc.wait_for("curl ")
        assert "tok-123" not in line  # the token is referenced, never printed
        answer = _run_curl(line, env)
        assert answer["model"] == MODEL and answer["table"] == "users"
        np.testing.assert_array_equal(np.asarray(answer["vectors"], np.float32),
                                      model_files.vectors[0][:3])
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
    finally:
        assert proc.interrupt() in (0, 130)  # 130: the conventional exit after Ctrl-C


def test_serve_fails_clearly_on_a_bad_config(tmp_path: Path, cli_env: dict[str, str]) -> None:
    bad = tmp_path / "ps.json"
    bad.write_text('{"models": []}')
    done = subprocess.run([sys.executable, "-m", "hps.tools.cli", "serve", str(bad), "--port",
                           str(free_port())], capture_output=True, text=True, env=cli_env,
                          timeout=60)
    assert done.returncode == 2
    assert "models" in done.stdout + done.stderr


def test_demo_serves_with_serve_and_ends_without(tmp_path: Path,
                                                 cli_env: dict[str, str]) -> None:
    port = free_port()
    proc = Process([sys.executable, "-m", "hps.tools.cli", "demo", "--scale", "0.01", "--folder",
                    str(tmp_path / "demo"), "--serve", "--port", str(port)], cli_env)
    try:
        line = proc.wait_for("curl ", timeout=90)
        answer = _run_curl(line, cli_env)
        assert answer["model"] == "demo" and answer["width"] == 16
        keys = np.fromfile(tmp_path / "demo" / "user_item" / "key", "<i8")[:3]
        vectors = np.fromfile(tmp_path / "demo" / "user_item" / "emb_vector", "<f4")
        np.testing.assert_array_equal(np.asarray(answer["vectors"], np.float32),
                                      vectors.reshape(-1, 16)[:3])
        assert f'"keys": [{", ".join(map(str, keys))}]' in line
    finally:
        assert proc.interrupt() in (0, 130)  # 130: the conventional exit after Ctrl-C
    done = subprocess.run([sys.executable, "-m", "hps.tools.cli", "demo", "--scale", "0.01",
                           "--folder", str(tmp_path / "again")], capture_output=True,
                          text=True, env=cli_env, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--serve" in done.stdout  # ends, and says how to serve (tests/http/test_hints.py)


def test_a_taken_port_is_one_line_and_exit_1(config_file: Path,
                                              cli_env: dict[str, str]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        done = subprocess.run([sys.executable, "-m", "hps.tools.cli", "serve", str(config_file),
                               "--port", str(port)], capture_output=True, text=True,
                              env=cli_env, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1
    assert "serving" not in done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"port {port} is in use" in done.stderr and "--port" in done.stderr


def test_a_port_past_65535_is_refused_not_wrapped(config_file: Path,
                                                  cli_env: dict[str, str]) -> None:
    # before, 99999 reached the resolver, which wrapped it: the server ran on 34463
    done = subprocess.run([sys.executable, "-m", "hps.tools.cli", "serve", str(config_file),
                           "--port", "99999"], capture_output=True, text=True, env=cli_env,
                          timeout=60)
    assert done.returncode == 2 and "serving" not in done.stdout + done.stderr
    assert "--port" in done.stderr and "65535" in done.stderr, done.stderr
    for port in (65536, -1):  # the library call says so too, binding nothing
        with pytest.raises(BindError, match=r"a TCP port is 0 to 65535"):
            bind_socket("127.0.0.1", port)


def test_fresh_clone_demo_then_serve_configs_demo(tmp_path: Path,
                                                  cli_env: dict[str, str]) -> None:
    """README: `hps demo` then `hps serve configs/demo.json`, keys 17, 42, -3 hit; and
    `hps lookup` reads the served RocksDB read-only; with --write-store it says how to
    read it."""
    clone = tmp_path / "clone"
    (clone / "configs").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "demo.json", clone / "configs" / "demo.json")
    demo = subprocess.run([sys.executable, "-m", "hps.tools.cli", "demo", "--scale", "0.01"],
                          capture_output=True, text=True, env=cli_env, cwd=clone, timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    folder = clone / "models" / "demo"
    assert (folder / "user_item" / "key").is_file()
    port = free_port()
    proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", "configs/demo.json", "--port",
                    str(port)], cli_env, cwd=clone)
    try:
        proc.wait_for("curl ", timeout=90)
        url = f"http://127.0.0.1:{port}/v1/models/demo/tables"
        for table, dim in (("user_item", 16), ("item_category", 64)):
            answer = httpx.post(f"{url}/{table}/lookup", json={"keys": [17, 42, -3]}).json()
            rows = np.fromfile(folder / table / "emb_vector", "<f4").reshape(-1, dim)
            assert np.fromfile(folder / table / "key", "<i8")[:3].tolist() == [17, 42, -3]
            np.testing.assert_array_equal(np.asarray(answer["vectors"], np.float32), rows[:3])
        lookup = [sys.executable, "-m", "hps.tools.cli", "lookup", "configs/demo.json",
                  "-m", "demo", "-t", "item_category", "--json", "--", "17", "42", "-3"]
        locked = subprocess.run([*lookup[:5], "--write-store", *lookup[5:]],
                                capture_output=True, text=True, env=cli_env, cwd=clone,
                                timeout=60)
        assert locked.returncode == 2, locked.stderr
        plain = re.search(r"without --write-store, `([^`]+)` reads it", locked.stderr)
        assert plain is not None, locked.stderr  # the command as given, less --write-store
        assert shlex.split(plain.group(1))[1:] == [str(a) for a in lookup[3:]]
        read = subprocess.run(lookup, capture_output=True, text=True, env=cli_env, cwd=clone,
                              timeout=60)  # read-only by default
        assert read.returncode == 0, read.stderr
        rows = np.fromfile(folder / "item_category" / "emb_vector", "<f4").reshape(-1, 64)
        np.testing.assert_array_equal(np.asarray(json.loads(read.stdout)["vectors"],
                                                 np.float32), rows[:3])
    finally:
        assert proc.interrupt() in (0, 130)


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under `folder`; only the name of
    RocksDB's info log, which its writer (the server) appends to as it runs."""
    return {str(p.relative_to(folder)): (0, 0) if p.name == "LOG" else
            (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_demo_beside_its_server_writes_nothing_and_says_how_to_read(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """A second `hps demo` while `hps serve` serves the demo's folder refuses in one line,
    naming the server's process, before a byte is written (model files, ps.json and
    RocksDB alike); the read-only ways it names work beside the server: `hps lookup
    (without --write-store), and in Python the config with persistent_db.read_only."""
    from hps import load_config
    from hps.inference import HPS

    folder = tmp_path / "demo"
    demo = [sys.executable, "-m", "hps.tools.cli", "demo", "--scale", "0.01", "--folder",
            str(folder)]
    first = subprocess.run(demo, capture_output=True, text=True, env=cli_env, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", str(folder / "ps.json"),
                    "--port", str(free_port())], cli_env)
    try:
        proc.wait_for("curl ", timeout=90)
        before = _snapshot(folder)
        again = subprocess.run(demo, capture_output=True, text=True, env=cli_env, timeout=300)
        assert again.returncode == 2 and again.stdout == "", again.stdout
        assert len(again.stderr.strip().splitlines()) == 1, again.stderr
        assert f"process {proc.proc.pid}" in again.stderr
        assert "nothing was written" in again.stderr
        assert f"`hps lookup {folder / 'ps.json'} -m demo -- 17 42 -3`" in again.stderr
        assert "Traceback" not in again.stderr
        assert _snapshot(folder) == before
        lookup = [sys.executable, "-m", "hps.tools.cli", "lookup", str(folder / "ps.json"),
                  "-m", "demo", "--json", "--", "17", "42", "-3"]
        locked = subprocess.run([*lookup[:4], "--write-store", *lookup[4:]],
                                capture_output=True, text=True, env=cli_env, timeout=120)
        assert locked.returncode == 2 and len(locked.stderr.strip().splitlines()) == 1
        assert "persistent_db.read_only" in locked.stderr
        assert f"`hps lookup {folder / 'ps.json'} -m demo --json -- 17 42 -3`" in locked.stderr
        read = subprocess.run([*lookup[:4], "--read-only", *lookup[4:]], capture_output=True,
                              text=True, env=cli_env, timeout=120)
        assert read.returncode == 0, read.stderr
        rows = np.fromfile(folder / "user_item" / "emb_vector", "<f4").reshape(-1, 16)
        np.testing.assert_array_equal(
            np.asarray(json.loads(read.stdout)["vectors"], np.float32), rows[:3])
        config = load_config(str(folder / "ps.json"))
        config.persistent_db.read_only = True  # as README shows beside a server
        with HPS(config) as hps:
            np.testing.assert_array_equal(hps.lookup(np.array([17, 42, -3]), "demo", 0),
                                          rows[:3])
    finally:
        assert proc.interrupt() in (0, 130)


def test_a_model_that_fails_to_load_is_one_line_and_require_models_exits(
        tmp_path: Path, model_files: ModelFiles, cli_env: dict[str, str]) -> None:
    """A config whose second model's folder does not exist: `hps serve` says so in one
    line naming the model and the folder, and serves the other (/readyz 503); with
    --require-models, or http.require_models in the config, it exits with status 2 after
    that line, one error line and no traceback."""
    gone = {**model_files.config["models"][0], "model": "gone",
            "sparse_files": [str(tmp_path / "nope"), str(tmp_path / "nope2")]}
    config = {**model_files.config, "models": [model_files.config["models"][0], gone]}
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    port = free_port()
    proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", str(path), "--port",
                    str(port)], cli_env)
    try:
        line = proc.wait_for("hps: model 'gone' failed to load", timeout=90)
        assert f"models[1].sparse_files[0]: sparse folder '{tmp_path / 'nope'}' does not " \
            "exist" in line
        assert "--require-models" in line and "/readyz answers 503" in line
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/readyz").status_code == 503
        served = httpx.post(f"{url}/v1/models/{MODEL}/tables/0/lookup",
                            json={"keys": model_files.keys[0][:3].tolist()})
        assert served.status_code == 200
    finally:
        assert proc.interrupt() in (0, 130)
    failed_lines = [x for x in proc.seen if "failed to load" in x]
    assert len(failed_lines) == 1 and not any("Traceback" in x for x in proc.seen)

    required = dict(config, http={"require_models": True})
    (tmp_path / "required.json").write_text(json.dumps(required))
    for argv in ([str(path), "--require-models"], [str(tmp_path / "required.json")]):
        done = subprocess.run([sys.executable, "-m", "hps.tools.cli", "serve", *argv,
                               "--port", str(free_port())], capture_output=True, text=True,
                              env=cli_env, timeout=180)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "hps: model 'gone' failed to load: models[1].sparse_files[0]: sparse " \
            "folder" in done.stdout
        assert "(--require-models: stopping)" in done.stdout
        errors = done.stderr.strip().splitlines()
        assert errors[-1] == ("error: 1 of 2 models failed to load at start (gone); "
                              "--require-models stopped the server"), done.stderr
        assert "Traceback" not in done.stderr


def test_a_model_that_failed_on_a_typo_loads_after_the_fix_with_the_printed_command(
        tmp_path: Path, model_files: ModelFiles, cli_env: dict[str, str]) -> None:
    """The newcomer's path: a ps.json naming a folder with a typo; `hps serve` says which
    file to fix and prints the reload command; after the fix, that command, run as
    printed, loads the model from the file read again (/readyz turns 200)."""
    good = json.loads(json.dumps(model_files.config))
    typo = json.loads(json.dumps(good))
    typo["models"][0]["sparse_files"][1] = str(model_files.dir / "itmes")
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(typo))
    port = free_port()
    proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", str(path), "--port",
                    str(port)], cli_env)
    try:
        line = proc.wait_for(f"hps: model '{MODEL}' failed to load", timeout=90)
        assert f"fix {path}, then" in line, line
        printed = re.search(r"`(curl [^`]+)`", line)
        assert printed is not None, line
        assert printed.group(1) == (f"curl -s -X POST http://127.0.0.1:{port}/v1/models/"
                                    f"{MODEL}/reload")
        path.write_text(json.dumps(good))
        if shutil.which("curl"):
            done = subprocess.run(["bash", "-c", printed.group(1)], capture_output=True,
                                  text=True, env=cli_env, timeout=120)
            assert done.returncode == 0, done.stderr
            answer = json.loads(done.stdout)
        else:  # the same request, sent with httpx
            answer = httpx.post(shlex.split(printed.group(1))[-1], timeout=120).json()
        assert answer["model"] == MODEL and "error" not in answer, answer
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/readyz").status_code == 200
        served = httpx.post(f"{url}/v1/models/{MODEL}/tables/1/lookup",
                            json={"keys": model_files.keys[1][:3].tolist()})
        assert served.status_code == 200
        np.testing.assert_array_equal(np.asarray(served.json()["vectors"], np.float32),
                                      model_files.vectors[1][:3])
    finally:
        assert proc.interrupt() in (0, 130)


def test_the_first_load_on_a_machine_says_it_compiles(config_file: Path, tmp_path: Path,
                                                      cli_env: dict[str, str]) -> None:
    """With nothing in numba's cache (a fresh machine), `hps serve` says once that it
    compiles before the load's first compile ends; with the cache filled, it does not."""
    env = {**cli_env, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    for run in ("fresh", "cached"):
        proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", str(config_file),
                        "--port", str(free_port())], env)
        try:
            proc.wait_for("every model is loaded", timeout=180)
        finally:
            assert proc.interrupt() in (0, 130)
        said = [x for x in proc.seen if "compiling what this config runs" in x]
        announced = [x for x in said if x.rstrip().endswith("numba caches it) …")]
        assert len(announced) == (1 if run == "fresh" else 0), "".join(proc.seen)
        # then, while compiles go on, a line every 2 s with the count so far
        counts = [int(m.group(1)) for x in said
                  for m in [re.search(r": (\d+) functions compiled, \d+ read", x)] if m]
        assert counts == sorted(counts) and len(said) == len(announced) + len(counts)
