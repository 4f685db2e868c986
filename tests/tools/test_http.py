"""The HTTP bench's reading of a server's CPU time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from hps.tools.bench.http import cpu_seconds


def test_cpu_seconds_counts_every_thread_of_a_process() -> None:
    before = cpu_seconds(os.getpid())
    assert before is not None

    def spin() -> None:
        stop = time.thread_time() + 0.5
        while time.thread_time() < stop:
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    after = cpu_seconds(os.getpid())
    # /proc counts clock ticks (10 ms on Linux): the 0.5 s spun, less a few ticks
    assert after is not None and after - before >= 0.45


def test_cpu_seconds_of_a_process_gone_is_none() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu_seconds(gone.pid) is None
