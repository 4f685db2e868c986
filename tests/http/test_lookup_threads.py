"""The server's lookup threads (HTTP and gRPC) take their GPU waits' GIL rule from
`HPS_LOOKUP_GIL` (hps/http/lookup_threads.py); the caller's own threads keep theirs."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hps.gpu import gil_wait
from tests.http.conftest import TABLE_NAMES, ModelFiles, serving


def _held_on_lookup_thread(state: object) -> int:
    return state.executor.submit(gil_wait.held_keys).result(timeout=10)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("rule", "held"), [("release", 0), ("keep", gil_wait.HELD_KEYS),
                                            ("nonsense", gil_wait.HELD_KEYS)])
def test_the_lookup_threads_take_the_environments_rule(
        model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch, rule: str, held: int
        ) -> None:
    monkeypatch.setenv("HPS_LOOKUP_GIL", rule)
    with serving(model_files) as live:
        keys = live.model.sample_keys(np.random.default_rng(0), 0, 50)
        answer = live.lookup_binary(TABLE_NAMES[0], keys)  # the pool's threads started
        assert answer.status_code == 200, answer.text
        assert _held_on_lookup_thread(live.app.state.hps) == held
    # the test's own thread, and a new one, keep the default
    assert gil_wait.held_keys() == gil_wait.HELD_KEYS
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(gil_wait.held_keys()))
    other.start()
    other.join()
    assert seen == [gil_wait.HELD_KEYS]


def test_a_thread_that_released_may_keep_again() -> None:
    def both() -> tuple[int, int]:
        gil_wait.release_gil_in_waits()
        released = gil_wait.held_keys()
        gil_wait.release_gil_in_waits(False)
        return released, gil_wait.held_keys()

    out: list[tuple[int, int]] = []
    t = threading.Thread(target=lambda: out.append(both()))
    t.start()
    t.join()
    assert out == [(0, gil_wait.HELD_KEYS)]
