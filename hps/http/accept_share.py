"""Connections spread evenly over the workers of `hps serve --workers N`.

Every worker accepts from the one listening socket the supervisor holds. Left to the
event loop, the worker that wakes first accepts every connection waiting (uvloop accepts
until none is left, asyncio up to its backlog), so clients that connect together land on
one or two workers: 8 keep-alive connections opened at once to `hps serve --workers 4`
went 8/0/0/0, 3/3/2/0, then 5/3/0/0 three times (2 cores). Clients that keep their
connections (a frontend, a load balancer's pool, a benchmark's client processes) then
get the throughput of the workers that hold them while the others idle, and how many
that is changes from one start of the clients to the next.

Here each worker accepts itself (`SharedAccept`, in place of uvicorn's listener): one
connection each time the socket is readable, and only while it holds no more open
connections than the fewest any other responsive worker holds. Otherwise it stops
watching the socket for PAUSE_S and looks again, leaving the connection to a worker with
fewer. The workers' counts are on a `ConnectionBoard`: a small file in the run folder
that each maps, one slot a worker (its open connections and a heartbeat). A worker whose
heartbeat is older than STALE_S (a process stopped, or an event loop held by a long
call) is not waited for, so a new connection waits at most about that long for a worker
with room; at worst it is accepted as before, by whoever is free. Each worker counts on
the board the connections it took past such a worker holding fewer (`passed_over`):
an uneven spread with none counted is this module's fault, not the machine's load.

The count is the worker's open HTTP connections (the `ConnectionGuard`'s, which counts
every connection the protocol made and not yet lost) plus those accepted and not yet
made; a connection passes from the second to the first in one step, its protocol's
`connection_made` (`SharedAccept.counted`), so no count ever holds it twice. gRPC has
its own port and grpcio's own accept (SO_REUSEPORT: the kernel spreads those).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

log = logging.getLogger("hps.http")

#: the board's file in the run folder
BOARD_FILE = "connections"
#: seconds a worker with more connections than another stops watching the socket
PAUSE_S = 0.001
#: seconds between a worker's heartbeats (a timer on its event loop)
BEAT_S = 0.01
#: a worker whose heartbeat is older than this is not waited for (seconds)
STALE_S = 0.05
#: seconds a worker out of descriptors (EMFILE and the like) waits before accepting again
OUT_OF_DESCRIPTORS_S = 1.0
# int64 words a worker: open connections, heartbeat (CLOCK_MONOTONIC ns), connections
# taken past a worker that was not responsive and held fewer
_SLOT = 3

_Protocol = TypeVar("_Protocol", bound=asyncio.BaseProtocol)


class ConnectionBoard:
    """The open connections and heartbeat of each of `workers` workers, in the file
    `folder/connections` that every worker maps (created by the first to open it)."""

    def __init__(self, folder: Path, workers: int) -> None:
        path = folder / BOARD_FILE
        size = max(workers, 1) * _SLOT * 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # every worker asks for the same size
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.slots = np.frombuffer(self._map, dtype=np.int64).reshape(-1, _SLOT)

    def publish(self, index: int, open_connections: int) -> None:
        """Worker `index`'s count, and a heartbeat."""
        slot = self.slots[index]
        slot[0] = open_connections
        slot[1] = time.monotonic_ns()

    def fewest_other(self, index: int) -> int | None:
        """The fewest open connections of a worker other than `index` whose heartbeat is
        fresh (None: no such worker)."""
        return self.others(index)[0]

    def others(self, index: int) -> tuple[int | None, int | None]:
        """Of the workers other than `index`, from one reading of the board: the fewest
        open connections of one whose heartbeat is fresh, and of one whose heartbeat is
        stale (not one that left: it has none). None where there is no such worker."""
        slots = self.slots[:, :2].copy()
        fresh = _fresh(slots[:, 1])
        stale = (slots[:, 1] > 0) & ~fresh
        fresh[index] = stale[index] = False
        return _fewest(slots[fresh, 0]), _fewest(slots[stale, 0])

    def count_pass(self, index: int) -> None:
        """Worker `index` took a connection past a worker not responsive that held fewer."""
        self.slots[index, 2] += 1

    def passed_over(self) -> np.ndarray:
        """Each worker's count of connections taken past a worker that was not
        responsive and held fewer (a copy)."""
        return self.slots[:, 2].copy()

    def responsive(self) -> int:
        """How many workers have a fresh heartbeat (are accepting)."""
        return int(_fresh(self.slots[:, 1]).sum())

    def leave(self, index: int) -> None:
        """Worker `index` takes no more connections: not waited for."""
        self.slots[index, :2] = 0

    def close(self) -> None:
        del self.slots
        with contextlib.suppress(BufferError):  # a view still held: the process exit unmaps
            self._map.close()


def _fresh(heartbeats: np.ndarray) -> np.ndarray:
    """Which of the workers whose `heartbeats` these are beat within STALE_S."""
    return heartbeats >= time.monotonic_ns() - int(STALE_S * 1e9)


def _fewest(counts: np.ndarray) -> int | None:
    return int(counts.min()) if counts.size else None


class SharedAccept:
    """A worker's accept of the shared listening socket `sock` onto its event loop,
    leaving connections to workers with fewer (the module docstring). `open_connections`
    is this worker's count of connections its protocol made and not yet lost; `start`'s
    factory makes instances of `counted(protocol class)`."""

    def __init__(self, sock: socket.socket, board: ConnectionBoard, index: int,
                 open_connections: Callable[[], int]) -> None:
        self._sock = sock
        self._board = board
        self._index = index
        self._open = open_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._factory: Callable[[], asyncio.Protocol] | None = None
        self._watching = False
        self._stopped = False
        self._beat_timer: asyncio.TimerHandle | None = None
        self._watch_timer: asyncio.TimerHandle | None = None
        self._making = 0  # accepted, not yet made (counted()'s connection_made)

    def counted(self, protocol_class: type[_Protocol]) -> type[_Protocol]:
        """`protocol_class`, whose connections this worker's `open_connections` counts,
        taking each over from the accept in one step (`connection_made`): no reading of
        the board sees a connection twice or not at all. Connections are made from
        instances of this class (`start`'s factory).

        The task that makes a connection learnt it was made a loop turn or more after
        `connection_made`; a heartbeat or the next accept in between counted it twice,
        and the worker holding 3 of 8 connections read 4 and left the 8th to the other
        worker (3/5)."""
        made = self._made_one

        class Counted(protocol_class):  # type: ignore[valid-type, misc]
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made()
                super().connection_made(transport)

        return Counted

    def start(self, loop: asyncio.AbstractEventLoop,
              protocol_factory: Callable[[], asyncio.Protocol]) -> None:
        self._loop, self._factory = loop, protocol_factory
        self._sock.setblocking(False)
        self._beat()
        self._watch()

    def stop(self) -> None:
        """No more connections accepted here (the drain); the ones made stay."""
        self._stopped = True
        self._unwatch()
        for timer in (self._beat_timer, self._watch_timer):
            if timer is not None:
                timer.cancel()
        self._board.leave(self._index)

    # -- inside (all on the event loop) --------------------------------------------------

    def publish(self) -> None:
        """This worker's count on the board now (a connection gone: the others see the
        room at once, not at the next heartbeat)."""
        if not self._stopped:
            self._board.publish(self._index, self._count())

    def _count(self) -> int:
        return self._open() + self._making

    def _made_one(self) -> None:
        """A connection accepted here is made: its protocol counts it from now."""
        self._making -= 1

    def _beat(self) -> None:
        if self._stopped:
            return
        self.publish()
        assert self._loop is not None
        self._beat_timer = self._loop.call_later(BEAT_S, self._beat)

    def _watch_in(self, delay: float) -> None:
        assert self._loop is not None
        self._watch_timer = self._loop.call_later(delay, self._watch)

    def _watch(self) -> None:
        if self._stopped or self._watching:
            return
        assert self._loop is not None
        self._loop.add_reader(self._sock.fileno(), self._readable)
        self._watching = True

    def _unwatch(self) -> None:
        if self._watching and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        self._watching = False

    def _readable(self) -> None:
        fewest, fewest_stale = self._board.others(self._index)
        if fewest is not None and self._count() > fewest:
            self._unwatch()  # another worker has room: its wake-up takes it
            self._watch_in(PAUSE_S)
            return
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another worker took it, or its client gave up
        except OSError as exc:
            self._unwatch()
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.error("accepting a connection: %s; trying again in %gs", exc,
                          OUT_OF_DESCRIPTORS_S)
                self._watch_in(OUT_OF_DESCRIPTORS_S)
            else:  # the socket stopped listening (the supervisor's drain)
                self._stopped = True
            return
        if fewest_stale is not None and fewest_stale < self._count():
            self._board.count_pass(self._index)
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._making += 1
        self.publish()
        assert self._loop is not None
        self._loop.create_task(self._made(conn))

    async def _made(self, conn: socket.socket) -> None:
        assert self._loop is not None and self._factory is not None
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except Exception as exc:  # noqa: BLE001 - one connection's failure, not the server's
            # raised before the transport called connection_made (after it, only a
            # cancel at shutdown, which is no Exception): never counted by the protocol
            log.warning("a connection accepted could not be served: %s", exc)
            conn.close()
            self._made_one()


def shared_accept(sock: socket.socket, board: ConnectionBoard, index: int,
                  protocol_class: Any) -> SharedAccept:
    """The SharedAccept of a worker whose connections `protocol_class`'s guard counts
    (connections.py), told of each connection gone."""
    guard = protocol_class.guard
    accept = SharedAccept(sock, board, index, lambda: guard.open)
    guard.on_gone = accept.publish
    return accept
