"""The file of a shared GPU table's record (hps/gpu/shared_cache.py): its layout, where it
lives, how it is made whole, how a record found there is checked before it is mapped, and
how long a process waits for its owner.

Where: `<shm>/hps-gpu-cache-<uid>/<key>.table` (shm: `$HPS_SHM_DIR`, else /dev/shm), a
folder of the user's own, mode 0700, checked on every open (hps/runtime/shm_files.py):
processes of one user share tables, another user's never meet them. The folder of every
user's records before it (`<shm>/hps-gpu-cache`) is removed, once no process maps its
records, by the first process that finds it (clear_old_folder).

Made whole: the owner writes the record under a name of its own, then links it to
`<key>.table` (link fails when the name is taken: one process wins, as O_EXCL did). So no
record of a live process is ever seen short, unmarked or half-written, and a record that is
(a crash of an older release between its O_EXCL and its ftruncate, a file of garbage) is
nobody's: it is replaced when it is this user's, refused when not.

Checked before it is mapped: opened without following a link, a regular file of this
user's with one name, RECORD_BYTES long, with the magic and words a record can hold (a
state, an owner PID, process slots holding PIDs). A record that fails is never mapped, so
no garbage word reaches a kill(2) (an owner of -1 would "signal" every process) or a wait.

The wait for the owner: a live owner's warm-up may take minutes (a large table from S3), so
the wait is long (READY_TIMEOUT_S), but a thread of the owner advances the record's progress
word while it builds: a waiter refuses, within STUCK_S, an owner whose word stood still (a
process stopped or frozen; a PID that is not building anything) and, at once, an owner PID
of another user's process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path

import numpy as np

from hps.errors import DeviceError
from hps.gpu.fast_query import CLOSED
from hps.gpu.shared_gate import GATE_WORDS, REGION_BYTES, SLOT_WORDS, SLOTS, WRITER
from hps.runtime.run_dir import alive_since, base_dir, pid_alive, process_started
from hps.runtime.shm_files import (
    NotOurs,
    mapped_by,
    me,
    open_file,
    private_folder,
    user_name,
)

log = logging.getLogger("hps")

_MAGIC = 0x48505347_50554332  # "HPSGPUC2": with the progress word
# record words
_MAGIC_W, STATE, OWNER, HANDLES = 0, 1, 2, 3
PARAMS, PARAM_WORDS = 4, 12
GATE_AT = 128  # bytes
#: the owner's progress while it builds: the first word of the padding after the gate (no
#: query runs before the table is ready, so no reader shares its line meanwhile); then
#: when the owner process started (/proc's clock ticks since boot): a live process of the
#: owner's PID that started at another time took a dead owner's PID
PROGRESS = (GATE_AT + REGION_BYTES) // 8
OWNER_START = PROGRESS + 1
HANDLES_AT = GATE_AT + REGION_BYTES + 64
HANDLE_BYTES = 64
MAX_HANDLES = 16
RECORD_BYTES = -(-(HANDLES_AT + MAX_HANDLES * HANDLE_BYTES) // 4096) * 4096
BUILDING, READY, RETIRED = 0, 1, 2
#: how long a process waits for a live owner, whose progress word moves, to make a table
#: ready (a warm-up of a large table from S3 can take minutes; the owner's death ends the
#: wait at once)
READY_TIMEOUT_S = 1800.0
#: how long an owner's progress word may stand still before a waiter calls it stuck (a
#: stuck owner is refused within 30 s, the wait's first look included)
STUCK_S = 20.0
#: how often the owner's thread advances the word (STUCK_S is 20 of these: a process whose
#: threads are starved for seconds, a numba compile holding the GIL, is not stuck)
PROGRESS_TICK_S = 1.0
#: the largest PID Linux gives (PID_MAX_LIMIT): a larger word is no PID
_PID_MAX = 1 << 22


class Damaged(Exception):
    """A record of this user's that no live process made (short, unmarked, garbage
    words): the message says what is wrong; `inode` names the file to replace."""

    def __init__(self, message: str, inode: int) -> None:
        super().__init__(message)
        self.inode = inode


def shared_dir() -> Path:
    """Where this user's shared tables' records are: <shm>/hps-gpu-cache-<uid>, made 0700
    if absent. Raises DeviceError when it is not a folder of this user's closed to others
    (a link, a file, another user's, a folder open to others)."""
    base = base_dir()
    try:
        folder = private_folder(base / f"hps-gpu-cache-{me()}")
    except NotOurs as exc:
        raise DeviceError(f"the shared GPU cache's folder is refused: {exc} (remove it, or "
                          "point HPS_SHM_DIR at a folder of your own)") from None
    if base not in _OLD_LOOKED_AT:
        _OLD_LOOKED_AT.add(base)
        clear_old_folder(base)
    return folder


#: the folder of every user's records before the per-user one (releases before it)
OLD_FOLDER = "hps-gpu-cache"
#: the shared-memory bases whose old folder this process looked at (once each)
_OLD_LOOKED_AT: set[Path] = set()


def clear_old_folder(base: Path) -> None:
    """Removes `base`/hps-gpu-cache, the records of a release before the per-user folder,
    when it is a folder of this user's that no process maps a record of (their processes
    are gone: nothing else ever frees it, and a tmpfs holds it until the host reboots);
    says so, or, while processes of this user's map its records, that it is left and why.
    Another user's folder, or a link, is theirs: left, unmentioned."""
    old = base / OLD_FOLDER
    try:
        st = os.lstat(old)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me():
        return
    users = mapped_by(old)
    if users:
        log.warning("the shared GPU cache's folder of an older release, %s, is left: "
                    "process(es) %s map its records; the first process of this release "
                    "that starts after they stop removes it", old,
                    ", ".join(map(str, sorted(users)[:8])))
        return
    try:
        shutil.rmtree(old)
    except FileNotFoundError:
        return  # another process of this release removed it meanwhile
    except OSError as exc:
        log.warning("the shared GPU cache's folder of an older release, %s, could not be "
                    "removed (%s)", old, exc)
        return
    log.info("removed the shared GPU cache's folder of an older release, %s (no process "
             "mapped its records)", old)


def create(path: Path, params: dict[str, int]) -> int | None:
    """Makes the record `path` of a table to build, whole, owned by this process, and
    returns its fd (read-write); None when a record of that name exists already."""
    folder = path.parent
    _sweep(folder)
    words = np.zeros(RECORD_BYTES // 8, np.int64)
    words[PARAMS:PARAMS + len(params)] = [int(v) for v in params.values()]
    words[OWNER], words[STATE], words[_MAGIC_W] = os.getpid(), BUILDING, _MAGIC
    words[OWNER_START] = process_started(os.getpid()) or 0
    draft = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.new"
    fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, words.tobytes())  # a full tmpfs says so here, not later with SIGBUS
        os.link(draft, path)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, FileExistsError):
            return None
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(draft)
    return fd


def _sweep(folder: Path) -> None:
    """Removes the drafts of processes that died between making and linking them."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):  # a loop over files of the folder, at load only
            parts = name.rsplit(".", 3)
            if not (name.startswith(".") and len(parts) == 4 and parts[3] == "new"):
                continue
            with contextlib.suppress(ValueError, OSError):
                pid = int(parts[1])
                if 0 < pid <= _PID_MAX and not pid_alive(pid):
                    os.unlink(folder / name)


def open_existing(path: Path) -> int:
    """The fd (read-write) of the record at `path`, checked whole (the module docstring).
    Raises NotOurs for what is not this user's regular file, Damaged for a file of this
    user's that holds no record, FileNotFoundError when it is gone."""
    fd, st = open_file(path, os.O_RDWR)
    try:
        if st.st_size != RECORD_BYTES:
            raise Damaged(f"{path} is {st.st_size} bytes, not a record's {RECORD_BYTES}",
                          st.st_ino)
        words = np.frombuffer(os.pread(fd, RECORD_BYTES, 0), np.int64)
        problem = damage(words)
        if problem:
            raise Damaged(f"{path} {problem}", st.st_ino)
    except BaseException:
        os.close(fd)
        raise
    return fd


def damage(words: np.ndarray) -> str | None:
    """What makes `words` (a whole record) no record hps wrote; None when it is one."""
    if words[_MAGIC_W] != _MAGIC:
        return "does not start with a record's mark"
    if int(words[STATE]) not in (BUILDING, READY, RETIRED):
        return f"holds no state a record has ({int(words[STATE])})"
    if not 0 < int(words[OWNER]) <= _PID_MAX:
        return f"names no process as its owner ({int(words[OWNER])})"
    if not 0 <= int(words[HANDLES]) <= MAX_HANDLES:
        return f"holds {int(words[HANDLES])} allocations, more than a table has"
    gate = words[GATE_AT // 8:(GATE_AT + REGION_BYTES) // 8]
    slots = gate[GATE_WORDS:].reshape(SLOTS, SLOT_WORDS)
    pids, counts = slots[:, 0], slots[:, 1]
    writers = gate[[CLOSED, WRITER]]
    if ((pids < 0) | (pids > _PID_MAX) | (counts < 0) | ((pids == 0) & (counts != 0))).any() \
            or ((writers < 0) | (writers > _PID_MAX)).any():
        return "holds process slots no process wrote"
    return None


def wait_ready(words: np.ndarray, key: str) -> bool:
    """Waits until the owner named in `words` (a mapped record) made the table ready:
    True then; False when the owner died (its handles can no longer be opened, before or
    after the table was ready) or retired it. Raises DeviceError, naming the record, the
    owner's PID and the wait, for this process's own record, an owner of another user's,
    an owner whose progress stood still for STUCK_S, or a wait past READY_TIMEOUT_S."""
    owner = int(words[OWNER])  # set before the record was linked, never changed
    begun = moved = time.monotonic()
    progress = int(words[PROGRESS])
    told = False
    while True:
        if not owner_alive(words):
            return False
        state = int(words[STATE])
        if state == READY:
            return True
        if state == RETIRED:
            return False
        now = time.monotonic()
        if not told:
            _check_owner(owner, key)
            log.info("waiting for process %d to load the shared GPU table %s", owner, key)
            told = True
        if int(words[PROGRESS]) != progress:
            progress, moved = int(words[PROGRESS]), now
        elif now - moved > STUCK_S:
            raise DeviceError(
                f"the shared GPU table {key} was not ready after {now - begun:.0f} s (owner "
                f"pid {owner}), and its owner made no progress for {STUCK_S:g} s: a stopped "
                "or stuck process, or one that builds nothing; end it, or remove the record")
        if now - begun > READY_TIMEOUT_S:
            raise DeviceError(f"the shared GPU table {key} was not ready after "
                              f"{READY_TIMEOUT_S:.0f} s (owner pid {owner})")
        time.sleep(0.01)


def owner_alive(words: np.ndarray) -> bool:
    """Whether the process that made the record `words` (mapped) still runs: its PID is
    alive and, where /proc says when it started, it started when the owner did."""
    return alive_since(int(words[OWNER]), int(words[OWNER_START]))


def _check_owner(owner: int, key: str) -> None:
    """Refuses at once an owner that cannot be building this record for this process: the
    process itself, or a process of another user (a record's owner is the user whose
    folder holds it)."""
    if owner == os.getpid():  # never ready while this process waits on itself
        raise DeviceError(f"the shared GPU table {key} is still being built by this process")
    try:
        uid = os.stat(f"/proc/{owner}").st_uid
    except OSError:
        return  # gone meanwhile (the wait's next look says so), or no /proc to ask
    if uid != me():
        raise DeviceError(
            f"the shared GPU table {key} was not ready after 0 s (owner pid {owner}): its "
            f"owner is a process of user {user_name(uid)}, not of this process's "
            f"{user_name(me())}; remove the record")
