"""The feeder thread of the GPU key samplers (hps/gpu/key_sample.py `_Feeder`): it feeds
while samples are in flight and sleeps while none is, so a worker whose lookups launch no
sample (an HTTP worker answered by its host tiers) is not woken 100 times a second. No GPU:
the feeder is driven through the two calls a sampler makes of it (`add`, `wake`) and the
one it makes of a sampler (`feed_arrived`)."""

from __future__ import annotations

import gc
import time

import pytest

from hps.gpu import key_sample


class _Sampler:
    """What the feeder asks of a KeySampler: feed what arrived, and say whether some are
    still in flight (`in_flight` passes answer True, then False)."""

    def __init__(self) -> None:
        self.passes: list[float] = []
        self.in_flight = 0

    def feed_arrived(self) -> bool:
        self.passes.append(time.monotonic())
        self.in_flight = max(0, self.in_flight - 1)
        return self.in_flight > 0


def _until(check, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.005)
    return check()


@pytest.fixture
def feeder(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(key_sample, "IDLE_CHECK", 0.5)
    return key_sample._Feeder()


def test_with_no_sample_in_flight_the_feeder_sleeps(feeder) -> None:
    sampler = _Sampler()
    feeder.add(sampler)
    time.sleep(0.4)
    assert sampler.passes == []  # every FEED_INTERVAL would have been 40 passes
    time.sleep(0.6)  # past IDLE_CHECK: one pass, to see whether samplers are left
    assert 1 <= len(sampler.passes) <= 2


def test_a_launch_wakes_it_and_it_feeds_until_none_is_in_flight(feeder) -> None:
    sampler = _Sampler()
    feeder.add(sampler)
    sampler.in_flight = 3
    woken = time.monotonic()
    feeder.wake()
    assert _until(lambda: len(sampler.passes) >= 3)
    assert sampler.passes[0] - woken < key_sample.IDLE_CHECK  # not the idle look
    time.sleep(0.3)
    assert len(sampler.passes) == 3  # none in flight after the third: asleep again


def test_the_feeder_ends_once_no_sampler_is_left(feeder) -> None:
    sampler = _Sampler()
    feeder.add(sampler)
    thread = feeder._thread
    assert thread is not None and thread.is_alive()
    del sampler
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive() and feeder._thread is None
