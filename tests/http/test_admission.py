"""The admission rule (hps/http/admission.py): an arrival is shed when every lookup
thread is taken and the lookups ahead of it, at the measured pace of answers, would keep
it waiting past the target, or when the hard bound is reached; Retry-After follows the
refusals of the last second at that pace; the early refusal answers what the handler's
refusal answers. The rule's inputs are set here, so no timing decides; the last test
holds a real server's lookup thread."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from hps.http.admission import MAX_RETRY_AFTER_S, STALL_TARGETS, Admission
from tests.http.conftest import MODEL, Live, ModelFiles, start, wait_until
from tests.support.raw_http import ResponseReader, connect, raw_request


def _busy(admission: Admission, queued: int, gap_s: float) -> Admission:
    """`admission` with `queued` lookups in, answers `gap_s` apart, the last one now."""
    admission.queued = queued
    admission.drain_gap_s = gap_s
    admission._last_done = time.perf_counter()
    return admission


def test_sheds_by_the_delay_an_arrival_would_wait() -> None:
    # 2 threads, answers 1 ms apart, target 3 ms: 2 taken + 3 waiting is the most that
    # a newcomer waits 3 ms behind (3 answers ahead of it get a thread before it)
    assert not _busy(Admission(2, 100, 0.003), 1, 0.001).shed_now()  # a thread is free
    assert not _busy(Admission(2, 100, 0.003), 4, 0.001).shed_now()  # 3 answers ahead
    assert _busy(Admission(2, 100, 0.003), 5, 0.001).shed_now()  # 4 ahead: 4 ms
    # short lookups admit a deeper queue, long ones none past the threads
    assert not _busy(Admission(2, 100, 0.003), 30, 0.0001).shed_now()
    assert _busy(Admission(2, 100, 0.003), 2, 0.010).shed_now()


def test_the_bound_holds_whatever_the_pace() -> None:
    assert not _busy(Admission(2, 8, 0.003), 7, 0.0).shed_now()
    assert _busy(Admission(2, 8, 0.003), 8, 0.0).shed_now()
    assert _busy(Admission(2, 8, 3600.0), 8, 0.0).shed_now()


def test_below_the_floor_nothing_is_shed() -> None:
    """However slow the answers, fewer than `floor` lookups in are never shed."""
    admission = _busy(Admission(2, 100, 0.003, floor=8), 7, 1.0)
    admission._busy_since -= 1.0
    assert not admission.shed_now()
    admission.queued = 8
    assert admission.shed_now()
    assert Admission(2, 3, floor=8).floor == 3  # never above the bound


def test_while_it_sheds_the_lower_floor_holds() -> None:
    """Once a lookup was refused, more clients ask than the floor lets in: for a second
    after the last refusal the shedding floor holds, so the queue stays short; then the
    floor protects a handful of slow clients again."""
    admission = _busy(Admission(2, 100, 0.003, floor=8, shedding_floor=4), 6, 0.002)
    assert not admission.shed_now()  # 6 in, under the floor: a tier slow for a moment
    admission.queued = 8
    assert admission.shed_now()  # past the floor, 7 answers ahead at 2 ms
    admission.count_shed()
    admission.queued = 6
    assert admission.shed_now()  # shedding: 5 ahead at 2 ms, over the floor of 4
    admission.queued = 3
    assert not admission.shed_now()  # under the shedding floor
    admission.queued = 6
    admission._last_shed -= 1.5  # no refusal for a second and a half
    assert not admission.shed_now()
    assert Admission(2, 100, floor=8).shedding_floor == 8  # by default: the floor
    assert Admission(2, 100, floor=2, shedding_floor=4).shedding_floor == 2


def test_no_answer_for_longer_than_the_target_sheds() -> None:
    """No answer for STALL_TARGETS targets since every thread was taken (a tier that
    stopped answering): what arrives then is not queued behind it. A shorter pause is
    not a stall."""
    admission = Admission(1, 100, 0.003)
    admission.enter()  # the one thread taken; no answer yet
    assert admission.queued == 1 and admission.drain_gap_s == 0.0
    admission._busy_since -= 0.5 * STALL_TARGETS * 0.003
    assert not admission.shed_now()
    admission._busy_since -= 1.0  # ... a second ago
    assert admission.shed_now()
    admission.leave()  # answered: a thread is free again
    assert admission.queued == 0 and not admission.shed_now()


def test_the_pace_is_measured_while_every_thread_is_busy() -> None:
    admission = Admission(2, 100)
    admission.enter()
    admission.leave()  # a thread was free all along: no gap measured
    assert admission.drain_gap_s == 0.0
    for _ in range(3):
        admission.enter()
    admission.leave()  # the first answer of the busy spell starts the clock
    assert admission.drain_gap_s == 0.0
    admission._last_done -= 0.002  # type: ignore[operator]
    admission.leave()  # 2 ms after it, with both threads still taken before
    assert admission.drain_gap_s == pytest.approx(0.002, rel=0.2)
    admission.leave()  # a thread free again: the spell ends
    assert admission.queued == 0 and admission._last_done is None


def test_retry_after_follows_the_refusals_at_the_drain_rate() -> None:
    counted: list[int] = []
    admission = _busy(Admission(2, 100, 0.003), 50, 0.001)
    admission.on_shed = lambda: counted.append(1)
    assert admission.count_shed() == "1"  # 1 refusal at 1,000 answers/s
    for _ in range(1998):
        admission.count_shed()
    assert admission.count_shed() == "2"  # 2,000 refusals in this second: 2 s to serve
    admission.drain_gap_s = 1.0
    assert admission.count_shed() == str(MAX_RETRY_AFTER_S)
    assert len(counted) == 2001


@pytest.fixture
def held(model_files: ModelFiles) -> Iterator[Live]:
    """One lookup thread, a hard bound no test reaches, a 10 ms target (a stall: no
    answer for STALL_TARGETS × 10 ms), no floor."""
    yield from start(model_files, lookup_threads=1, max_queued_lookups=100,
                     queue_target_s=0.01, min_queued_lookups=0)


@pytest.fixture
def full(model_files: ModelFiles) -> Iterator[Live]:
    """One lookup thread and a bound of 1; the delay never decides."""
    yield from start(model_files, lookup_threads=1, max_queued_lookups=1,
                     queue_target_s=3600.0)


def _v2(live: Live) -> httpx.Response:
    return live.client.post(f"/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "KEYS", "datatype": "INT64", "shape": [1], "data": [1]},
        {"name": "NUMKEYS", "datatype": "INT32", "shape": [1], "data": [1]}]})


def test_the_early_refusal_answers_what_the_handler_s_does(full: Live) -> None:
    """The pre-encoded 503 ahead of the handler is the general path's answer (FastAPI,
    the handler's `admit`, the exception handler) byte for byte, in both protocols."""
    state = full.app.state.hps
    keys = full.model.keys[0][:16]
    release = threading.Event()
    state.executor.submit(release.wait)
    first: list[Any] = []
    waiter = threading.Thread(target=lambda: first.append(full.lookup_binary(0, keys)))
    waiter.start()
    try:
        wait_until(lambda: state.queued_lookups == 1)
        refused_before = full.app.hot_routes.refused_directly
        early = [full.lookup_binary(0, keys), _v2(full)]
        # both refused by the connection itself (hps/http/direct.py), not an ASGI task
        assert full.app.hot_routes.refused_directly == refused_before + 2
        hot, full.app.hot_routes = full.app.hot_routes, None  # every request via FastAPI
        try:
            general = [full.lookup_binary(0, keys), _v2(full)]
        finally:
            full.app.hot_routes = hot
    finally:
        release.set()
        waiter.join()
    assert first[0].status_code == 200
    for a, b in zip(early, general, strict=True):
        assert a.status_code == b.status_code == 503
        assert a.content == b.content
        for name in ("content-type", "content-length", "retry-after"):
            assert a.headers[name] == b.headers[name], name
    assert early[0].json()["error"]["kind"] == "overloaded"
    assert full.metric("hps_http_shed_total") == 4
    assert full.metric("hps_http_errors_total", kind="overloaded", code="503") == 4


def test_a_refusal_keeps_the_connection_and_drops_its_body(full: Live) -> None:
    """A shed lookup answered by the connection itself: the 503 comes once its body is
    in (the body dropped, a part at a time), and the same keep-alive connection then
    gets its next lookup answered, the rows exact."""
    state = full.app.state.hps
    keys = full.model.keys[0][:16]
    body = keys.astype("<i8").tobytes()
    path = f"/v1/models/{MODEL}/tables/0/lookup"
    release = threading.Event()
    state.executor.submit(release.wait)
    first: list[Any] = []
    waiter = threading.Thread(target=lambda: first.append(full.lookup_binary(0, keys)))
    waiter.start()
    sock = connect(full.url)
    try:
        wait_until(lambda: state.queued_lookups == 1)
        request = raw_request(path, body)
        sock.sendall(request[:-40])  # the headers and part of the body ...
        time.sleep(0.05)
        sock.sendall(request[-40:])  # ... then the rest: one answer, after the last part
        reader = ResponseReader(sock)
        status, headers, answer = reader.response()
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(answer)["error"]["kind"] == "overloaded"
        assert "connection" not in headers  # kept alive
    finally:
        release.set()
        waiter.join()
    try:
        wait_until(lambda: state.queued_lookups == 0)
        sock.sendall(raw_request(path, body))
        status, _, answer = reader.response()
        assert status == 200
        rows = np.frombuffer(answer, "<f4").reshape(len(keys), -1)
        np.testing.assert_array_equal(rows, full.model.expected(0, keys))
    finally:
        sock.close()
    assert first[0].status_code == 200
    assert full.metric("hps_http_shed_total") == 1


def test_a_stalled_thread_sheds_before_the_bound(held: Live) -> None:
    state = held.app.state.hps
    keys = held.model.keys[0][:16]
    release = threading.Event()
    state.executor.submit(release.wait)  # the thread is stuck on something slow
    first: list[Any] = []
    waiter = threading.Thread(target=lambda: first.append(held.lookup_binary(0, keys)))
    waiter.start()
    try:
        wait_until(lambda: state.queued_lookups == 1)
        time.sleep(3 * STALL_TARGETS * 0.01)  # no answer for three times the stall
        shed = held.lookup_binary(0, keys)
        assert shed.status_code == 503, shed.text
        assert shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["kind"] == "overloaded"
        assert state.queued_lookups == 1  # not queued behind the stalled one
    finally:
        release.set()
        waiter.join()
    assert first[0].status_code == 200
    assert held.metric("hps_http_shed_total") == 1
    assert held.metric("hps_http_errors_total", kind="overloaded", code="503") == 1
    assert held.client.post(f"/v1/models/{MODEL}/tables/0/lookup",
                            content=keys.astype("<i8").tobytes(),
                            headers={"Content-Type": "application/octet-stream"}
                            ).status_code == 200
