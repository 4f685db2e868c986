"""The online-update side of `hps bench soak --update-rows N`.

A publisher sends rounds of updates (five a second, `rows_per_second` rows in all) through a
Redis stream to keys of their own (UPDATE_KEYS on: no model file holds them, so the
clients' whole-version checks are untouched), reloads or not. Rounds this small go to
RocksDB through its write-ahead log, the path that found the server's growing log. Every
`check_every` seconds a checker publishes one round to keys of its own (CHECK_FIRST on)
and asks for its rows over a connection per worker until each answers them exactly
(`visible_s`), or counts the round stale after STALE_S. A reload forgets the keys only
updates added, so a reload and a check never overlap (`gate`, which the reloader holds).
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hps.config import PSConfig, load_config
from hps.updates.contract import UpdatePublisher
from hps.updates.open import open_publisher
from hps.updates.publish import publish_arrays

#: the first key of the updates (clients look up unknown keys below it)
UPDATE_KEYS = 2**43
#: distinct keys the rounds draw from
UPDATE_POOL = 200_000
#: the first key of the checked rounds (as many distinct keys after it)
CHECK_FIRST = UPDATE_KEYS + UPDATE_POOL
ROUNDS_PER_SECOND = 5
#: keys of a checked round: the soak model's largest lookup
CHECKED_ROWS = 256
STALE_S = 10.0


@dataclass
class UpdateResult:
    rows: int = 0  # rows published
    checks: int = 0
    stale: int = 0  # checks not answered exactly within STALE_S by every worker
    visible_s: list[float] = field(default_factory=list, repr=False)
    errors: list[str] = field(default_factory=list)


class UpdateLoad:
    """The publisher and checker threads over a running server (`host`, `port`)."""

    def __init__(self, config: dict[str, Any] | PSConfig, model: str, table: int, dim: int,
                 host: str, port: int, workers: int, rows_per_second: int,
                 check_every: float, gate: threading.Lock,
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.config = load_config(config)  # parsed once, not at each round
        self.model, self.table, self.dim = model, table, dim
        self.host, self.port, self.workers = host, port, workers
        self.round_rows = max(1, rows_per_second // ROUNDS_PER_SECOND)
        self.check_every = check_every
        self.gate = gate
        self.log = log
        self.result = UpdateResult()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._publish_rounds, name="soak-publisher"),
                         threading.Thread(target=self._check_rounds, name="soak-checker")]

    def start(self) -> UpdateLoad:
        for t in self._threads:  # a loop over two threads
            t.start()
        return self

    def stop(self) -> UpdateResult:
        self._stop.set()
        for t in self._threads:  # a loop over two threads
            t.join(120)
        return self.result

    def _round(self, rng: np.random.Generator, rows: int, first: int = UPDATE_KEYS
               ) -> tuple[np.ndarray, np.ndarray]:
        keys = np.unique(first + rng.integers(0, UPDATE_POOL, rows)).astype(np.int64)
        return keys, rng.standard_normal((keys.size, self.dim)).astype(np.float32)

    def _send(self, publisher: UpdatePublisher, keys: np.ndarray, vectors: np.ndarray
              ) -> bool:
        try:
            publish_arrays(self.config, self.model, self.table, keys, vectors,
                           publisher=publisher)
        except Exception as exc:  # the bench reports it and goes on
            self.result.errors.append(f"publish: {exc!r}")
            return False
        with self._lock:  # the publisher's and the checker's
            self.result.rows += keys.size
        return True

    def _publish_rounds(self) -> None:
        rng = np.random.default_rng(11)
        with self._publisher() as publisher:
            while not self._stop.wait(1.0 / ROUNDS_PER_SECOND):
                self._send(publisher, *self._round(rng, self.round_rows))

    def _check_rounds(self) -> None:
        rng = np.random.default_rng(12)
        with self._publisher() as publisher:
            while not self._stop.wait(self.check_every):
                self._check_round(publisher, rng)

    def _check_round(self, publisher: UpdatePublisher, rng: np.random.Generator) -> None:
        with self.gate:
            keys, vectors = self._round(rng, CHECKED_ROWS, CHECK_FIRST)
            if not self._send(publisher, keys, vectors):
                return
            sent = time.perf_counter()
            seen = self._wait_for(keys, vectors)
        self.result.checks += 1
        if seen:
            self.result.visible_s.append(time.perf_counter() - sent)
        else:
            self.result.stale += 1
            self.result.errors.append(f"update round not served within {STALE_S:g} s")
        self.log(f"update check {self.result.checks}: {'exact' if seen else 'STALE'}")

    @contextlib.contextmanager
    def _publisher(self) -> Iterator[UpdatePublisher]:
        """One stream publisher a thread for the whole soak (one a round cost a config
        parse and a connection five times a second)."""
        publisher = open_publisher(self.config.update_source)
        try:
            yield publisher
        finally:
            publisher.close()

    def _wait_for(self, keys: np.ndarray, vectors: np.ndarray) -> bool:
        """Whether `workers` connections opened together (the server spreads them over
        its workers) each answer `keys` with `vectors` within STALE_S."""
        deadline = time.monotonic() + STALE_S
        conns = [http.client.HTTPConnection(self.host, self.port, timeout=60)
                 for _ in range(self.workers)]
        try:
            for conn in conns:  # a loop over connections: each connects now
                conn.connect()
            pending = list(conns)
            while pending and time.monotonic() < deadline:
                pending = [c for c in pending if not self._answers(c, keys, vectors)]
                if pending:
                    time.sleep(0.02)
            return not pending
        except (OSError, http.client.HTTPException) as exc:
            self.result.errors.append(f"update check: {exc!r}")
            return False
        finally:
            for conn in conns:  # a loop over connections
                conn.close()

    def _answers(self, conn: http.client.HTTPConnection, keys: np.ndarray,
                 vectors: np.ndarray) -> bool:
        conn.request("POST", f"/v1/models/{self.model}/tables/{self.table}/lookup",
                     keys.astype("<i8").tobytes(), {"Content-Type": "application/octet-stream"})
        answer = conn.getresponse()
        body = answer.read()
        return answer.status == 200 and np.array_equal(
            np.frombuffer(body, "<f4").reshape(vectors.shape), vectors)
