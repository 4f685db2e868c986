"""The retry policy: delays grow by the factor up to the cap, jitter stays in bounds,
attempts and the stop event end the retries."""

from __future__ import annotations

import itertools
import random
import threading

import pytest

from hps.runtime.backoff import Backoff


def test_delays_double_up_to_the_cap_without_jitter() -> None:
    policy = Backoff(initial=0.1, cap=1.0, jitter=0.0)
    delays = list(itertools.islice(policy.delays(), 7))
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])


def test_jitter_stays_within_bounds_and_under_the_cap() -> None:
    policy = Backoff(initial=1.0, cap=8.0, factor=2.0, jitter=0.25)
    rng = random.Random(7)
    for _ in range(200):
        delays = list(itertools.islice(policy.delays(rng), 6))
        for n, delay in enumerate(delays):
            base = min(8.0, 2.0 ** n)
            assert base * 0.75 <= delay <= min(8.0, base * 1.25)
    # the jitter draws differ: clients do not retry in lockstep
    assert len({next(policy.delays(rng)) for _ in range(20)}) > 1


def test_attempts_bound_the_delays() -> None:
    assert len(list(Backoff(0.01, 0.01, attempts=4).delays())) == 3
    assert list(Backoff(0.01, 0.01, attempts=1).delays()) == []


def test_retry_returns_once_the_call_succeeds() -> None:
    calls: list[int] = []
    seen: list[tuple[str, float]] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OSError(f"try {len(calls)}")
        return "ok"

    policy = Backoff(0.001, 0.002, jitter=0.0)
    result = policy.retry(flaky, retry_on=(OSError,),
                          on_retry=lambda exc, delay: seen.append((str(exc), delay)))
    assert result == "ok"
    assert len(calls) == 3
    assert seen == [("try 1", 0.001), ("try 2", 0.002)]


def test_retry_raises_the_last_error_when_attempts_run_out() -> None:
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise OSError(f"failure {len(calls)}")

    with pytest.raises(OSError, match="failure 3"):
        Backoff(0.001, 0.001, attempts=3).retry(broken, retry_on=(OSError,))
    assert len(calls) == 3


def test_retry_does_not_retry_other_errors() -> None:
    calls: list[int] = []

    def wrong() -> None:
        calls.append(1)
        raise KeyError("not transient")

    with pytest.raises(KeyError):
        Backoff(0.001, 0.001).retry(wrong, retry_on=(OSError,))
    assert len(calls) == 1


def test_stop_event_ends_an_endless_retry() -> None:
    stop = threading.Event()
    calls: list[int] = []

    def down() -> None:
        calls.append(1)
        if len(calls) == 5:
            stop.set()  # e.g. close() from another thread
        raise ConnectionError("down")

    # an hour-long delay would hang the test if the stop did not end the wait
    policy = Backoff(initial=0.001, cap=3600.0, factor=10.0)
    with pytest.raises(ConnectionError):
        policy.retry(down, retry_on=(ConnectionError,), stop=stop)
    assert len(calls) == 5


def test_stop_set_while_waiting_ends_the_wait() -> None:
    stop = threading.Event()
    waiting = threading.Event()
    outcome: list[BaseException] = []

    def down() -> None:
        waiting.set()
        raise ConnectionError("down")

    def run() -> None:
        try:
            Backoff(initial=3600.0, cap=3600.0).retry(down, retry_on=(ConnectionError,),
                                                      stop=stop)
        except ConnectionError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert waiting.wait(10)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert len(outcome) == 1


@pytest.mark.parametrize("kwargs", [
    {"initial": 0.0, "cap": 1.0},
    {"initial": 2.0, "cap": 1.0},
    {"initial": 0.1, "cap": 1.0, "factor": 0.5},
    {"initial": 0.1, "cap": 1.0, "jitter": 1.0},
    {"initial": 0.1, "cap": 1.0, "attempts": 0},
])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(**kwargs)  # type: ignore[arg-type]
