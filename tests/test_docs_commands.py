"""Every command line and every Python block shown in README.md and docs/*.md runs as shown.

The fenced ```bash, ```sh, ```shell, ```console and ```python blocks of each page run in
page order, as a reader following the page would run them, in a fresh copy of the tracked
files whose own code is imported (PYTHONPATH), with the project's `.venv` first on PATH.
A shell block runs one command at a time (a line, or one side of `&&`), and each must
exit 0. The page's Python blocks run in one interpreter that lives until the page ends,
each in the namespace the blocks above it left (tests/support/python_session.py), as a
reader pastes them into one session: a block may use only what its page defined above
it, and must not raise. Once a page has shown a `pip install`, its blocks may import only
what the installs shown so far bring (the other extras' modules are not found), as in the
reader's environment. Four kinds are handled apart, each for a stated reason:

- the set-up steps (making and activating a virtual environment, `pip install`) are
  checked, not run (tests/support/docs_installs.py): this suite already runs in the
  project's `.venv`, and installing into it would replace the checkout's own install. A
  `pip install` is checked to be a no-op here: every extra it names exists and every
  requirement is installed (STAND_INS);
- `hps serve` runs in the background until its `/readyz` answers 200, the next commands
  of the page run against it, and it is stopped when the page ends. It serves on a free
  port instead of 8000, which other tests or services may hold;
- a block after `<!-- docs-test: needs-WHAT -->` needs something the test provides
  (NEEDS): a CUDA device (the page then has a second test, marked `gpu`, that runs it; the
  first runs the page without it), the server the page started above, a Redis server or
  an S3 server;
- a block after `<!-- docs-test: skip-WHY -->` is not run; MARKERS says which markers exist
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.docs_installs import STAND_INS, installs_of, not_installed
from tests.support.python_session import PythonSession

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent

#: markers a block may carry (`<!-- docs-test: MARKER -->` on the line before it) and why
#: a block so marked is not run
MARKERS = {
    "skip-network": "needs a service on the network (an S3 bucket, a registry)",
    "skip-container": "needs a container runtime",
    "skip-long": "runs for minutes",
}
#: markers for what a block needs, each provided by the test as said
NEEDS = {
    "needs-gpu": "a CUDA device: run by the page's second test, marked `gpu` (deselected "
                 "where there is none, as in CI: -m 'not gpu'); the first runs the page "
                 "without the block",
    "needs-server": "the `hps serve` the page started above, on the test's free port "
                    "(127.0.0.1:8000 and gRPC's 127.0.0.1:8001 on the page stand for them)",
    "needs-redis": "a redis-server of the test's own (127.0.0.1:6379 on the page stands "
                   "for it)",
    "needs-s3": "an S3 server of the test's own (moto; AWS_ENDPOINT_URL names it), holding "
                "the buckets the page reads",
}
#: the addresses a page names, each standing for one the test provides
SERVE_ADDRESS, GRPC_ADDRESS, REDIS_ADDRESS = "127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:6379"
#: commands that are not run, by their first words, and why
NOT_RUN = {
    "bash scripts/test.sh": "runs the whole test suite (this test is part of it)",
}
#: how long one command may take, and a server to answer /readyz (generous: a stuck
#: command fails the test, a slow one does not)
COMMAND_TIMEOUT = 300
READY_TIMEOUT = 120

_FENCE = re.compile(r"^```(bash|sh|shell|console|python)[ \t]*\n(.*?)^```[ \t]*$",
                    re.S | re.M)
_MARKER = re.compile(r"<!--\s*docs-test:\s*([\w-]+)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    marker: str | None
    commands: list[str] = field(default_factory=list)  # a shell block's
    source: str | None = None  # a Python block's

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: str) -> list[Block]:
    """The shell and Python blocks of `page` in page order, each with its marker."""
    text = (ROOT / page).read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        block = Block(page, text.count("\n", 0, match.start()) + 1,
                      marker.group(1) if marker else None)
        if match.group(1) == "python":
            block.source = match.group(2)
        else:
            block.commands = commands_of(match.group(2), console=match.group(1) == "console")
        found.append(block)
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


#: files a page's blocks need that the page makes outside a shell or Python block, and how
GIVEN: dict[str, Callable[[Page], None]] = {}


def _parquet_lake(page: Page) -> None:
    # the page reads s3://lake/items/, a folder of Parquet parts written by Spark:
    # columns id (int64) and emb (list<float>)
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    part = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": np.arange(1000),
                             "emb": list(rng.standard_normal((1000, 16), dtype=np.float32))}),
                   part)
    s3 = boto3.client("s3", endpoint_url=page.env["AWS_ENDPOINT_URL"])
    s3.create_bucket(Bucket="lake")
    s3.put_object(Bucket="lake", Key="items/part-00000.parquet", Body=part.getvalue().to_pybytes())
    s3.put_object(Bucket="lake", Key="items/_SUCCESS", Body=b"")


GIVEN["docs/model-files.md"] = _parquet_lake


def _demo_tables(page: Page, **model: Any) -> None:
    # the pages' model `demo` as `hps demo` shapes it (tables user_item, width 16, and
    # item_category, width 64, both holding keys 17, 42 and -3), small: ps.json and
    # tables/; `model` adds keys to the model block
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    rng = np.random.default_rng(0)
    keys = np.arange(-3, 997, dtype=np.int64)
    for table, width in (("user_item", 16), ("item_category", 64)):
        write_sparse_model(page.work / "tables" / table, keys,
                           rng.standard_normal((keys.size, width), dtype=np.float32))
    (page.work / "ps.json").write_text(json.dumps({"models": [{
        "model": "demo", "sparse_files": ["tables/user_item", "tables/item_category"],
        "embedding_table_names": ["user_item", "item_category"],
        "embedding_vecsize_per_table": [16, 64],
        "maxnum_catfeature_query_per_table_per_sample": [16, 16], "gpucache": False,
        **model}]}))


def _redis_updates(page: Page) -> dict[str, Any]:
    return {"type": "redis_stream", "address": page.local(REDIS_ADDRESS)}


GIVEN["docs/python.md"] = _demo_tables
GIVEN["docs/gpu-cache.md"] = lambda page: _demo_tables(page, gpucache=True,
                                                    deployed_device_list=[0])


def _demo_with_updates(page: Page) -> None:
    # ps.json with the page's update_source; models/retrained/user_item the retrained table
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    _demo_tables(page)
    config = json.loads((page.work / "ps.json").read_text())
    config["update_source"] = _redis_updates(page)
    (page.work / "ps.json").write_text(json.dumps(config))
    keys = np.arange(100, dtype=np.int64)
    write_sparse_model(page.work / "models" / "retrained" / "user_item", keys,
                       np.ones((keys.size, 16), np.float32))


GIVEN["docs/updates.md"] = _demo_with_updates


def _wdl_model(page: Page) -> None:
    # HugeCTR's WDL sample's two sparse folders: widths 1 and 16, keys 0..999
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    rng = np.random.default_rng(0)
    keys = np.arange(1000, dtype=np.int64)
    for name, width in (("wdl0_sparse.model", 1), ("wdl1_sparse.model", 16)):
        write_sparse_model(page.work / name, keys,
                           rng.standard_normal((keys.size, width), dtype=np.float32))


GIVEN["docs/hugectr.md"] = _wdl_model


def _torch_checkpoints(page: Page) -> None:
    # the page saves a torch.distributed.checkpoint folder from a training job (one
    # process here: DCP saves without a group); its ps.json is the from-torch block of
    # model.pt (which the page saves) with an update_source, as the page says to add
    import torch
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    dcp.save({"model.ebc.embedding_bags.t_user.weight": torch.randn(500, 8,
                                                                    generator=generator)},
             checkpoint_id=str(page.work / "ckpt" / "step_9000"), no_dist=True)
    (page.work / "ps.json").write_text(json.dumps({"models": [{
        "model": "ranker", "sparse_files": [{"path": "model.pt", "tensor": "embedding.weight"}],
        "embedding_table_names": ["embedding"], "embedding_vecsize_per_table": [16],
        "maxnum_catfeature_query_per_table_per_sample": [26], "gpucache": False}],
        "update_source": _redis_updates(page)}))


GIVEN["docs/pytorch.md"] = _torch_checkpoints


def _ranking_model(page: Page) -> None:
    # the page's model `ranking`: table `user` served from models/v1/user; models/v2/user
    # is a next version whose rows grew 10x (the load gate warns about it); user.keys
    # are keys to prefetch, raw int64
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    work = page.work
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


def _readme_ps_json(page: Page) -> None:
    # the page shows ps.json as a ```json block for the reader to save
    blocks = re.findall(r"^```json\n(.*?)^```$", (ROOT / "README.md").read_text(), re.S | re.M)
    assert len(blocks) == 1, "README.md: one ps.json block expected"
    (page.work / "ps.json").write_text(blocks[0])


GIVEN["README.md"] = _readme_ps_json
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
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: each address the page names, and the one the test provides for it
    addresses: dict[str, str] = field(default_factory=dict)
    session: PythonSession | None = None
    #: the installs the page showed so far (`installs_of`); None until it shows one: a page
    #: that shows none is read in an environment that has what it uses
    shown: set[str] | None = None

    def __post_init__(self) -> None:
        self.addresses.setdefault(SERVE_ADDRESS, f"127.0.0.1:{self.port}")
        self.addresses.setdefault(GRPC_ADDRESS, f"127.0.0.1:{_free_port()}")

    def local(self, text: str) -> str:
        """`text` with the page's addresses replaced by those the test provides."""
        for named, provided in self.addresses.items():
            text = text.replace(named, provided)
        grpc_port = self.addresses[GRPC_ADDRESS].rsplit(":", 1)[1]
        return text.replace(f"--grpc-port {GRPC_ADDRESS.rsplit(':', 1)[1]}",
                            f"--grpc-port {grpc_port}")

    def run_block(self, block: Block) -> None:
        if block.marker == "needs-server":
            assert any(s.poll() is None for s in self.servers), (
                f"{block.name} needs a server, and the page started none above it")
        if block.source is not None:
            self.run_python(block)
            return
        for command in block.commands:
            if not any(command.startswith(skipped) for skipped in NOT_RUN):
                self.run(command)

    def run_python(self, block: Block) -> None:
        assert block.source is not None
        if self.session is None:
            self.session = PythonSession(self.work, self.env, self.work / "python.log",
                                         COMMAND_TIMEOUT)
        self.session.run(self.local(block.source), block.name,
                         not_installed(frozenset(self.shown)) if self.shown is not None
                         else ())

    def run(self, command: str) -> None:
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            self.shown = (self.shown or set()) | installs_of(words)
        for matches, check in STAND_INS:
            if matches(words):
                check(words, self.work)
                return
        command = self.local(command)
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
        if self.session is not None:
            self.session.close()
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


def _env(home: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env["HOME"] = str(home)
    env.pop("HPS_TOKEN", None)
    # the copy's own code first, as `pip install .` in it gives: the environment's install
    # may be of another tree (an editable install of another checkout); then what the
    # environment adds (the GPU machine's carried wheels)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work), env.get("PYTHONPATH")]))
    return env


def _runs() -> Iterator[Any]:
    """One test per page with blocks other than GPU ones; one marked `gpu` for a page with
    GPU blocks, running them all."""
    for page in PAGES:
        blocks = blocks_of(page)
        if any(b.marker != "needs-gpu" for b in blocks):
            yield pytest.param(page, False, id=page)
        if any(b.marker == "needs-gpu" for b in blocks):
            yield pytest.param(page, True, id=f"{page}[gpu]", marks=pytest.mark.gpu)


@pytest.mark.parametrize(("page", "with_gpu"), list(_runs()))
def test_page_runs(page: str, with_gpu: bool, page_dir: Path, tmp_path: Path,
                   request: pytest.FixtureRequest) -> None:
    blocks = blocks_of(page)
    needs = {b.marker for b in blocks}
    addresses = {}
    if "needs-redis" in needs:
        addresses[REDIS_ADDRESS] = request.getfixturevalue("redis_server").address
    # before the environment is copied: the S3 server sets fake AWS credentials in it
    s3_endpoint = request.getfixturevalue("s3_server").endpoint if "needs-s3" in needs else None
    home = tmp_path / "home"
    home.mkdir()
    runner = Page(page_dir, _env(home, page_dir), _free_port(), addresses=addresses)
    if s3_endpoint is not None:
        runner.env["AWS_ENDPOINT_URL"] = s3_endpoint
    if page in GIVEN:
        GIVEN[page](runner)
    try:
        for block in blocks:
            if block.marker in MARKERS or (block.marker == "needs-gpu" and not with_gpu):
                continue
            runner.run_block(block)
    finally:
        runner.stop()


def test_markers_are_known_and_few() -> None:
    blocks = [b for p in PAGES for b in blocks_of(p)]
    for block in blocks:
        assert block.marker is None or block.marker in MARKERS or block.marker in NEEDS, (
            f"{block.name}: unknown marker {block.marker!r} (known: {[*MARKERS, *NEEDS]})")
    not_run = [b for b in blocks if b.marker in MARKERS]
    assert len(not_run) <= max(3, len(blocks) // 4), [b.name for b in not_run]
    commands = [c for b in blocks for c in b.commands]
    for skipped in NOT_RUN:
        assert any(c.startswith(skipped) for c in commands), f"{skipped!r} is in no page"


def test_python_blocks_share_one_session_in_page_order(tmp_path: Path) -> None:
    runner = Page(tmp_path, _env(tmp_path, tmp_path), _free_port())
    try:
        runner.run_python(Block("p.md", 1, None, source="import numpy as np\nx = np.arange(3)\n"))
        runner.run_python(Block("p.md", 5, None, source="assert int(x.sum()) == 3\n"))
        with pytest.raises(AssertionError, match="(?s)p.md:9 raised:.*NameError: name 'torch'"):
            runner.run_python(Block("p.md", 9, None, source="torch.empty(3)\n"))
        runner.run_python(Block("p.md", 12, None, source="print(x)\n"))  # it goes on
    finally:
        runner.stop()


def test_a_python_block_imports_only_what_the_page_installed_above(tmp_path: Path) -> None:
    runner = Page(tmp_path, _env(tmp_path, tmp_path), _free_port())
    try:
        runner.run("pip install '.[server]'")
        runner.run_python(Block("p.md", 1, None, source="import numpy, httpx, hps\n"))
        # as a module not installed: its import fails, importlib.util.find_spec says None
        runner.run_python(Block("p.md", 5, None, source="import importlib.util\n"
                                "assert importlib.util.find_spec('torch') is None\n"))
        with pytest.raises(AssertionError, match="(?s)'torch'.*torch is not installed by"):
            runner.run_python(Block("p.md", 7, None, source="import torch.nn\n"))
        runner.run("pip install '.[torch]'")
        runner.run_python(Block("p.md", 9, None, source="import torch.nn\n"))
    finally:
        runner.stop()


def test_a_python_block_is_read_with_its_marker() -> None:
    assert [(b.marker, b.source) for b in blocks_of("docs/http.md") if b.source][0] == (
        "needs-server", (ROOT / "docs/http.md").read_text().split("```python\n")[1]
        .split("```")[0])


def test_commands_are_split_as_a_shell_would() -> None:
    body = ("python3 -m venv .venv && . .venv/bin/activate   # a comment\n"
            "curl -s -d '{\"keys\": [1]}' \\\n     http://h/x\n\n# only a comment\n")
    assert commands_of(body) == ["python3 -m venv .venv", ". .venv/bin/activate",
                                 "curl -s -d '{\"keys\": [1]}' http://h/x"]
    assert commands_of("$ hps --version\nhps 1.0\n", console=True) == ["hps --version"]


def test_a_wrong_command_or_install_line_fails(tmp_path: Path) -> None:
    runner = Page(tmp_path, _env(tmp_path, tmp_path), _free_port())
    with pytest.raises(AssertionError, match="exited 1"):
        runner.run("false")
    with pytest.raises(AssertionError, match="exited 7"):  # nothing serves there
        runner.run(f"curl -s http://127.0.0.1:{runner.port}/healthz")
    with pytest.raises(AssertionError, match="no extra 'nosuch'"):
        runner.run("pip install '.[server,nosuch]'")
    with pytest.raises(AssertionError, match="not installed"):
        runner.run("pip install no-such-package-here")
    runner.run("pip install '.[server]'")  # installed: a no-op
