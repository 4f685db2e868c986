"""The file of a shared GPU table's record (hps/gpu/shared_record.py), in real processes,
with no GPU: its folder is the user's own (0700), a record is checked before it is mapped
(a link, a FIFO, a hard link, another user's file refused; a short, zero, garbage record of
the user's replaced), every wait on one is bounded (an owner stopped, another user's, a
lock held by a stopped writer or by another user's process, a write stopped mid-way for a
query, a query stopped mid-way for a write) while a live owner, writer or query slower
than the bound is waited for, a PID another process took is a dead process's (an
owner, a process slot), and the folder of an older release is removed once unused."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hps.gpu.shared_gate as shared_gate
import hps.gpu.shared_record as shared_record
from hps.errors import DeviceError
from hps.gpu.shared_cache import SharedTableRecord, shared_dir
from hps.gpu.shared_record import RECORD_BYTES, create
from hps.runtime.run_dir import process_started
from tests.support.strangers import Stranger, stranger  # noqa: F401 (a fixture)

PARAMS = {"kind": 3, "dim": 8, "keys": 1000}


@pytest.fixture(autouse=True)
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HPS_SHM_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture()
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits' bounds made short (the children set the same): an owner's word still
    for 2 s is stuck, and another process waited on (a lock's holder, a query, a write),
    each ticking every 0.05 s (40 ticks: a loaded machine starves no thread that long)."""
    monkeypatch.setattr(shared_record, "STUCK_S", 2.0)
    monkeypatch.setattr(shared_record, "PROGRESS_TICK_S", 0.05)
    monkeypatch.setattr(shared_gate, "LOCK_WAIT_S", 2.0)
    monkeypatch.setattr(shared_gate, "PROGRESS_TICK_S", 0.05)


def _quick() -> None:
    shared_record.STUCK_S, shared_record.PROGRESS_TICK_S = 2.0, 0.05
    shared_gate.LOCK_WAIT_S, shared_gate.PROGRESS_TICK_S = 2.0, 0.05


def _run(target: Any, *args: Any) -> Any:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _record_path(name: str) -> Path:
    return shared_dir() / f"{name}.table"


# -- the folder -------------------------------------------------------------------------


def _folder() -> Path:
    return Path(os.environ["HPS_SHM_DIR"]) / f"hps-gpu-cache-{os.geteuid()}"


def test_the_folder_is_made_0700_for_this_user_only() -> None:
    record = SharedTableRecord("t", PARAMS)
    st = _folder().lstat()
    assert record.path.parent == _folder() and st.st_mode & 0o777 == 0o700
    assert st.st_uid == os.geteuid()


@pytest.mark.parametrize("plant", ["link", "file", "open", "stranger"])
def test_a_folder_not_this_users_own_is_refused(
        tmp_path: Path, plant: str, stranger: Stranger) -> None:  # noqa: F811
    folder = _folder()
    if plant == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    elif plant == "file":
        folder.write_text("")
    else:
        folder.mkdir()
        folder.chmod(0o777)  # what the folder was made as (0777 minus the umask)
        if plant == "stranger":
            folder.chmod(0o700)
            stranger.owns(folder)
    said = {"link": "is a symbolic link", "file": "is not a folder",
            "open": "has mode 0777, open to other users",
            "stranger": f"belongs to user {stranger.uid}"}[plant]
    with pytest.raises(DeviceError, match="the shared GPU cache's folder is refused: ") as e:
        SharedTableRecord("t", PARAMS)
    assert said in str(e.value) and str(folder) in str(e.value)


def _old_folder() -> Path:
    """Where every user's records were before the per-user folder."""
    return Path(os.environ["HPS_SHM_DIR"]) / "hps-gpu-cache"


def _old_records() -> Path:
    old = _old_folder()
    old.mkdir()
    (old / "m.t.d0.0123.table").write_bytes(bytes(RECORD_BYTES))
    return old


def test_an_old_folder_of_this_user_that_no_process_maps_is_removed(
        caplog: pytest.LogCaptureFixture) -> None:
    old = _old_records()
    with caplog.at_level(logging.INFO, logger="hps"):
        SharedTableRecord("t", PARAMS)
    assert not old.exists() and _folder().is_dir()
    assert f"removed the shared GPU cache's folder of an older release, {old}" in caplog.text


def _map_old_record(path: str, ready: Any) -> None:
    """A process of a release before the per-user folder, mapping its record."""
    import mmap

    fd = os.open(path, os.O_RDWR)
    kept = mmap.mmap(fd, RECORD_BYTES)
    ready.set()
    time.sleep(600)
    kept.close()


def test_an_old_folder_a_live_process_maps_is_left_and_said_then_removed_after_it(
        caplog: pytest.LogCaptureFixture) -> None:
    old = _old_records()
    ready = mp.get_context("spawn").Event()
    proc = _run(_map_old_record, str(old / "m.t.d0.0123.table"), ready)
    assert ready.wait(120)
    try:
        with caplog.at_level(logging.INFO, logger="hps"):
            SharedTableRecord("t", PARAMS)
        assert (old / "m.t.d0.0123.table").exists()
        assert f"older release, {old}, is left: process(es) {proc.pid} map" in caplog.text
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    shared_record.clear_old_folder(old.parent)  # what the next process to start does
    assert not old.exists()


def test_an_old_folder_of_another_user_or_a_link_is_left_untouched(
        tmp_path: Path, stranger: Stranger,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    old = _old_records()
    stranger.owns(old)
    with caplog.at_level(logging.INFO, logger="hps"):
        SharedTableRecord("t", PARAMS)
    assert (old / "m.t.d0.0123.table").exists() and old.stat().st_uid == stranger.uid
    old.rename(tmp_path / "elsewhere")
    old.symlink_to(tmp_path / "elsewhere")  # a link of this user's: not a folder it made
    shared_record.clear_old_folder(old.parent)
    assert old.is_symlink() and (tmp_path / "elsewhere" / "m.t.d0.0123.table").exists()
    assert "older release" not in caplog.text


# -- a record found -----------------------------------------------------------------------


def _zero(path: Path) -> None:
    path.write_bytes(bytes(RECORD_BYTES))


def _empty(path: Path) -> None:  # what a crash between O_EXCL and ftruncate left
    path.write_bytes(b"")


def _short(path: Path) -> None:
    path.write_bytes(os.urandom(RECORD_BYTES // 3))


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(RECORD_BYTES))


def _owner_minus_one(path: Path) -> None:
    """A record with its mark whose owner word is -1 (kill(-1, 0) "finds" every process)."""
    fd = create(path, PARAMS)
    assert fd is not None
    os.pwrite(fd, np.array([-1], np.int64).tobytes(), shared_record.OWNER * 8)
    os.close(fd)


def _bad_slot(path: Path) -> None:
    """A record whose first process slot holds a count and no PID."""
    fd = create(path, PARAMS)
    assert fd is not None
    os.pwrite(fd, np.array([0, 5], np.int64).tobytes(),
              shared_record.GATE_AT + shared_gate.GATE_WORDS * 8)
    os.close(fd)


DAMAGED = {"zero": _zero, "empty": _empty, "short": _short, "garbage": _garbage,
           "owner-1": _owner_minus_one, "slot": _bad_slot}


@pytest.mark.parametrize("plant", list(DAMAGED))
def test_a_damaged_record_of_this_user_is_replaced(
        plant: str, caplog: pytest.LogCaptureFixture) -> None:
    path = _record_path("t")
    DAMAGED[plant](path)
    with caplog.at_level(logging.WARNING, logger="hps"):
        record = SharedTableRecord("t", PARAMS)
    assert record.owner and record.owner_pid() == os.getpid()
    assert shared_record.damage(np.frombuffer(path.read_bytes(), np.int64)) is None
    assert "left by no live process: replaced" in caplog.text


@pytest.mark.parametrize("plant", list(DAMAGED))
def test_a_record_of_another_user_is_refused(
        plant: str, stranger: Stranger) -> None:  # noqa: F811
    path = _record_path("t")
    DAMAGED[plant](path)
    stranger.owns(path)
    with pytest.raises(DeviceError, match=f"belongs to user {stranger.uid}") as e:
        SharedTableRecord("t", PARAMS)
    assert "the shared GPU table t is refused" in str(e.value)
    assert path.stat().st_uid == stranger.uid  # left as it was


def test_a_link_to_another_record_is_refused_and_that_record_untouched() -> None:
    b = SharedTableRecord("b", PARAMS)
    b.publish()
    _record_path("a").symlink_to(b.path)
    before = b.path.read_bytes()
    with pytest.raises(DeviceError, match=r"a\.table is a symbolic link"):
        SharedTableRecord("a", PARAMS)
    assert b.path.read_bytes() == before and b.attached() == [os.getpid()]
    os.link(b.path, _record_path("c"))  # a hard link: the same record under two names
    with pytest.raises(DeviceError, match="has 2 names"):
        SharedTableRecord("c", PARAMS)


def test_a_fifo_record_is_refused_without_blocking() -> None:
    os.mkfifo(_record_path("t"), 0o600)
    with pytest.raises(DeviceError, match="is not a regular file"):
        SharedTableRecord("t", PARAMS)


def test_drafts_of_dead_processes_are_swept() -> None:
    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    draft = _folder()
    draft.mkdir(mode=0o700, exist_ok=True)
    draft = draft / f".x.table.{dead.pid}.0a1b2c3d.new"
    draft.write_bytes(bytes(RECORD_BYTES))
    SharedTableRecord("t", PARAMS)
    assert not draft.exists()
    assert [p.name for p in _folder().iterdir()] == ["t.table"]


# -- waits -------------------------------------------------------------------------------


def _own(shm: str, key: str, ready: Any, build_s: float) -> None:
    """An owner that builds for `build_s` (its thread ticking), then publishes and stays."""
    os.environ["HPS_SHM_DIR"] = shm
    _quick()
    record = SharedTableRecord(key, PARAMS)
    assert record.owner
    ready.set()
    time.sleep(build_s)
    record.publish()
    time.sleep(600)


@pytest.fixture()
def owner(shm: Path) -> Iterator[Any]:
    procs: list[Any] = []

    def start(build_s: float) -> Any:
        ready = mp.get_context("spawn").Event()
        procs.append(_run(_own, str(shm), "t", ready, build_s))
        assert ready.wait(120)
        return procs[-1]

    yield start
    for proc in procs:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)


def test_a_live_owner_slower_than_the_bound_is_waited_for(quick: None, owner: Any) -> None:
    proc = owner(build_s=6.0)  # three times STUCK_S, its progress word moving
    record = SharedTableRecord("t", PARAMS)
    assert not record.owner and record.owner_pid() == proc.pid


def test_a_stopped_owner_is_refused(quick: None, owner: Any) -> None:
    proc = owner(build_s=600)
    os.kill(proc.pid, signal.SIGSTOP)  # alive, its progress word still
    try:
        with pytest.raises(DeviceError) as e:
            SharedTableRecord("t", PARAMS)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    said = str(e.value)
    assert "the shared GPU table t was not ready after" in said
    assert f"(owner pid {proc.pid})" in said and "made no progress for 2 s" in said


def _plant_owner(pid: int, started: int | None) -> None:
    """A record being built, naming process `pid` (started at `started`) as its owner."""
    fd = create(_record_path("t"), PARAMS)
    assert fd is not None
    os.pwrite(fd, np.array([pid], np.int64).tobytes(), shared_record.OWNER * 8)
    os.pwrite(fd, np.array([started or 0], np.int64).tobytes(),
              shared_record.OWNER_START * 8)
    os.close(fd)


@pytest.fixture()
def sleeper() -> Iterator[Any]:
    """A live process of this user's that builds nothing."""
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    proc.start()
    yield proc
    proc.kill()
    proc.join(30)


def test_an_owner_that_builds_nothing_is_refused(quick: None, sleeper: Any) -> None:
    _plant_owner(sleeper.pid, process_started(sleeper.pid))
    with pytest.raises(DeviceError, match=f"owner pid {sleeper.pid}.*made no progress"):
        SharedTableRecord("t", PARAMS)


def test_an_owner_whose_pid_another_process_took_is_taken_over(sleeper: Any) -> None:
    """The owner died and its PID went to another process: that one started later."""
    started = process_started(sleeper.pid)
    assert started is not None
    _plant_owner(sleeper.pid, started - 1)
    record = SharedTableRecord("t", PARAMS)  # at once: no wait for its progress
    assert record.owner and record.owner_pid() == os.getpid()


def test_an_owner_of_another_user_is_refused_at_once(stranger: Stranger) -> None:  # noqa: F811
    theirs = stranger.process()
    try:
        _plant_owner(theirs.pid, process_started(theirs.pid))
        with pytest.raises(DeviceError) as e:  # before STUCK_S (20 s here)
            SharedTableRecord("t", PARAMS)
    finally:
        theirs.kill()
        theirs.wait(30)
    said = str(e.value)
    assert f"owner pid {theirs.pid}" in said and f"a process of user {stranger.uid}" in said


def _hold_lock(path: str, ready: Any, uid: int) -> None:
    """Another user's process holding the record's lock (opened before it became that
    user: a file it can no longer open, as a process started by root may)."""
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.setgid(uid)
    os.setuid(uid)
    ready.set()
    time.sleep(600)


@pytest.mark.parametrize("doing", ["attach", "write"])
def test_a_lock_held_by_another_users_process_is_waited_for_within_the_bound(
        quick: None, stranger: Stranger, doing: str) -> None:  # noqa: F811
    record = SharedTableRecord("t", PARAMS)
    record.publish()
    ready = mp.get_context("spawn").Event()
    proc = _run(_hold_lock, str(record.path), ready, stranger.uid)
    assert ready.wait(120)
    try:
        with pytest.raises(DeviceError) as e:
            if doing == "attach":
                SharedTableRecord("t", PARAMS)
            else:
                record.gate.close()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    said = str(e.value)
    assert re.match(r"the shared GPU table t: this process waited \d+ s for its lock "
                    rf"\(to {doing}\), held by ", said)
    assert f"process {proc.pid} of user {stranger.uid}" in said
    assert "with no progress for 2 s" in said


def _write_for(shm: str, seconds: float, ready: Any, done: Any) -> None:
    """A process of this server's that attaches and writes for `seconds` (its gate closed,
    the writers' lock held), then sets `done`, reopens and stays."""
    os.environ["HPS_SHM_DIR"] = shm
    _quick()
    record = SharedTableRecord("t", PARAMS)
    record.gate.close()
    ready.set()
    time.sleep(seconds)
    done.set()  # before the lock is let go: a waiter that gets it finds it set
    record.gate.write_queued(None, 0)
    time.sleep(600)


@pytest.fixture()
def writer(shm: Path) -> Iterator[Any]:
    """Starts a writer (_write_for) on table t, published here, once it holds the lock."""
    procs: list[Any] = []

    def start(seconds: float) -> tuple[Any, Any]:
        ctx = mp.get_context("spawn")
        ready, done = ctx.Event(), ctx.Event()
        procs.append(_run(_write_for, str(shm), seconds, ready, done))
        assert ready.wait(120)
        return procs[-1], done

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)


def test_a_live_writer_slower_than_the_bound_is_waited_for(quick: None, writer: Any) -> None:
    SharedTableRecord("t", PARAMS).publish()
    record = SharedTableRecord("t", PARAMS)  # another process's view of the table
    proc, done = writer(seconds=6.0)  # three times LOCK_WAIT_S, its progress word moving
    record.gate.close()
    assert done.is_set()  # the lock came when its write was done, not before
    assert int(record.gate.words[shared_gate.WRITER]) == os.getpid()
    record.gate.write_queued(None, 0)
    assert not record.gate.words[shared_gate.WRITER] and proc.is_alive()


def test_a_stopped_writer_is_refused_then_recovered_once_dead(
        quick: None, writer: Any, caplog: pytest.LogCaptureFixture) -> None:
    SharedTableRecord("t", PARAMS).publish()
    record = SharedTableRecord("t", PARAMS)
    proc, _ = writer(seconds=600)
    os.kill(proc.pid, signal.SIGSTOP)  # alive, holding the lock mid-write, ticking no more
    with pytest.raises(DeviceError) as e:
        record.gate.close()
    said = str(e.value)
    assert said.startswith("the shared GPU table t: this process waited ")
    assert f"(to write), held by process {proc.pid} of user {os.geteuid()}" in said
    assert "with no progress for 2 s" in said
    gate = record.gate.words
    assert int(gate[shared_gate.WRITER]) == proc.pid  # its write left as it was
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    with caplog.at_level(logging.WARNING, logger="hps"):
        record.gate.close()  # its lock freed by its death: the table emptied, then written
    assert f"writer (pid {proc.pid}) died mid-write" in caplog.text
    assert int(gate[shared_gate.RECOVERIES]) == 1
    record.gate.write_queued(None, 0)


def test_a_query_waits_for_a_live_writer_and_refuses_a_stopped_one(
        quick: None, writer: Any) -> None:
    SharedTableRecord("t", PARAMS).publish()
    record = SharedTableRecord("t", PARAMS)
    proc, done = writer(seconds=6.0)  # three times LOCK_WAIT_S, its progress word moving
    record.gate.enter()
    assert done.is_set()  # counted in once the write was done
    record.gate.leave_locked()
    proc, _ = writer(seconds=600)
    os.kill(proc.pid, signal.SIGSTOP)
    with pytest.raises(DeviceError) as e:
        record.gate.enter()
    said = str(e.value)
    assert said.startswith("the shared GPU table t: a query waited ")
    assert f"for the write of process {proc.pid} of user {os.geteuid()}" in said
    assert "which made no progress for 2 s" in said
    assert record.gate.words[record.gate._slot_word + 1] == 0  # not counted in


def _query_for(shm: str, seconds: float, ready: Any, done: Any) -> None:
    """A process of this server's with a query in flight for `seconds` (its count held, as
    while its caller's host work runs), then done, staying attached."""
    os.environ["HPS_SHM_DIR"] = shm
    _quick()
    record = SharedTableRecord("t", PARAMS)
    record.gate.enter()
    ready.set()
    time.sleep(seconds)
    done.set()  # before its count drops: a writer that drains finds it set
    record.gate.leave_locked()
    time.sleep(600)


def test_a_write_waits_for_a_live_query_and_refuses_a_stopped_one(
        quick: None, shm: Path) -> None:
    SharedTableRecord("t", PARAMS).publish()
    record = SharedTableRecord("t", PARAMS)
    ctx = mp.get_context("spawn")
    procs = []
    try:
        for seconds in (6.0, 600):
            ready, done = ctx.Event(), ctx.Event()
            procs.append(_run(_query_for, str(shm), seconds, ready, done))
            assert ready.wait(120)
            if seconds == 6.0:  # three times LOCK_WAIT_S, its progress word moving
                record.gate.close()
                assert done.is_set()
                record.gate.write_queued(None, 0)
        os.kill(procs[-1].pid, signal.SIGSTOP)
        with pytest.raises(DeviceError) as e:
            record.gate.close()
        said = str(e.value)
        assert said.startswith("the shared GPU table t: a write waited ")
        assert f"for a query in flight of process {procs[-1].pid}, which made no progress " \
               "for 2 s" in said
        gate = record.gate.words
        assert not gate[shared_gate.WRITER] and not gate[shared_gate.CLOSED]  # reopened, unlocked
        os.kill(procs[-1].pid, signal.SIGKILL)
        procs[-1].join(30)
        record.gate.close()  # its query's count dropped with its death
        record.gate.write_queued(None, 0)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)


# -- a PID another process took ------------------------------------------------------------


def _slot_word(record: SharedTableRecord, slot: int) -> int:
    return shared_gate.GATE_WORDS + slot * shared_gate.SLOT_WORDS


def _plant_slot(record: SharedTableRecord, pid: int, started: int) -> int:
    """Fills the last process slot as a process `pid`, started at `started`, with a query
    in flight would."""
    word = _slot_word(record, shared_gate.SLOTS - 1)
    words = record.gate.words
    words[word + 1], words[word + 2], words[word] = 1, started, pid
    return word


@pytest.mark.parametrize("same", [True, False], ids=["its-process", "pid-taken"])
def test_a_slot_whose_pid_another_process_took_is_dead(sleeper: Any, same: bool) -> None:
    record = SharedTableRecord("t", PARAMS)
    record.publish()
    started = process_started(sleeper.pid)
    assert started is not None
    word = _plant_slot(record, sleeper.pid, started if same else started - 1)
    assert (sleeper.pid in record.attached()) == same
    if same:
        return  # its query in flight: a writer would wait for it (test_shared_gate.py)
    closing = threading.Thread(target=record.gate.close, daemon=True)
    closing.start()  # its query in flight is of a dead process: not waited for
    closing.join(60)
    assert not closing.is_alive()
    assert record.gate.words[word] == 0 and record.gate.words[word + 1] == 0
    record.gate.write_queued(None, 0)


def test_an_owner_whose_pid_another_process_took_is_said_dead(
        owner: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import hps.gpu.shared_cache as shared_cache

    monkeypatch.setattr(shared_cache, "_OWNER_CHECK_S", 0.05)
    proc = owner(build_s=0.0)
    record = SharedTableRecord("t", PARAMS)
    assert not record.owner and not record.owner_gone()
    started = int(record._words[shared_record.OWNER_START])
    assert started == process_started(proc.pid)
    with caplog.at_level(logging.WARNING, logger="hps"):
        record._words[shared_record.OWNER_START] = started - 1  # its PID, another process
        assert record.owner_gone()
        deadline = time.monotonic() + 60
        while "died: this process keeps serving" not in caplog.text:
            assert time.monotonic() < deadline, "the watcher never said the owner died"
            time.sleep(0.05)
    assert f"process {proc.pid}, which allocated the shared GPU table t, died" in caplog.text
