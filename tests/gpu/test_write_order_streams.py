"""Which streams a GPU table's writes wait on, without a GPU (hps/gpu/streams.py,
hps/gpu/write_order.py): a shard of a sharded table is queried and written from every
device's streams, and the legacy default stream's handle (0) names another stream on each
device, so a write from one device's default stream must wait for a query in flight on
another device's default stream. And when the one pass reopens its shards' gates: only
once each shard's last write is done, the insert event they share asked once."""

from __future__ import annotations

import threading
from typing import Any

from hps.gpu.fast_query import CLOSED, FastGate
from hps.gpu.streams import LEGACY_STREAM, PER_THREAD_STREAM, same_stream, stream_key
from hps.gpu.write_order import WriteOrder, reopen_for_one_pass

CREATED = 0x7F00_1234_5000  # a created stream's handle: one stream in the process


def test_the_default_streams_handle_names_one_stream_a_device() -> None:
    assert same_stream(stream_key(0, 0), stream_key(0, 0))
    assert same_stream(stream_key(0, 1), stream_key(LEGACY_STREAM, 1))
    assert not same_stream(stream_key(0, 0), stream_key(0, 1))
    assert not same_stream(stream_key(LEGACY_STREAM, 0), stream_key(0, 3))
    # a created stream is itself on whichever device asks; per-thread streams never match
    assert same_stream(stream_key(CREATED, 0), stream_key(CREATED, 2))
    assert not same_stream(stream_key(CREATED, 0), stream_key(0, 0))
    assert not same_stream(stream_key(PER_THREAD_STREAM, 0), stream_key(PER_THREAD_STREAM, 0))


class _Runtime:
    """The CUDA runtime calls WriteOrder makes, recorded: (stream, event) of each wait."""

    def __init__(self) -> None:
        self.waits: list[tuple[int, int]] = []

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:  # noqa: N802
        self.waits.append((stream, event))


class _Shard(WriteOrder):
    """The parts of a table WriteOrder uses, for a shard on device 1."""

    def __init__(self) -> None:
        self.device_id = 1
        self._lock = threading.RLock()
        self._rt: Any = _Runtime()
        self._gate = FastGate()
        self._inflight: dict[int, int] = {}
        self._write_event = None
        self._closed = False

    def _check_open(self) -> None:
        assert not self._closed


def test_a_write_from_another_devices_default_stream_waits_for_the_query_in_flight() -> None:
    shard = _Shard()
    # one pass queries of the shard from device 0's and device 2's default streams
    for device, event in ((0, 100), (2, 102)):
        shard.hold_for_query(0)
        shard.release_after_query(0, event, device)
    # an insert from device 0's default stream: ordered after device 2's query only
    shard._after_queries(0, device=0)
    assert shard._rt.waits == [(0, 102)]
    # the shard's own device's default stream is a third stream: it waits for both
    shard._rt.waits.clear()
    shard._after_queries(0)
    assert sorted(shard._rt.waits) == [(0, 100), (0, 102)]
    # a query done reads the shard no more
    shard.query_done(102)
    shard._rt.waits.clear()
    shard._after_queries(0, device=0)
    assert shard._rt.waits == []


def test_a_write_on_a_created_stream_skips_only_its_own_streams_queries() -> None:
    shard = _Shard()
    shard.hold_for_query(CREATED)
    shard.release_after_query(CREATED, 200, 0)
    shard.hold_for_query(0)
    shard.release_after_query(0, 201, 0)
    shard._after_queries(CREATED, device=0)
    assert shard._rt.waits == [(CREATED, 201)]


class _Event:
    """A write's event: done or not, and how often it was asked."""

    def __init__(self) -> None:
        self.finished = False
        self.asked = 0

    @property
    def done(self) -> bool:
        self.asked += 1
        return self.finished


def _written(shards: list[_Shard], events: list[_Event]) -> None:
    """Each shard written (its gate closed, as a write closes it) with its event last."""
    for shard, event in zip(shards, events, strict=True):
        shard._gate.close()
        shard._write_event = event


def test_the_one_pass_reopens_its_shards_once_their_shared_insert_is_done() -> None:
    shards = [_Shard() for _ in range(4)]
    insert = _Event()  # the miss path's one launch: every shard's last write
    _written(shards, [insert] * 4)
    assert not reopen_for_one_pass(shards)  # the insert still running: no gate opens
    assert insert.asked == 1
    assert all(s._gate.words[CLOSED] == 1 and s._write_event is insert for s in shards)
    insert.finished = True
    assert reopen_for_one_pass(shards)
    assert insert.asked == 2  # asked once for the four shards
    assert all(s._gate.words[CLOSED] == 0 and s._write_event is None for s in shards)
    assert reopen_for_one_pass(shards)  # nothing written since: open, nothing asked
    assert insert.asked == 2


def test_a_shard_with_a_write_of_its_own_pending_keeps_the_one_pass_locked() -> None:
    shards = [_Shard() for _ in range(3)]
    insert, update = _Event(), _Event()
    insert.finished = True
    _written(shards, [insert, update, insert])  # shard 1 updated after the insert
    assert not reopen_for_one_pass(shards)
    assert shards[1]._gate.words[CLOSED] == 1 and shards[1]._write_event is update
    assert shards[2]._gate.words[CLOSED] == 1  # not reached: the locked path orders it
    update.finished = True
    assert reopen_for_one_pass(shards)
    # each reopen asks a shared event once: shard 0 the first time, shard 2 the second
    assert (insert.asked, update.asked) == (2, 2)
    shards[0]._closed = True  # a closed table is never reopened
    assert not reopen_for_one_pass(shards)
