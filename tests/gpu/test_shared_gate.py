"""The host-side bookkeeping of a GPU table shared by processes (hps/gpu/shared_gate.py,
hps/gpu/shared_cache.py), in real processes, with no GPU: the record's election and
parameters, writers excluded from every process's readers (a torn read is counted), a
reader or a writer SIGKILLed mid-operation, the owner's memory kept until the last process
is gone, the owner killed after the table was ready, a version loaded again in the owner's
process."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.errors import ConfigError
from hps.gpu.shared_cache import READY, RETIRED, SharedTableRecord, shared_dir
from hps.gpu.shared_gate import RECOVERIES
from tests.support.redis_servers import eventually

PARAMS = {"kind": 3, "dim": 8, "keys": 1000}
ROW = 64  # int64 words a "row" of the shared board spans: torn if its words differ


@pytest.fixture(autouse=True)
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HPS_SHM_DIR", str(tmp_path))
    return tmp_path


def _board(path: Path) -> np.ndarray:
    """A row of int64 words in shared memory that writers fill with one value each time."""
    return np.memmap(path, np.int64, "r+", shape=(ROW,))


def _reader(shm: str, key: str, board: str, seconds: float, gated: bool, out: Any) -> None:
    os.environ["HPS_SHM_DIR"] = shm
    record = SharedTableRecord(key, PARAMS)
    row = _board(Path(board))
    torn = reads = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if gated:
            record.gate.enter()
        first = row[0]
        torn += int(np.any(row != first))
        reads += 1
        if gated:
            record.gate.leave_locked()
    out.put((torn, reads))


def _writer(shm: str, key: str, board: str, seconds: float, out: Any) -> None:
    os.environ["HPS_SHM_DIR"] = shm
    record = SharedTableRecord(key, PARAMS)
    row = _board(Path(board))
    writes = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        record.gate.close()
        value = os.getpid() * 1000 + writes
        for i in range(ROW):  # slowly, word by word: a reader in between would see a tear
            row[i] = value
            if i % 16 == 0:
                time.sleep(0)
        record.gate.write_queued(None, 0)
        writes += 1
    out.put(("w", writes))


def _owner(key: str) -> SharedTableRecord:
    record = SharedTableRecord(key, PARAMS)
    assert record.owner
    record.publish()
    return record


def _run(target: Any, *args: Any) -> Any:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _torn_reads(shm: Path, gated: bool) -> tuple[int, int, int]:
    owner = _owner("board")
    board = shm / "board.bin"
    board.write_bytes(bytes(ROW * 8))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [_run(_reader, str(shm), "board", str(board), 3.0, gated, out) for _ in range(2)]
    procs += [_run(_writer, str(shm), "board", str(board), 3.0, out) for _ in range(2)]
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    owner.close(None, contextlib.nullcontext(), lambda: None)
    torn = sum(r[0] for r in results if r[0] != "w")
    reads = sum(r[1] for r in results if r[0] != "w")
    writes = sum(r[1] for r in results if r[0] == "w")
    return torn, reads, writes


def test_no_reader_of_any_process_sees_a_write_in_progress(shm: Path) -> None:
    torn, reads, writes = _torn_reads(shm, gated=True)
    assert reads > 100 and writes > 10
    assert torn == 0


def test_the_same_readers_without_the_gate_see_torn_rows(shm: Path) -> None:
    # the check above can fail: ungated, the same processes read rows mid-write
    torn, reads, writes = _torn_reads(shm, gated=False)
    assert reads > 100 and writes > 10
    assert torn > 0


def _enter_and_hang(shm: str, key: str, ready: Any) -> None:
    os.environ["HPS_SHM_DIR"] = shm
    record = SharedTableRecord(key, PARAMS)
    record.gate.enter()  # a query that never ends: killed mid-lookup
    ready.set()
    time.sleep(600)


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_reader_killed_mid_query_does_not_hold_writers_back(shm: Path, reaped: bool) -> None:
    """Also while the dead reader is a zombie that its parent has not reaped yet (a test
    or a supervisor busy elsewhere): its PID still exists, but it reads nothing."""
    owner = _owner("t")
    ready = mp.get_context("spawn").Event()
    proc = _run(_enter_and_hang, str(shm), "t", ready)
    assert ready.wait(60)
    os.kill(proc.pid, signal.SIGKILL)
    if reaped:
        proc.join(30)
    else:
        eventually(lambda: _assert_zombie(proc.pid), 30, "the reader is a zombie")
    try:
        write = threading.Thread(target=_write_nothing, args=(owner,), daemon=True)
        write.start()
        write.join(30)  # waits for live readers only; a zombie's slot would hang it
        assert not write.is_alive()
        assert owner.attached() == [os.getpid()]
    finally:
        proc.join(30)


def _write_nothing(owner: SharedTableRecord) -> None:
    owner.gate.close()
    owner.gate.write_queued(None, 0)


def _assert_zombie(pid: int) -> None:
    stat = Path(f"/proc/{pid}/stat").read_text()
    assert stat[stat.rfind(")") + 2] == "Z"


def _close_and_hang(shm: str, key: str, ready: Any) -> None:
    os.environ["HPS_SHM_DIR"] = shm
    record = SharedTableRecord(key, PARAMS)
    record.gate.close()  # a write that never ends: killed mid-insert
    ready.set()
    time.sleep(600)


def test_a_writer_killed_mid_write_empties_the_table_once_and_reopens(shm: Path) -> None:
    owner = _owner("t")
    emptied: list[int] = []
    owner.gate.recover = lambda: emptied.append(1)
    ready = mp.get_context("spawn").Event()
    proc = _run(_close_and_hang, str(shm), "t", ready)
    assert ready.wait(60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    owner.gate.enter()  # a query finds the gate closed by a dead writer: recovers, enters
    owner.gate.leave_locked()
    assert emptied == [1]
    assert owner.gate.words[RECOVERIES] == 1
    owner.gate.close()  # and writes go on
    owner.gate.write_queued(None, 0)
    assert emptied == [1]


def test_a_live_writer_is_waited_for_not_recovered(shm: Path) -> None:
    owner = _owner("t")
    emptied: list[int] = []
    owner.gate.recover = lambda: emptied.append(1)
    other = SharedTableRecord("t", PARAMS)  # attached before the write begins
    ready = mp.get_context("spawn").Event()
    proc = _run(_close_and_hang, str(shm), "t", ready)
    assert ready.wait(60)
    with pytest.raises(BlockingIOError):  # the writer holds the lock: no takeover
        import fcntl

        fcntl.flock(other._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other.gate._recover_if_writer_died()
    assert emptied == [] and owner.gate.words[RECOVERIES] == 0
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)


def test_the_first_process_owns_the_others_attach_with_the_same_parameters(shm: Path) -> None:
    owner = _owner("t")
    other = SharedTableRecord("t", PARAMS)
    assert not other.owner
    assert owner.attached() == [os.getpid(), os.getpid()]
    with pytest.raises(ConfigError, match="dim: theirs 8, ours 16"):
        SharedTableRecord("t", {**PARAMS, "dim": 16})


def _own_and_die(shm: str, key: str, ready: Any) -> None:
    os.environ["HPS_SHM_DIR"] = shm
    SharedTableRecord(key, PARAMS)  # owner, never ready
    ready.set()
    time.sleep(600)


def test_an_owner_that_dies_before_the_table_is_ready_is_taken_over(shm: Path) -> None:
    ready = mp.get_context("spawn").Event()
    proc = _run(_own_and_die, str(shm), "t", ready)
    assert ready.wait(60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    record = SharedTableRecord("t", PARAMS)
    assert record.owner


def _attach_and_wait(shm: str, key: str, ready: Any, leave: Any) -> None:
    os.environ["HPS_SHM_DIR"] = shm
    record = SharedTableRecord(key, PARAMS)
    ready.set()
    leave.wait(120)
    record.close(None, contextlib.nullcontext(), lambda: None)


def test_the_owner_frees_a_retired_table_when_the_last_process_detaches(shm: Path) -> None:
    owner = _owner("t")
    ctx = mp.get_context("spawn")
    ready, leave = ctx.Event(), ctx.Event()
    proc = _run(_attach_and_wait, str(shm), "t", ready, leave)
    assert ready.wait(60)
    freed: list[int] = []
    path = owner.path
    owner.close(None, contextlib.nullcontext(), lambda: freed.append(1))
    time.sleep(0.5)
    assert freed == [] and path.exists()  # the other process still maps it
    assert int(np.frombuffer(path.read_bytes()[:16], np.int64)[1]) == RETIRED
    leave.set()
    proc.join(60)
    deadline = time.monotonic() + 10
    while not freed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert freed == [1]
    assert not path.exists()


def _own_ready_and_wait(shm: str, key: str, ready: Any) -> None:
    os.environ["HPS_SHM_DIR"] = shm
    _owner(key)
    ready.set()
    time.sleep(600)


def test_an_owner_killed_leaves_the_table_to_its_processes_and_a_new_one_is_made(
        shm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import hps.gpu.shared_cache as shared_cache

    monkeypatch.setattr(shared_cache, "_OWNER_CHECK_S", 0.05)
    ready = mp.get_context("spawn").Event()
    proc = _run(_own_ready_and_wait, str(shm), "t", ready)
    assert ready.wait(60)
    attached = SharedTableRecord("t", PARAMS)  # maps the table before its owner dies
    assert not attached.owner and attached.owner_pid() == proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    # the process attached keeps its table: its writes and queries still go through the
    # gate, which lives in the record it maps
    attached.gate.close()
    attached.gate.open()
    attached.gate.enter()
    attached.gate.leave_locked()
    with caplog.at_level("WARNING", logger="hps"):
        deadline = time.monotonic() + 10
        while "died" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    said = [r for r in caplog.records if f"process {proc.pid}, which allocated" in r.message]
    assert len(said) == 1, caplog.text  # once, not every check
    # a process that loads the table now cannot open the dead owner's handles: it makes
    # a new table under a new record, and the processes still on the old one keep theirs
    newcomer = SharedTableRecord("t", PARAMS)
    assert newcomer.owner and newcomer.owner_pid() == os.getpid()
    assert newcomer.path.stat().st_ino != os.fstat(attached._fd).st_ino  # noqa: SLF001
    assert attached.owner_pid() == proc.pid
    newcomer.publish()
    again = SharedTableRecord("t", PARAMS)  # and the next one joins the new table
    assert not again.owner and again.owner_pid() == os.getpid()


def test_a_version_loaded_again_in_the_owners_process_inherits_the_table(shm: Path) -> None:
    owner = _owner("t")
    allocations = [object(), object()]
    owner._own.extend(allocations)  # noqa: SLF001 (what memory() keeps: CuPy's, on a GPU)
    again = SharedTableRecord("t", PARAMS)  # a reload of the same files, same process
    assert not again.owner
    owner._words[3] = len(allocations)  # noqa: SLF001 (handles published)
    assert [again.memory(None, 1), again.memory(None, 1)] == allocations  # no IPC open
    freed: list[int] = []
    owner.close(None, contextlib.nullcontext(), lambda: freed.append(1))
    # the old version's references go; the table stays, owned by the new version
    assert freed == [1] and again.owner
    assert int(np.frombuffer(again.path.read_bytes()[:16], np.int64)[1]) == READY
    third = SharedTableRecord("t", PARAMS)
    assert not third.owner  # still the one table to join
    third.close(None, contextlib.nullcontext(), lambda: freed.append(3))  # its caller frees
    again.close(None, contextlib.nullcontext(), lambda: freed.append(2))
    assert freed == [1, 2] and not again.path.exists()  # the last one out frees it


def test_records_live_under_the_shared_memory_folder(shm: Path) -> None:
    record = _owner("m.t.d0.abc")
    folder = shm / f"hps-gpu-cache-{os.geteuid()}"  # the user's own, closed to others
    assert record.path.parent == shared_dir() == folder
    assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.geteuid()
    assert record.path.stat().st_mode & 0o777 == 0o600
    assert int(np.frombuffer(record.path.read_bytes()[:16], np.int64)[1]) == READY
