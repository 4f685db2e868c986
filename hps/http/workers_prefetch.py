"""Prefetches in every worker of `hps serve --workers N`: the run's prefetch board.

A prefetch asked of one worker (`POST /v1/models/{model}/prefetch`) runs there and is
announced on the board, in the run folder's `prefetch/`: its keys in a file, a line in
the request log (`requests.<n>.jsonl`, segments of SEGMENT_BYTES; a segment no live
worker reads any more goes once the one after it is full). Every other worker reads the
board on its op thread (at once: the worker that announces rings the others' doorbells,
hps/http/workers_wake.py; hps/http/workers_ops.py) and runs the same
job, under the same id, itself. So every worker's GPU caches get the rows, each through
its own insert path. Only the leader writes the volatile tier (the others only read the
shared tables and Redis, as for updates): its part of a job fills it, the others read
what is there, or the persistent tier where it is not yet.

Each worker publishes its part of a job (`<job>.<worker>.json`: status and counts) when
it is queued, starts and ends. `GET /v1/models/{model}/prefetch/{job}`, whichever worker
answers, reads the parts of the live workers (`status`): the leader's counts,
`gpu_inserted` summed over them, and each part under `workers`. The job is done when
every live worker's part is. Ids name the worker that took the request (`w1.p3`), so
they are unique in the run. The keys file goes once every live worker queued its part;
a worker keeps its last KEEP parts. Only jobs on the board have parts: a warm-up
(`warm_from`) runs in each worker as it loads, under that worker's own id.

A worker that starts later (one replaced after it died) takes the prefetches announced
after its start. Its part of each earlier job on the board is `skipped` (its caches
were warmed as any new worker's are), so those jobs still finish; a skipped part counts
as done.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps.runtime.run_dir import file_lock, read_lines, replace_file
from hps.server.prefetch import KEEP, PrefetchJob

#: the form of the ids the workers give (anything else names no job, and no file)
JOB_ID = re.compile(r"w\d{1,4}\.p\d{1,12}")
#: bytes of one segment of the request log (about a thousand requests)
SEGMENT_BYTES = 1 << 16
_FINISHED = ("done", "skipped", "failed", "cancelled")


def job_prefix(index: int) -> str:
    """What worker `index` puts before its jobs' numbers."""
    return f"w{index}."


class PrefetchBoard:
    """One worker's view of the run's prefetch board (see the module)."""

    def __init__(self, run_folder: Path, index: int,
                 live_workers: Callable[[], list[int]]) -> None:
        self.folder = run_folder / "prefetch"
        self.folder.mkdir(exist_ok=True)
        self.index = index
        self._live = live_workers
        self._lock_path = self.folder / "requests.lock"  # appends and new segments
        self._mine: deque[str] = deque()  # the jobs whose parts this worker published
        self._on_board: set[str] = set()  # the jobs this worker announced or took
        self._lock = threading.Lock()
        with file_lock(self._lock_path):
            segments = self._segments()
            if not segments:
                self._segment_path(0).touch()
                segments = [0]
        # reading from the newest segment's start: the prefetches before this worker's
        # start, with the segment before it, get skipped parts; the rest are taken
        self._segment, self._read_at = segments[-1], 0
        self._note_reading()
        earlier = self._lines(segments[-2]) if len(segments) > 1 else []
        self._skip(earlier + self._read())

    def _skip(self, requests: list[dict[str, Any]]) -> None:
        """This worker's part of the latest KEEP of `requests`, where it has none
        finished (a worker that died under the same index may have left one running)."""
        for request in requests[-KEEP:]:  # a loop over requests, not keys
            job_id = request["job"]
            try:
                part = json.loads(self._part_path(job_id, self.index).read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                part = {"status": None}
            if part["status"] not in _FINISHED:
                self._on_board.add(job_id)
                self.publish(idle_part(request, "skipped"))

    # -- requests -------------------------------------------------------------------------

    def announce(self, job_id: str, model: str, table: str, keys: np.ndarray) -> None:
        """Tell the other workers to run job `job_id` (taken here) on their caches."""
        staging = self.folder / f".{job_id}.keys.{os.getpid()}.npy"
        np.save(staging, np.ascontiguousarray(keys, dtype=np.int64))
        os.replace(staging, self._keys_path(job_id))
        line = json.dumps({"job": job_id, "model": model, "table": table,
                           "from": self.index})
        self._on_board.add(job_id)
        with file_lock(self._lock_path):
            segment = self._segments()[-1]
            if self._segment_path(segment).stat().st_size >= SEGMENT_BYTES:
                segment += 1  # the full one takes no more lines: readers move on
                self._segment_path(segment).touch()
                self._drop_segments(segment)
            with open(self._segment_path(segment), "a") as f:
                f.write(line + "\n")

    def new_requests(self) -> list[dict[str, Any]]:
        """The jobs other workers announced since the last call (whole lines only)."""
        requests = [r for r in self._read() if r["from"] != self.index]
        self._on_board.update(r["job"] for r in requests)
        return requests

    def _read(self) -> list[dict[str, Any]]:
        """The whole lines of the log after this worker's place, across segments."""
        requests: list[dict[str, Any]] = []
        while True:
            # a next segment seen first means this one is complete when read below
            newer = self._segment_path(self._segment + 1).exists()
            lines, self._read_at = read_lines(self._segment_path(self._segment),
                                              self._read_at)
            requests += [json.loads(line) for line in lines]
            if not newer:
                return requests
            self._segment, self._read_at = self._segment + 1, 0
            self._note_reading()

    def _lines(self, segment: int) -> list[dict[str, Any]]:
        return [json.loads(line) for line in read_lines(self._segment_path(segment))[0]]

    def _segments(self) -> list[int]:
        return sorted(int(p.name.split(".")[1]) for p in self.folder.glob("requests.*.jsonl"))

    def _segment_path(self, segment: int) -> Path:
        return self.folder / f"requests.{segment}.jsonl"

    def _note_reading(self) -> None:
        replace_file(self.folder / f"reading.{self.index}", str(self._segment))

    def _drop_segments(self, newest: int) -> None:
        """Remove the segments before every live worker's place (the log's lock held),
        keeping the one before `newest` for a worker that starts later (`_skip`)."""
        oldest = newest - 1
        for i in self._live():  # a loop over workers
            try:
                oldest = min(oldest, int((self.folder / f"reading.{i}").read_text()))
            except (FileNotFoundError, ValueError):
                return  # a worker that has not said where it reads: keep everything
        for segment in self._segments():
            if segment < oldest:
                with contextlib.suppress(FileNotFoundError):
                    self._segment_path(segment).unlink()

    def keys_of(self, request: dict[str, Any]) -> np.ndarray | None:
        """The keys of an announced job (None: gone, as every live worker took them)."""
        try:
            keys: np.ndarray = np.load(self._keys_path(request["job"]), allow_pickle=False)
            return keys
        except (FileNotFoundError, ValueError, OSError):
            return None

    # -- parts ------------------------------------------------------------------------------

    def publish(self, job: PrefetchJob | dict[str, Any]) -> None:
        """This worker's part of a job (as it stands now), for every worker to read."""
        with self._lock:  # read under the lock: a later state is never overwritten
            part = job if isinstance(job, dict) else job.as_dict()
            self._write_part(part)

    def _write_part(self, part: dict[str, Any]) -> None:
        job_id = part["job"]
        if job_id not in self._on_board or not JOB_ID.fullmatch(job_id):
            return  # a job of this worker alone (a warm-up's)
        replace_file(self._part_path(job_id, self.index), json.dumps(part))
        if job_id not in self._mine:
            self._mine.append(job_id)
            while len(self._mine) > KEEP:
                old = self._mine.popleft()
                self._on_board.discard(old)
                self._forget(old)
        if all(self._part_path(job_id, i).exists() for i in self._live()):
            with contextlib.suppress(FileNotFoundError):
                self._keys_path(job_id).unlink()

    def status(self, job_id: str) -> dict[str, Any] | None:
        """Job `job_id` over the live workers (see the module), or None when no live
        worker published a part of it."""
        if not JOB_ID.fullmatch(job_id):
            return None
        live = self._live()
        parts: dict[int, dict[str, Any]] = {}
        for i in live:  # a loop over workers
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                parts[i] = json.loads(self._part_path(job_id, i).read_text())
        if not parts:
            return None
        return combine(parts, live)

    def _forget(self, job_id: str) -> None:
        for path in (self._part_path(job_id, self.index), self._keys_path(job_id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _keys_path(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.keys.npy"

    def _part_path(self, job_id: str, index: int) -> Path:
        return self.folder / f"{job_id}.{index}.json"


def combine(parts: dict[int, dict[str, Any]], live: list[int]) -> dict[str, Any]:
    """One job's answer from the parts of the workers (index → PrefetchJob.as_dict()):
    the leader's counts (else the lowest worker's), `gpu_inserted` summed, `seconds` the
    longest, `workers` each part; `status` failed or cancelled when a part is, done when
    every live worker's part is done (or skipped), queued while none started, else
    running."""
    first = parts[min(parts)]
    answer = dict(first)
    statuses = [parts[i]["status"] if i in parts else "queued" for i in live]
    if "failed" in statuses:
        answer["status"] = "failed"
    elif "cancelled" in statuses:
        answer["status"] = "cancelled"
    elif all(s in ("done", "skipped") for s in statuses):
        answer["status"] = "done"
    elif all(s == "queued" for s in statuses):
        answer["status"] = "queued"
    else:
        answer["status"] = "running"
    answer["gpu_inserted"] = sum(int(p["gpu_inserted"]) for p in parts.values())
    answer["seconds"] = max(float(p["seconds"]) for p in parts.values())
    answer["error"] = next((p["error"] for p in parts.values() if p.get("error")), None)
    answer["workers"] = [
        {"worker": i, **{k: parts[i][k] for k in ("status", "found", "volatile_filled",
                                                   "gpu_inserted", "missing", "seconds",
                                                   "error")}}
        if i in parts else {"worker": i, "status": "queued"}
        for i in live]
    return answer


def idle_part(request: dict[str, Any], status: str, keys: int = 0,
              error: str | None = None) -> dict[str, Any]:
    """A part of an announced job that ran nothing here: `skipped` or `failed`."""
    return {"job": request["job"], "model": request["model"], "table": str(request["table"]),
            "status": status, "keys": keys, "found": 0, "volatile_filled": 0,
            "gpu_inserted": 0, "missing": 0, "seconds": 0.0, "error": error}
