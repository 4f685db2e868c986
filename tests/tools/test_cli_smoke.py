"""Every `hps` command and every `hps bench` subcommand, run as a user runs it (a
subprocess) at tiny sizes with its documented options: each exits 0 and prints what it
documents; the GPU benchmark refuses clearly without CUDA.

The runs are independent (each its own files, RocksDB store, Redis and ports), so they
run side by side: the whole module takes about half a minute on two cores.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import typer.main

from hps.modelfiles.formats.sparse_folder import write_sparse_model
from tests.support.redis_servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (8, 16)


@dataclass
class Ran:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"hps {' '.join(self.argv)} → {self.returncode}\n{self.stdout}\n{self.stderr}"


def hps(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> Ran:
    done = subprocess.run(
        [sys.executable, "-m", "hps.tools.cli", *argv], capture_output=True, text=True,
        cwd=cwd, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(cwd),
                                   "PYTHONPATH": str(ROOT), **(env or {})})
    return Ran(list(argv), done.returncode, done.stdout, done.stderr)


def write_model(folder: Path, seed: int, rocks: Path) -> tuple[Path, list[np.ndarray],
                                                               list[np.ndarray]]:
    """Two small tables (key -3 in both) and a ps.json reading them into its own store."""
    rng = np.random.default_rng(seed)
    keys, rows = [], []
    for index, width in enumerate(WIDTHS):
        table_keys = np.concatenate([[-3], rng.choice(10**9, 499, replace=False) + 1])
        table_rows = rng.standard_normal((500, width)).astype(np.float32)
        write_sparse_model(folder / f"t{index}", table_keys, table_rows)
        keys.append(table_keys)
        rows.append(table_rows)
    config = {"supportlonglong": True, "models": [{
        "model": "m", "sparse_files": [str(folder / "t0"), str(folder / "t1")],
        "embedding_table_names": ["t0", "t1"], "embedding_vecsize_per_table": list(WIDTHS),
        "maxnum_catfeature_query_per_table_per_sample": [4, 4],
        "deployed_device_list": [0], "max_batch_size": 64, "gpucache": False}],
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(rocks)}}
    path = folder / "ps.json"
    path.write_text(json.dumps(config))
    return path, keys, rows


def serve_and_manage(work: Path) -> dict[str, Ran]:
    """`hps serve`, then `hps models list|add|reload|remove` against it (a real server on
    a socket); reload takes relative paths, resolved on the client side."""
    served, _, _ = write_model(work / "models" / "m", 1, work / "rocks-serve")
    extra, _, _ = write_model(work / "models" / "extra", 2, work / "rocks-extra")
    block = json.loads(extra.read_text())["models"][0]
    extra.write_text(json.dumps({**block, "model": "extra"}))
    _, new_keys, new_rows = write_model(work / "models" / "new", 3, work / "rocks-new")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"HPS_URL": url}
    log = work / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hps.tools.cli", "serve", str(served), "--port", str(port),
             "--allow-root", str(work / "models")], stdout=out, stderr=subprocess.STDOUT,
            cwd=work, env={"PATH": "/usr/bin:/bin", "HOME": str(work), "PYTHONPATH": str(ROOT)})
    ran: dict[str, Ran] = {}
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                ran["serve"] = Ran(["serve"], proc.poll() or -1, "", log.read_text())
                return ran
            time.sleep(0.1)
        ran["serve"] = Ran(["serve"], 0, "ready", "")
        ran["models list"] = hps("models", "list", cwd=work, env=env)
        ran["models add"] = hps("models", "add", str(extra), cwd=work, env=env)
        ran["models keys"] = hps("models", "keys", "m", "t0", cwd=work, env=env)
        ran["models prefetch"] = hps("models", "prefetch", "m", cwd=work, env=env)
        # a CPU server's tables have no hot copies (sharded GPU tables do): refused
        ran["models hot-rows"] = hps("models", "hot-rows", "m", cwd=work, env=env)
        ran["models prefetch --wait"] = hps("models", "prefetch", "m", "--table", "t0",
                                            "--wait", cwd=work, env=env)
        # relative paths: from the folder they are in, resolved by the client
        ran["models reload"] = hps("models", "reload", "m", "t0", "t1",
                                   cwd=work / "models" / "new", env=env)
        body = json.dumps({"keys": [int(k) for k in new_keys[1][:3]]}).encode()
        request = urllib.request.Request(f"{url}/v1/models/m/tables/1/lookup", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            got = np.asarray(json.loads(answer.read())["vectors"], np.float32)
        ran["reloaded rows"] = Ran([], int(not np.array_equal(got, new_rows[1][:3])), "", "")
        ran["models reload again"] = hps("models", "reload", "m", cwd=work, env=env)
        ran["models reload missing"] = hps("models", "reload", "m", "absent0", "absent1",
                                           cwd=work / "models", env=env)
        ran["models remove"] = hps("models", "remove", "extra", cwd=work, env=env)
        return ran
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def publish(work: Path, redis: RedisServer) -> Ran:
    path, _, _ = write_model(work / "publish", 4, work / "rocks-publish")
    config = json.loads(path.read_text())
    config["update_source"] = {"type": "redis_stream", "address": redis.address}
    path.write_text(json.dumps(config))
    return hps("publish", str(path), "m", cwd=work)


def in_process(*argv: str, cwd: Path) -> Ran:
    """`hps ARGV` through typer's CliRunner in this process: no interpreter to start."""
    from typer.testing import CliRunner

    from hps.tools.cli import app

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    here = os.getcwd()
    os.chdir(cwd)
    try:
        done = CliRunner().invoke(app, list(argv), env={"COLUMNS": "200"})
    finally:
        os.chdir(here)
        root.handlers[:], root.level = handlers, level  # the command set up its own logging
    stderr = done.stderr
    if done.exception is not None and not isinstance(done.exception, SystemExit):
        stderr += "".join(traceback.format_exception(done.exception))
    return Ran(list(argv), done.exit_code, done.stdout, stderr)


Job = Callable[[], "Ran | dict[str, Ran]"]


#: sockets standing for MPS daemons' endpoints, open while the module's runs go on
_ENDPOINTS: list[socket.socket] = []


def jobs(work: Path, redis: RedisServer) -> tuple[dict[str, Job], dict[str, Job]]:
    """Every command, each in its own folder (its own files and RocksDB store): those
    that start processes of their own (servers, measured loads) as subprocesses, side by
    side; the others in this process, one after the other, meanwhile."""
    def folder(name: str) -> Path:
        (work / name).mkdir(exist_ok=True)
        return work / name

    def model(name: str, seed: int) -> Path:
        return write_model(folder(name), seed, work / name / "rocks")[0]

    local, looked, described = model("load", 5), model("lookup", 6), model("inspect", 7)
    # an MPS daemon's endpoint as the GPU machine's daemon opens it (a Unix socket named
    # `control`), for `hps mps status`; the control program itself is not on this PATH
    pipes = folder("mps-pipes")
    _ENDPOINTS.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    _ENDPOINTS[-1].bind(str(pipes / "control"))
    checkpoint = folder("from-torch") / "model.pt"
    import torch

    torch.save({"emb.weight": torch.zeros(10, 4), "dense.weight": torch.zeros(4, 4, 4)},
               checkpoint)
    apart = {  # the longest first: the pool's last runs are then short ones
        "bench http": ["bench", "http", "--keys", "2k", "--dim", "8", "--batch", "64",
                       "--clients", "1", "--seconds", "0.2", "--rounds", "1", "--no-pin"],
        "bench storage": ["bench", "storage", "--keys", "2k", "--dim", "8",
                          "--batches", "1,256", "--repeats", "20"],
        "bench soak": ["bench", "soak", "--minutes", "0.03", "--clients", "1",
                       "--reload-every", "1", "--redis-restarts", "1"],
        "bench slowloris": ["bench", "slowloris", "--connections", "20", "--requests", "20",
                            "--max-connections", "16"],
        "bench torch": ["bench", "torch", "--keys", "100", "--table-keys", "1k",
                        "--rounds", "2", "--calls", "3"],
        "bench ready": ["bench", "ready", "--demo-scale", "0", "--keys", "500", "--dim", "8",
                        "--workers", "1", "--folder", "other", "--first", "5",
                        "--later", "10", "--timeout", "240"],
        "mps status": ["mps", "status", "--pipe-dir", str(pipes)],
        "mps start": ["mps", "start", "--pipe-dir", str(work / "mps-new")],
        "mps stop": ["mps", "stop", "--pipe-dir", str(pipes)],
    }
    here = {
        "bench load": ["bench", "load", "--keys", "2k", "--dim", "8", "--rounds", "1"],
        "bench": ["bench", "--keys", "2k", "--batch", "256"],
        "bench tier-fetch": ["bench", "tier-fetch", "--keys", "2k", "--dim", "8",
                             "--batch", "256"],
        "bench load --format": ["bench", "load", "--format", "parquet", "--keys", "2k",
                                "--dim", "8", "--rounds", "1"],
        "bench tiers": ["bench", "tiers", "--keys", "2k", "--dim", "8", "--batches", "1,256",
                        "--repeats", "20", "--thread-batch", "256", "--rounds", "1"],
        "bench updates": ["bench", "updates", "--rows", "2k", "--table-keys", "2k",
                          "--dim", "8", "--batch", "64", "--per-message", "500",
                          "--seconds", "0.3", "--samples", "3"],
        "bench redis": ["bench", "redis", "--address", redis.address, "--keys", "2k",
                        "--dim", "8", "--batch", "256", "--repeats", "3"],
        "bench gpu": ["bench", "gpu", "--dims", "16", "--slots", "64k", "--batch", "1k"],
        "bench group options": ["bench", "--keys", "50000", "tiers"],
        "bench warm-start": ["bench", "warm-start", "--keys", "2k", "--dim", "8", "--batch",
                             "16", "--lookups", "50", "--first", "10"],
        "bench restart-fill": ["bench", "restart-fill", "--scale", "0.005", "--updated",
                               "100", "--restarts", "1"],
        "demo": ["demo", "--scale", "0.005", "--folder", "models/demo"],
        "load": ["load", str(local)],
        "lookup": ["lookup", str(looked), "-m", "m", "-t", "t1", "-3", "--json"],
        "inspect": ["inspect", str(described.parent / "t0")],
        "convert": ["convert", str(described.parent / "t1"),
                    str(work / "inspect" / "t1.parquet")],
        "config dump": ["config", "dump", str(described)],
        "plan": ["plan", "--table", "clicks:1M:64", "--json"],
        "validate": ["validate", str(described.parent / "t0"), "--width", "8"],
        "config from-torch": ["config", "from-torch", str(checkpoint), "-m", "m"],
    }
    subprocesses: dict[str, Job] = {"serve": lambda: serve_and_manage(folder("serve")),
                                    "publish": lambda: publish(folder("publish"), redis)}
    for name, argv in apart.items():
        subprocesses[name] = lambda argv=argv, cwd=folder(name): hps(*argv, cwd=cwd)
    local_runs: dict[str, Job] = {
        name: lambda argv=argv, cwd=folder(name): in_process(*argv, cwd=cwd)
        for name, argv in here.items()}
    return subprocesses, local_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ran]]:
    work = tmp_path_factory.mktemp("smoke")
    redis = RedisServer(work / "redis").start()
    try:
        subprocesses, local_runs = jobs(work, redis)
        results: dict[str, Ran] = {}
        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = {name: pool.submit(job) for name, job in subprocesses.items()}
            for name, job in local_runs.items():
                results[name] = job()  # type: ignore[assignment]
        for name, future in futures.items():
            result = future.result()
            results.update(result if isinstance(result, dict) else {name: result})
        yield results
    finally:
        redis.close()
        while _ENDPOINTS:
            _ENDPOINTS.pop().close()


#: what each run must print: (stdout, stderr) fragments
EXPECTED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "demo": (("compiled functions: ", "0 mismatches", "match the model files",
              "hps serve models/demo/ps.json"), ()),
    "load": (("loaded models", "500"), ()),
    "lookup": (('"keys": [-3]',), ()),
    "inspect": (("sparse_folder", "500", "valid"), ()),
    "convert": (("parquet",), ("writing ",)),
    "config dump": (('"models"', '"t1"'), ()),
    "plan": (('"clicks"', '"GPU dynamic cache'), ()),
    "validate": (("load gate", "width", "ok"), ()),
    "config from-torch": (('"sparse_files"', '"emb"'), ()),
    "publish": (("messages published to redis_stream",), ()),
    "serve": (("ready",), ()),
    "models list": (("loaded models", "t0", "t1"), ()),
    "models add": (("added model extra",), ()),
    "models reload": (("reloaded model m (tables t0, t1)",), ()),
    "reloaded rows": ((), ()),
    "models reload again": (("reloaded model m",), ()),
    "models remove": (("removed model extra",), ()),
    "models keys": (("hot keys of m / t0",), ()),
    "models prefetch": (("m / t0: job p", "m / t1: job p"), ()),
    "models prefetch --wait": (("m / t0: job p", " done: ", " found, ", " in no tier"), ()),
    "bench warm-start": (("warmed", "p99 µs", "the peer's hot set"), ()),
    "bench restart-fill": (("after 100 updated keys", "but for 100 keys written"), ()),
    "bench": (("expected peak memory", "searchsorted", "multi_get"), ()),
    "bench tier-fetch": (("expected peak memory", "2,000 keys", "multi_get"), ()),
    "bench load": (("expected peak memory", "2,000"), ()),
    "bench load --format": (("parquet: ", "keys/s, sparse folder"), ()),
    "bench storage": (("expected peak memory", "float16 → float16 out", "RSS growth"), ()),
    "bench tiers": (("HPS.lookup", "two threads / one"), ()),
    "bench updates": (("ingest, rows/s", "publish → visible p50"), ()),
    "bench redis": (("ours / baseline",), ()),
    "bench torch": (("LookupLayer overhead over lookup_fromdlpack",), ()),
    "bench http": (("v1 binary lookup", "bare uvicorn (floor)", "one client alone"), ()),
    "bench soak": (("0 failed, 0 wrong",), ()),
    "bench slowloris": (("alone:", "attacked:"), ()),
    "mps status": (("running (",), ()),
    "bench ready": (("ready cold s", "load average before:"), ()),
}
#: runs that must fail, with exit status 2 and the line that names the fix
REFUSED = {
    "bench gpu": "needs a CUDA device and CuPy: pip install 'hps-server[gpu]'",
    "bench group options": "put them after it: hps bench tiers --keys 50000",
    "models reload missing": "404",
    "models hot-rows": "409",
    "mps start": "nvidia-cuda-mps-control is not on PATH",
    "mps stop": "nvidia-cuda-mps-control is not on PATH",
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_command_runs(runs: dict[str, Ran], name: str) -> None:
    ran = runs[name]
    assert ran.returncode == 0, str(ran)
    out, err = EXPECTED[name]
    for text in out:
        assert text in ran.stdout, f"{text!r} missing: {ran}"
    for text in err:
        assert text in ran.stderr, f"{text!r} missing: {ran}"
    assert "Traceback" not in ran.stderr, str(ran)


@pytest.mark.parametrize("name", list(REFUSED))
def test_command_refuses_with_the_fix(runs: dict[str, Ran], name: str) -> None:
    ran = runs[name]
    assert ran.returncode == 2, str(ran)
    assert REFUSED[name] in ran.stderr, str(ran)
    assert "Traceback" not in ran.stderr, str(ran)


def test_every_command_is_run(runs: dict[str, Ran]) -> None:
    """A command added to `hps` without a run here fails this test."""
    from hps.tools.cli import app

    def names(group: object, prefix: str = "") -> Iterator[str]:
        for name, command in group.commands.items():  # type: ignore[attr-defined]
            if hasattr(command, "commands"):
                yield from names(command, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}"

    ran = {name.split(" --")[0] for name in runs}
    missing = [n for n in names(typer.main.get_command(app)) if n not in ran]
    assert not missing, f"commands the smoke test does not run: {missing}"
