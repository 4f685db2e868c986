"""Every command line shown in README.md and docs/*.md runs as shown.

The fenced ```bash, ```sh, ```shell and ```console blocks of each page run in order, as a
reader following the page would run them: one shell command at a time (a line, or one
side of `&&`), in a fresh copy of the tracked files, with the project's `.venv` first on
PATH. A command must exit 0. Three kinds are handled apart, each for a stated reason:

- the set-up steps (making and activating a virtual environment, `pip install`) are
  checked, not run: this suite already runs in the project's `.venv`, and installing into
  it would replace the checkout's own install. A `pip install` is checked to be a no-op
  here: every extra it names exists and every requirement is installed (STAND_INS);
- `hps serve` runs in the background until its `/readyz` answers 200, the next commands
  of the page run against it, and it is stopped when the page ends. It serves on a free
  port instead of 8000, which other tests or services may hold;
- a block after `<!-- docs-test: MARKER -->` is not run; MARKERS says which markers exist
  and why, and commands in NOT_RUN are not run either. Both lists must stay short.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import httpx
import numpy as np
import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent

#: markers a block may carry (`<!-- docs-test: MARKER -->` on the line before it) and why
#: a block so marked is not run
MARKERS = {
    "skip-network": "needs a service on the network (an S3 bucket, a registry)",
    "skip-gpu": "needs a CUDA device",
    "skip-container": "needs a container runtime",
    "skip-long": "runs for minutes",
}
#: commands that are not run, by their first words, and why
NOT_RUN = {
    "bash scripts/test.sh": "runs the whole test suite (this test is part of it)",
}
#: how long one command may take, and a server to answer /readyz (generous: a stuck
#: command fails the test, a slow one does not)
COMMAND_TIMEOUT = 300
READY_TIMEOUT = 120

_FENCE = re.compile(r"^```(bash|sh|shell|console)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*docs-test:\s*([\w-]+)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    marker: str | None
    commands: list[str]


def blocks_of(page: str) -> list[Block]:
    """The shell blocks of `page`, each with its marker and its commands."""
    text = (ROOT / page).read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        found.append(Block(page, text.count("\n", 0, match.start()) + 1,
                           marker.group(1) if marker else None,
                           commands_of(match.group(2), console=match.group(1) == "console")))
    return found


def commands_of(body: str, console: bool = False) -> list[str]:
    """The commands of a block: continuation lines joined, comments and blank lines
    dropped, `a && b` split in two; in a console block only lines after `$ `."""
    lines = body.replace("\\\n", " ").splitlines()
    if console:
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if not words:
            continue
        command: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                commands.append(shlex.join(command))
                command = []
            else:
                command.append(word)
    return commands


# -- set-up steps, checked rather than run ------------------------------------------------

def _installed(requirement: Requirement, constraints: dict[str, str]) -> str | None:
    """Why `requirement` is not met by the installed distributions (None: it is)."""
    if requirement.marker is not None and not requirement.marker.evaluate():
        return None
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return f"{requirement.name} is not installed"
    if not requirement.specifier.contains(version, prereleases=True):
        return f"{requirement.name} {version} does not meet {requirement.specifier}"
    pinned = constraints.get(requirement.name.lower().replace("_", "-"))
    if pinned is not None and pinned != version:
        return f"{requirement.name} {version} is not the pinned {pinned} (constraints.txt)"
    return None


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["optional-dependencies"])


def check_pip_install(words: list[str], work: Path) -> None:
    """`pip install ...` would change nothing here: each extra of `.[...]` exists and its
    requirements are installed, and so is each package named (at its pin with -c)."""
    args = words[2:]
    constraints: dict[str, str] = {}
    targets: list[str] = []
    index_url = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-c", "--constraint"):
            for line in (work / args[i + 1]).read_text().splitlines():
                name, sep, version = line.partition("==")
                if sep:
                    constraints[name.strip().lower().replace("_", "-")] = version.strip()
            i += 2
        elif arg in ("--index-url", "--extra-index-url"):
            index_url = args[i + 1]
            i += 2
        elif arg.startswith("-"):
            raise AssertionError(f"`{shlex.join(words)}`: option {arg} is not known here")
        else:
            targets.append(arg)
            i += 1
    assert targets, f"`{shlex.join(words)}` installs nothing"
    extras = _extras()
    problems = []
    for target in targets:
        if target.startswith("."):
            wanted = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
            assert wanted, f"`{target}`: not a `.[extra,...]` form"
            for extra in (wanted.group(1) or "").split(",") if wanted.group(1) else []:
                assert extra in extras, f"`{target}`: no extra {extra!r} in pyproject.toml"
                problems += [p for r in extras[extra]
                             if (p := _installed(Requirement(r), constraints))]
        else:
            problems += [p for p in [_installed(Requirement(target), constraints)] if p]
    if index_url is not None and "download.pytorch.org/whl/cpu" in index_url:
        # the CPU build's version carries +cpu; a CUDA build would bring NVIDIA wheels
        assert "torch" in targets and metadata.version("torch").endswith("+cpu"), \
            f"`{shlex.join(words)}`: the installed torch is {metadata.version('torch')}"
    assert not problems, f"`{shlex.join(words)}` would not be a no-op here: {problems}"


def check_venv(words: list[str], work: Path) -> None:
    """Making or activating `.venv`: the tests run in the project's own, on PATH."""
    assert (VENV_BIN / "python").exists()


#: the set-up commands checked rather than run (the module doc says why)
STAND_INS: list[tuple[Callable[[list[str]], bool], Callable[[list[str], Path], None]]] = [
    (lambda w: w[:2] == ["pip", "install"], check_pip_install),
    (lambda w: w[1:3] == ["-m", "venv"] and w[0].startswith("python"), check_venv),
    (lambda w: w[0] in (".", "source") and w[1:2] == [".venv/bin/activate"], check_venv),
]

#: files a page's commands need that the page makes outside a shell block, and how
GIVEN: dict[str, Callable[[Path], None]] = {}


def _user_safetensors(work: Path) -> None:
    # the page saves it from a trained nn.Embedding with safetensors.torch.save_file
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({"weight": rng.standard_normal((1000, 16), dtype=np.float32)},
              str(work / "user.safetensors"))


GIVEN["docs/model-files.md"] = _user_safetensors


def _torch_checkpoints(work: Path) -> None:
    # the page saves them from a training job: a state_dict with torch.save, and a
    # torch.distributed.checkpoint folder (one process here: DCP saves without a group)
    import torch
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    torch.save({"embedding.weight": torch.randn(1000, 16, generator=generator)},
               str(work / "model.pt"))
    dcp.save({"model.ebc.embedding_bags.t_user.weight": torch.randn(500, 8,
                                                                    generator=generator)},
             checkpoint_id=str(work / "ckpt" / "step_9000"), no_dist=True)


GIVEN["docs/pytorch.md"] = _torch_checkpoints


def _ranking_model(work: Path) -> None:
    # the page's model `ranking`: table `user` served from models/v1/user; models/v2/user
    # is a next version whose rows grew 10x (the load gate warns about it); user.keys
    # are keys to prefetch, raw int64
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    rng = np.random.default_rng(0)
    keys = np.arange(5000, dtype=np.int64)
    rows = rng.standard_normal((keys.size, 16), dtype=np.float32)
    write_sparse_model(work / "models" / "v1" / "user", keys, rows)
    write_sparse_model(work / "models" / "v2" / "user", keys, rows * 10)
    keys[:100].astype("<i8").tofile(work / "user.keys")
    (work / "ps.json").write_text(json.dumps({"models": [{
        "model": "ranking", "sparse_files": ["models/v1/user"],
        "embedding_table_names": ["user"], "embedding_vecsize_per_table": [16],
        "maxnum_catfeature_query_per_table_per_sample": [64], "gpucache": False}]}))


GIVEN["docs/operating.md"] = _ranking_model
GIVEN["docs/workers.md"] = _ranking_model


# -- running a page ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Page:
    work: Path
    env: dict[str, str]
    port: int
    servers: list[subprocess.Popen[bytes]]

    def run(self, command: str) -> None:
        words = shlex.split(command)
        for matches, check in STAND_INS:
            if matches(words):
                check(words, self.work)
                return
        command = command.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        if words[:2] == ["hps", "serve"]:
            self.serve(f"{command} --port {self.port}")
            return
        if words[0] == "curl":  # curl exits 0 on an HTTP error unless told otherwise
            command = f"curl --fail-with-body {command[len('curl '):]}"
        done = subprocess.run(["bash", "-c", command], cwd=self.work, env=self.env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, (
            f"`{command}` exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
            f"--- stderr\n{done.stderr[-3000:]}")

    def serve(self, command: str) -> None:
        log = self.work / f"serve-{len(self.servers)}.log"
        with log.open("wb") as out:  # the server writes to its own copy of the file
            server = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.work,
                                      env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
        self.servers.append(server)
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            assert server.poll() is None, (
                f"`{command}` exited {server.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (
                f"`{command}` not ready in {READY_TIMEOUT} s:\n{log.read_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        for server in self.servers:
            if server.poll() is None:
                server.send_signal(signal.SIGINT)  # as Ctrl-C: a clean shutdown
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()


@pytest.fixture
def page_dir(tmp_path: Path) -> Iterator[Path]:
    """A copy of the tracked files (links as links), as a fresh clone has them."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    work = tmp_path / "checkout"
    for name in filter(None, listed):
        source, target = ROOT / name, work / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        else:
            shutil.copy2(source, target)
    yield work


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env["HOME"] = str(home)
    env.pop("HPS_TOKEN", None)
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("page", [p for p in PAGES if blocks_of(p)])
def test_page_commands_run(page: str, page_dir: Path, tmp_path: Path) -> None:
    if page in GIVEN:
        GIVEN[page](page_dir)
    home = tmp_path / "home"
    home.mkdir()
    runner = Page(page_dir, _env(home), _free_port(), [])
    try:
        for block in blocks_of(page):
            if block.marker is not None:
                continue
            for command in block.commands:
                if any(command.startswith(skipped) for skipped in NOT_RUN):
                    continue
                runner.run(command)
    finally:
        runner.stop()


def test_markers_are_known_and_few() -> None:
    blocks = [b for p in PAGES for b in blocks_of(p)]
    marked = [b for b in blocks if b.marker is not None]
    for block in marked:
        assert block.marker in MARKERS, (
            f"{block.page}:{block.line}: unknown marker {block.marker!r} (known: {MARKERS})")
    assert len(marked) <= max(3, len(blocks) // 4), [f"{b.page}:{b.line}" for b in marked]
    commands = [c for b in blocks for c in b.commands]
    for skipped in NOT_RUN:
        assert any(c.startswith(skipped) for c in commands), f"{skipped!r} is in no page"


def test_commands_are_split_as_a_shell_would() -> None:
    body = ("python3 -m venv .venv && . .venv/bin/activate   # a comment\n"
            "curl -s -d '{\"keys\": [1]}' \\\n     http://h/x\n\n# only a comment\n")
    assert commands_of(body) == ["python3 -m venv .venv", ". .venv/bin/activate",
                                 "curl -s -d '{\"keys\": [1]}' http://h/x"]
    assert commands_of("$ hps --version\nhps 1.0\n", console=True) == ["hps --version"]


def test_a_wrong_command_or_install_line_fails(tmp_path: Path) -> None:
    runner = Page(tmp_path, _env(tmp_path), _free_port(), [])
    with pytest.raises(AssertionError, match="exited 1"):
        runner.run("false")
    with pytest.raises(AssertionError, match="exited 7"):  # nothing serves there
        runner.run(f"curl -s http://127.0.0.1:{runner.port}/healthz")
    with pytest.raises(AssertionError, match="no extra 'nosuch'"):
        runner.run("pip install '.[server,nosuch]'")
    with pytest.raises(AssertionError, match="not installed"):
        runner.run("pip install no-such-package-here")
    runner.run("pip install '.[server]'")  # installed: a no-op
