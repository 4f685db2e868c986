"""The workers' doorbell (hps/http/workers_wake.py): a follower that finds nothing waits
longer and longer between looks, a ring from another process ends its wait at once, and
a ring never reaches another run's workers; the GPU caches' update follower
(hps/server/cache_journal.py) sleeps on a bell of its own until the leader's journal rings.
Real sockets, a real second process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hps.http import workers_wake
from hps.http.workers_wake import Doorbell
from hps.server.cache_journal import CacheFollower, UpdateJournal

ROOT = Path(__file__).resolve().parents[2]


def _rests(bell: Doorbell, seconds: float, busy: bool) -> int:
    """How many rests a follower that finds work (`busy`) or none takes in `seconds`."""
    count, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        bell.rest(busy)
        count += 1
    return count


def _ring_from_another_process(run: Path, indices: list[int]) -> None:
    code = ("import sys; from pathlib import Path; from hps.http.workers_wake import Doorbell;"
            "Doorbell(Path(sys.argv[1]), 99).ring(int(i) for i in sys.argv[2:])")
    subprocess.run([sys.executable, "-c", code, str(run), *map(str, indices)], check=True,
                   cwd=ROOT, timeout=60)


def test_a_follower_that_finds_nothing_looks_less_and_less_often(tmp_path: Path) -> None:
    bell = Doorbell(tmp_path, 0)
    assert bell.rings
    # 50 looks a second at POLL while there is work; 1.5 s idle: 0.02, 0.04, ... 0.32 s
    assert _rests(bell, 1.0, busy=True) >= 20
    idle = _rests(bell, 1.5, busy=False)
    assert idle <= 10
    bell.close()
    bell.release()


def test_a_ring_from_another_worker_ends_a_long_wait(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_wake, "IDLE_POLL", 60.0)  # asleep for good without a ring
    bell = Doorbell(tmp_path, 1)
    bell._wait = 30.0  # long idle: its next rest waits a minute
    woke = threading.Event()

    def follower() -> None:
        bell.rest(busy=False)
        woke.set()

    thread = threading.Thread(target=follower)
    thread.start()
    _ring_from_another_process(tmp_path, [0, 1, 2])  # 0 and 2 are not there: harmless
    assert woke.wait(30), "the ring did not end the follower's wait"
    thread.join()
    # the ring was read: the next rest waits again (here, its shortest)
    started = time.monotonic()
    bell.rest(busy=True)
    assert time.monotonic() - started >= workers_wake.POLL * 0.9
    bell.close()
    bell.release()


def test_rings_stay_within_their_run_and_close_ends_a_rest(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setattr(workers_wake, "IDLE_POLL", 60.0)
    ours, theirs = Doorbell(tmp_path / "a", 0), Doorbell(tmp_path / "b", 0)
    theirs.ring([0])  # run b's worker 0: not run a's
    started = time.monotonic()
    ours.rest(busy=True)  # POLL: nothing ends it early
    assert time.monotonic() - started >= workers_wake.POLL * 0.9
    assert ours._inbox is not None
    with pytest.raises(BlockingIOError):
        ours._inbox.recv(16)  # no ring of run b reached it
    ours._wait = 30.0
    done = threading.Event()
    thread = threading.Thread(target=lambda: (ours.rest(busy=False), done.set()))
    thread.start()
    time.sleep(0.1)
    ours.close()  # the server stops: the follower's rest ends at once
    assert done.wait(10)
    thread.join()
    ours.rest(busy=False)  # and later ones do not wait
    for bell in (ours, theirs):
        bell.close()
        bell.release()
    assert not ours.rings


def test_a_second_bell_of_one_worker_polls(tmp_path: Path) -> None:
    # a worker's index is bound once: a second bell there (never in a run: one process a
    # worker) cannot take its rings, and looks every POLL seconds rather than sleep on
    first = Doorbell(tmp_path, 3)
    second = Doorbell(tmp_path, 3)
    assert first.rings and not second.rings
    assert _rests(second, 0.5, busy=False) >= 10
    for bell in (first, second):
        bell.close()
        bell.release()


def test_a_stream_of_changes_rings_at_most_once_every_given_seconds(tmp_path: Path) -> None:
    follower, leader = Doorbell(tmp_path, 1), Doorbell(tmp_path, 0)
    for _ in range(5):  # an update stream's appends in quick succession
        leader.ring([1], every=30.0)
    assert follower._inbox is not None
    follower._inbox.recv(16)  # the first rang
    with pytest.raises(BlockingIOError):
        follower._inbox.recv(16)  # the others, within 30 s of it, did not
    for bell in (follower, leader):
        bell.close()
        bell.release()


def test_the_gpu_caches_follower_sleeps_until_the_leaders_journal_rings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every rest a minute long: only a ring (or wake) makes the follower look in time
    monkeypatch.setattr(workers_wake, "POLL", 30.0)
    monkeypatch.setattr(workers_wake, "IDLE_POLL", 60.0)
    applied: list[list[int]] = []
    leader = Doorbell(tmp_path, 0, channel="gpu")
    journal = UpdateJournal(tmp_path, lambda: leader.ring([1]))
    follower = CacheFollower(tmp_path, lambda: [("m", "users", None)],
                             lambda table, keys: applied.append(keys.tolist()),
                             lambda table: None,
                             bell=Doorbell(tmp_path, 1, channel="gpu"))
    follower.start()

    def applied_within(count: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while len(applied) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(applied) >= count

    try:
        time.sleep(0.2)  # resting now
        journal.append("m", "users", np.array([5, 4]))
        assert applied_within(1, 10), "the journal's ring did not wake the follower"
        assert applied == [[4, 5]]
        # the op log's channel is another: its ring leaves this follower asleep
        quiet, ops = UpdateJournal(tmp_path), Doorbell(tmp_path, 0)
        quiet.append("m", "users", np.array([6]))  # no ring
        quiet.close()
        ops.ring([1])
        ops.release()
        assert not applied_within(2, 1.0)
        leader.ring([1])
        assert applied_within(2, 10) and applied[-1] == [6]
        follower.reset("m")  # a version loaded here: every key again, at once
        assert applied_within(3, 10) and applied[-1] == [4, 5, 6]
    finally:
        started = time.monotonic()
        follower.close()  # ends the minute-long rest at once, and frees the bell
        assert time.monotonic() - started < 10
        journal.close()
        leader.close()
        leader.release()
