"""hps/gpu/overlap.py: a task handed over for a GPU lookup's wait runs once, on the
thread that set it, and only there."""

from __future__ import annotations

import threading

from hps.gpu import overlap


def test_task_runs_once_and_is_cleared() -> None:
    ran: list[int] = []
    overlap.set_task(ran.append, 1)
    overlap.run_task()
    overlap.run_task()  # a second wait in the same call (e.g. a miss path) runs nothing
    assert ran == [1]
    overlap.set_task(ran.append, 2)
    overlap.set_task(None)  # the caller's finally: a lookup that ran no kernel
    overlap.run_task()
    assert ran == [1]


def test_tasks_are_per_thread() -> None:
    ran: list[str] = []
    overlap.set_task(ran.append, "main")
    other = threading.Thread(target=overlap.run_task)  # another thread's lookup
    other.start()
    other.join()
    assert ran == []
    overlap.run_task()
    assert ran == ["main"]
