"""VersionRefs: a retired version's clean-up runs once, after its last lookup."""

from __future__ import annotations

import threading

import pytest

from hps.server.versions import VersionRefs


def test_retire_without_lookups_leaves_the_clean_up_to_the_caller() -> None:
    refs = VersionRefs()
    calls: list[int] = []
    assert refs.retire(lambda: calls.append(1)) is True
    assert calls == [] and refs.retired and not refs.acquire()


def test_the_last_release_runs_the_clean_up_once() -> None:
    refs = VersionRefs()
    assert refs.acquire() and refs.acquire()
    calls: list[str] = []
    assert refs.retire(lambda: calls.append(threading.current_thread().name)) is False
    assert not refs.acquire()  # retired: no new lookup holds it
    refs.release()
    assert calls == [] and refs.in_flight == 1
    worker = threading.Thread(target=refs.release, name="last-lookup")
    worker.start()
    worker.join()
    assert calls == ["last-lookup"]


def test_misuse_is_refused() -> None:
    refs = VersionRefs()
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        refs.release()
    refs = VersionRefs()
    refs.retire(lambda: None)
    with pytest.raises(RuntimeError, match="twice"):
        refs.retire(lambda: None)


def test_concurrent_lookups_and_retirement() -> None:
    """Threads acquiring and releasing while the version retires: the clean-up runs
    exactly once, after every acquire that succeeded was released."""
    refs = VersionRefs()
    held = threading.Semaphore(0)
    calls: list[int] = []
    stop = threading.Event()

    def lookups() -> None:
        while not stop.is_set() and refs.acquire():
            held.release()
            refs.release()

    threads = [threading.Thread(target=lookups) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(100):
        held.acquire()  # lookups are under way
    idle_now = refs.retire(lambda: calls.append(refs.in_flight))
    stop.set()
    for t in threads:
        t.join()
    assert (calls == [] and idle_now) or (calls == [0] and not idle_now)
    assert refs.in_flight == 0


def test_retirement_races_with_frequent_thread_switches() -> None:
    """The lock-free holds under a thread switch every microsecond, many times: the
    clean-up still runs once and only after the last hold."""
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(30):
            test_concurrent_lookups_and_retirement()
    finally:
        sys.setswitchinterval(interval)
