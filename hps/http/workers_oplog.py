"""The op log of a run of `hps serve --workers N`: its ops, the leader's outcomes, the
workers' acks (a file of JSON lines and small files in the run folder). How the workers
use it: hps/http/workers_ops.py."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hps.config import ModelConfig, PSConfig
from hps.errors import TierError
from hps.runtime.run_dir import file_lock, pid_alive, read_lines, replace_file


@dataclass(frozen=True)
class Op:
    """One line of the op log."""

    seq: int
    kind: str  # "load", "add", "unload"
    model: str
    block: dict[str, Any] | None  # the model block of a load or an add
    # the allowed roots its files are opened beneath (hps/modelfiles/confined.py): those
    # of the request that asked for it, so the worker that loads it opens them alike
    roots: tuple[str, ...] | None = None
    # the load gate's opt-ins the request asked for (hps.gate.settings.OPT_INS)
    opt_ins: tuple[str, ...] = ()


class OpLog:
    """The op log, the outcomes and the acks of one run folder (see the module)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder / "ops"
        for sub in ("outcomes", "acks", "workers"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "log.jsonl"
        self.path.touch(exist_ok=True)
        self._read_at = 0
        self._ops: list[Op] = []

    def append(self, kind: str, model: str, block: dict[str, Any] | None = None,
               roots: tuple[str, ...] | None = None, opt_ins: Sequence[str] = ()) -> int:
        """Add an op; returns its number."""
        with file_lock(self.folder / "log.lock"):
            seq = self.path.read_bytes().count(b"\n") + 1  # the file closed at once
            line = json.dumps({"seq": seq, "kind": kind, "model": model, "block": block,
                               "roots": None if roots is None else list(roots),
                               "opt_ins": list(opt_ins)})
            with open(self.path, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        return seq

    def ops(self) -> list[Op]:
        """Every op so far (whole lines only: a line being written is read next time)."""
        lines, self._read_at = read_lines(self.path, self._read_at)
        for line in lines:
            raw = json.loads(line)
            roots = raw.get("roots")
            self._ops.append(Op(raw["seq"], raw["kind"], raw["model"], raw["block"],
                                None if roots is None else tuple(roots),
                                tuple(raw.get("opt_ins", ()))))
        return list(self._ops)

    # -- outcomes (the leader's) --------------------------------------------------------

    def set_outcome(self, seq: int, error: BaseException | None,
                    stored: dict[str, str] | None = None,
                    verdicts: dict[str, Any] | None = None) -> None:
        """The leader applied op `seq`: failed with `error`, or stored the tables of its
        version under `stored` (table → storage name, in the tiers every worker reads),
        its load gate's `verdicts` (table → verdict) the decision every worker reports."""
        payload: dict[str, Any] = {"ok": error is None, "stored": stored or {},
                                   "verdicts": verdicts or {}}
        if error is not None:
            payload["message"] = str(error)
            with contextlib.suppress(Exception):
                payload["error"] = base64.b64encode(pickle.dumps(error)).decode()
        replace_file(self.folder / "outcomes" / str(seq), json.dumps(payload))

    def outcome(self, seq: int) -> tuple[bool, BaseException | None] | None:
        """(done, the error or None) once the leader applied op `seq`, else None."""
        try:
            payload = json.loads((self.folder / "outcomes" / str(seq)).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if payload["ok"]:
            return True, None
        error: BaseException = TierError(payload.get("message", "the op failed"))
        if "error" in payload:
            with contextlib.suppress(Exception):
                error = pickle.loads(base64.b64decode(payload["error"]))  # our own file
        return True, error

    def stored(self, seq: int, part: str = "stored") -> dict[str, Any]:
        """Where the leader stored the tables of op `seq`'s version (empty: not known);
        `part="verdicts"`: its load gate's verdicts."""
        try:
            return dict(json.loads((self.folder / "outcomes" / str(seq)).read_text())
                        .get(part, {}))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    # -- workers and acks ---------------------------------------------------------------

    def register(self, index: int) -> None:
        """Worker `index` (this process) starts: its ack goes back to 0."""
        replace_file(self.folder / "workers" / str(index), str(os.getpid()))
        self.ack(index, 0)  # after the PID: never read as its predecessor's (see below)

    def mark_serving(self, index: int) -> None:
        """Worker `index` (this process) replayed the log and takes requests."""
        (self.folder / "serving").mkdir(exist_ok=True)
        replace_file(self.folder / "serving" / str(index), str(os.getpid()))

    def served(self, index: int, pid: int) -> bool:
        """Whether worker `index`'s process `pid` got as far as taking requests."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int((self.folder / "serving" / str(index)).read_text()) == pid
        return False

    def unfinished(self) -> int | None:
        """The first op the leader has not completed (no outcome), if any."""
        for op in self.ops():  # a loop over ops, not keys
            if self.outcome(op.seq) is None:
                return op.seq
        return None

    def ack(self, index: int, seq: int) -> None:
        replace_file(self.folder / "acks" / str(index), str(seq))

    def acked(self, index: int) -> int:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int((self.folder / "acks" / str(index)).read_text() or 0)
        return 0

    def live_workers(self) -> list[int]:
        """Indices of the workers whose process is alive."""
        live = []
        for entry in (self.folder / "workers").iterdir():  # a loop over workers
            with contextlib.suppress(ValueError, OSError):
                if pid_alive(int(entry.read_text())):
                    live.append(int(entry.name))
        return sorted(live)

    def lowest_ack(self) -> int:
        """The last op every live worker applied."""
        return min((self.acked(i) for i in self.live_workers()), default=0)

    def lowest_serving_ack(self) -> int:
        """The last op every live worker that takes requests applied (one started again:
        once it replayed the log). An ack counts if the PID is the same after it: a leader
        started again between the reads has ack 0 (register), and /readyz then listed none."""
        serving = self.serving_workers()
        acks = {i: self.acked(i) for i in serving}
        return min((a for i, a in acks.items() if self._pid(i) == serving[i]), default=0)

    def serving_workers(self) -> dict[int, int]:
        """The live workers that take requests (replayed the log): index → PID."""
        return {i: pid for i in self.live_workers() if self.served(i, pid := self._pid(i))}

    def _pid(self, index: int) -> int:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int((self.folder / "workers" / str(index)).read_text())
        return 0


def initial_ops(log_: OpLog, config: PSConfig) -> None:
    """The supervisor's first ops: one load per configured model."""
    for model in config.models:
        log_.append("load", model.model, block_of(model))


def block_of(model: ModelConfig) -> dict[str, Any]:
    return model.model_dump(mode="json")
