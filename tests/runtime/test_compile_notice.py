"""CompileNotice: a compile is announced once, as it starts, when it really compiles."""

from __future__ import annotations

import threading
import time

from hps.runtime.compile_notice import CompileNotice
from hps.runtime.compile_on_use import CompileEvent

START = CompileEvent("hps.tiers.m.fetch", "(int64[:],)")
CACHED = CompileEvent("hps.tiers.m.fetch", "(int64[:],)", seconds=0.002, from_cache=True)


def test_a_compile_that_runs_on_is_announced_once_with_its_name() -> None:
    said = threading.Event()
    times: list[int] = []
    notice = CompileNotice(lambda: (times.append(1), said.set()), after=0.05)
    notice(START)
    assert said.wait(10) and notice.running == "fetch"
    notice(CompileEvent(START.function, START.signature, seconds=3.0))
    notice(START)  # the next compile: said already
    time.sleep(0.3)
    assert times == [1] and notice.done == 1


def test_a_read_from_the_cache_is_never_announced() -> None:
    times: list[int] = []
    notice = CompileNotice(lambda: times.append(1), after=0.2)
    for _ in range(3):
        notice(START)
        notice(CACHED)
    time.sleep(0.6)  # three times the notice's delay after the last start
    assert times == [] and notice.done == 3 and notice.running is None
