"""Models added, reloaded and removed in every worker of `hps serve --workers N`: the op
log of a run and `ReplicatedServer`.

The op log (hps/http/workers_oplog.py) is a file of JSON lines in the run folder, one op a
line, numbered from 1: `load` (a model block: a first load or a reload), `add`, `unload`.
The supervisor writes one `load` op per configured model before any worker starts; a
worker asked to change the models (an admin route) appends one. Every worker applies
every op in order on one thread (`ReplicatedServer`'s follower thread, which looks at the
log every POLL seconds while ops come and sleeps longer while none does; the worker that
appends an op rings every worker's doorbell, hps/http/workers_wake.py, to look at once):

- the leader (worker 0) applies it as one process would: it loads the files into the
  shared tables (hps/tiers/hash_map/shared.py), with the op's number as their
  generation, and writes the op's outcome (done, and where the version's tables lie in
  Redis and RocksDB; or the error, pickled);
- every other worker waits for that outcome, then applies the op too, mapping the tables
  the leader made (its loader skips the rows: `loaded_elsewhere`), or, when the leader
  failed, records the same error without applying it. One that fails an op the leader
  did tries again on the store read anew, then exits to be started again (a replay).

A worker then writes the versions it serves (hps/http/workers_versions.py) and the
number of the last op it applied (its ack). The worker that appended an op answers once
it applied the op itself and every live worker acked it (at most ACK_WAIT seconds, or
`$HPS_WORKER_ACK_WAIT_S`, then a 503 that names the workers behind; a worker that dies is
not waited for, and one started again acks once it replayed), so after a 2xx every worker
serves the new version; each swaps it in atomically, as one process does.

A worker started again (after it died) replays the log compacted: the last successful load
or add of each model still served, mapping the tables the leader holds, before it takes
requests (hps/http/workers_child.py), then follows the log as before. A leader started
again replays the ops that have an outcome, then applies the first one without (the op its
predecessor died in) again, after removing the shared tables that op had begun
(`_remove_unfinished`); the supervisor fails an op the leader died in twice
(hps/http/workers.py), so the log always goes on. In Redis and RocksDB it reads each
version where the outcome says the leader stored it (`_place`), whatever its own registry
names it; the leader drops the tables a change replaced there only once every live worker
applied the change (hps/http/workers_drops.py). A follower's RocksDB is a secondary
instance of the leader's store (hps/tiers/rocksdb/secondary.py), opened again before each
op.

A model counts as served by the server (`models`: /readyz, /v1/models) once every live
worker serves it, and the server is ready only while every such worker serves the
version the server says (`versions`: hps/http/workers_versions.py). Only the leader
consumes online updates: its /readyz shows their state, and /metrics shows the leader's
update figures whichever worker answers (hps/http/workers_metrics.py). A prefetch asked
of one worker runs in every worker through the run's prefetch board, which the same
thread reads (hps/http/workers_prefetch.py).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hps.config import ModelConfig, PSConfig
from hps.errors import ConfigError, TierError, WorkersBehindError
from hps.gate.settings import OPT_INS, requested_opt_ins
from hps.http.workers_drops import HeldDrops
from hps.http.workers_gpu import cuda_here, refuse_uvm
from hps.http.workers_oplog import Op, OpLog, block_of
from hps.http.workers_prefetch import PrefetchBoard, idle_part, job_prefix
from hps.http.workers_versions import VersionBoard
from hps.http.workers_wake import POLL, Doorbell
from hps.intake.keys import host_key_array, key_ref
from hps.modelfiles.confined import confined, current_roots
from hps.server import HierarchicalParameterServer, LoadedTable
from hps.server.cache_journal import CacheFollower, UpdateJournal
from hps.server.loader import LoadProgress
from hps.server.models import LoadedModel
from hps.server.prefetch import PrefetchJob
from hps.server.registry import STAGING_SUFFIX, _storage_name
from hps.tiers.contract import table_name

log = logging.getLogger("hps.http.workers")

#: the environment variable naming a worker's inherited listening socket's descriptor
FD_ENV = "HPS_WORKER_FD"
#: the exit status of a worker that could not start (its error is in the run folder)
SETUP_FAILED = 3
#: seconds an op's answer waits for the other live workers to apply it (and the leader,
#: before its next op, for them to leave the tables the op replaced in Redis and RocksDB)
ACK_WAIT = 120.0
#: the environment variable that sets those seconds instead (`ack_wait`)
ACK_WAIT_ENV = "HPS_WORKER_ACK_WAIT_S"
#: tries of a follower at an op the leader did, then the exit status it is restarted with
RESYNC_ATTEMPTS, RESYNC_EXIT = 3, 4


def ack_wait() -> float:
    """ACK_WAIT, or the seconds `$HPS_WORKER_ACK_WAIT_S` gives (the supervisor checks it
    before any worker starts: hps/http/workers.py); ConfigError for a value that is not a
    number of seconds above 0."""
    given = os.environ.get(ACK_WAIT_ENV, "").strip()
    if not given:
        return ACK_WAIT
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ConfigError(f"{ACK_WAIT_ENV}={given!r}: expected the seconds a model change "
                          f"waits for every worker, above 0 (default {ACK_WAIT:g})")
    return seconds


class ReplicatedServer(HierarchicalParameterServer):
    """A worker's parameter server: model changes go through the op log (see the module).

    `ReplicatedServer(config, oplog=, index=, workers=)`; the config's tiers must be
    shareable (the supervisor checks: hps/http/workers.py). Its host-key lookups take the
    device of its index (hps/server/host_device.py)."""

    def __init__(self, config: PSConfig | dict[str, Any] | str, *, oplog: OpLog, index: int,
                 workers: int | None = None) -> None:
        super().__init__(config, load=False)
        self.oplog, self.index = oplog, index
        self.worker, self.workers = index, workers
        self.leader = index == 0
        self._applied: dict[int, BaseException | None] = {}
        self._cond = threading.Condition()
        self._since: dict[str, int] = {}  # model → the op that first made it served here
        self._progress: dict[int, LoadProgress] = {}
        self.unasked: LoadProgress | None = None  # hears the loads no caller gave one to
        self._initial = {op.model: op.seq for op in oplog.ops()
                         if op.seq <= len(self.config.models)}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = 0  # the last op applied here
        self._versions: dict[str, int] = {}  # model → the op that loaded the one served
        #: the versions every worker serves (/readyz compares them with the server's)
        self.versions = VersionBoard(oplog, index)
        self._ack_wait = ack_wait()
        #: told of each op applied here (the worker's app marks models ready or not)
        self.on_applied: Callable[[Op], None] | None = None
        # the tiers every worker reads but only the leader writes: Redis, RocksDB
        # (the followers' RocksDB is a secondary instance from its start: secondary.py)
        common = [t for t in self.tiers if not getattr(t, "shared", False)]
        self._readers = [t for t in common if hasattr(t, "read_as")]
        self._stored: dict[str, str] = {}  # storage name here → there (see _place)
        self._drops = HeldDrops(common, oplog.lowest_ack, self._ack_wait
                                ) if self.leader else None
        if not self.leader:
            for tier in common:  # a loop over tiers
                if hasattr(tier, "follow"):
                    tier.follow()
        # every worker has GPU caches of its own: the leader's online updates reach the
        # others' through the journal of the keys it wrote (hps/server/cache_journal.py)
        # (each journal append rings the others' followers, which sleep while none comes)
        self._follower: CacheFollower | None = None
        self._gpu_bell: Doorbell | None = None
        if self.leader:
            self._gpu_bell = Doorbell(oplog.folder.parent, index, channel="gpu")
            self._gpu.journal = UpdateJournal(oplog.folder.parent, self._ring_gpu_followers)
        else:
            self._follower = CacheFollower(
                oplog.folder.parent, self._cached_tables, self._gpu.refetch,
                self._gpu.refresh_table, self._catch_up,
                bell=Doorbell(oplog.folder.parent, index, channel="gpu"))
            self._follower.start()
        # a prefetch asked of one worker runs in every worker (workers_prefetch.py); only
        # the leader writes the volatile tier, as for updates
        self._board = PrefetchBoard(oplog.folder.parent, index, oplog.live_workers)
        self._bell = Doorbell(oplog.folder.parent, index)
        self._prefetch.id_prefix = job_prefix(index)
        self._prefetch.fill_volatile = self.leader
        self._prefetch.on_change = self._board.publish
        oplog.register(index)

    def _cached_tables(self) -> list[tuple[str, str, LoadedTable]]:
        """The tables with GPU caches here: (model, table name, table)."""
        return [(name, t.name, t) for name, loaded in self._registry.models.items()
                for t in loaded.tables if t.gpu]

    def _catch_up(self) -> None:
        """A follower's RocksDB secondary reads what the leader wrote since it looked."""
        persistent = self.tiers.persistent
        if persistent is not None and hasattr(persistent, "catch_up"):
            persistent.catch_up()

    # -- the follower thread -----------------------------------------------------------

    def replay(self) -> None:
        """Apply the ops the leader already completed, compacted (a worker started again
        after one died), then follow the log on a thread."""
        ops = self.oplog.ops()
        done = self.oplog.acked(0) if not self.leader else self.oplog_leader_done(ops)
        latest: dict[str, Op] = {}
        first: dict[str, int] = {}  # the op that made each model served, for `models`
        for op in ops[:done]:
            outcome = self.oplog.outcome(op.seq)
            ok = outcome is not None and outcome[1] is None
            if not ok and self.leader:  # one the supervisor failed may have left tables
                self._remove_unfinished(op)
            if ok and op.kind == "unload":
                latest.pop(op.model, None)
                first.pop(op.model, None)
            elif ok:
                latest[op.model] = op
                first.setdefault(op.model, op.seq)
            self._record(op.seq, outcome[1] if outcome else None)
        if done:  # the models the server serves now, not the config's first ones
            self._set_models([ModelConfig.model_validate(op.block) for op in latest.values()])
        for op in sorted(latest.values(), key=lambda o: o.seq):
            try:
                self._apply(op, decided=True)
            except Exception as exc:  # the others serve it: this one says why it cannot
                log.error("worker %d: replaying op %d (%s %s) failed: %s", self.index,
                          op.seq, op.kind, op.model, exc)
        # served since the op that first made it so, as in the workers that never stopped
        # (dated by its last reload, a model left /readyz until every worker acked that)
        self._since.update({name: seq for name, seq in first.items() if name in self._since})
        self._done = done
        self.versions.publish(self._versions)  # before it takes requests (workers_child)
        if done:
            self.oplog.ack(self.index, done)
        self._thread = threading.Thread(target=self._follow, name="hps-workers-ops", daemon=True)
        self._thread.start()

    def oplog_leader_done(self, ops: Sequence[Op]) -> int:
        """The ops a leader started again had completed: those with an outcome."""
        first = self.oplog.unfinished()
        return len(ops) if first is None else min(first - 1, len(ops))

    def _follow(self) -> None:
        while not self._stop.is_set():
            busy = False
            if self._drops is not None:
                self._drops.flush()
                busy = self._drops.held  # waiting for the others' acks: look again soon
            busy = self._take_prefetches() or busy
            for op in self.oplog.ops()[self._done:]:
                if self._stop.is_set():
                    return
                self._step(op)
                self._done = op.seq
                busy = True
            self._bell.rest(busy)

    def _ring(self) -> None:
        """Every worker's follower looks now: this one wrote a change (the op log, the
        prefetch board, an outcome)."""
        self._bell.ring(range(self.workers) if self.workers else self.oplog.live_workers())

    def _ring_gpu_followers(self) -> None:
        """The leader journaled an update's keys: the others' GPU caches take it now (a
        stream of updates rings once a POLL: the followers it woke look that often)."""
        assert self._gpu_bell is not None
        workers = range(self.workers) if self.workers else self.oplog.live_workers()
        self._gpu_bell.ring((i for i in workers if i != self.index), every=POLL)

    def _step(self, op: Op) -> None:
        error: BaseException | None = None
        if self.leader:
            stored, verdicts = None, None
            try:
                self._remove_unfinished(op)
                self._apply(op)
                stored = self._stored_names(op)
                verdicts = {t.name: t.source.load_gate for t in super().model(op.model).tables
                            } if stored is not None else None
            except Exception as exc:
                error = exc
            self.versions.publish(self._versions)  # before the outcome makes it the server's
            self.oplog.set_outcome(op.seq, error, stored, verdicts)
            self._ring()  # the followers waiting for it look now
        else:
            outcome = self.oplog.outcome(op.seq)
            while outcome is None and not self._stop.is_set():
                self._bell.rest(busy=True)  # POLL, or the leader's ring with its outcome
                outcome = self.oplog.outcome(op.seq)
            if outcome is None:
                return
            error = outcome[1]
            if error is None:
                self._follow_leader(op)
                self.versions.publish(self._versions)  # before its ack
        self._record(op.seq, error)
        if error is None and self.on_applied is not None:
            self.on_applied(op)
        self.oplog.ack(self.index, op.seq)

    def _follow_leader(self, op: Op) -> None:
        """A follower applies an op the leader did. Where it fails here (its RocksDB
        instance read the leader's store as it changed) it reads the store anew (`_apply`
        opens a new instance) and tries again; still failing, the worker exits, and the
        supervisor starts it again, which replays the log before it takes a request. Never
        acked as failed: the others would serve the new version and this one the old."""
        for attempt in range(1, RESYNC_ATTEMPTS + 1):  # a loop over attempts
            try:
                self._apply(op, decided=True)
                return
            except Exception as exc:
                log.error("worker %d: op %d (%s %s) failed here, not in the leader (attempt "
                          "%d of %d): %s", self.index, op.seq, op.kind, op.model, attempt,
                          RESYNC_ATTEMPTS, exc)
            if self._stop.wait(POLL * attempt):
                return
        log.error("worker %d: exits to be started again and replay the log", self.index)
        logging.shutdown()
        os._exit(RESYNC_EXIT)

    def _apply(self, op: Op, decided: bool = False) -> None:
        """Apply `op`. `decided`: the leader admitted it (a follower, a replay), so its
        size is not judged again here, where a replay is a first load."""
        if self._drops is not None:  # the leader: what an earlier op replaced goes first
            self._drops.before_op(op.seq, [t.storage_name for m in super().models.values()
                                           for t in m.tables])
        elif hasattr(self.tiers.persistent, "catch_up"):  # a follower: the leader's tables
            self.tiers.persistent.catch_up(reopen=True)  # type: ignore[union-attr]
        self._place(op)
        volatile = self.tiers.volatile
        if volatile is not None and hasattr(volatile, "generation"):
            volatile.generation = op.seq  # the same file name in every worker
        progress = self._progress.pop(op.seq, self.unasked)  # a first load: applied unasked
        if op.kind == "unload":
            super().unload_model(op.model)
            self._since.pop(op.model, None)
            self._versions.pop(op.model, None)
            return
        model = ModelConfig.model_validate(op.block)
        opt_ins = OPT_INS if decided else op.opt_ins
        flags = {k: k in opt_ins for k in (OPT_INS if op.kind == "load" else OPT_INS[:1])}
        load = super().add_model if op.kind == "add" else super().load_model
        confined(op.roots, lambda: load(model, progress=progress, **flags))
        if not self.leader:  # the leader's gate decided: every worker reports its verdict
            leader = self.oplog.stored(op.seq, "verdicts")
            for table in super().model(op.model).tables:
                table.source.load_gate = leader.get(table.name, table.source.load_gate)
        self._since.setdefault(op.model, op.seq)
        self._versions[op.model] = op.seq
        if self._follower is not None:  # its caches were warmed from the files
            self._follower.reset(op.model)

    def _remove_unfinished(self, op: Op) -> None:
        """The leader, before it applies op `op` (which has no outcome): the shared tables
        a leader that died applying it left are removed, to be made again. Mapped as they
        are, they would serve the rows it wrote before it died, and a write it was in
        the middle of would leave their sequence counter odd for good: every lookup of
        the version, in every worker, would wait for a writer that is gone."""
        volatile = self.tiers.volatile
        if op.block is None or volatile is None or not hasattr(volatile, "remove_unfinished"):
            return
        model = ModelConfig.model_validate(op.block)
        for name in model.embedding_table_names:  # a loop over tables
            volatile.remove_unfinished(table_name(model.model, name), op.seq)

    def _place(self, op: Op) -> None:
        """Say where the version op `op` loads is stored in the tiers every worker reads.

        Each process's registry names a version's tables itself (HugeCTR's name, and a
        staging name beside it for a reload: hps/server/registry.py), from the versions
        it loaded before; a worker started again, which replays only the latest op of each
        model, may name a version otherwise than the leader did. So the tables go where the
        leader stored them (the op's outcome), and where the leader has no outcome yet
        (it applies the op now) beside the served version's place, as one process does.
        """
        if not self._readers or op.kind == "unload" or op.block is None:
            return
        model = ModelConfig.model_validate(op.block)
        old = super().models.get(op.model)
        stored = self.oplog.stored(op.seq)
        for index, name in enumerate(model.embedding_table_names):  # a loop over tables
            mine = _storage_name(model, index, old)
            there = stored.get(name)
            if there is None:  # the leader applies the op now: beside the served version
                base = table_name(model.model, name)
                served = next((t.storage_name for t in old.tables if t.name == name),
                              None) if old is not None else None
                there = base + STAGING_SUFFIX if served is not None and self._stored.get(
                    served, served) == base else base
            self._stored[mine] = there
            for tier in self._readers:  # with an outcome: a leader wrote it whole
                tier.read_as(mine, there, whole=stored.get(name) is not None)

    def _stored_names(self, op: Op) -> dict[str, str] | None:
        """Where this process stored the tables of op `op`'s version (see `_place`)."""
        if op.kind == "unload" or op.model not in super().models:
            return None
        return {t.name: self._stored.get(t.storage_name, t.storage_name)
                for t in super().model(op.model).tables}

    def _record(self, seq: int, error: BaseException | None) -> None:
        with self._cond:
            self._applied[seq] = error
            self._cond.notify_all()

    # -- what the routes call ----------------------------------------------------------

    def _await(self, seq: int, everyone: bool) -> None:
        with self._cond:
            while seq not in self._applied:
                self._cond.wait(1.0)
            error = self._applied[seq]
        if error is not None:
            raise error
        if not everyone:
            return
        deadline = time.monotonic() + self._ack_wait
        while self.oplog.lowest_ack() < seq:
            if time.monotonic() > deadline:  # never a 2xx while a worker serves the old
                behind = [i for i in self.oplog.live_workers() if self.oplog.acked(i) < seq]
                log.warning("op %d: worker(s) %s did not apply it within %gs", seq,
                            behind, self._ack_wait)
                raise WorkersBehindError(
                    f"the change is made in the leader, but worker(s) "
                    f"{', '.join(map(str, behind))} did not apply it within "
                    f"{self._ack_wait:g}s ({ACK_WAIT_ENV}) and still serve what "
                    "they served before (GET /readyz names them); ask again to see it "
                    "through")
            time.sleep(POLL)

    def initial_loads_done(self) -> None:
        """The app's first loads (one per configured model: they wait for the
        supervisor's first ops) are over: every later load of a model is a reload, an op
        of its own. Without this, a worker whose models were served before its app
        started (a worker started again) answered its first reload of each model with
        the first op, already applied: 200, and nothing changed."""
        self._initial.clear()

    def load_model(self, model: ModelConfig, progress: LoadProgress | None = None, *,
                   allow_empty: bool = False, allow_shrink: bool = False) -> LoadedModel:
        """Load or reload `model` in every worker (see the module); the load gate's
        opt-ins go with the op to the leader, which decides."""
        seq = self._initial.pop(model.model, None)
        everyone = seq is None
        if seq is None:
            self._check_gpu(model)
            seq = self.oplog.append("load", model.model, block_of(model), current_roots(),
                                    requested_opt_ins(allow_empty, allow_shrink))
            self._ring()
        if progress is not None:
            self._progress[seq] = progress
        self._await(seq, everyone)
        return super().model(model.model)

    def add_model(self, model: ModelConfig, progress: LoadProgress | None = None, *,
                  allow_empty: bool = False) -> LoadedModel:
        """Add `model` in every worker."""
        self._check_gpu(model)
        seq = self.oplog.append("add", model.model, block_of(model), current_roots(),
                                requested_opt_ins(allow_empty, False))
        self._ring()
        if progress is not None:
            self._progress[seq] = progress
        self._await(seq, everyone=True)
        return super().model(model.model)

    def _check_gpu(self, model: ModelConfig) -> None:
        """ConfigError, before any worker loads it, for a model added or reloaded at
        runtime that the workers cannot each hold on their GPUs (workers_gpu.py)."""
        if model.gpucache and cuda_here():
            refuse_uvm([model])

    def unload_model(self, name: str) -> None:
        """Remove model `name` in every worker."""
        super().model(name)  # UnknownModelError before anything is logged
        seq = self.oplog.append("unload", name)
        self._ring()
        self._await(seq, everyone=True)

    # -- prefetches in every worker (workers_prefetch.py) ------------------------------

    def prefetch(self, model: str, table: int | str, keys: Any, job_id: str | None = None
                 ) -> PrefetchJob:
        """Prefetch here; a job asked of this worker (no `job_id`) is announced, and
        every other worker runs its part."""
        host_keys = host_key_array(key_ref(keys))
        job = super().prefetch(model, table, host_keys, job_id)
        if job_id is None:
            self._board.announce(job.id, model, job.table, host_keys)
            self._ring()
        self._board.publish(job)
        return job

    def _take_prefetches(self) -> bool:
        """Run this worker's part of the prefetches other workers announced; whether
        there were any."""
        requests = self._board.new_requests()
        for request in requests:  # a loop over requests, not keys
            keys = self._board.keys_of(request)
            try:
                if keys is None:
                    raise TierError("its keys were gone before this worker read them")
                self.prefetch(request["model"], request["table"], keys, request["job"])
            except Exception as exc:  # this part fails; the job's answer says why
                log.warning("worker %d: prefetch %s failed here: %s", self.index,
                            request["job"], exc)
                self._board.publish(idle_part(request, "failed",
                                              0 if keys is None else int(keys.size),
                                              f"worker {self.index}: {exc}"))
        return bool(requests)

    def prefetch_status(self, job_id: str) -> dict[str, Any] | None:
        """A job announced on the board over every live worker; another (a warm-up's)
        as this worker has it."""
        combined = self._board.status(job_id)
        return combined if combined is not None else super().prefetch_status(job_id)

    @property
    def models(self) -> dict[str, LoadedModel]:
        """The models every live worker that takes requests serves (a snapshot). A
        worker started again joins once it replayed the log: while it starts, the others
        serve what they served, and /readyz says so."""
        mine = super().models
        if not mine:
            return mine
        floor = self.oplog.lowest_serving_ack()
        return {name: m for name, m in mine.items() if self._since.get(name, 0) <= floor}

    def close(self) -> None:
        self._stop.set()
        self._bell.close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._bell.release()
        if self._follower is not None:
            self._follower.close()
        if self._drops is not None:
            self._drops.release()  # every worker stops: nothing is held any more
        super().close()
        if self._gpu.journal is not None:  # after the update consumer stopped
            self._gpu.journal.close()
        if self._gpu_bell is not None:  # the journal's appends ring no more
            self._gpu_bell.release()

