"""Which version of each model every worker of `hps serve --workers N` serves, beside the
version the server says: `VersionBoard`, which /readyz, the v2 readiness routes and
`GET /v1/models` read.

A version is named by the op of the run's op log (hps/http/workers_oplog.py) that loaded
it, a load or an add: the same number in every worker, however each one came by it
(applied as it came, or replayed after a restart). The server's version of a model is the
last such op the leader completed (its outcome says done), unless an unload of the model
came after it; every worker applies the same ops in order, so each serves that version
once it applied the op (hps/http/workers_ops.py).

Each worker writes the versions it serves to `ops/versions/<index>` in the run folder
(one small JSON file, with its PID: a predecessor's file is never read as its own) after
each op it applies, before its ack, and after its replay, before it takes requests. A
reader compares the files of the live workers that take requests (a worker started again
counts once it replayed the log; a dead one not at all) with the server's versions: a
follower still on the version before (a reload it has not applied yet: for a moment after
every reload, or for good while it is stopped or stuck) is named with both versions, and
the server is not ready until they agree. A read costs a few small files: the op log's
new lines (read once, from where the last read stopped), the outcome of the first op not
completed, and one file of each worker; the lock is held for the op log's part only.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hps.http.workers_oplog import OpLog
from hps.runtime.run_dir import read_lines, replace_file


@dataclass(frozen=True)
class VersionLag:
    """A live worker that serves a version of a model other than the server's."""

    worker: int
    model: str
    version: int | None  # what the worker serves (None: no version of the model)
    server_version: int | None  # what the server says (None: it serves no version)

    def as_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "model": self.model, "version": self.version,
                "server_version": self.server_version}

    def message(self) -> str:
        if self.version is None:
            return (f"worker {self.worker} serves no version of model {self.model!r} "
                    f"(the server's is {self.server_version})")
        if self.server_version is None:
            return (f"worker {self.worker} serves version {self.version} of model "
                    f"{self.model!r}, which the server no longer serves")
        return (f"worker {self.worker} serves version {self.version} of model "
                f"{self.model!r}, the server's is {self.server_version}")


def lags_message(lags: list[VersionLag]) -> str:
    """One line naming every lag (for a 503's message)."""
    return "; ".join(lag.message() for lag in lags)


class VersionBoard:
    """The versions the workers of one run serve, and the server's (see the module).

    `VersionBoard(oplog, index)`: this process is worker `index` of the run whose op log
    is `oplog`. Safe to call from any thread."""

    def __init__(self, oplog: OpLog, index: int) -> None:
        self.oplog, self.index = oplog, index
        self.folder = oplog.folder / "versions"
        self.folder.mkdir(exist_ok=True)
        self._lock = threading.Lock()
        self._read_at = 0  # the op log's bytes read so far
        self._pending: collections.deque[tuple[int, str, str]] = collections.deque()
        self._server: dict[str, int] = {}  # the server's versions of the ops completed

    def publish(self, versions: Mapping[str, int]) -> None:
        """This worker serves `versions` (model → the op that loaded it) now."""
        replace_file(self.folder / str(self.index),
                     json.dumps({"pid": os.getpid(), "models": dict(versions)}))

    def server_versions(self) -> dict[str, int]:
        """The server's version of each model it serves (model → op)."""
        with self._lock:
            lines, self._read_at = read_lines(self.oplog.path, self._read_at)
            for line in lines:  # a loop over new ops
                raw = json.loads(line)
                self._pending.append((raw["seq"], raw["kind"], raw["model"]))
            while self._pending:  # the leader completes ops in order: stop at the first not
                seq, kind, model = self._pending[0]
                outcome = self.oplog.outcome(seq)
                if outcome is None:
                    break
                if outcome[1] is None and kind == "unload":
                    self._server.pop(model, None)
                elif outcome[1] is None:
                    self._server[model] = seq
                self._pending.popleft()
            return dict(self._server)

    def workers(self) -> dict[int, dict[str, int]]:
        """The versions each live worker that takes requests serves (index → model → op)."""
        out: dict[int, dict[str, int]] = {}
        for index, pid in self.oplog.serving_workers().items():  # a loop over workers
            with contextlib.suppress(FileNotFoundError, ValueError):
                raw = json.loads((self.folder / str(index)).read_text())
                if raw.get("pid") == pid:  # not a predecessor's
                    out[index] = {str(k): int(v) for k, v in raw["models"].items()}
        return out

    def lags(self, model: str | None = None) -> list[VersionLag]:
        """The live workers serving a version other than the server's, of every model
        (of `model`), by worker and model."""
        server = self.server_versions()
        lags = []
        for index, served in sorted(self.workers().items()):  # a loop over workers
            names = sorted(set(server) | set(served)) if model is None else [model]
            lags += [VersionLag(index, name, served.get(name), server.get(name))
                     for name in names if served.get(name) != server.get(name)]
        return lags

    def of_model(self, model: str) -> dict[str, Any]:
        """What `GET /v1/models/{model}` adds: the server's `version` and each worker's
        (`workers`: [{worker, version}], None where it serves none)."""
        return {"version": self.server_versions().get(model),
                "workers": [{"worker": index, "version": served.get(model)}
                            for index, served in sorted(self.workers().items())]}
