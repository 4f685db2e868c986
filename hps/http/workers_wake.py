"""The workers' doorbell: a change one worker of `hps serve --workers N` writes to the run's
boards (an op on the op log, a prefetch on the prefetch board) reaches the others at once,
while their follower threads (hps/http/workers_ops.py) sleep between looks. The GPU
caches' update follower (hps/server/cache_journal.py) has a bell of its own (another
channel), rung as the leader journals the keys of an online update.

A follower that looked every POLL seconds, whatever came, woke 50 times a second in every
worker: the 8 workers' followers took 0.09 cores, idle or serving, about half of what an
idle 8-worker server took in all (one H200 machine, 16 cores, 2026-11-29: the threads'
CPU read from /proc), and a wake costs its CPU whatever the look finds. So a follower
looks every POLL seconds while there is work (`rest(busy=True)`), waits twice as long
after each look that found none, up to IDLE_POLL, and a worker that writes a change rings
every worker's bell (`ring`), which ends that wait at once: a change is seen as soon as
before, and a quiet server wakes about 3 times a second.

The bell is a datagram socket of each worker, bound in Linux's abstract namespace under a
name made of the run folder, the channel and the worker's index: no file to leave behind,
and gone with its process. A ring is one datagram to each worker; one to a worker that is
not there (yet) is lost, which costs nothing: a worker's follower looks at the boards as
it starts.
Where the socket cannot be made (not Linux), the follower looks every POLL seconds.
"""

from __future__ import annotations

import hashlib
import logging
import select
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("hps.http.workers")

#: seconds between two looks of a follower while it finds work
POLL = 0.02
#: the longest wait between looks after a quiet spell (seconds): where a ring is lost
#: (none is, between live workers) a change waits at most this long
IDLE_POLL = 0.32


class Doorbell:
    """Worker `index`'s bell in the run at `run_folder` (see the module). Thread-safe:
    any thread may ring; one thread (the follower) rests."""

    def __init__(self, run_folder: Path, index: int, channel: str = "ops") -> None:
        self._prefix = b"\0hps-bell-" + hashlib.sha1(
            str(run_folder.resolve()).encode()).hexdigest()[:24].encode() + (
            f"-{channel}-".encode())
        self._wait = POLL
        self._rung = -POLL  # when this bell last rang the others (monotonic seconds)
        self._stop = threading.Event()
        self._inbox: socket.socket | None = None
        self._outbox: socket.socket | None = None
        try:
            inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                inbox.bind(self._name(index))
            except OSError:
                inbox.close()
                raise
            inbox.setblocking(False)
            outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            outbox.setblocking(False)
        except (OSError, AttributeError) as exc:  # no abstract namespace here: polling
            log.info("worker %d: no doorbell (%s); its follower looks every %g s", index,
                     exc, POLL)
            return
        self._inbox, self._outbox = inbox, outbox

    @property
    def rings(self) -> bool:
        """Whether rings reach this worker (else it looks every POLL seconds)."""
        return self._inbox is not None

    def ring(self, indices: Iterable[int], every: float = 0.0) -> None:
        """Wake the followers of workers `indices` (this one too, where listed). With
        `every`, not again within `every` seconds of the last ring: a follower a ring woke
        looks again POLL later while it finds work, so a stream of changes wakes it no
        more often than that (pass POLL)."""
        if self._outbox is None:
            return
        if every:
            now = time.monotonic()
            if now - self._rung < every:
                return
            self._rung = now
        for index in indices:  # a loop over workers
            try:
                self._outbox.sendto(b"!", self._name(index))
            except OSError:  # not there (yet), or its inbox full: it will look anyway
                pass

    def rest(self, busy: bool) -> None:
        """The follower's wait after a look: POLL where the look found work, else twice
        the last wait up to IDLE_POLL; a ring or `close` ends it."""
        self._wait = POLL if busy or self._inbox is None else min(self._wait * 2, IDLE_POLL)
        if self._inbox is None:
            self._stop.wait(self._wait)
            return
        if self._stop.is_set():
            return
        ready, _, _ = select.select([self._inbox], [], [], self._wait)
        if ready:
            self._drain()

    def wake(self) -> None:
        """Ends a rest in progress (or the next one) at once: a look wanted now."""
        inbox, outbox = self._inbox, self._outbox
        if inbox is None or outbox is None:
            return
        try:
            outbox.sendto(b"!", inbox.getsockname())
        except OSError:
            pass

    def close(self) -> None:
        """Ends a rest in progress and every later one at once (the sockets stay until
        `release`)."""
        self._stop.set()
        self.wake()

    def release(self) -> None:
        """Close the sockets (after the follower thread stopped)."""
        for sock in (self._inbox, self._outbox):
            if sock is not None:
                sock.close()
        self._inbox = self._outbox = None

    def _drain(self) -> None:
        assert self._inbox is not None
        while True:  # a loop over the rings that came while asleep, a few at most
            try:
                self._inbox.recv(16)
            except OSError:  # BlockingIOError: none left
                return

    def _name(self, index: int) -> bytes:
        return self._prefix + str(index).encode()
