"""Every command the CLI prints as a hint works for the options it was given: each is run
as printed (`hps` standing for this checkout's `python -m hps.tools.cli`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.http.conftest import MODEL, ModelFiles
from tests.http.test_serve import Process, _run_curl, cli_env, config_file  # noqa: F401
from tests.support.redis_servers import free_port

HPS = [sys.executable, "-m", "hps.tools.cli"]


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)
    assert argv[0] == "hps", command
    return [*HPS, *argv[1:]]


def _serves_the_demo(command: str, folder: Path, env: dict[str, str]) -> None:
    """Run `command` (printed by the demo) until its server's curl line works, then
    stop it; the line's vectors are the demo's files' under `folder`."""
    proc = Process(_argv(command), env)
    try:
        line = proc.wait_for("curl ", timeout=120)
        # each table's load was said as it went, though no terminal reads the output
        assert any(s.startswith("loading demo/user_item: ") for s in proc.seen), proc.seen
        assert any(s.startswith("loading demo/item_category: done") for s in proc.seen)
        answer = _run_curl(line, env)
        vectors = np.fromfile(folder / "user_item" / "emb_vector", "<f4").reshape(-1, 16)
        np.testing.assert_array_equal(np.asarray(answer["vectors"], np.float32),
                                      vectors[:3])
    finally:
        assert proc.interrupt() in (0, 130)


def test_the_demos_serve_hints_serve_its_folder_on_its_port(
        tmp_path: Path, cli_env: dict[str, str]) -> None:  # noqa: F811
    folder, port = tmp_path / "my demo", free_port()
    done = subprocess.run([*HPS, "demo", "--scale", "0.01", "--folder", str(folder),
                           "--port", str(port)], capture_output=True, text=True, env=cli_env,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    hint = re.search(r"Serve it over HTTP: (hps serve .+) \(or (hps demo .+)\)$", done.stdout,
                     re.MULTILINE)
    assert hint is not None, done.stdout
    serve, again = hint.groups()
    assert f"--port {port}" in serve and f"--port {port}" in again
    assert not (tmp_path / "models").exists()
    _serves_the_demo(serve, folder, cli_env)
    _serves_the_demo(again, folder, cli_env)
    assert not (tmp_path / "models").exists()  # the folder asked for, never models/demo


def test_the_curl_hints_work_with_a_token_given_as_an_option(
        config_file: Path, model_files: ModelFiles,  # noqa: F811
        cli_env: dict[str, str]) -> None:  # noqa: F811
    for workers in ("1", "2"):
        proc = Process([*HPS, "serve", str(config_file), "--port", str(free_port()),
                        "--token", "tok-9", "--workers", workers], cli_env)
        try:
            said = proc.wait_for("every model is loaded", timeout=120)
            assert "HPS_TOKEN holding the server's token" in said
            line = said[said.index("curl "):] if "curl " in said else proc.wait_for("curl ")
            answer = _run_curl(line, {**cli_env, "HPS_TOKEN": "tok-9"})
            if workers == "1":
                assert answer["model"] == MODEL
                np.testing.assert_array_equal(np.asarray(answer["vectors"], np.float32),
                                              model_files.vectors[0][:3])
            else:
                assert [m["model"] for m in answer["models"]] == [MODEL]
        finally:
            assert proc.interrupt() in (0, 130)
