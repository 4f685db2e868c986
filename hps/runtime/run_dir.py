"""The shared-memory folder of one multi-process run: where its processes meet.

A run is one `hps serve --workers N` (or one process serving a `multi_process_hash_map`
by itself). Everything its processes share lies in one folder of a tmpfs,
`<base>/hps-mp-<pid>` (base: `$HPS_SHM_DIR`, else /dev/shm), named after the process that
owns the run (the supervisor): the table segments, the op log, each worker's metrics; a
process serving shared tables by itself makes `hps-mp-<pid>-<random>`.
The owner removes the folder when it stops; a run whose owner died without removing it
(SIGKILL of the whole server) is removed by the next run that starts on the host, which
finds its PID gone. The processes of a run find it through `$HPS_RUN_DIR`.

A run folder is mode 0700 and checked to be this user's (hps/runtime/shm_files.py): what
another user planted at a run folder's name is refused with one line (an HPSError), never
removed or used; what this user left there (a folder, file or link of a process that had
the same PID) is removed and the folder made anew.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hps.errors import HPSError
from hps.runtime.shm_files import NotOurs, check_folder, clear_stale, me

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


def process_started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (/proc/<pid>/stat's 22nd
    field); None where /proc cannot tell. With its PID, it names one process for good: a
    PID is given again once its process is gone, its start time never."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat[stat.rfind(b")") + 2:].split()[19])  # fields after the name
    except (OSError, ValueError, IndexError):
        return None


def alive_since(pid: int, started: int) -> bool:
    """Whether the process that had PID `pid` and started at `started` (process_started;
    0: not recorded) still runs: pid_alive, and not a later process that took the PID (it
    started at another time; where /proc cannot tell, the PID alone decides)."""
    if not pid_alive(pid):
        return False
    return not started or process_started(pid) in (None, started)


def _zombie(pid: int) -> bool:
    """Whether the process has exited and awaits its parent's wait (Linux's /proc; False
    where /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")  # the state follows the name


def remove_dead_runs(base: Path | None = None) -> list[Path]:
    """Remove this user's run folders whose owner PID no longer exists (another user's are
    theirs to remove); returns those removed."""
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
            if pid != os.getpid() and not pid_alive(pid) and _mine(entry):
                with contextlib.suppress(OSError):  # removed by another run meanwhile
                    clear_stale(entry)
                removed.append(entry)
    return removed


def create_run_dir(base: Path | None = None, *, private: bool = False) -> Path:
    """A new, empty run folder owned by this process (dead runs' folders go first):
    `hps-mp-<pid>` for a supervisor's run, or with `private` one of several a process
    may hold (`hps-mp-<pid>-<random>`: a tier serving shared tables by itself). Raises
    HPSError, with one line naming the path and why, when another user's file, link or
    folder is at the name, or the folder made is not this user's 0700 folder."""
    base = base or base_dir()
    remove_dead_runs(base)
    base.mkdir(parents=True, exist_ok=True)
    try:
        if private:  # a fresh random name (O_EXCL), mode 0700
            path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
        else:
            path = base / f"{PREFIX}{os.getpid()}"
            # named after this process: what is there was left by a process that had this
            # PID before (dead, as this one holds it now), or planted
            clear_stale(path)
            os.mkdir(path, 0o700)
        check_folder(path)
    except (NotOurs, OSError) as exc:  # OSError: planted meanwhile, or not removable
        raise HPSError(f"cannot make the run folder: {exc}; remove it, or point "
                       f"{BASE_ENV} at a folder of your own") from None
    return path


def _mine(entry: Path) -> bool:
    """Whether `entry` (a file, link or folder itself, not what a link names) is this
    user's."""
    try:
        return entry.lstat().st_uid == me()
    except OSError:
        return False


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
