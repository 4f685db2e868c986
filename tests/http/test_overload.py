"""Overload: a bounded admission queue (past it, lookups get 503 with Retry-After), and
deadlines (`X-HPS-Deadline-Ms`: 504 rather than an answer served late), counted in the
metrics. The lookup thread is held by the test, so what waits is known, not timed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.http.conftest import DIMS, MODEL, Live, ModelFiles, start, wait_until

QUEUE = 3


@pytest.fixture
def live(model_files: ModelFiles) -> Iterator[Live]:
    """One lookup thread, a bound of QUEUE, and a queueing delay target no wait here
    reaches: the bound alone decides (the delay rule: test_admission.py)."""
    yield from start(model_files, lookup_threads=1, max_queued_lookups=QUEUE,
                     queue_target_s=3600.0)


def test_shed_above_the_queue_and_expire_past_the_deadline(live: Live) -> None:
    state = live.app.state.hps
    keys = live.model.keys[0][:64]
    expected = live.model.expected(0, keys)
    held = threading.Event()
    state.executor.submit(held.wait)  # the one lookup thread is busy until released

    def lookup(headers: dict[str, str]) -> httpx.Response:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            return client.post(f"/v1/models/{MODEL}/tables/0/lookup",
                               content=keys.astype("<i8").tobytes(),
                               headers={"Content-Type": "application/octet-stream",
                                        **headers})

    with ThreadPoolExecutor(QUEUE) as pool:
        waiting = [pool.submit(lookup, {}), pool.submit(lookup, {"X-HPS-Deadline-Ms": "200"})]
        wait_until(lambda: state.queued_lookups == 2)
        waiting.append(pool.submit(lookup, {}))
        wait_until(lambda: state.queued_lookups == QUEUE)
        shed = live.lookup_binary(0, keys)
        assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["kind"] == "overloaded"
        v2 = live.client.post(f"/v2/models/{MODEL}/infer", json={"inputs": [
            {"name": "KEYS", "datatype": "INT64", "shape": [1], "data": [1]},
            {"name": "NUMKEYS", "datatype": "INT32", "shape": [1], "data": [1]}]})
        assert v2.status_code == 503 and v2.headers["retry-after"] == "1"
        time.sleep(0.25)  # the 200 ms deadline has passed before the thread is released
        held.set()
        first, late, third = (f.result() for f in waiting)
    for answer in (first, third):
        assert answer.status_code == 200
        rows = np.frombuffer(answer.content, "<f4").reshape(len(keys), DIMS[0])
        np.testing.assert_array_equal(rows, expected)
    assert late.status_code == 504 and late.json()["error"]["kind"] == "deadline_exceeded"

    gone = live.lookup_binary(0, keys, headers={"X-HPS-Deadline-Ms": "0"})
    assert gone.status_code == 504
    bad = live.lookup_binary(0, keys, headers={"X-HPS-Deadline-Ms": "soon"})
    assert bad.status_code == 400
    fine = live.lookup_binary(0, keys, headers={"X-HPS-Deadline-Ms": "60000"})
    assert fine.status_code == 200
    assert live.metric("hps_http_shed_total") == 2
    assert live.metric("hps_http_deadline_expired_total") == 2


def test_the_v2_timeout_parameter_is_a_deadline(live: Live) -> None:
    """KServe v2's `timeout` request parameter (microseconds, as Triton reads it) is a
    deadline like X-HPS-Deadline-Ms: 0 has passed before the lookup; a long one is met."""
    def infer(parameters: dict[str, object]) -> httpx.Response:
        return live.client.post(f"/v2/models/{MODEL}/infer", json={
            "parameters": parameters, "inputs": [
                {"name": "KEYS", "datatype": "INT64", "shape": [1], "data": [1]},
                {"name": "NUMKEYS", "datatype": "INT32", "shape": [2], "data": [1, 0]}]})

    assert infer({"timeout": 0}).status_code == 504
    assert infer({"timeout": 60_000_000}).status_code == 200
    for bad in (-1, "soon", True, 1.5):
        assert infer({"timeout": bad}).status_code == 400, bad
