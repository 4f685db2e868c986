"""The shared-memory folder of one multi-process run: where its processes meet.

A run is one `hps serve --workers N` (or one process serving a `multi_process_hash_map`
by itself). Everything its processes share lies in one folder of a tmpfs,
`<base>/hps-mp-<pid>` (base: `$HPS_SHM_DIR`, else /dev/shm), named after the process that
owns the run (the supervisor): the table segments, the op log, each worker's metrics; a
process serving shared tables by itself makes `hps-mp-<pid>-<random>`.
The owner removes the folder when it stops; a run whose owner died without removing it
(SIGKILL of the whole server) is removed by the next run that starts on the host, which
finds its PID gone. The processes of a run find it through `$HPS_RUN_DIR`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: the prefix of every run folder
PREFIX = "hps-mp-"
#: the environment variable naming the run folder of the process's run
RUN_DIR_ENV = "HPS_RUN_DIR"
#: the environment variable that moves the run folders off /dev/shm
BASE_ENV = "HPS_SHM_DIR"


def base_dir() -> Path:
    """The tmpfs folder run folders are made in."""
    return Path(os.environ.get(BASE_ENV) or "/dev/shm")


def pid_alive(pid: int) -> bool:
    """Whether a process of that PID runs (signal 0 checks without sending). A zombie is
    dead: it exists until its parent reaps it, which a parent busy with other work (a
    test, a supervisor between polls) may not do for seconds, and a zombie holds nothing
    any more: no lock, no mapping, no query in flight."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, not ours to judge
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether the process has exited and awaits its parent's wait (Linux's /proc; False
    where /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")  # the state follows the name


def remove_dead_runs(base: Path | None = None) -> list[Path]:
    """Remove the run folders whose owner PID no longer exists; returns those removed."""
    base = base or base_dir()
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for entry in base.iterdir():  # a loop over run folders, not keys
            if not entry.name.startswith(PREFIX):
                continue
            try:  # hps-mp-<pid>, or hps-mp-<pid>-<suffix> (a process's own tables)
                pid = int(entry.name[len(PREFIX):].split("-", 1)[0])
            except ValueError:
                continue
            if pid != os.getpid() and not pid_alive(pid):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def create_run_dir(base: Path | None = None, *, private: bool = False) -> Path:
    """A new, empty run folder owned by this process (dead runs' folders go first):
    `hps-mp-<pid>` for a supervisor's run, or with `private` one of several a process
    may hold (`hps-mp-<pid>-<random>`: a tier serving shared tables by itself)."""
    base = base or base_dir()
    remove_dead_runs(base)
    if private:
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
    path = base / f"{PREFIX}{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True)
    return path


def current_run_dir() -> Path | None:
    """The run folder this process was started in (`$HPS_RUN_DIR`), None outside a run."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def remove_process_folders(run: Path, pid: int) -> list[Path]:
    """Remove the folders a process of the run `run` kept for itself, one level down
    and named `*-<pid>` (a follower's RocksDB secondary instances: rocksdb/<store>-
    <worker>-<pid>), once it died; returns those removed."""
    removed = sorted(p for p in run.glob(f"*/*-{int(pid)}") if p.is_dir())
    for folder in removed:  # a loop over folders, not keys
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def remove_run_dir(path: Path) -> None:
    """Remove a run folder and everything in it (mappings of its files stay valid)."""
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of a run, on file `path` (made if absent)."""
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_lines(path: Path, offset: int = 0) -> tuple[list[bytes], int]:
    """The whole lines of `path` from byte `offset` on (a line being appended is read
    next time) and the offset after them; none when `path` is gone."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return data[:end].splitlines(), offset + end


def replace_file(path: Path, text: str) -> None:
    """Replace `path`'s contents whole: readers in other processes see the old text or
    the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
