"""Warm-ups from a peer: a model's `warm_from` hot-key export prefetched before the model
serves.

`warm_from` names, per model, where each table's hot keys are (the binary export of
`GET /v1/models/{model}/tables/{table}/hot-set`: little-endian int64 keys):
- `http://host:port` or `https://...` (a peer server's base URL): each table's export is
  read from `{URL}/v1/models/{model}/tables/{table}/hot-set`, with `Authorization:
  Bearer $HPS_TOKEN` when that variable is set (replicas share their token);
- a URL or a file path holding `{table}`: that, with each table's name put in;
- any other file path: the export of a model's only table.

`hot_set(table, top, cached)` is what a peer exports: the table's `top` hot keys from its
sketch (heaviest first), then up to `cached` keys its GPU caches hold (most recently used
first). The sketch tracks a few thousand keys; a GPU cache holds the long tail its
traffic reached too, so a replica warmed with both starts with the peer's working set
(on the H100 the sketch's keys alone left the first lookups missing that tail).

`warm_up(loaded, prefetcher)` reads each table's export and prefetches it
(hps/server/prefetch.py), waiting at most the model's `warm_timeout` seconds in all,
reads included. It never raises: a source that cannot be read, a peer that lacks the
table, or a job that runs past the bound is logged and the version serves anyway (jobs
past the bound are cancelled: they stop within one chunk).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from hps.errors import HPSError, SourceError
from hps.modelfiles.confined import ConfinedSource, current_roots
from hps.server.gpu_caches import GpuCaches
from hps.server.models import LoadedModel, LoadedTable
from hps.server.prefetch import Prefetcher, PrefetchJob, first_occurrences

log = logging.getLogger("hps")

#: the largest export read (8M keys): a sketch exports a few thousand
MAX_EXPORT_BYTES = 64 << 20
#: the most keys of its GPU caches an export carries after the hot keys (32 MiB)
MOST_CACHED_KEYS = 1 << 22


class WarmSourceError(HPSError):
    """A table's export could not be read (logged; the warm-up goes on without it)."""

    kind = "warm_source"


def table_source(warm_from: str, model: str, table: str, num_tables: int) -> str:
    """Where the export of `table` is (URL or path), from a model's `warm_from`."""
    if "{table}" in warm_from:
        return warm_from.replace("{table}", urllib.parse.quote(table, safe=""))
    if _is_url(warm_from):
        return (f"{warm_from.rstrip('/')}/v1/models/{urllib.parse.quote(model, safe='')}"
                f"/tables/{urllib.parse.quote(table, safe='')}/hot-set")
    if num_tables != 1:
        raise WarmSourceError(f"warm_from {warm_from!r} is one file but model {model!r} has "
                              f"{num_tables} tables: put {{table}} in the path")
    return warm_from


def read_export(where: str, timeout: float) -> np.ndarray:
    """The int64 keys of the export at `where` (URL or file), within `timeout` seconds.

    For a model a request named (its load runs under `hps.modelfiles.confined`), only a
    file beneath the server's allowed roots is read, through the same confined opens as
    its model files, and never a URL: a request cannot make the server fetch elsewhere.
    """
    roots = current_roots()
    if roots is not None:
        if _is_url(where):
            raise WarmSourceError(f"{where}: a model added or reloaded over HTTP warms from "
                                  "files under the allowed roots only")
        data = _confined_read(where, roots)
    elif _is_url(where):
        request = urllib.request.Request(where, headers={"Accept": "application/octet-stream"})
        token = os.environ.get("HPS_TOKEN")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        deadline = time.monotonic() + timeout
        try:
            with urllib.request.urlopen(request, timeout=max(timeout, 0.001)) as answer:
                parts: list[bytes] = []
                got = 0
                # in parts: a peer that sends slowly is cut off at the bound, not waited for
                while got <= MAX_EXPORT_BYTES:
                    part = answer.read(1 << 20)
                    if not part:
                        break
                    parts.append(part)
                    got += len(part)
                    if time.monotonic() > deadline:
                        raise WarmSourceError(f"{where}: not read within the warm_timeout")
                data = b"".join(parts)
        except urllib.error.HTTPError as exc:
            raise WarmSourceError(f"{where}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise WarmSourceError(f"{where}: {getattr(exc, 'reason', exc)}") from None
    else:
        try:
            with open(where, "rb") as file:
                data = file.read(MAX_EXPORT_BYTES + 1)
        except OSError as exc:
            raise WarmSourceError(f"{where}: {exc.strerror or exc}") from None
    if len(data) > MAX_EXPORT_BYTES:
        raise WarmSourceError(f"{where}: more than {MAX_EXPORT_BYTES:,} bytes")
    if len(data) % 8:
        raise WarmSourceError(f"{where}: {len(data)} bytes is not a whole number of int64 "
                              "keys")
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


def hot_set(table: LoadedTable, top: int, cached: int = MOST_CACHED_KEYS) -> np.ndarray:
    """The export of `table`, each key once (int64): its `top` hot keys, heaviest first
    (those its GPU caches lack ahead of the others), then up to `cached` of the keys the
    caches hold, most recently used first."""
    hot = table.keys_seen.sketch("hot").top(top)["keys"]
    if cached <= 0 or not table.gpu:
        return hot
    held = GpuCaches.held_keys(table, cached)
    # hot keys the caches lack lead: a replica's cache of the peer's size inserts them
    # first, so the held keys that follow evict them rather than each other (a set holds
    # at most as many held keys as it has ways)
    lacking = ~np.isin(hot, held)
    every = np.concatenate([hot[lacking], hot[~lacking], held])
    return first_occurrences(every)[:hot.size + cached]


def warm_up(loaded: LoadedModel, prefetcher: Prefetcher) -> list[PrefetchJob]:
    """Prefetch the peer's hot keys of every table of `loaded` (see the module docstring);
    returns the jobs submitted (done, or cancelled at the bound)."""
    cfg = loaded.config
    if not cfg.warm_from:
        return []
    started = time.monotonic()
    deadline = started + cfg.warm_timeout
    jobs: list[PrefetchJob] = []
    for table in loaded.tables:
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("warm-up of model %r: warm_timeout (%gs) passed before table %r was "
                        "read", cfg.model, cfg.warm_timeout, table.name)
            break
        keys = _table_keys(loaded, table, left)
        if keys is not None:
            jobs.append(prefetcher.submit(loaded, table, keys))
    for job in jobs:
        if not job.wait(max(0.0, deadline - time.monotonic())):
            job.cancel()
            log.warning("warm-up of model %r: table %r not done within warm_timeout (%gs); "
                        "serving without the rest", cfg.model, job.table, cfg.warm_timeout)
    for job in jobs:
        if job.finished:
            log.info("warm-up of model %r, table %r: %s of %s keys found (%s into the "
                     "volatile tier, %s into GPU caches), %s", cfg.model, job.table,
                     job.found, job.keys, job.volatile_filled, job.gpu_inserted, job.status)
    log.info("warm-up of model %r from %s took %.2fs", cfg.model, cfg.warm_from,
             time.monotonic() - started)
    return jobs


def _table_keys(loaded: LoadedModel, table: LoadedTable, timeout: float
                ) -> np.ndarray | None:
    cfg = loaded.config
    try:
        where = table_source(cfg.warm_from or "", cfg.model, table.name, len(loaded.tables))
        return read_export(where, timeout)
    except WarmSourceError as exc:
        log.warning("warm-up of model %r, table %r skipped: %s", cfg.model, table.name, exc)
        return None


def _confined_read(path: str, roots: tuple[str, ...]) -> bytes:
    """The bytes of the file at `path`, opened beneath one of `roots` (never followed out
    of it), at most MAX_EXPORT_BYTES + 1 of them."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        source = ConfinedSource(path, folder, roots)
        try:
            size = source.size(name)
            return source.read(name, 0, min(size, MAX_EXPORT_BYTES + 1))
        finally:
            source.close()
    except SourceError as exc:
        raise WarmSourceError(str(exc)) from None


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))
