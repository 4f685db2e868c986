"""How a GPU table orders its writes against its queries (DeviceTable's mixin).

Queries run on the callers' streams; inserts, updates and removes on the table's own
stream or, on the lookup path's miss path, on the caller's. A write waits, on the GPU,
for the queries in flight (each records an event after its kernel) and for the write
before it; a query waits for the last write. Queries of the fast path (hps/gpu/fast_query.py)
record no event the table keeps: a write first closes the table's gate and waits until none
is between its launch and its miss count, and the gate stays closed until the locked path
finds the write done. Every method here runs under the table's lock.

Uses the table's `_lock`, `_cp`, `_rt`, `_device`, `_stream`, `_inflight` (query event →
its stream's key, hps/gpu/streams.py), `_write_event`, `_retire`, `_gate` and `_check_open`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hps.gpu.streams import same_stream, stream_key


def reopen_for_one_pass(tables: list[Any]) -> bool:
    """Whether every table's gate is open for a sharded table's one pass, each reopened
    (as hold_for_query does) when its last write is done: then the one pass may take its
    fast path instead of ordering itself in each table (a lookup with misses inserts into
    its shards, so in steady state each next one found the gates closed, the inserts long
    done). False, at the first table, while a write is pending or a table is closed: the
    locked path then orders the query, or raises.

    The miss path's one launch records one event that becomes every shard's last write
    (hps/gpu/sharded_misses.py): it is asked once, not once a shard (an event query is
    about a microsecond; 4 H200s, a quarter cached: the four reopens took 7.5 us of a
    117 us call). The events found done are kept referenced until the end, so no event
    made meanwhile can be taken for one of them by its id."""
    done: list[Any] = []
    for table in tables:
        with table._lock:
            if table._closed:
                return False
            event = table._write_event
            if event is not None and any(event is d for d in done):
                table._write_event = None
            elif not table._writes_done():
                return False
            elif event is not None:
                done.append(event)
            if not table._open_when_written():
                return False
    return True


class WriteOrder:
    """The ordering of DeviceTable's writes (see the module docstring)."""

    _lock: Any
    _cp: Any
    _rt: Any
    _device: Any
    device_id: int
    _stream: Any
    _inflight: dict[int, int]
    _write_event: Any
    _retire: Any
    _gate: Any
    _closed: bool

    def _check_open(self) -> None:
        raise NotImplementedError

    def _wait_for_writes(self, stream_ptr: int) -> None:
        """Orders work on `stream_ptr` after the last write (each write is ordered after
        the one before it, so the last one is enough)."""
        if not self._writes_done():
            self._rt.streamWaitEvent(stream_ptr, self._write_event.ptr, 0)

    def _writes_done(self) -> bool:
        """Whether the last write is done (its event then forgotten)."""
        ev = self._write_event
        if ev is not None and ev.done:
            self._write_event = ev = None
        return ev is None

    # A query that another table's kernel makes of this one (a sharded table's one pass,
    # hps/gpu/sharded_query.py), ordered as the locked path orders this table's own:
    #     table.hold_for_query(stream)              # the lock taken, after the last write
    #     ... launch, record `event` on stream ...
    #     table.release_after_query(stream, event, device)  # event 0: nothing launched
    #     ... the query's miss count read ...
    #     table.query_done(event)
    def hold_for_query(self, stream_ptr: int) -> None:
        """Takes the table's lock and orders `stream_ptr` after the last write; with none
        pending, reopens the gate, as the locked path of the table's own queries does.
        Raises DeviceError (the lock released) when the table is closed."""
        self._lock.acquire()
        try:
            self._check_open()
            self._wait_for_writes(stream_ptr)
            self._open_when_written()
        except BaseException:
            self._lock.release()
            raise

    def _open_when_written(self) -> bool:
        """With no write pending, opens the gate to the one pass's fast path (a shared
        table's gate is for its own queries alone); whether it did. The lock held."""
        if self._write_event is None and not self._gate.shared:
            self._gate.open()
            return True
        return False

    def release_after_query(self, stream_ptr: int, event_ptr: int, device: int) -> None:
        """Counts the query recorded by `event_ptr` (0: none launched) on stream `stream_ptr`
        of `device` among the queries in flight, which later writes wait for, and releases
        the lock."""
        if event_ptr:
            self._inflight[event_ptr] = stream_key(stream_ptr, device)
        self._lock.release()

    def query_done(self, event_ptr: int) -> None:
        """The query of `event_ptr` reads the table no more (its miss count landed)."""
        self._inflight.pop(event_ptr, None)

    def _after_queries(self, stream_ptr: int, own_event: int = 0,
                       device: int | None = None) -> None:
        """Orders work on `stream_ptr` (of `device`; None: this table's) after the queries
        in flight on other streams: the fast path's are waited for on the host (the
        gate), the others on the GPU."""
        self._gate.close()
        rt = self._rt
        key = stream_key(stream_ptr, self.device_id if device is None else device)
        for ev_ptr, query_stream in tuple(self._inflight.items()):
            if ev_ptr != own_event and not same_stream(query_stream, key):
                rt.streamWaitEvent(stream_ptr, ev_ptr, 0)

    @contextmanager
    def _on_table_stream(self) -> Iterator[None]:
        """Runs the body under the lock with the table's stream current, after the work
        the caller has queued on its own stream (whose arrays the body may use)."""
        cp = self._cp
        with self._lock:
            self._check_open()
            with self._device:
                caller = cp.cuda.get_current_stream()
                if caller.ptr != self._stream.ptr:
                    ready = cp.cuda.Event(block=False, disable_timing=True)
                    ready.record(caller)
                    self._stream.wait_event(ready)
                with self._stream:
                    yield

    @contextmanager
    def _writing(self, *refs: Any) -> Iterator[None]:
        """Like _on_table_stream, also after the queries in flight; later queries wait for
        it. Keeps `refs` (the inputs) alive until the write is done. A shared table's gate
        (hps/gpu/shared_gate.py) stays closed to every process until the write is done."""
        cp = self._cp
        with self._on_table_stream():
            done_ptr = 0
            try:
                self._after_queries(self._stream.ptr)
                self._wait_for_writes(self._stream.ptr)
                yield
                done = cp.cuda.Event(block=False, disable_timing=True)
                done.record(self._stream)
                done_ptr = done.ptr
                self._write_event = done
                self._retire.append((done, refs))
                while self._retire and self._retire[0][0].done:
                    self._retire.popleft()
            finally:
                self._gate.write_queued(self._rt, done_ptr)

    @contextmanager
    def _writing_on(self, stream_ptr: int, ws: Any) -> Iterator[None]:
        """Runs the body (a write queued on the caller's stream `stream_ptr`, the table's
        device current) under the lock, after the queries in flight on other streams and
        the writes before it; later queries and writes wait for it (ws.write_done)."""
        rt = self._rt
        with self._lock:
            self._check_open()
            done_ptr = 0
            try:
                self._after_queries(stream_ptr, ws.event_ptr)
                self._wait_for_writes(stream_ptr)
                yield
                rt.eventRecord(ws.write_done.ptr, stream_ptr)
                done_ptr = int(ws.write_done.ptr)
                self._write_event = ws.write_done
            finally:
                self._gate.write_queued(rt, done_ptr)
