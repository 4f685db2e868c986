"""A reload onto a full disk: 507 with a JSON body naming the file and the bytes not
written, one log line (no traceback), the old version serving on; a reload that fits
works afterwards. The disk is real: `hps serve` runs in a user namespace (`unshare -Urm`,
no root needed) with its RocksDB on a 4 MiB tmpfs mounted there, so the kernel itself
answers ENOSPC."""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import httpx
import numpy as np

from tests.http.conftest import DIMS, MODEL, TABLE_NAMES, write_model
from tests.http.test_serve import Process, cli_env  # noqa: F401 - a fixture
from tests.support.redis_servers import free_port

#: mounts a tmpfs of 4 MiB on $1 in a new user and mount namespace, then runs the rest
_ON_SMALL_DISK = 'mount -t tmpfs -o size=4m tmpfs "$1" && shift && exec "$@"'


def test_a_reload_onto_a_full_disk_answers_507(tmp_path: Path,
                                               cli_env: dict[str, str]) -> None:  # noqa: F811
    assert shutil.which("unshare"), "util-linux's unshare is needed to make a small disk"
    served = write_model(tmp_path / "models" / "m", seed=3, sizes=(300, 200))
    big = write_model(tmp_path / "models" / "big", seed=4, sizes=(20000, 40000))
    disk = tmp_path / "disk"
    disk.mkdir()
    config = copy.deepcopy(served.config)
    config["persistent_db"] = {"type": "rocks_db", "path": str(disk / "rocks")}
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    port = free_port()
    proc = Process(["unshare", "-Urm", "sh", "-c", _ON_SMALL_DISK, "sh", str(disk),
                    sys.executable, "-m", "hps.tools.cli", "serve", str(path),
                    "--port", str(port)], cli_env)
    try:
        proc.wait_for("every model is loaded")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            answer = client.post(f"/v1/models/{MODEL}/reload", json={
                "sparse_files": [str(big.dir / t) for t in TABLE_NAMES]})
            assert answer.status_code == 507, answer.text
            error = answer.json()["error"]
            assert error["kind"] == "insufficient_storage"
            assert str(disk / "rocks") in error["message"]
            assert "bytes of a table file not written" in error["message"]
            keys = served.keys[1][:100]
            got = client.post(f"/v1/models/{MODEL}/tables/1/lookup",
                              content=keys.astype("<i8").tobytes(),
                              headers={"Content-Type": "application/octet-stream"})
            assert got.status_code == 200
            assert np.array_equal(np.frombuffer(got.content, "<f4").reshape(-1, DIMS[1]),
                                  served.expected(1, keys))
            # what the failed reload wrote went away: one that fits is taken
            fits = client.post(f"/v1/models/{MODEL}/reload", json={
                "sparse_files": [str(served.dir / t) for t in TABLE_NAMES]})
            assert fits.status_code == 200, fits.text
    finally:
        proc.interrupt()
    while not proc.lines.empty():
        proc.seen.append(proc.lines.get())
    output = "".join(proc.seen)
    assert "Traceback" not in output, output
    assert output.count("[Errno 28]") == 1, output  # one log line (wrapped by the console)
