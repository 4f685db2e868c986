"""Checking lookup clients for the workers' kill tests: threads that send binary lookups
over keep-alive connections (http.client) and check every answer whole.

Each `Expected` names a model's table, the keys the clients ask for, the rows each
version of the model gives those keys (a lookup reads one version: every row of an
answer must come from the same one) and the statuses an answer may have besides 200.
Every answer is recorded with how long it was waited for; a connection that breaks (a
worker killed under it) is recorded as a reset and a new one is opened.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np

#: seconds a client waits for an answer before it records the lookup as hung
HUNG = 8.0
#: keys a lookup asks for
BATCH = 64
#: seconds a client rests between two lookups: the kill tests are about hangs, and
#: clients that take every cycle of a 2-core machine only slow the restarts they watch
PACE = 0.005


@dataclass(frozen=True)
class Expected:
    """What lookups of `model`/`table` may answer (see the module)."""

    model: str
    table: str
    keys: np.ndarray  # int64[n]
    versions: tuple[np.ndarray, ...]  # float32[n, dim] each
    also: frozenset[int] = frozenset({503})  # statuses besides 200 that are not wrong

    @property
    def path(self) -> str:
        return f"/v1/models/{self.model}/tables/{self.table}/lookup"

    def whole(self, pick: np.ndarray, payload: bytes) -> bool:
        """Whether `payload` is the rows of `pick` of one version, exactly."""
        dim = self.versions[0].shape[1]
        if len(payload) != pick.size * dim * 4:
            return False
        got = np.frombuffer(payload, "<f4").reshape(pick.size, dim)
        return any(np.array_equal(rows[pick], got) for rows in self.versions)


@dataclass(frozen=True)
class Answer:
    """One lookup: when it was sent, how long it waited, what came back."""

    model: str
    sent: float  # time.monotonic()
    waited: float
    status: int | None  # None: the connection broke (reset) or no answer within HUNG
    right: bool  # 200 with whole rows, or a status `also` allows
    kind: str = ""  # the error's kind, for a status other than 200


@dataclass
class CheckingClients:
    """`count` threads, each cycling over `expected`, until `stop()`."""

    port: int
    expected: list[Expected]
    count: int = 4
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> CheckingClients:
        for i in range(self.count):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * HUNG)

    def since(self, moment: float) -> list[Answer]:
        return [a for a in list(self.answers) if a.sent >= moment]

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HUNG)
        turn = 0
        while not self._stop.wait(PACE):
            case = self.expected[turn % len(self.expected)]
            turn += 1
            pick = rng.integers(0, case.keys.size, BATCH)
            sent = time.monotonic()
            try:
                conn.request("POST", case.path, case.keys[pick].astype("<i8").tobytes(),
                             {"Content-Type": "application/octet-stream"})
                answer = conn.getresponse()
                payload = answer.read()
            except (OSError, http.client.HTTPException):
                # a worker killed under the connection (at once), or no answer (HUNG s)
                self.answers.append(Answer(case.model, sent, time.monotonic() - sent,
                                           None, False))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HUNG)
                continue
            status = answer.status
            right = case.whole(pick, payload) if status == 200 else status in case.also
            self.answers.append(Answer(case.model, sent, time.monotonic() - sent, status,
                                       right, "" if status == 200 else _kind(payload)))
        conn.close()


def _kind(payload: bytes) -> str:
    """The `kind` of an error answer's JSON body ("?" when it has none)."""
    try:
        return str(json.loads(payload)["error"]["kind"])
    except (ValueError, KeyError, TypeError):
        return "?"
