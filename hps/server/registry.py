"""The loaded models by name: versioned loads, one-assignment swaps, retirement.

A model becomes visible to lookups only once every one of its tables is loaded: the
registry maps names to fully built `LoadedModel` objects and is swapped in one
assignment, so no lookup ever sees a half-loaded model. A reload writes the new version
under staging storage names beside the served one (`hps_et.<model>.<table>~next`, then
back to HugeCTR's name at the next reload). Lookups hold the version they read
(`acquire`, `VersionRefs`); the replaced version takes no new lookups and its tables are
dropped when the last lookup holding it is done: at once in the reloading thread when
none is, else on a background worker. Never on a timer. A reload that needs a storage
name still held by a retiring version waits for that version's last lookup.

A model whose files a request named (`POST /v1/models`, a reload naming new files) is
read beneath the server's allowed roots (hps.modelfiles.confined); the version keeps
those roots (`LoadedModel.roots`), and reading the same files again (a plain reload, a
refill of the volatile tier) happens beneath them too.

Every table streams through the load gate (hps/gate/) as it loads, a reload's drift
measured against the served version's rows in the tier that holds them whole. A version
the gate refuses is not swapped in; `gate_ledger` counts the verdicts, and the served
version's tables carry the refused one's in `source.load_gate`. Each version remembers
the rows digests of the one it replaced, with the opt-ins each one's pass rested on
(`LoadedModel.previous_versions`): a reload of those rows is a rollback, which the gate's
comparisons with the served version never refuse where the load gives those opt-ins
again. A load's caller may allow, for that load alone, what the config's `validation`
does not (`opt_ins`: allow_empty, allow_shrink).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from hps.config import ModelConfig, PSConfig
from hps.errors import (
    LookupInputError,
    ModelExistsError,
    TierUnavailableError,
    UnknownModelError,
    UnknownTableError,
)
from hps.gate.drift import ServedRows, TierRows
from hps.gate.settings import effective, with_opt_ins
from hps.gate.table_gate import TableGate
from hps.gate.verdict import GateLedger, GateVerdict, LoadGateError, PassedVersion
from hps.modelfiles.confined import confined, current_roots
from hps.runtime.background import BackgroundWorker
from hps.runtime.backoff import Backoff
from hps.runtime.compile_on_use import loading
from hps.server.gpu_caches import GpuCaches
from hps.server.loader import (
    LoadProgress,
    load_table,
    open_reader,
    open_readers,
    return_freed_memory,
)
from hps.server.models import LoadedModel, LoadedTable
from hps.server.source_keys import naming_the_key, source_key
from hps.server.volatile_fill import VolatileFiller
from hps.tiers import Tiers
from hps.tiers.contract import table_name

log = logging.getLogger("hps")

#: storage-name suffix of the version being loaded beside a served one
STAGING_SUFFIX = "~next"
#: seconds between the warnings of a reload kept waiting by a lookup still in flight
_WAIT_WARN_SECONDS = 10.0


@dataclass(eq=False)
class _Retirement:
    """A replaced version whose tables are still to be dropped."""

    model: LoadedModel
    names: list[str]  # its storage names the new version does not use
    claimed: bool = False  # a thread is dropping it
    done: threading.Event = field(default_factory=threading.Event)


class ReloadObserver:
    """Told about reloads by the registry (the online updates, hps/server/updates.py, use
    it so that an update arriving during a reload reaches the new version). This one does
    nothing."""

    def reload_started(self, model: str) -> None:
        """A reload of served model `model` starts writing its new version."""

    def reload_failed(self, model: str) -> None:
        """That reload failed: the old version goes on serving."""

    def swap(self, old: LoadedModel, new: LoadedModel, install: Callable[[], None]) -> None:
        """Make `new` the served version in place of `old` by calling `install()`."""
        install()


class ModelRegistry:
    """Loads models into `tiers` (and GPU caches) and holds the versions served.

    Thread-safe: loads are serialised; `acquire` and `model()` never wait for a load.
    """

    def __init__(self, config: PSConfig, tiers: Tiers, gpu: GpuCaches, *,
                 chunk_bytes: int) -> None:
        self.config = config
        self.tiers = tiers
        self.gpu = gpu
        self.chunk_bytes = chunk_bytes
        self._models: dict[str, LoadedModel] = {}
        self._load_lock = threading.Lock()
        self._retiring: list[_Retirement] = []
        self._retiring_lock = threading.Lock()
        self._dropper: BackgroundWorker[_Retirement] = BackgroundWorker(
            "hps-version-drop", 1024, self._drop_each, log=log)
        db = config.volatile_db
        self.filler = (VolatileFiller(tiers.volatile, db.initial_cache_rate, Backoff(
            initial=db.reconnect_backoff, cap=max(db.reconnect_backoff, db.reconnect_backoff_max)),
            stored=tiers.persistent)
            if tiers.volatile is not None and tiers.persistent is not None else None)
        if self.filler is not None:  # tables the volatile tier loses later are filled again
            self.filler.watch(lambda: self._models.values(), lambda model, table: open_reader(
                self.config, model.config, table.index, self.chunk_bytes))
        #: told when a reload starts, fails, and swaps (see ReloadObserver)
        self.observer = ReloadObserver()
        #: the load gate's verdicts: counts by model, table and check, for /metrics
        self.gate_ledger = GateLedger()

    @property
    def models(self) -> dict[str, LoadedModel]:
        """Loaded models by name (a snapshot)."""
        return dict(self._models)

    def model(self, name: str) -> LoadedModel:
        """The served version of model `name`; raises UnknownModelError if none.

        The version is not held: a lookup that reads its tables uses `acquire`.
        """
        try:
            return self._models[name]
        except KeyError:
            loaded = ", ".join(sorted(self._models)) or "none"
            raise UnknownModelError(
                f"no model named {name!r} is loaded (loaded: {loaded})"
            ) from None

    def acquire(self, name: str) -> LoadedModel:
        """The served version of `name`, held until `loaded.refs.release()`.

        Its tables stay in the tiers while it is held, even when a reload replaces it
        meanwhile. Raises UnknownModelError if no version of `name` is served.
        """
        while True:
            loaded = self._models.get(name)
            if loaded is None:
                loaded = self.model(name)  # raises UnknownModelError (or a racing load won)
            if loaded.refs.acquire():
                return loaded
            # retired between the read and the acquire: the next read sees its successor

    @property
    def retiring(self) -> int:
        """Replaced versions whose tables are not dropped yet."""
        with self._retiring_lock:
            return len(self._retiring)

    def wait_retired(self, timeout: float | None = None) -> bool:
        """Wait until every replaced version is dropped; False if `timeout` passed first."""
        with self._retiring_lock:
            pending = [r.done for r in self._retiring]
        return all(done.wait(timeout) for done in pending)

    def load(self, model: ModelConfig, progress: LoadProgress | None = None,
             opt_ins: Collection[str] = ()) -> LoadedModel:
        """Load (or reload) `model`; it becomes visible to lookups only when complete.

        A reload of a served model writes the new version beside the old one (staging
        storage names) and swaps it in with one assignment; a load that fails leaves the
        old version serving and removes what it wrote (a failed first load too).
        `opt_ins`: load gate settings (hps.gate.settings.OPT_INS) set for this load alone.
        """
        with self._load_lock:
            return self._load(model, progress or LoadProgress(), opt_ins)

    def add(self, model: ModelConfig, progress: LoadProgress | None = None,
            opt_ins: Collection[str] = ()) -> LoadedModel:
        """Load a model that is not served yet; ModelExistsError if one of that name is."""
        with self._load_lock:
            if model.model in self._models:
                raise ModelExistsError(f"model {model.model!r} is already served: reload it, or "
                                  "unload it first")
            return self._load(model, progress or LoadProgress(), opt_ins)

    def _load(self, model: ModelConfig, progress: LoadProgress, opt_ins: Collection[str]
              ) -> LoadedModel:
        """The body of `load` and `add`, beneath the roots `_roots_for` says; the caller
        holds the load lock."""
        with_opt_ins(self.config.validation, opt_ins)  # ConfigError for an unknown name
        with loading():  # its compiles are the load's, not a served lookup's
            return confined(self._roots_for(model), self._load_beneath, model, progress,
                            tuple(opt_ins))

    def _roots_for(self, model: ModelConfig) -> tuple[str, ...] | None:
        """The allowed roots a load of `model` opens its local files beneath: its
        caller's (a request named the files: hps.modelfiles.confined), else, when it
        reads again the very files the served version was read from beneath roots (a
        plain reload of a model a request named), those roots: the files are no more
        trusted than the request that named them. None: the config's own files."""
        roots = current_roots()
        old = self._models.get(model.model)
        if (roots is None and old is not None and old.roots is not None
                and model.sparse_files == old.config.sparse_files):
            return old.roots
        return roots

    def _load_beneath(self, model: ModelConfig, progress: LoadProgress,
                      opt_ins: Collection[str]) -> LoadedModel:
        verdicts: list[GateVerdict] = []  # the load gate's, table by table
        try:
            readers = open_readers(self.config, model, self.chunk_bytes)  # validates first
        except LoadGateError as exc:  # a table of another width than the config's
            self._refused(model, exc, verdicts)
            raise
        old = self._models.get(model.model)
        names = [_storage_name(model, i, old) for i in range(model.num_tables)]
        self._wait_dropped(names)
        if old is None:  # a staging version left behind by an earlier process
            self._drop_leftover_staging(names)
        else:  # rows a failed drop (Redis down) left under these names are stale
            self._drop_tables(names, tiers=[self.tiers.volatile])
            self.observer.reload_started(model.model)
        written: list[str] = []
        loaded = LoadedModel(model, [], roots=current_roots(), previous_versions=(
            {t.name: PassedVersion(t.source.rows_digest, frozenset(t.source.rows_opt_ins))
             for t in old.tables} if old is not None else {}))
        fills = []
        try:
            for i, reader in enumerate(readers):
                written.append(names[i])
                with naming_the_key(source_key(self.config, model, i)):  # a file cut short
                    loaded.tables.append(self._load_table(model, i, names[i], reader,
                                                          progress, old, verdicts, opt_ins))
            self.gpu.attach(loaded, readers, progress)
            if self.filler is not None:  # pending from the moment the version serves
                fills = [self.filler.hold(loaded, table, functools.partial(
                            open_reader, self.config, model, table.index, self.chunk_bytes))
                         for table in loaded.tables if not table.volatile_ready]
            if old is None:
                self._install(loaded)
            else:
                self.observer.swap(old, loaded, lambda: self._install(loaded))
        except BaseException as exc:
            # what a failed load wrote goes away: a reload's staging tables, or the
            # tables of a first load that never became visible
            if isinstance(exc, LoadGateError):
                self._refused(model, exc, verdicts)
            if old is not None:
                self.observer.reload_failed(model.model)
            for fill in fills:
                self.filler.release(fill)  # type: ignore[union-attr]
            self.gpu.close(loaded)
            self._drop_tables(written)
            raise
        finally:
            for reader in readers:
                reader.close()
        for verdict in verdicts:
            self.gate_ledger.record(verdict)
        if old is not None:
            self._retire(old, keep=set(names))
        for fill in fills:
            self.filler.start(fill)  # type: ignore[union-attr]
        return loaded

    def _install(self, loaded: LoadedModel) -> None:
        """Serve `loaded` from now on (one assignment: lookups see old or new)."""
        self._models = {**self._models, loaded.config.model: loaded}

    def unload(self, name: str) -> None:
        """Stop serving model `name`; its tables are dropped once no lookup holds it, its
        load gate figures at once.

        Raises UnknownModelError if it is not served.
        """
        with self._load_lock:
            old = self.model(name)
            self._models = {k: v for k, v in self._models.items() if k != name}
            self._retire(old, keep=set())
            self.gate_ledger.forget(name)

    def reload(self, name: str, sparse_files: Sequence[str] | None = None,
               progress: LoadProgress | None = None, opt_ins: Collection[str] = ()
               ) -> LoadedModel:
        """Re-read a served model, optionally from new files (a new version)."""
        current = self.model(name).config
        update = {"sparse_files": list(sparse_files)} if sparse_files is not None else {}
        if sparse_files is not None and len(sparse_files) != current.num_tables:
            raise LookupInputError(
                f"model {name!r} has {current.num_tables} tables but "
                f"{len(sparse_files)} sparse files were given"
            )
        return self.load(current.model_copy(update=update), progress=progress, opt_ins=opt_ins)

    def close(self) -> None:
        """Drop every replaced version now (lookups must be over), close every GPU
        cache, forget every model. The tables of the served versions stay in the tiers."""
        if self.filler is not None:
            self.filler.close()
        self._dropper.close(timeout=30.0)
        with self._retiring_lock:
            left = list(self._retiring)
        for retirement in left:
            self._drop_version(retirement)
        for loaded in self._models.values():
            self.gpu.close(loaded)
        self._models = {}

    def _load_table(self, model: ModelConfig, index: int, storage_name: str, reader: Any,
                    progress: LoadProgress, old: LoadedModel | None,
                    verdicts: list[GateVerdict], opt_ins: Collection[str]) -> LoadedTable:
        name = model.embedding_table_names[index]
        settings = with_opt_ins(effective(self.config.validation, model.validation), opt_ins)
        gate = TableGate(settings, model=model.model, table=name, uri=reader.uri,
                         dim=reader.vec_size, num_keys=reader.num_keys, storage=model.storage,
                         allow_non_finite=model.allow_non_finite_vectors,
                         served=self._served_rows(old, name), files=reader.files,
                         previous=old.previous_versions.get(name) if old else None)
        verdicts.append(gate.verdict)
        source = load_table(
            storage_name, reader, self.tiers.volatile, self.tiers.persistent,
            self.config.volatile_db.initial_cache_rate, progress, gate, storage=model.storage,
        )
        return LoadedTable(
            index=index,
            name=model.embedding_table_names[index],
            storage_name=storage_name,
            dim=reader.vec_size,
            default_value=float(model.default_value_for_each_table[index]),
            max_keys=model.max_keys_per_lookup(index),
            source=source,
            volatile_ready=not source.volatile_error,
            storage=model.storage,
        )

    def _served_rows(self, old: LoadedModel | None, table: str) -> ServedRows | None:
        """The served version's table `table` as the gate's drift reads it: through the
        tiers as a lookup reads them (volatile, then persistent). None on a first load,
        for a table the served version lacks, or one no tier holds whole now."""
        if old is None:
            return None
        try:
            served = old.table(table)
        except UnknownTableError:
            return None
        persistent, volatile = self.tiers.persistent, self.tiers.volatile
        if volatile is not None and not served.volatile_ready:
            volatile = None  # it may hold stale rows under the table's name
        if persistent is None and volatile is None:
            return None
        return TierRows(volatile, persistent, served.storage_name, served.dim)

    def _refused(self, model: ModelConfig, exc: LoadGateError,
                 verdicts: list[GateVerdict]) -> None:
        """Record a version the load gate refused: counted in the ledger, and, where a
        version serves, its tables' `load_gate` say what the refused one's gate found."""
        if exc.verdict not in verdicts:
            verdicts.append(exc.verdict)
        for verdict in verdicts:
            verdict.served = False
            self.gate_ledger.record(verdict)
        old = self._models.get(model.model)
        if old is None:
            return
        found = {v.table: v.as_dict() for v in verdicts}
        for table in old.tables:
            if table.name in found:
                table.source.load_gate = found[table.name]

    def _drop_leftover_staging(self, names: Sequence[str]) -> None:
        persistent = self.tiers.persistent
        if persistent is None:
            return
        stored = persistent.tables()
        self._drop_tables([n + STAGING_SUFFIX for n in names if n + STAGING_SUFFIX in stored])

    def _wait_dropped(self, names: Sequence[str]) -> None:
        """Wait until no retiring version holds any of `names` (its last lookup ends)."""
        wanted = set(names)
        with self._retiring_lock:
            blocking = [r for r in self._retiring if wanted.intersection(r.names)]
        for retirement in blocking:
            while not retirement.done.wait(_WAIT_WARN_SECONDS):
                log.warning("reload of %r waits for %d lookup(s) still reading its previous "
                            "version", retirement.model.config.model,
                            retirement.model.refs.in_flight)

    def _retire(self, old: LoadedModel, keep: set[str]) -> None:
        """Drop a replaced version's tables once no lookup holds it (at once if none)."""
        retirement = _Retirement(old, [t.storage_name for t in old.tables
                                       if t.storage_name not in keep])
        with self._retiring_lock:
            self._retiring.append(retirement)
        if old.refs.retire(lambda: self._drop_later(retirement)):
            self._drop_version(retirement)

    def _drop_later(self, retirement: _Retirement) -> None:
        # runs in the thread of the version's last lookup: hand the drop to the worker
        if not self._dropper.submit(retirement):
            self._drop_version(retirement)  # closing (or 1,024 drops queued): drop here

    def _drop_each(self, batch: list[_Retirement]) -> None:
        for retirement in batch:
            self._drop_version(retirement)

    def _drop_version(self, retirement: _Retirement) -> None:
        with self._retiring_lock:
            if retirement.claimed:
                return  # another thread drops it (close raced the worker)
            retirement.claimed = True
        try:
            if self.filler is not None:
                self.filler.quiesce()  # a fill of the retired version stops writing first
            self.gpu.close(retirement.model)
            self._drop_tables(retirement.names)
        finally:
            with self._retiring_lock:  # only now may a load write these names again
                self._retiring.remove(retirement)
            retirement.done.set()
        return_freed_memory()

    def _drop_tables(self, names: Sequence[str], tiers: Sequence[Any] | None = None) -> None:
        for tier in self.tiers if tiers is None else tiers:
            if tier is None or tier.read_only:
                continue
            for name in names:
                try:
                    tier.drop_table(name)
                except TierUnavailableError:
                    log.warning("could not drop %s from the %s tier", name, tier.name)


def _storage_name(model: ModelConfig, index: int, old: LoadedModel | None) -> str:
    """HugeCTR's name for a first load; a reload alternates with a staging name."""
    base = table_name(model.model, model.embedding_table_names[index])
    if old is None:
        return base
    current = next((t.storage_name for t in old.tables
                    if t.name == model.embedding_table_names[index]), None)
    return f"{base}{STAGING_SUFFIX}" if current == base else base
