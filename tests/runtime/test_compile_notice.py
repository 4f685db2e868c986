"""CompileNotice: a compile is announced once, as it starts, when it really compiles;
CompileLines: then a line every few seconds while compiles go on, with their count."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from hps.runtime.compile_notice import READING, CompileLines, CompileNotice
from hps.runtime.compile_on_use import CompileEvent

START = CompileEvent("hps.tiers.m.fetch", "(int64[:],)")
CACHED = CompileEvent("hps.tiers.m.fetch", "(int64[:],)", seconds=0.002, from_cache=True)
#: the start of a compile numba's cache lists: a read
READ = CompileEvent("hps.tiers.m.fetch", "(int64[:],)", from_cache=True)


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


def test_a_slow_read_from_the_cache_is_never_called_compiling() -> None:
    """On a loaded machine a read from numba's cache may take over `after` seconds: it
    says `reading()`, once, and never `say()` (the compile's announcement)."""
    compiled: list[int] = []
    reads = threading.Event()
    read_times: list[int] = []
    notice = CompileNotice(lambda: compiled.append(1), after=0.05,
                           reading=lambda: (read_times.append(1), reads.set()))
    notice(READ)
    assert reads.wait(10) and notice.running == "fetch" and notice.running_read
    notice(CACHED)
    notice(READ)  # the next slow read: said already
    time.sleep(0.3)
    notice(CACHED)
    assert compiled == [] and read_times == [1] and not notice.said
    assert notice.done == 2 and notice.read == 2
    # a compile after the reads is announced as one
    notice(START)
    time.sleep(0.3)
    assert compiled == [1] and notice.said


def test_a_slow_read_says_nothing_without_a_reading_callback() -> None:
    compiled: list[int] = []
    notice = CompileNotice(lambda: compiled.append(1), after=0.05)
    notice(READ)
    time.sleep(0.3)
    assert compiled == [] and not notice.said and not notice.said_reading


def _wait_for(lines: list[str], text: str) -> None:
    for _ in range(3000):  # a line is due every 0.02 s: at most 30 s
        if any(text in line for line in lines):
            return
        time.sleep(0.01)
    raise AssertionError(f"no line says {text!r}: {lines}")


@pytest.fixture
def heard() -> Iterator[tuple[list[str], CompileLines]]:
    """The lines a CompileLines says (every 0.02 s, after 0.02 s), and it."""
    lines: list[str] = []
    compiling = CompileLines(lines.append, "compiling what this config runs", every=0.02,
                             after=0.02)
    try:
        yield lines, compiling
    finally:
        compiling.close()


def test_compile_lines_say_what_then_how_far_while_compiles_go_on(
        heard: tuple[list[str], CompileLines]) -> None:
    lines, compiling = heard
    compiling(START)
    _wait_for(lines, "now fetch")
    assert lines[0] == "compiling what this config runs …"
    compiling(CompileEvent(START.function, START.signature, seconds=3.0))
    compiling(READ)
    compiling(CACHED)
    compiling(CompileEvent("hps.tiers.m.insert", "(int64[:],)"))
    _wait_for(lines, "1 functions compiled, 1 read from the cache, now insert")
    assert not [line for line in lines if READING in line]
    compiling(CompileEvent("hps.tiers.m.insert", "(int64[:],)", seconds=2.0))
    said = len(lines)
    time.sleep(0.2)  # no compile runs: no line
    assert len(lines) == said


def test_compile_lines_of_slow_reads_say_reading(heard: tuple[list[str], CompileLines]
                                                 ) -> None:
    lines, compiling = heard
    compiling(READ)
    _wait_for(lines, "functions read, now fetch")
    assert lines[0] == f"{READING} …"
    assert not [line for line in lines if "compiling" in line]
