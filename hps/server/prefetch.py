"""Prefetch: the rows of given keys brought up the tiers before lookups ask for them.

`Prefetcher.submit(loaded, table, keys)` queues a job and returns it at once; one
background thread runs the jobs in order. A job takes the distinct keys (in the order
given: heaviest first, as exports list them) in chunks of
`CHUNK` and, for each chunk:
1. reads the volatile tier; the keys it lacks are read from the persistent tier, and the
   rows found there are written to the volatile tier (synchronously: when the job is
   done, they are there);
2. inserts every row found into each GPU cache of the table, through the caches' own
   insert path (`GpuCaches.prefetch`: the table's stream, never a caller's).
Keys no tier holds are counted and skipped. A job neither counts as lookups nor feeds the
key sketches. A volatile tier that fails (Redis down) is skipped, as lookups skip it.
A process that only reads the volatile tier (a follower of `hps serve --workers N`:
`fill_volatile` False) skips step 1's writes; the leader's part of the same job makes
them (hps/http/workers_prefetch.py).

`PrefetchJob` is what a caller holds: `status` (queued, running, done, failed,
cancelled), the counts so far, `wait(timeout)`, `cancel()` (the job stops before its next
chunk). The last `KEEP` jobs stay readable by id.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hps.errors import TierError
from hps.server.gpu_caches import GpuCaches
from hps.server.models import LoadedModel, LoadedTable
from hps.tiers import Tiers

log = logging.getLogger("hps")

#: distinct keys per step of a job: a cancelled job stops within one step
CHUNK = 1 << 16
#: finished jobs kept readable by id
KEEP = 256


def first_occurrences(keys: np.ndarray) -> np.ndarray:
    """Each key of `keys` once, where it first appears, in the order given."""
    _, first = np.unique(keys, return_index=True)
    return keys[np.sort(first)]


class PrefetchJob:
    """One prefetch of one table's keys; its figures are read with `as_dict()`."""

    def __init__(self, job_id: str, model: str, table: str, keys: int) -> None:
        self.id = job_id
        self.model = model
        self.table = table
        self.keys = keys
        self.status = "queued"
        self.found = 0  # keys some tier holds
        self.volatile_filled = 0  # rows copied from the persistent tier to the volatile one
        self.gpu_inserted = 0  # rows inserted into GPU caches (each cache counted)
        self.missing = 0  # keys no tier holds
        self.error: str | None = None
        self.seconds = 0.0
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._release: Callable[[], None] | None = None

    def _finish(self, status: str, error: str | None = None) -> None:
        """End the job once: its status, its waiters told, its version let go."""
        if self._done.is_set():
            return
        self.status, self.error = status, error
        release, self._release = self._release, None
        self._done.set()
        if release is not None:
            release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the job ends; False if `timeout` seconds passed first."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop the job before its next chunk (rows written so far stay)."""
        self._cancel.set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def as_dict(self) -> dict[str, Any]:
        """The job's id, model, table, status and counts (JSON-ready)."""
        return {"job": self.id, "model": self.model, "table": self.table,
                "status": self.status, "keys": self.keys, "found": self.found,
                "volatile_filled": self.volatile_filled, "gpu_inserted": self.gpu_inserted,
                "missing": self.missing, "seconds": round(self.seconds, 6),
                "error": self.error}


class Prefetcher:
    """Runs prefetch jobs on one background thread (see the module docstring)."""

    def __init__(self, tiers: Tiers, gpu: GpuCaches) -> None:
        self.tiers = tiers
        self.gpu = gpu
        #: whether jobs write the rows they read from the persistent tier to the volatile one
        self.fill_volatile = True
        #: before each job's number: ids unique among the processes of one server
        self.id_prefix = ""
        #: told when a job starts running and when it ends (a worker publishes its part)
        self.on_change: Callable[[PrefetchJob], None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hps-prefetch")
        self._jobs: OrderedDict[str, PrefetchJob] = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, loaded: LoadedModel, table: LoadedTable, keys: np.ndarray,
               release: Callable[[], None] | None = None, job_id: str | None = None
               ) -> PrefetchJob:
        """Queue a prefetch of `keys` (host int64[n]) into `table` of `loaded`; `release`
        is called when the job ends (the version's reference a caller took for it).
        `job_id`: the id of a job another process announced (default: the next own)."""
        # in the order given: an export lists its heaviest keys first, so a job cut off
        # at its bound has warmed those
        distinct = first_occurrences(np.asarray(keys, np.int64).ravel())
        with self._lock:
            job = PrefetchJob(job_id or f"{self.id_prefix}p{next(self._ids)}",
                              loaded.config.model, table.name, int(distinct.size))
            job._release = release
            self._jobs[job.id] = job
            while len(self._jobs) > KEEP:
                oldest = next(iter(self._jobs.values()))
                if not oldest.finished:
                    break
                self._jobs.popitem(last=False)
            closed = self._closed
            if not closed:
                self._pool.submit(self._run, job, table, distinct)
        if closed:
            job._finish("cancelled", "the server is closing")
        return job

    def job(self, job_id: str) -> PrefetchJob | None:
        """The job of that id, None when unknown (or forgotten: only `KEEP` are kept)."""
        with self._lock:
            return self._jobs.get(job_id)

    def _run(self, job: PrefetchJob, table: LoadedTable, keys: np.ndarray) -> None:
        started = time.perf_counter()
        job.status = "running"
        self._changed(job)
        status, error = "done", None
        try:
            for start in range(0, keys.size, CHUNK):
                if job._cancel.is_set():
                    status = "cancelled"
                    break
                self._step(job, table, keys[start:start + CHUNK])
        except Exception as exc:  # the job's answer says why; the server goes on
            status, error = "failed", str(exc) or type(exc).__name__
            log.warning("prefetch %s of %s/%s failed: %s", job.id, job.model, job.table,
                        error)
        finally:
            job.seconds = time.perf_counter() - started
            job._finish(status, error)
            self._changed(job)

    def _changed(self, job: PrefetchJob) -> None:
        hook = self.on_change
        if hook is not None:
            try:
                hook(job)
            except Exception:  # telling others is a bonus: the job's own outcome stands
                log.exception("prefetch %s: publishing its state failed", job.id)

    def _step(self, job: PrefetchJob, table: LoadedTable, keys: np.ndarray) -> None:
        """One chunk of distinct keys: volatile ← persistent, then the GPU caches."""
        name = table.storage_name
        volatile, persistent = self.tiers.volatile, self.tiers.persistent
        rows = np.zeros((keys.size, table.dim), np.float32)
        found = np.zeros(keys.size, bool)
        volatile_up = volatile is not None and table.volatile_ready
        if volatile_up:
            try:
                rows, found = volatile.fetch(name, keys)  # type: ignore[union-attr]
            except TierError:
                volatile_up = False  # as a lookup does: the next tier answers
        if persistent is not None and not found.all():
            lacking = np.flatnonzero(~found)
            more, present = persistent.fetch(name, keys[lacking])
            got = lacking[present]
            rows[got] = more[present]
            found[got] = True
            if volatile_up and got.size and self.fill_volatile:
                try:
                    volatile.insert(name, keys[got], rows[got])  # type: ignore[union-attr]
                    job.volatile_filled += int(got.size)
                except TierError as exc:
                    log.warning("prefetch %s: the volatile tier took no rows: %s", job.id,
                                exc)
        held = np.flatnonzero(found)
        job.found += int(held.size)
        job.missing += int(keys.size - held.size)
        if held.size and table.gpu:
            job.gpu_inserted += self.gpu.prefetch(table, keys[held], rows[held])

    def close(self) -> None:
        """Cancel every job and wait for the one running to stop (within a chunk)."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for job in jobs:  # queued jobs that never ran: their waiters are told
            job._finish("cancelled", "the server closed")
