"""The hot copies of sharded tables, filled in the background and on demand.

A static table sharded over several devices keeps on each device a copy of its peers'
heaviest rows (hps/gpu/hot_rows.py). Every load and reload makes the copies empty, and
empty copies are what a server has unless someone fills them: on four H200s 1M power-law
keys ran at 0.42x the link bound with the copies empty, 1.21x filled (issue 74). So each
server fills them itself, from each table's hot-key sketch (hps/server/key_sketch.py).

`HotRowsFiller`, one thread a server, started once a model with hot copies serves, looks
at every served table with hot copies each TICK seconds and fills its copies with the
sketch's heaviest keys where `refill_due` says so:
- not sooner than the model's `gpu_hot_rows_refresh_seconds` after the last fill (0: never
  in the background; the copies are then filled on demand only);
- only where the sketch counted lookups since (no traffic, nothing moved);
- only where the heaviest keys moved: the keys the copies were last offered miss at least
  REFILL_MOVED of the counted weight of the sketch's top keys (or none were offered yet).
A reload's new version starts with an empty sketch of its own, so its copies are first
filled with the heaviest keys of the version it replaces (`seed`), as soon as it serves.

On demand: `fill(server's registry, model, table)` (HPS.fill_hot_rows, `POST
/v1/models/{model}/hot-rows`, `hps models hot-rows`) fills them now, whatever the interval.
Under `hps serve --workers N` the route asks every worker (hps/http/workers_hot_rows.py):
their fillers read the request (`asked`) at their next tick.

What a fill costs the lookups: it reads the rows of its keys from their shards (a query
each, beside the lookups) and builds each copy in one kernel, under the copy's lock, which
the lookups reading the copy wait for as they wait for an update of it (HotRows.fill).
Writes to the table wait for the whole fill (the table's write lock, HotCopies.lock), so
no fill ever copies a row that a write changes before the copy is built.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.errors import NoHotCopiesError, UnknownModelError
from hps.server.gpu_caches import GpuCaches
from hps.server.models import LoadedModel, LoadedTable

log = logging.getLogger("hps")

#: seconds between two looks of the filler at the served tables
TICK = 0.25
#: the share of the sketch's counted weight (of its top keys) that keys the copies were not
#: offered must reach before a background refill: less is noise of the sampling
REFILL_MOVED = 0.05


def refill_due(now: float, filled_at: float | None, interval: float, total: int,
               filled_total: int, counts: np.ndarray, offered: np.ndarray) -> bool:
    """Whether a table's hot copies are filled again in the background (see the module):
    `now` and `filled_at` (the last fill, None: never) in seconds, `interval` the model's
    `gpu_hot_rows_refresh_seconds`, `total` the sketch's counted weight now and
    `filled_total` then, `counts` the counts of the sketch's top keys (heaviest first)
    and `offered` whether each of them was among the keys the copies were last offered."""
    if interval <= 0 or total == filled_total or not counts.size:
        return False
    if filled_at is not None and now - filled_at < interval:
        return False
    if not offered.any():
        return True
    moved = float(counts[~offered].sum())
    return moved >= REFILL_MOVED * float(counts.sum())


class HotRowsFiller:
    """The background filler of one server (see the module). `acquire(name)` holds a
    served version (the registry's: released with `loaded.refs.release()`), `names()`
    lists the served models. `asked`: called each tick for the fills other processes
    asked of this one, [(model, table or None: every table)]."""

    def __init__(self, acquire: Callable[[str], LoadedModel], names: Callable[[], list[str]]
                 ) -> None:
        self._acquire = acquire
        self._names = names
        self.asked: Callable[[], list[tuple[str, str | None]]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._fill_lock = threading.Lock()  # a table's fills one at a time, in this process

    def watch(self, loaded: LoadedModel, previous: LoadedModel | None) -> None:
        """A version about to serve: its copies seeded with the heaviest keys of the
        version it replaces (`previous`), and the thread started where it has copies."""
        copies = False
        background = loaded.config.gpu_hot_rows_refresh_seconds > 0
        for table in loaded.tables:
            for owner in GpuCaches.hot_owners(table):
                copies = True
                seed = _seed_of(previous, table.name) if background else None
                if seed is not None and seed.size:
                    owner.hot.seed = seed
        if copies:
            self.start()

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="hps-hot-rows",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        said = ""  # the last failure logged: a lasting one is logged once, not every tick
        while not self._stop.wait(TICK):
            try:
                self.tick()
                said = ""
            except Exception as exc:  # a fill is a speed-up: the copies stay as they were
                if repr(exc) != said:
                    log.exception("background fill of hot copies failed")
                    said = repr(exc)

    def tick(self) -> None:
        """One look at every served table with hot copies: the fills asked of this
        process, then the ones due."""
        asked = self.asked() if self.asked is not None else []
        for model, table in asked:
            try:
                self.fill(model, table)
            except (UnknownModelError, NoHotCopiesError) as exc:
                log.info("hot copies of %s asked by another worker: %s", model, exc)
        for name in self._names():
            try:
                loaded = self._acquire(name)
            except UnknownModelError:
                continue  # removed meanwhile
            try:
                interval = loaded.config.gpu_hot_rows_refresh_seconds
                for table in loaded.tables:
                    for owner in GpuCaches.hot_owners(table):
                        self._look(name, table, owner, interval)
            finally:
                loaded.refs.release()

    def _look(self, model: str, table: LoadedTable, owner: Any, interval: float) -> None:
        hot = owner.hot
        if hot.seed is not None:  # a reload's first fill: the replaced version's keys
            seed, hot.seed = hot.seed, None
            self._fill_owner(model, table, owner, seed, hot.sketch_total)
            return
        sketch = table.keys_seen.hot
        top = sketch.top(sketch.capacity)
        offered = np.isin(top["keys"], hot.offered, assume_unique=False)
        if refill_due(time.monotonic(), hot.filled_at, interval, int(top["total"]),
                      hot.sketch_total, top["counts"], offered):
            self._fill_owner(model, table, owner, top["keys"], int(top["total"]))

    def _fill_owner(self, model: str, table: LoadedTable, owner: Any, keys: np.ndarray,
                    total: int) -> dict[int, int]:
        with self._fill_lock:
            held = owner.replicate_hot(keys)
            owner.hot.sketch_total = total
        log.debug("hot copies of %s table %s filled: %s", model, table.name, held)
        return held

    def fill(self, model: str, table: int | str | None = None) -> dict[str, Any]:
        """Fill the hot copies of one table of `model` (None: every table that keeps some)
        now, from its hot-key sketch. Returns {"model", "tables": [{"table", "keys"
        offered, "held": {device: keys its copy holds}}]}. Raises UnknownModelError,
        UnknownTableError, or NoHotCopiesError where no table asked for keeps copies."""
        loaded = self._acquire(model)
        try:
            tables = (loaded.tables if table is None else [loaded.table(table)])
            done = []
            for t in tables:
                for owner in GpuCaches.hot_owners(t):
                    sketch = t.keys_seen.hot
                    top = sketch.top(sketch.capacity)
                    held = self._fill_owner(model, t, owner, top["keys"], int(top["total"]))
                    done.append({"table": t.name, "keys": int(top["keys"].size),
                                 "held": {str(d): n for d, n in held.items()}})
            if not done:
                which = (f"table {tables[0].name!r} of model {model!r} keeps no"
                         if table is not None else f"no table of model {model!r} keeps")
                raise NoHotCopiesError(
                    f"{which} hot copies here: they are made for a static table "
                    "sharded over several GPUs (gpu_sharding row_wise, not stored as int8, "
                    "gpu_hot_rows above 0) on a server with GPU caches")
            return {"model": model, "tables": done}
        finally:
            loaded.refs.release()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _seed_of(previous: LoadedModel | None, table: str) -> np.ndarray | None:
    """The heaviest keys of table `table` of the version a reload replaces (None: none)."""
    if previous is None:
        return None
    for t in previous.tables:
        if t.name == table:
            sketch = t.keys_seen.hot
            keys: np.ndarray = sketch.top(sketch.capacity)["keys"]
            return keys
    return None
