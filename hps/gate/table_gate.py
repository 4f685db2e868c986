"""The load gate of one table: its checks, made on the chunks as the load streams them.

`TableGate.check(chunks)` wraps a reader's chunks (keys int64[n], rows float32[n, dim])
and yields them on, checked, on whatever thread pulls them (the loader's read-ahead
thread, so the checks overlap the tiers' writes); nothing reads the files a second time:

- width: every chunk's rows are the configured width (the reader checks its header
  when it opens; `width_refusal` turns that into this check's refusal);
- non_finite: rows holding NaN or infinity are counted; past `max_nan_rows` the version
  is refused at once, naming the first such row (unless `allow_non_finite_vectors`);
- encodable: with a compact `embedding_storage_dtype`, a row the storage cannot hold
  refuses the version at once (NaN or infinity as `non_finite`, whatever the limit);
- duplicates: `last` counts repeats after the load (the whole-table tier's size, given
  to `finish`); `first` drops every row whose key an earlier row had (a compiled key
  set, `key_set.KeySet`); `refuse` refuses at the first repeat;
- size: a table of no keys is refused (every lookup of it would answer the default
  vector) unless `allow_empty`; a reload holding fewer than `min_key_ratio` of the
  served version's keys is refused unless `allow_shrink`;
- drift (reloads): the rows of about `drift_sample_keys` keys chosen by hash have their
  norms kept; `finish` measures them against the served version (`drift.measure`) and
  checks `max_norm_ratio` and `max_key_churn`, refusing under `drift: refuse`, else
  warning. `allow_shrink` (`allow_empty` for an empty table) makes the churn of a
  version smaller than the served one a warning.

The same sample gives the version's digest (digest.py). A version whose digest is
`previous`'s (the version served before the one served now) is a rollback: the size and
drift checks, which compare it with the version it replaces, warn but do not refuse it,
so the version that served before can always come back as it passed. A pass that rested
on an opt-in (`PassedVersion.opt_ins`) lets it back only where the load gives that
opt-in again: else a version let in once by `allow_shrink` came back without it after
every rollback. Every check let through that would have refused is named, with why, in
the verdict's `admitted`, and the opt-ins the pass rests on in its `opt_ins`.

A refusal raises `LoadGateError` carrying the verdict. Per-row work is compiled or
vectorised: two reductions per chunk find a chunk without NaN (the common case), the
sample costs one hash per key.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Iterator, Sequence

import numpy as np

from hps.errors import ModelFileError, TierError
from hps.gate.digest import row_hashes, version_digest
from hps.gate.drift import ServedRows, measure, row_norms
from hps.gate.key_set import KeySet, sample_rows, sample_threshold
from hps.gate.settings import OPT_INS, ValidationConfig
from hps.gate.verdict import Finding, GateVerdict, LoadGateError, PassedVersion
from hps.rows.storage_types import FLOAT32, StorageType, first_unencodable_row

log = logging.getLogger("hps.gate")

Chunks = Iterable[tuple[np.ndarray, np.ndarray]]


class TableGate:
    """The checks of one table's load (see the module docstring). One use: `check` once,
    then `finish`. `served`: the version served now (a reload's drift is measured against
    it); `count_duplicates`: count repeats in the stream under `duplicates: last` too
    (`hps validate`, where no tier counts them); `files`: (name, bytes) of the files read,
    named by a size refusal; `previous`: the version served before the one served now
    (None when none is known)."""

    def __init__(self, settings: ValidationConfig, *, model: str, table: str, uri: str,
                 dim: int, num_keys: int, storage: StorageType = FLOAT32,
                 allow_non_finite: bool = False, served: ServedRows | None = None,
                 count_duplicates: bool = False, files: Sequence[tuple[str, int]] = (),
                 previous: PassedVersion | None = None) -> None:
        self.settings = settings
        self.dim = dim
        self.num_keys = num_keys
        self.storage = storage
        self.allow_non_finite = allow_non_finite
        self.served = served
        self.files = list(files)
        self.previous = previous
        self._rollback = False  # the previous-version rule lets this version in (finish)
        self.verdict = GateVerdict(model, table, uri)
        # `last` leaves the repeats to the tiers and counts them from the whole-table
        # tier's size after the load, unless asked to count them here (no tier offline)
        self._keys = (KeySet(num_keys) if count_duplicates
                      or settings.duplicates in ("first", "refuse") else None)
        self._threshold = sample_threshold(num_keys, settings.drift_sample_keys)
        self._sample_keys: list[np.ndarray] = []
        self._sample_norms: list[np.ndarray] = []
        self._sample_hashes: list[np.ndarray] = []
        self._first_bad: int | None = None

    def check(self, chunks: Chunks) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`chunks`, checked; under `duplicates: first` without the rows of repeated keys.
        Raises LoadGateError at the first chunk that refuses the version."""
        for keys, rows in chunks:
            first = self.verdict.rows
            self.verdict.rows += len(keys)
            if rows.ndim != 2 or rows.shape[1] != self.dim:
                width = rows.shape[1] if rows.ndim == 2 else 0
                self._refuse("width", width, self.dim, f"{self.verdict.uri}: rows are "
                             f"{width} wide but embedding_vecsize_per_table says {self.dim}")
            if self.storage.compact:  # holds finite values in its range only
                self._check_encodable(first, rows)
            else:
                self._check_finite(first, rows)
            if self._keys is not None:
                keys, rows = self._first_rows(first, keys, rows)
            if len(keys):  # every load: the sample is the version's digest too
                self._sample(keys, rows)
            yield keys, rows

    def finish(self, distinct_keys: int | None = None, *, reused: bool = False,
               digest: str = "", passed_with: Collection[str] = ()) -> GateVerdict:
        """The verdict, with the size checked and the drift measured (a reload).
        `distinct_keys`: the keys the tier holding the whole table has, which counts the
        repeats under `duplicates: last`. `reused`: the rows were not read (the persistent
        tier held these exact files, checked when they were loaded; `digest` is the one
        recorded then, `distinct_keys` its keys). `passed_with`: the opt-ins an earlier
        pass of these same files rested on (recorded with the persistent tier's copy): a
        restart's first load, compared with nothing, does not clear them. Raises
        LoadGateError on a refusal."""
        v = self.verdict
        v.reused = reused
        if reused:
            distinct = self.num_keys if distinct_keys is None else distinct_keys
        elif self._keys is not None:
            distinct = self._keys.size
        elif distinct_keys is not None:
            v.duplicate_keys = max(0, v.rows - distinct_keys)
            distinct = distinct_keys
        else:
            distinct = v.rows
        if v.duplicate_keys and self.settings.duplicates == "last":
            log.warning("%s: %s holds %d rows whose key a later row repeats; the last row "
                        "of each key is served", v.table, v.uri, v.duplicate_keys)
        keys, norms, hashes = self._sampled()
        v.keys = distinct
        v.digest = digest if reused else version_digest(keys, hashes, distinct, self.dim)
        previous = self.previous
        v.previous_version = (previous is not None and bool(previous.digest)
                              and v.digest == previous.digest)
        self._rollback = v.previous_version and self._missing_opt_ins() == []
        served_keys = self._served_keys()
        v.served_keys = served_keys
        self._check_size(distinct, served_keys)
        if self.served is not None and not reused:
            self._drift(keys, norms, distinct)
        v.opt_ins = self._rests_on(passed_with)
        if not v.passed:
            raise LoadGateError(v)
        for f in v.findings:
            log.warning("%s (%s)", f.message, self._why_served(f.check))
        return v

    def replay(self, chunks: Chunks) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`chunks` of a second read of the same files (a fallback of the loader),
        filtered as `check` filtered the first read, and not counted again."""
        if self.settings.duplicates != "first":
            yield from chunks
            return
        seen = KeySet(self.num_keys)
        for keys, rows in chunks:
            keep, repeats = seen.first_rows(keys)
            yield (keys[keep], rows[keep]) if repeats else (keys, rows)

    # -- the checks -----------------------------------------------------------------------

    def _check_finite(self, first: int, rows: np.ndarray) -> None:
        # NaN spreads into the least and the greatest value, an infinity is one of them:
        # two reductions without a mask the size of the chunk, in the common case
        if self.allow_non_finite or rows.size == 0 or (
                np.isfinite(rows.min()) and np.isfinite(rows.max())):
            return
        bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
        if self._first_bad is None:
            self._first_bad = first + int(bad[0])
        self.verdict.non_finite_rows += bad.size
        limit = self.settings.max_nan_rows
        if self.verdict.non_finite_rows > limit:
            allowed = (f"validation.max_nan_rows allows {limit:,}" if limit else
                       "a model trained to non-finite values is refused")
            self._refuse("non_finite", self.verdict.non_finite_rows, limit,
                         f"{self.verdict.uri}: row {self._first_bad:,} holds NaN or infinity "
                         f"({_rows(self.verdict.non_finite_rows)} so far): {allowed}; "
                         "raise the limit, or set allow_non_finite_vectors: true in the "
                         "model's config to load it anyway")

    def _check_encodable(self, first: int, rows: np.ndarray) -> None:
        bad = first_unencodable_row(self.storage, rows)
        if bad is None:
            return
        row = rows[bad]
        finite = bool(np.isfinite(row).all())
        what = (f"{float(row[np.argmax(np.abs(row))]):g}, past the range of "
                f"{self.storage.name} (magnitudes below {self.storage.max_magnitude:g})"
                if finite else "NaN or infinity")
        message = (f"{self.verdict.uri}: row {first + bad:,} holds {what} (and maybe more "
                   f"rows after it): the model stores its rows as {self.storage.name} "
                   "(embedding_storage_dtype), which holds finite values in its range "
                   "only; use float32 storage to load it")
        if finite:
            self._refuse("encodable", float(np.max(np.abs(row))),
                         self.storage.max_magnitude, message)
        self.verdict.non_finite_rows += 1
        self._refuse("non_finite", self.verdict.non_finite_rows, 0, message)

    def _first_rows(self, first: int, keys: np.ndarray, rows: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        try:
            keep, repeats = self._keys.first_rows(keys)  # type: ignore[union-attr]
        except ValueError as exc:
            raise ModelFileError(f"{self.verdict.uri}: {exc}") from None
        if not repeats:
            return keys, rows
        self.verdict.duplicate_keys += repeats
        if self.settings.duplicates == "last":  # counted only: every row goes on
            return keys, rows
        if self.settings.duplicates == "refuse":
            at = int(np.argmin(keep))
            self._refuse("duplicates", self.verdict.duplicate_keys, 0,
                         f"{self.verdict.uri}: row {first + at:,} repeats key "
                         f"{int(keys[at])} of an earlier row: validation.duplicates is "
                         "refuse (first or last picks the row that serves instead)")
        return keys[keep], rows[keep]

    def _sample(self, keys: np.ndarray, rows: np.ndarray) -> None:
        at = sample_rows(keys, self._threshold)
        if at.size:
            sampled = rows[at]
            self._sample_keys.append(keys[at])
            self._sample_norms.append(row_norms(sampled))
            self._sample_hashes.append(row_hashes(sampled))

    def _sampled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sample's distinct keys in ascending order, with the norms and hashes of
        the row that serves each: a key the files repeat is served from its last row (or
        its first, already filtered)."""
        if not self._sample_keys:
            return (np.empty(0, np.int64), np.empty(0, np.float64), np.empty(0, np.uint64))
        keys = np.concatenate(self._sample_keys)
        norms = np.concatenate(self._sample_norms)
        hashes = np.concatenate(self._sample_hashes)
        last = keys.size - 1 - np.unique(keys[::-1], return_index=True)[1]
        return keys[last], norms[last], hashes[last]

    def _served_keys(self) -> int | None:
        """The served version's distinct keys; None on a first load, or when no tier can
        count them now (then the size is not compared and the drift says why)."""
        if self.served is None:
            return None
        try:
            return self.served.count()
        except TierError:
            return None

    def _check_size(self, distinct: int, served_keys: int | None) -> None:
        """Refuse a table of no keys, and a reload far smaller than the served version."""
        s, uri = self.settings, self.verdict.uri
        files = ", ".join(f"{name}: {size:,} bytes" for name, size in self.files) or "no file"
        if distinct == 0:
            held = (f"; the served version holds {served_keys:,} keys" if served_keys else "")
            self._gated("size", 0, 1, "allow_empty" if s.allow_empty else None,
                        f"{uri}: the table holds no keys ({files}){held}: every lookup of it "
                        "would answer the default vector; allow_empty (in the reload's body, "
                        "or validation.allow_empty) loads it anyway")
        elif served_keys and distinct < s.min_key_ratio * served_keys:
            need = math.ceil(s.min_key_ratio * served_keys)
            self._gated("size", distinct, need, "allow_shrink" if s.allow_shrink else None,
                        f"{uri}: the table holds {distinct:,} keys ({files}) where the served "
                        f"version holds {served_keys:,}: validation.min_key_ratio "
                        f"{s.min_key_ratio:g} asks for {need:,} at least (the keys it lacks "
                        "would answer the default vector); allow_shrink (in the reload's body, "
                        "or validation.allow_shrink) loads it anyway")

    def _drift(self, keys: np.ndarray, norms: np.ndarray, distinct: int) -> None:
        figures = measure(keys, norms, distinct, self.served)  # type: ignore[arg-type]
        self.verdict.drift = figures
        s = self.settings
        refuse = s.drift == "refuse"
        ratio, churn = figures["norm_ratio"], figures["key_churn"]
        if ratio is not None and ratio > s.max_norm_ratio:
            self._gated("norm_ratio", ratio, s.max_norm_ratio, None,
                        f"{self.verdict.uri}: row norms drifted {ratio:.3g}× from the served "
                        f"version (mean, p50, p99 new {_figures(figures['norm_new'])} vs "
                        f"old {_figures(figures['norm_old'])} on {figures['shared_keys']:,} "
                        f"shared sampled keys); validation.max_norm_ratio is "
                        f"{s.max_norm_ratio:g}", refuse=refuse)
        if churn is not None and churn > s.max_key_churn:
            shrunk = distinct < (figures["served_keys"] or 0)
            opt_in = ("allow_empty" if distinct == 0 and s.allow_empty else
                      "allow_shrink" if shrunk and s.allow_shrink else None)
            self._gated("key_churn", churn, s.max_key_churn, opt_in,
                        f"{self.verdict.uri}: {figures['keys_added']:.1%} of the keys are new "
                        f"and {figures['keys_removed']:.1%} of the served ones are gone; "
                        f"validation.max_key_churn is {s.max_key_churn:g}", refuse=refuse)

    def _gated(self, check: str, figure: float, limit: float, opt_in: str | None,
               message: str, *, refuse: bool = True) -> None:
        """A check past its limit: a warning where `refuse` is False; else a refusal,
        unless `opt_in` (the setting that allows it) or a rollback to the previous version
        lets it in, which the verdict's `admitted` records."""
        by = opt_in or ("previous_version" if refuse and self._rollback else None)
        if refuse and by is not None:
            self.verdict.admitted.append({"check": check, "by": by, "why": _WHY[by]})
        elif refuse and self.verdict.previous_version:  # a rollback short of its opt-in
            message += (f"; these rows are the version served before, which passed only "
                        f"with {' and '.join(self._missing_opt_ins())}: give it again to "
                        "load them")
        self._find(check, figure, limit, refuse and by is None, message)

    def _missing_opt_ins(self) -> list[str]:
        """The opt-ins the previous version's pass rested on that this load does not give."""
        needed = self.previous.opt_ins if self.previous is not None else frozenset()
        return sorted(name for name in needed if not getattr(self.settings, name))

    def _rests_on(self, recorded: Collection[str]) -> list[str]:
        """The opt-ins this version's pass rests on (`recorded`: those an earlier pass of
        the same files rested on)."""
        by = {entry["by"] for entry in self.verdict.admitted}
        rests = (by & set(OPT_INS)) | set(recorded)
        if "previous_version" in by and self.previous is not None:
            rests |= self.previous.opt_ins
        return sorted(rests)

    def _why_served(self, check: str) -> str:
        """Why a finding that did not refuse lets the version serve, for its log line."""
        for entry in self.verdict.admitted:
            if entry["check"] == check:
                return f"let in by {entry['by']}: {entry['why']}"
        return "validation.drift is warn: the version serves"

    def _find(self, check: str, figure: float, limit: float, refused: bool,
              message: str) -> None:
        self.verdict.add(Finding(check, float(figure), float(limit), refused, message))

    def _refuse(self, check: str, figure: float, limit: float, message: str) -> None:
        self._find(check, figure, limit, True, message)
        raise LoadGateError(self.verdict)


#: why a check that would refuse lets a version in, by what let it in
_WHY = {
    "allow_empty": "the load asked for it (allow_empty): the table serves the default "
                   "vector for every key",
    "allow_shrink": "the load asked for it (allow_shrink): the keys the version lacks "
                    "answer the default vector",
    "previous_version": "its rows are those of the version served before the one it "
                        "replaces (the same digest): a rollback is never refused for how "
                        "it compares with the version it replaces",
}


def _rows(n: int) -> str:
    return f"{n:,} such row" + ("" if n == 1 else "s")


def _figures(norms: dict[str, float] | None) -> str:
    return "-" if norms is None else "/".join(f"{norms[k]:.3g}" for k in ("mean", "p50", "p99"))


def width_refusal(verdict: GateVerdict, found: int, expected: int) -> LoadGateError:
    """The refusal of files whose rows are `found` wide where the config says `expected`."""
    verdict.add(Finding("width", float(found), float(expected), True,
                        f"{verdict.uri}: rows are {found} wide but embedding_vecsize_per_table "
                        f"says {expected}"))
    return LoadGateError(verdict)
