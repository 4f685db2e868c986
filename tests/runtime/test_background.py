"""The bounded-queue background worker, the periodic task and the weak ticker, on real
threads."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from hps.runtime.background import BackgroundWorker, PeriodicTask, WeakTicker


class Gate:
    """A handler that records what it got and blocks until released."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, batch: list[int]) -> None:
        self.batches.append(batch)
        self.entered.set()
        assert self.release.wait(10)


def test_items_are_handled_in_order_and_wait_idle_sees_them_done() -> None:
    got: list[int] = []
    worker = BackgroundWorker("hps-test-order", 100, got.extend)
    for i in range(50):
        assert worker.submit(i)
    assert worker.wait_idle(10)
    assert got == list(range(50))
    assert worker.pending() == 0
    assert worker.close(10)


def test_submit_never_blocks_and_reports_a_drop_when_full() -> None:
    gate = Gate()
    worker = BackgroundWorker("hps-test-full", 3, gate)
    assert worker.submit(0)
    assert gate.entered.wait(10)  # 0 is being handled; the queue is empty again
    assert [worker.submit(i) for i in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
    assert worker.dropped == 2
    assert worker.pending() == 4
    assert not worker.wait_idle(0.01)  # still blocked in the handler
    gate.release.set()
    assert worker.wait_idle(10)
    assert gate.batches == [[0], [1], [2], [3]]
    assert worker.close(10)


def test_max_batch_merges_what_queued_up() -> None:
    gate = Gate()
    worker = BackgroundWorker("hps-test-merge", 10, gate, max_batch=3)
    worker.submit(0)
    assert gate.entered.wait(10)
    for i in range(1, 6):
        worker.submit(i)
    gate.release.set()
    assert worker.wait_idle(10)
    assert gate.batches == [[0], [1, 2, 3], [4, 5]]
    worker.close(10)


def test_close_handles_what_is_queued_then_refuses() -> None:
    gate = Gate()
    worker = BackgroundWorker("hps-test-close", 10, gate)
    worker.submit(0)
    assert gate.entered.wait(10)
    worker.submit(1)
    gate.release.set()
    assert worker.close(10)
    assert gate.batches == [[0], [1]]
    assert not worker.submit(2)
    assert worker.dropped == 1
    assert worker.close(10)  # idempotent


def test_close_with_a_stuck_handler_gives_up_and_drops_the_queue(
        caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate()
    worker = BackgroundWorker("hps-test-stuck", 10, gate)
    worker.submit(0)
    assert gate.entered.wait(10)
    worker.submit(1)
    worker.submit(2)
    with caplog.at_level(logging.WARNING, logger="hps.runtime.background"):
        assert not worker.close(0.05)
    assert "2 queued items dropped" in caplog.text
    gate.release.set()
    assert worker.wait_idle(10)
    assert gate.batches == [[0]]


def test_discard_drops_what_no_handler_took() -> None:
    gate = Gate()
    worker = BackgroundWorker("hps-test-discard", 10, gate)
    worker.submit(0)
    assert gate.entered.wait(10)
    worker.submit(1)
    worker.submit(2)
    assert worker.discard() == 2
    gate.release.set()
    assert worker.close(10)
    assert gate.batches == [[0]]


def test_a_failing_handler_is_logged_and_the_worker_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    got: list[int] = []

    def handle(batch: list[int]) -> None:
        if batch == [1]:
            raise RuntimeError("boom on 1")
        got.extend(batch)

    log = logging.getLogger("hps.test.background")
    worker = BackgroundWorker("hps-test-errors", 10, handle, log=log)
    with caplog.at_level(logging.ERROR, logger="hps.test.background"):
        for i in range(3):
            worker.submit(i)
        assert worker.wait_idle(10)
    assert got == [0, 2]
    [record] = caplog.records
    assert "hps-test-errors" in record.getMessage()
    assert record.exc_info is not None and "boom on 1" in str(record.exc_info[1])
    worker.close(10)


def test_the_thread_is_named_and_started_on_first_submit() -> None:
    names: list[str] = []
    worker = BackgroundWorker("hps-test-named", 10,
                              lambda _: names.append(threading.current_thread().name))
    assert not any(t.name == "hps-test-named" for t in threading.enumerate())
    worker.submit(0)
    assert worker.wait_idle(10)
    assert names == ["hps-test-named"]
    worker.close(10)
    assert not any(t.name == "hps-test-named" for t in threading.enumerate())


def test_bad_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        BackgroundWorker("hps-test-bad", 0, lambda _: None)


def test_periodic_task_runs_until_closed_and_survives_errors(
        caplog: pytest.LogCaptureFixture) -> None:
    runs: list[str] = []
    third = threading.Event()

    def run() -> None:
        runs.append(threading.current_thread().name)
        if len(runs) == 3:
            third.set()
        if len(runs) == 1:
            raise RuntimeError("first run fails")

    with caplog.at_level(logging.ERROR, logger="hps.runtime.background"):
        task = PeriodicTask("hps-test-periodic", 0.001, run)
        assert third.wait(10)
        assert task.close(10)
    count = len(runs)
    assert count >= 3 and set(runs) == {"hps-test-periodic"}
    assert "first run fails" in caplog.text
    assert task.close(10)
    assert len(runs) == count  # no run after close


def test_periodic_task_closed_during_its_delay_never_runs() -> None:
    runs: list[int] = []
    task = PeriodicTask("hps-test-delay", 0.001, lambda: runs.append(1), delay=3600.0)
    assert task.close(10)
    assert runs == []


class _Item:
    def __init__(self, open_: bool = True) -> None:
        self.open = open_
        self.ticks = 0


def test_a_weak_ticker_ticks_the_items_it_keeps_and_ends_with_the_last() -> None:
    def tick(items: list[_Item]) -> None:
        for item in items:
            item.ticks += 1

    ticker: WeakTicker[_Item] = WeakTicker("test-ticker", lambda: 0.01, tick,
                                           keep=lambda item: item.open)
    kept, closed = _Item(), _Item(open_=False)
    ticker.add(kept)
    ticker.add(closed)
    deadline = time.monotonic() + 5
    while kept.ticks < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kept.ticks >= 3 and closed.ticks == 0
    first = ticker._thread
    assert first is not None and first.name == "test-ticker"
    ticker.discard(kept)  # none left: the thread ends
    first.join(5)
    assert not first.is_alive() and ticker._thread is None
    again = _Item()
    ticker.add(again)  # and the next add starts another
    while again.ticks < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert again.ticks >= 1 and ticker._thread is not first


def test_a_weak_ticker_holds_no_item_alive_and_survives_a_failing_tick() -> None:
    import gc
    import weakref

    calls: list[int] = []

    def tick(items: list[_Item]) -> None:
        calls.append(len(items))
        raise RuntimeError("a tick that fails")

    ticker: WeakTicker[_Item] = WeakTicker("test-ticker-2", lambda: 0.01, tick)
    item = _Item()
    gone = weakref.ref(item)
    ticker.add(item)
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) >= 2  # the thread went on after the first failure
    thread = ticker._thread
    del item
    while gone() is not None and time.monotonic() < deadline:  # a tick may hold it now
        gc.collect()
        time.sleep(0.01)
    assert gone() is None  # held weakly: between ticks, nothing keeps it
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive()  # its last item gone, it ended
