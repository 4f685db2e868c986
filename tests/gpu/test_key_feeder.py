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
    """What the feeder asks of a KeySampler: feed what arrived (`fed` counts it), and say
    whether some were in flight as it began. Of `in_flight` samples, one arrives a pass."""

    def __init__(self) -> None:
        self.passes: list[float] = []
        self.in_flight = 0
        self.fed = 0

    def feed_arrived(self) -> bool:
        self.passes.append(time.monotonic())
        if not self.in_flight:
            return False
        self.in_flight -= 1
        self.fed += 1
        return True


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
    assert len(sampler.passes) == 1  # one look; every FEED_INTERVAL would be 40
    time.sleep(0.6)  # past IDLE_CHECK: one more, to see whether samplers are left
    assert 2 <= len(sampler.passes) <= 3


def test_a_launch_wakes_it_and_it_feeds_until_none_is_in_flight(feeder) -> None:
    sampler = _Sampler()
    feeder.add(sampler)
    assert _until(lambda: len(sampler.passes) == 1)
    time.sleep(0.05)  # that pass found nothing: asleep until a launch or IDLE_CHECK
    sampler.in_flight = 3
    woken = time.monotonic()
    feeder.wake()
    assert _until(lambda: len(sampler.passes) >= 4)
    time.sleep(0.3)
    # one a pass while they arrive, and one that found nothing: then asleep again
    assert len(sampler.passes) == 5 and sampler.fed == 3
    assert sampler.passes[1] - woken < key_sample.IDLE_CHECK / 2  # woken, not the look


def test_the_feeder_ends_once_no_sampler_is_left(feeder) -> None:
    sampler = _Sampler()
    feeder.add(sampler)
    thread = feeder._thread
    assert thread is not None and thread.is_alive()
    del sampler
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive() and feeder._thread is None
