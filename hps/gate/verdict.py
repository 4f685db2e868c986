"""What the load gate found: a table's verdict, the error that refuses a version, and the
ledger of verdicts that metrics read.

A `GateVerdict` holds a table's figures (rows read, non-finite rows, repeated keys, its
keys and the served version's, the drift against the served version, its digest) and
its `findings`: each check past its limit, with
the figure, the limit and whether it refused the version or only warned. A refusal is
raised as `LoadGateError` (a `ModelFileError`, so an HTTP answer is a 422) carrying the
verdict; the server then keeps its old version. `GateLedger` keeps the counts by model,
table and check, and each table's last verdict, for /metrics and `GET /v1/models`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hps.errors import ModelFileError

#: the checks, as findings, metrics and the JSON answer name them
CHECKS = ("width", "non_finite", "encodable", "duplicates", "size", "norm_ratio",
          "key_churn")


@dataclass(frozen=True)
class Finding:
    """One check past its limit."""

    check: str  # one of CHECKS
    figure: float
    limit: float
    refused: bool  # False: a warning (drift under `drift: warn`)
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "figure": self.figure, "limit": self.limit,
                "refused": self.refused, "message": self.message}


@dataclass(frozen=True)
class PassedVersion:
    """A table's version that passed the gate, as a later reload's rollback rule reads
    it: its rows digest, and the opt-ins (allow_empty, allow_shrink) its pass rests on.
    A rollback to it is let in as it passed: one that needed an opt-in needs it again."""

    digest: str
    opt_ins: frozenset[str] = frozenset()


@dataclass
class GateVerdict:
    """The gate's figures and findings for one table of one load."""

    model: str
    table: str
    uri: str
    rows: int = 0
    non_finite_rows: int = 0
    duplicate_keys: int = 0
    #: the drift against the served version (None on a first load, or unmeasured):
    #: sample_keys, shared_keys, norm_new / norm_old ({mean, p50, p99}), norm_ratio,
    #: keys_added, keys_removed (shares), key_churn, and `note` when not measured
    drift: dict[str, Any] | None = None
    findings: list[Finding] = field(default_factory=list)
    #: False when this verdict's version is not the one served (refused, or a table
    #: of a reload another table's refusal stopped)
    served: bool = True
    #: True when the rows were not read (the persistent tier held these exact files)
    reused: bool = False
    #: the version's distinct keys, and the served version's (None: a first load, or
    #: not countable now)
    keys: int = 0
    served_keys: int | None = None
    #: the version's digest (hps/gate/digest.py); "" when not known (rows not read)
    digest: str = ""
    #: True when it is the version served before the one it replaces (a rollback)
    previous_version: bool = False
    #: the checks past their limit that let it in all the same: {"check", "by" (the
    #: opt-in, or previous_version), "why"}
    admitted: list[dict[str, str]] = field(default_factory=list)
    #: the opt-ins its pass rests on: those that let a check in, and, where the
    #: previous-version rule let one in, those the earlier pass of these rows rested on
    opt_ins: list[str] = field(default_factory=list)
    checked_at: float = field(default_factory=time.time)

    @property
    def passed(self) -> bool:
        return not any(f.refused for f in self.findings)

    @property
    def refusal(self) -> Finding | None:
        return next((f for f in self.findings if f.refused), None)

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "served": self.served, "uri": self.uri,
                "rows": self.rows, "non_finite_rows": self.non_finite_rows,
                "duplicate_keys": self.duplicate_keys, "drift": self.drift,
                "reused": self.reused, "checked_at": self.checked_at, "keys": self.keys,
                "served_keys": self.served_keys, "digest": self.digest,
                "previous_version": self.previous_version, "admitted": list(self.admitted),
                "opt_ins": list(self.opt_ins),
                "findings": [f.as_dict() for f in self.findings]}


class LoadGateError(ModelFileError):
    """A version the load gate refused; the served version (if any) keeps serving."""

    kind = "load_gate"

    def __init__(self, verdict: GateVerdict) -> None:
        finding = verdict.refusal
        assert finding is not None, "a refusal needs a refusing finding"
        super().__init__(finding.message)
        self.verdict = verdict
        self.finding = finding

    def __reduce__(self) -> tuple[Any, ...]:
        # with --workers the leader's refusal reaches the answering worker pickled (the op
        # log's outcome): rebuilt from its verdict, not from the message alone, which
        # __init__ cannot take (the worker then answered a 500 `tier` for a 422)
        return (type(self), (self.verdict,))

    def details(self) -> dict[str, Any]:
        """What an answer names: the model, table, check, its figure and its limit."""
        return {"model": self.verdict.model, "table": self.verdict.table,
                "check": self.finding.check, "figure": self.finding.figure,
                "limit": self.finding.limit}


class GateLedger:
    """Refusals and warnings by (model, table, check), and each table's last verdict.

    Thread-safe; read by the metrics at scrape time, written once per table per load.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refusals: dict[tuple[str, str, str], int] = {}
        self._warnings: dict[tuple[str, str, str], int] = {}
        self._last: dict[tuple[str, str], GateVerdict] = {}
        self._drift: dict[tuple[str, str], dict[str, Any]] = {}

    def record(self, verdict: GateVerdict) -> None:
        """Count `verdict`'s findings and keep it as its table's last."""
        with self._lock:
            for f in verdict.findings:
                counts = self._refusals if f.refused else self._warnings
                key = (verdict.model, verdict.table, f.check)
                counts[key] = counts.get(key, 0) + 1
            self._last[(verdict.model, verdict.table)] = verdict
            if verdict.drift and verdict.drift.get("key_churn") is not None:
                self._drift[(verdict.model, verdict.table)] = verdict.drift

    def forget(self, model: str) -> None:
        """Drop every count and verdict of `model` (removed: its figures go with it)."""
        with self._lock:
            self._refusals = {k: v for k, v in self._refusals.items() if k[0] != model}
            self._warnings = {k: v for k, v in self._warnings.items() if k[0] != model}
            self._last = {k: v for k, v in self._last.items() if k[0] != model}
            self._drift = {k: v for k, v in self._drift.items() if k[0] != model}

    def refusals(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._refusals)

    def warnings(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._warnings)

    def last(self) -> dict[tuple[str, str], GateVerdict]:
        """Each (model, table)'s last verdict."""
        with self._lock:
            return dict(self._last)

    def last_drift(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Each (model, table)'s last measured drift (a refused reload's too)."""
        with self._lock:
            return dict(self._drift)
