"""What the routes of one app share: the server, metrics, settings and load state.

Models load in a background thread (`start_loading`), so the HTTP server answers
`/healthz` at once and `/readyz` says when every model of the config is served. A model
is visible to lookups only once the server has swapped it in whole (the server's rule);
this module only records which models are pending, loaded or failed.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.responses import JSONResponse

from hps.config import ModelConfig
from hps.errors import HPSError, UnknownModelError
from hps.http.admission import SHED_MESSAGE, TARGET_DELAY_S, Admission, Expired
from hps.http.bodies import parse_length
from hps.http.errors import (
    ApiError,
    BadBody,
    DeadlineExceeded,
    ErrorBody,
    Forbidden,
    LookupStalled,
    ModelNotReady,
    Overloaded,
    Unauthorized,
    error_body,
    kind_of,
    status_of,
)
from hps.http.guards import allowed_hosts, allowed_origins, check_admin_request, check_host
from hps.http.load_gate import detailed_body
from hps.http.lookup_watch import LOOKUP_WAIT_S, GivenUp, LookupWatch
from hps.http.metrics import Metrics
from hps.http.reload_block import reload_block
from hps.runtime.compile_on_use import CompileEvent
from hps.server.loader import BothProgress, LoadProgress

if TYPE_CHECKING:
    from starlette.requests import Request

    from hps.http.workers_versions import VersionBoard, VersionLag
    from hps.server import HierarchicalParameterServer, LoadedModel

log = logging.getLogger("hps.http")
T = TypeVar("T")

#: default limit of a request body: 16 MiB (2 M binary keys)
#: what a printed hint adds when the server needs a token (`hps serve`, its workers)
TOKEN_HINT = " (with HPS_TOKEN holding the server's token)"
DEFAULT_MAX_BODY_BYTES = 16 << 20
#: default hard bound of the admission queue (lookups waiting for or on a lookup thread),
#: per lookup thread. The queueing delay decides first (hps/http/admission.py); this bound
#: only holds when the delay cannot be measured.
QUEUED_LOOKUPS_PER_THREAD = 16
#: ... and never fewer than this in all
MIN_QUEUED_LOOKUPS = 32
#: default floor of the admission queue per lookup thread: below it no lookup is shed.
#: A handful of clients that wait for each answer cannot overload the server; with a
#: slow tier the delay alone shed them (4 such clients, while Redis restarted under
#: them, got 503s from a 3 ms target with 2 lookup threads; the soak's 8 did with a
#: floor of 4).
ADMITTED_LOOKUPS_PER_THREAD = 4
#: ... and never fewer than this in all
MIN_ADMITTED_LOOKUPS = 8
#: the floor per lookup thread while the server sheds (a refusal within the last second):
#: each thread's own lookup and one waiting keep it busy, more only queue
#: (hps/http/admission.py)
SHEDDING_LOOKUPS_PER_THREAD = 2
#: ... and never fewer than this in all
MIN_SHEDDING_LOOKUPS = 4
#: the header a client gives its deadline in: milliseconds from when the server has the
#: request's headers
DEADLINE_HEADER = "x-hps-deadline-ms"

#: Host values `check_client` remembers as the server's (its own names with each port
#: and spelling clients use: a handful)
_HOSTS_REMEMBERED = 64

#: default size of the lookup thread pool when a tier is on the network or on disk:
#: enough to overlap round trips, few enough that lookups do not fight over the GIL
DEFAULT_LOOKUP_THREADS = 2


def auto_lookup_threads(server: HierarchicalParameterServer) -> int:
    """0 (lookups on the event loop) when every tier is in process memory, else the pool.

    An in-memory lookup (the hash map tier, no persistent tier) is a short run of compiled
    code, and with a GPU cache over it a short run of launches and a wait of tens of µs
    for the device; handing it to a thread and back costs a good part of what it does.
    On the loaded 2-core test machine, one client alternating between a server with a
    pool of 2 and one without: p50 of a 1,024-key dim-64 binary lookup 1.61 → 1.39 ms.
    With a GPU cache over it (2,000-key dim-64 lookups from 1, 2, 4 and 8 client
    processes, `hps bench http --gpu`, on the loop against a pool of 2 on one machine):
    1-17% more keys/s on an H100, 8-35% on an H200 (docs/gpu-latency.md). Redis and
    RocksDB wait on I/O and must not stall it.
    """
    volatile, persistent = server.tiers.volatile, server.tiers.persistent
    in_memory = volatile is not None and volatile.name == "hash_map" and persistent is None
    return 0 if in_memory else DEFAULT_LOOKUP_THREADS


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ServiceState:
    """The shared state of one app (one per `create_app` call)."""

    server: HierarchicalParameterServer
    metrics: Metrics
    token: str | None
    host: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    lookup_threads: int | None = None  # None: auto_lookup_threads(server)
    on_ready: Callable[[], None] | None = None
    #: called with a model's name and what went wrong when it fails to load at start
    on_failed: Callable[[str, str], None] | None = None
    #: a model's name → a context whose LoadProgress hears that model's load, beside the
    #: metrics (`hps serve` shows it on the terminal); None: the metrics alone
    load_progress: Callable[[str], AbstractContextManager[LoadProgress]] | None = None
    #: the hard bound of lookups that may wait for or run on the lookup threads (see
    #: `admit`); None: QUEUED_LOOKUPS_PER_THREAD per lookup thread, at least
    #: MIN_QUEUED_LOOKUPS
    max_queued_lookups: int | None = None
    #: the queueing delay an admitted lookup may meet (hps/http/admission.py)
    queue_target_s: float = TARGET_DELAY_S
    #: below this many lookups none is shed; None: ADMITTED_LOOKUPS_PER_THREAD per
    #: lookup thread, at least MIN_ADMITTED_LOOKUPS
    min_queued_lookups: int | None = None
    #: where models added over HTTP may be read from (normalised; see roots.py)
    allowed_roots: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    #: the config file the server was started with (absolute), read again by a reload
    #: without sources; None: it was started from a config object
    config_file: str | None = None
    loader: threading.Thread | None = None
    #: the configured models' first loads are over (served or failed): a compile outside
    #: a load from now on is a lookup's after ready (`heard_compile`)
    initial_loads_done: bool = False
    executor: ThreadPoolExecutor = field(init=False)
    admission: Admission = field(init=False)
    #: the lookups on the lookup threads, none waited for past its limit
    lookups: LookupWatch = field(default_factory=LookupWatch)
    #: Host names admin routes accept (see guards.py)
    admin_hosts: frozenset[str] = field(init=False)
    #: origins of `http.allowed_hosts` admin routes accept besides the server's own
    admin_origins: frozenset[tuple[str, str, int]] = field(init=False)
    #: Host header values seen to name the server (check_client's shortcut; bounded)
    _hosts_seen: set[str] = field(init=False, default_factory=set)
    #: under `hps serve --workers N`, the versions every worker serves beside the
    #: server's (hps/http/workers_versions.py; the worker's app sets it); None: one process
    versions: VersionBoard | None = None

    def __post_init__(self) -> None:
        if self.lookup_threads is None:
            self.lookup_threads = auto_lookup_threads(self.server)
        self.executor = ThreadPoolExecutor(max(1, self.lookup_threads),
                                           thread_name_prefix="hps-lookup")
        if self.max_queued_lookups is None:
            self.max_queued_lookups = max(MIN_QUEUED_LOOKUPS,
                                          QUEUED_LOOKUPS_PER_THREAD * self.lookup_threads)
        if self.min_queued_lookups is None:
            self.min_queued_lookups = max(MIN_ADMITTED_LOOKUPS,
                                          ADMITTED_LOOKUPS_PER_THREAD * self.lookup_threads)
        self.admission = Admission(self.lookup_threads, self.max_queued_lookups,
                                   self.queue_target_s, floor=self.min_queued_lookups,
                                   shedding_floor=max(
                                       MIN_SHEDDING_LOOKUPS,
                                       SHEDDING_LOOKUPS_PER_THREAD * self.lookup_threads),
                                   on_shed=self.metrics.shed.inc,
                                   on_early_answer=self.metrics.errors.labels(
                                       Overloaded.kind, str(Overloaded.status)).inc)
        self.admin_hosts = allowed_hosts(self.server.config, self.host)
        self.admin_origins = allowed_origins(self.server.config)

    # -- admission: the one rule of every lookup route, on every path to it ---------------

    @property
    def queued_lookups(self) -> int:
        """Lookups admitted and not answered yet (waiting for or on a lookup thread)."""
        return self.admission.queued

    def admit(self, headers: Mapping[str, str]) -> float | None:
        """Before a lookup's body is read: Overloaded (503, Retry-After) when the admission
        rule sheds it (hps/http/admission.py), else the request's deadline
        (`time.monotonic()` seconds; None without `X-HPS-Deadline-Ms`). Every hot route's
        handler calls it, so the general path and both shortcuts (`hot_routes.py`,
        `direct.py`) apply the same rule."""
        admission = self.admission
        if admission.shed_now():
            raise Overloaded(SHED_MESSAGE, headers={"Retry-After": admission.count_shed()})
        given = headers.get(DEADLINE_HEADER)
        if given is None:
            return None
        ms = parse_length(given.strip())
        if ms is None:
            raise BadBody(f"X-HPS-Deadline-Ms {given!r} is not a whole number of "
                          "milliseconds")
        return time.monotonic() + ms / 1000.0

    def check_deadline(self, deadline: float | None) -> None:
        """DeadlineExceeded (504) once `deadline` has passed."""
        if deadline is not None and time.monotonic() >= deadline:
            self.metrics.expired.inc()
            raise DeadlineExceeded("the request's deadline (X-HPS-Deadline-Ms) passed "
                                   "before its answer was ready")

    async def run_lookup(self, fn: Callable[..., T], *args: Any,
                         deadline: float | None = None) -> T:
        """`fn(*args)` on the lookup thread pool; with `lookup_threads` 0, right here on
        the event loop (no thread handoff: for in-memory tiers, whose lookups are short
        compiled code, this is the fastest; a network or disk tier would stall the loop).
        Counted in the admission queue while it waits and runs; not started, and not
        answered, once `deadline` has passed (504 rather than served late). On the pool,
        never waited for past LOOKUP_WAIT_S: LookupStalled (503) then (lookup_watch.py)."""
        self.check_deadline(deadline)
        if self.lookup_threads == 0:
            return fn(*args)
        admission = self.admission
        admission.enter()
        result: T | None = None
        try:
            result = await self.lookups.run(self.executor, deadline, admission.run,
                                            deadline, fn, *args)
        except Expired:
            pass  # the deadline has passed: check_deadline raises
        except GivenUp:
            self.check_deadline(deadline)
            raise LookupStalled(
                f"the lookup did not return within {LOOKUP_WAIT_S:.0f}s: a lookup thread is "
                "held by something that does not end; retry after Retry-After seconds",
                headers={"Retry-After": "1"}) from None
        finally:
            admission.leave()
        self.check_deadline(deadline)
        return result  # type: ignore[return-value]  # None only past the deadline (raised)

    # -- auth ---------------------------------------------------------------------------

    @property
    def admin_open(self) -> bool:
        """Admin routes are open without a token only on a loopback-bound server."""
        return self.token is None and is_loopback(self.host)

    def check_admin(self, headers: Mapping[str, str], scheme: str = "http",
                    port: int | None = None) -> None:
        """Raise unless an admin request may go on: token (when set, or the server is
        bound to loopback), then Host/Origin and content type (`guards.py`; `scheme` and
        `port`: where the request came in, which an Origin must match)."""
        if self.token is None and not self.admin_open:
            raise Forbidden(
                f"admin routes are refused on a server bound to {self.host} without a "
                "token: start it with --token (or HPS_TOKEN), or bind it to 127.0.0.1")
        self.check_token(headers.get("authorization"))
        check_admin_request(headers, self.admin_hosts, self.admin_origins, scheme, port)

    def check_client(self, headers: Mapping[str, str]) -> None:
        """Raise unless a request of a route the token guards may go on: the token when
        one is set, else `check_own_host`."""
        self.check_token(headers.get("authorization"))
        self.check_own_host(headers)

    def check_own_host(self, headers: Mapping[str, str]) -> None:
        """On a loopback server without a token, HostNotAllowed (403) unless the Host
        names the server (`guards.check_host`): nothing else stops a page whose DNS name
        was rebound to 127.0.0.1 from reading what the server serves. With a token the
        token guards; bound to the network without one, reads are open by choice."""
        if not self.admin_open:
            return
        host = headers.get("host")
        if host in self._hosts_seen:  # the hot routes' common case: one set lookup
            return
        check_host(headers, self.admin_hosts)
        if host is not None and len(self._hosts_seen) < _HOSTS_REMEMBERED:
            self._hosts_seen.add(host)

    def check_token(self, authorization: str | None) -> None:
        """Unauthorized unless no token is set or `authorization` is 'Bearer <token>'."""
        if self.token is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized(
                "this server needs 'Authorization: Bearer <token>' (its --token / HPS_TOKEN)",
                headers={"WWW-Authenticate": "Bearer"})
        # header values arrive decoded as Latin-1: their bytes are what the client sent,
        # and a token with non-ASCII characters is sent (and compared) as UTF-8
        sent = given.strip().encode("latin-1", errors="replace")
        if not hmac.compare_digest(sent, self.token.encode("utf-8")):
            raise Unauthorized("wrong token", headers={"WWW-Authenticate": "Bearer"})

    # -- errors -------------------------------------------------------------------------

    def error_response(self, request: Request, exc: Exception,
                       body: ErrorBody = error_body) -> JSONResponse:
        """The JSON answer to an error (counted by kind in the metrics); `body` makes the
        protocol's error body from (kind, message)."""
        status = status_of(exc)
        kind = kind_of(exc)
        if kind == "internal":
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
            message = f"internal error: {type(exc).__name__}"
        else:
            if status >= 500 and not isinstance(exc, (Overloaded, DeadlineExceeded)):
                # (refusals under load are counted in the metrics: a line each would
                # flood the log and spend the CPU the refusal saves)
                log.warning("%s %s: %s", request.method, request.url.path, exc)
            message = str(exc)
        headers = exc.headers if isinstance(exc, ApiError) else None
        return self.answer(status, kind, message, headers, detailed_body(exc, body))

    def answer(self, status: int, kind: str, message: str,
               headers: dict[str, str] | None = None,
               body: ErrorBody = error_body) -> JSONResponse:
        self.metrics.errors.labels(kind, str(status)).inc()
        return JSONResponse(body(kind, message), status_code=status, headers=headers)

    # -- models -------------------------------------------------------------------------

    def configured(self) -> list[str]:
        return [m.model for m in self.server.config.models]

    def pending(self, loaded: Collection[str] | None = None) -> list[str]:
        """The configured models neither loaded nor failed; of `loaded` (a snapshot of
        the server's models) when given."""
        loaded = self.server.models if loaded is None else loaded
        return [n for n in self.configured() if n not in loaded and n not in self.failed]

    def ready(self, loaded: Collection[str] | None = None) -> bool:
        loaded = self.server.models if loaded is None else loaded
        return all(n in loaded for n in self.configured())

    def readiness(self, loaded: Collection[str]) -> tuple[list[str], list[str], bool]:
        """(pending, failed, every configured model loaded) of `loaded`, from one read of
        the configured models and of the failed ones: read apart, a model added between
        the reads (a workers' server computes its config anew on each read) was in
        neither list while the server said not ready ("models not served yet: starting",
        tests/http/test_workers_leader_kill.py, killing the leader mid-add)."""
        configured, failed = self.configured(), dict(self.failed)
        pending = [n for n in configured if n not in loaded and n not in failed]
        return pending, sorted(failed), all(n in loaded for n in configured)

    def version_lags(self, model: str | None = None) -> list[VersionLag]:
        """The live workers that serve a version of a model (of `model`) other than the
        server's: the server is not ready while there is one. [] in one process
        (`versions` is None)."""
        return [] if self.versions is None else self.versions.lags(model)

    def model(self, name: str) -> LoadedModel:
        """The loaded model; ModelNotReady if it is configured but not loaded."""
        try:
            return self.server.model(name)
        except UnknownModelError:
            if name in self.failed:
                raise ModelNotReady(f"model {name!r} failed to load: {self.failed[name]}",
                                    kind="model_failed") from None
            if name in self.configured():
                raise ModelNotReady(f"model {name!r} is still loading",
                                    headers={"Retry-After": "1"}) from None
            raise

    def model_config(self, name: str) -> ModelConfig:
        """The config a reload of `name` without sources starts from: the model's block
        of the config file read again, with what a reload body named and what is in no
        file taking precedence as hps/http/reload_block.py says. UnknownModelError when
        there is none; ConfigError when the file is no valid config now."""
        loaded = self.server.models.get(name)
        block = reload_block(name, config_file=self.config_file, started=self.server.config,
                             loaded=loaded.config if loaded is not None else None)
        if block is not None:
            return block
        known = ", ".join(self.configured())
        raise UnknownModelError(f"no model named {name!r} in the config (models: {known})")

    def load(self, model: ModelConfig, *, allow_empty: bool = False,
             allow_shrink: bool = False) -> LoadedModel:
        """Load or reload one model (blocking); records the outcome in metrics.
        `allow_empty`, `allow_shrink`: the load gate's opt-ins for this load alone."""
        name = model.model
        try:
            with self._progress(name) as progress:
                loaded = self.server.load_model(model, progress=progress,
                                                allow_empty=allow_empty,
                                                allow_shrink=allow_shrink)
        except Exception as exc:
            kind = exc.kind if isinstance(exc, HPSError) else "internal"
            self.metrics.load_failures.labels(name, kind).inc()
            if name not in self.server.models:
                self.failed[name] = str(exc)
                self.metrics.model_ready.labels(name).set(0)
            raise
        self.failed.pop(name, None)
        self.metrics.model_ready.labels(name).set(1)
        self.metrics.model_loads.labels(name).inc()
        return loaded

    def add(self, model: ModelConfig) -> LoadedModel:
        """Load a model that is not served yet (blocking); the others keep serving."""
        with self._progress(model.model) as progress:
            loaded = self.server.add_model(model, progress=progress)
        self.failed.pop(model.model, None)
        self.metrics.model_ready.labels(model.model).set(1)
        return loaded

    @contextlib.contextmanager
    def _progress(self, model: str) -> Iterator[LoadProgress]:
        """The progress of one load of `model`: the metrics', and `load_progress`'s."""
        counted = self.metrics.progress(model)
        if self.load_progress is None:
            yield counted
            return
        with self.load_progress(model) as shown:
            yield BothProgress(counted, shown)

    def remove(self, name: str) -> None:
        """Stop serving model `name` (blocking until it is out of the registry)."""
        self.server.unload_model(name)
        self.metrics.forget_model(name)

    def heard_compile(self, event: CompileEvent) -> None:
        """Count a compile that ended (a compile_events listener, for the app's life) in
        `hps_compiles_total` by phase: load, else before or after the initial loads."""
        if event.seconds is None:
            return
        phase = ("load" if event.during_load else
                 "after_ready" if self.initial_loads_done else "before_ready")
        self.metrics.compiles.labels(phase).inc()
        if phase == "after_ready":  # a path no warm-up ran: the log says which one
            log.warning("%s %s for %s after ready, in %.2f s: a path the models' warm-ups "
                        "did not run", "read from numba's cache" if event.from_cache
                        else "compiled", event.function, event.signature, event.seconds)

    def start_loading(self) -> None:
        """Load every configured model not loaded yet, in a background thread."""
        for name in self.configured():
            self.metrics.model_ready.labels(name).set(1 if name in self.server.models else 0)
        todo = [m for m in self.server.config.models if m.model not in self.server.models]
        if not todo:
            self.initial_loads_done = True
            self._announce_ready()
            return
        self.loader = threading.Thread(target=self._load_all, args=(todo,),
                                       name="hps-model-loader", daemon=True)
        self.loader.start()

    def _load_all(self, models: list[ModelConfig]) -> None:
        started = time.perf_counter()
        for model in models:
            try:
                self.load(model)
            except Exception as exc:  # recorded: /readyz reports it, the others still load
                if self.on_failed is None or not isinstance(exc, HPSError):
                    log.error("loading model %r failed: %s", model.model, exc,
                              exc_info=not isinstance(exc, HPSError))
                if self.on_failed is not None:
                    try:
                        self.on_failed(model.model, str(exc))
                    except Exception:  # a print hook must not take the loader down
                        log.exception("on_failed hook failed")
        self.initial_loads_done = True
        if self.ready():
            log.info("all models loaded in %.1fs", time.perf_counter() - started)
            self._announce_ready()

    def _announce_ready(self) -> None:
        if self.on_ready is not None:
            try:
                self.on_ready()
            except Exception:  # a print hook must not take the loader down
                log.exception("on_ready hook failed")
