"""Redis and Redis Cluster volatile tier, in HugeCTR's layout, that survives Redis failures.

Layout (HugeCTR's, so a Redis filled by HugeCTR is served as it is and HugeCTR reads what
we write). HugeCTR's `RedisClusterBackend` (HugeCTR/src/hps/redis_backend.cpp, v23–v24.06)
names a partition's hashes with

    make_hkey(table_name, part, suffix) = "hps_et{" + table_name + "/p" + part + "}" + suffix

and `HierParameterServer::update_database_per_model` passes as `table_name` the tag
`HierParameterServerBase::make_tag_name(model, table)` = "hps_et.<model>.<table>". So the
tag inside the braces is the whole storage name, prefix included:

    hps_et{hps_et.<model>.<table>/p<N>}v    fields: raw 8-byte little-endian keys
                                            values: raw float32 rows (dim × 4 bytes)
    hps_et{hps_et.<model>.<table>/p<N>}t    eviction metadata, same fields:
                                            evict_least_used: access count, ASCII decimal
                                              (HugeCTR bumps it with HINCRBY, 1 per insert
                                              and per fetch)
                                            evict_oldest: time_t seconds, raw 8 bytes LE
                                            evict_random: no metadata

with N = rrxmrrxmsx_0(key) % num_partitions (`hps.db.partition`). The braces make Redis
Cluster hash only "<tag>/p<N>", so both hashes of a partition live on one node.

Requests are RESP packed with NumPy (a fixed-width record per key), never built key by key
in Python: a fetch groups the keys by partition (argsort + bincount), sends one `HMGET` per
partition and `max_batch_size` chunk, to every node at once (send all, then read all, so the
nodes work in parallel), and decodes each reply while later ones are still on the wire
(`b"".join` + `np.frombuffer`, then one scatter per reply).

Failures. Every network failure (refused, reset, socket timeout, cluster failover, server
loading) is counted in `failures[kind]`, opens a circuit breaker and is logged once per
episode (logger "hps.db.redis"). While the breaker is open every call raises
`TierUnavailableError` at once, without touching the network; a background thread
reconnects with exponential backoff (rediscovering the cluster's slots) and closes the
breaker when every master answers. Redis being down when the tier starts is such an
episode, not an error. Wrong credentials or TLS settings raise `TierSetupError` at start.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.config import UNBOUNDED, VolatileDBConfig
from hps.db.base import TABLE_PREFIX, Tier, as_keys, as_vectors
from hps.errors import (
    LookupInputError,
    MissingExtraError,
    TierError,
    TierSetupError,
    TierUnavailableError,
)

try:
    import redis
    from redis import exceptions as rex
    from redis.backoff import NoBackoff
    from redis.connection import Connection, SSLConnection
    from redis.crc import key_slot
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

log = logging.getLogger("hps.db.redis")

NUM_SLOTS = 16384
_KEY_BYTES = 8
_FIELD_WIDTH = 14  # b"$8\r\n" + 8 key bytes + b"\r\n"
_WINDOW_KEYS = 1 << 18  # keys per insert round trip: bounds the packed request in memory

# HugeCTR pipelines one HINCRBY per key; one script call per partition chunk writes the
# same counters (ASCII integers in the `t` hash) without a reply per key.
_LFU_SCRIPT = b"for i=1,#ARGV do redis.call('HINCRBY',KEYS[1],ARGV[i],1) end return #ARGV"


def value_hash(table: str, partition: int) -> str:
    """Name of the hash holding the rows of `partition` of `table` (HugeCTR's layout)."""
    return f"{TABLE_PREFIX}{{{table}/p{partition}}}v"


def meta_hash(table: str, partition: int) -> str:
    """Name of the companion hash with the eviction metadata of the same partition."""
    return f"{TABLE_PREFIX}{{{table}/p{partition}}}t"


# -- RESP packing ---------------------------------------------------------------------------


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _head(num_args: int, *leading: bytes) -> bytes:
    """RESP array header for a command of `num_args` arguments, with its leading ones."""
    return b"*%d\r\n" % num_args + b"".join(_bulk(a) for a in leading)


def _command(*args: bytes) -> bytes:
    return _head(len(args), *args)


def _key_bytes(keys: np.ndarray) -> np.ndarray:
    """uint8[n, 8]: the keys as raw little-endian int64, HugeCTR's field format."""
    return np.ascontiguousarray(keys, dtype="<i8").view(np.uint8).reshape(-1, _KEY_BYTES)


_FIELD_TEMPLATE = np.frombuffer(b"$8\r\n" + bytes(8) + b"\r\n", dtype=np.uint8)


def _pack_fields(keys: np.ndarray) -> np.ndarray:
    """uint8[n * 14]: the keys as consecutive RESP bulk strings, one fixed record each."""
    out = np.empty((keys.size, _FIELD_WIDTH), dtype=np.uint8)
    out[:] = _FIELD_TEMPLATE
    out[:, 4:12] = _key_bytes(keys)
    return out.reshape(-1)


def _pack_pairs(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int]:
    """(uint8[n * width], width): field/value pairs as RESP bulk strings.

    `values` is uint8[n, L]: every value has the same length, so every pair is a record of
    the same width and the whole request is one strided NumPy fill.
    """
    n, length = values.shape
    vhead = np.frombuffer(b"$%d\r\n" % length, dtype=np.uint8)
    width = _FIELD_WIDTH + vhead.size + length + 2
    out = np.empty((n, width), dtype=np.uint8)
    out[:, :_FIELD_WIDTH] = _FIELD_TEMPLATE
    out[:, 4:12] = _key_bytes(keys)
    at = _FIELD_WIDTH
    out[:, at:at + vhead.size] = vhead
    at += vhead.size
    out[:, at:at + length] = values
    out[:, -2] = 13
    out[:, -1] = 10
    return out.reshape(-1), width


def _parse_keys(fields: Sequence[bytes]) -> np.ndarray:
    """int64 keys from raw 8-byte fields; fields of another length (not ours) are skipped."""
    if not fields:
        return np.empty(0, dtype=np.int64)
    data = b"".join(fields)
    if len(data) != _KEY_BYTES * len(fields):
        ok = np.fromiter(map(len, fields), dtype=np.int64, count=len(fields)) == _KEY_BYTES
        data = b"".join(np.asarray(fields, dtype=object)[ok].tolist())
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


def _parse_times(values: Sequence[bytes]) -> np.ndarray:
    """HugeCTR's evict_oldest metadata: raw 8-byte time_t; anything else reads as 0."""
    n = len(values)
    data = b"".join(values)
    if len(data) == _KEY_BYTES * n:
        return np.frombuffer(data, dtype="<i8").astype(np.int64)
    out = np.zeros(n, dtype=np.int64)
    ok = np.fromiter(map(len, values), dtype=np.int64, count=n) == _KEY_BYTES
    out[ok] = np.frombuffer(b"".join(np.asarray(values, dtype=object)[ok].tolist()), dtype="<i8")
    return out


def _parse_counts(values: Sequence[bytes]) -> np.ndarray:
    """HugeCTR's evict_least_used metadata: ASCII decimal counts; anything else reads as 0."""
    out = np.zeros(len(values), dtype=np.int64)
    if not values:
        return out
    text = np.asarray(values, dtype=np.bytes_)
    ok = np.char.isdigit(text) & (np.char.str_len(text) <= 18)
    out[ok] = text[ok].astype(np.int64)
    return out


def _eviction_scores(
    keys: np.ndarray, metadata: Sequence[bytes], policy: str
) -> tuple[np.ndarray, np.ndarray]:
    """(score per key, stale metadata keys) of one partition, from its HGETALL of `t`.

    Lower scores go first: the access count (evict_least_used) or the time
    (evict_oldest); keys without metadata score 0. Stale: keys with metadata but no row.
    """
    meta_keys = _parse_keys(metadata[0::2])
    values = metadata[1::2]
    if meta_keys.size != len(values) or not values:  # none, or fields that are not keys
        return np.zeros(keys.size, dtype=np.int64), np.empty(0, dtype=np.int64)
    meta_score = _parse_counts(values) if policy == "evict_least_used" else _parse_times(values)
    sorter = np.argsort(meta_keys, kind="stable")
    meta_keys, meta_score = meta_keys[sorter], meta_score[sorter]
    at = np.minimum(np.searchsorted(meta_keys, keys), meta_keys.size - 1)
    score = np.where(meta_keys[at] == keys, meta_score[at], 0)
    stale = meta_keys[~np.isin(meta_keys, keys)]
    return score, stale


# -- keys grouped by partition --------------------------------------------------------------


@dataclass(frozen=True)
class _Grouped:
    """Keys sorted by partition: `keys[i] == original[order[i]]`, partition p spans
    `starts[p]:starts[p + 1]`."""

    order: np.ndarray
    keys: np.ndarray
    starts: np.ndarray

    def chunks(self, max_batch: int) -> Iterator[tuple[int, int, int]]:
        """(partition, start, stop) of every non-empty partition, cut at `max_batch` keys.

        Loops over partitions and chunks, never over keys.
        """
        starts = self.starts
        for p in np.flatnonzero(np.diff(starts)).tolist():
            a, end = int(starts[p]), int(starts[p + 1])
            while a < end:
                b = min(a + max_batch, end)
                yield p, a, b
                a = b


def _group(keys: np.ndarray, num_partitions: int) -> _Grouped:
    from hps.db.partition import partition_of

    parts = np.asarray(partition_of(keys, num_partitions), dtype=np.int64)
    order = np.argsort(parts, kind="stable")
    starts = np.zeros(num_partitions + 1, dtype=np.int64)
    np.cumsum(np.bincount(parts, minlength=num_partitions), out=starts[1:])
    return _Grouped(order=order, keys=keys[order], starts=starts)


@dataclass(frozen=True)
class _Layout:
    """Hash names and cluster slots of one table's partitions."""

    values: list[bytes]
    metas: list[bytes]
    slots: np.ndarray


def _layout(table: str, num_partitions: int) -> _Layout:
    values = [value_hash(table, p).encode() for p in range(num_partitions)]
    metas = [meta_hash(table, p).encode() for p in range(num_partitions)]
    slots = np.array([key_slot(v) for v in values], dtype=np.int64)
    return _Layout(values=values, metas=metas, slots=slots)


# -- connections ----------------------------------------------------------------------------


class _PoolExhausted(Exception):
    """Every connection to a node stayed busy: the client is saturated, Redis is not down."""


if redis is not None:

    class _TLSConnection(SSLConnection):
        """SSLConnection that sends `server_name` as SNI (and checks the certificate
        against it) instead of the host it dials, as HugeCTR's `tls.sni` did."""

        def __init__(self, *, server_name: str | None = None, **kwargs: Any) -> None:
            self._server_name = server_name
            super().__init__(**kwargs)

        def _wrap_socket_with_ssl(self, sock: Any) -> Any:
            host = self.host
            if self._server_name:
                self.host = self._server_name
            try:
                return super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]
            finally:
                self.host = host


class _Node:
    """One Redis server: a bounded LIFO pool of redis-py connections.

    A connection goes back to the pool only after every reply it was sent was read;
    anything else (an error, a timeout) disconnects it, so a pooled connection is clean.
    """

    def __init__(self, host: str, port: int, kwargs: dict[str, Any], size: int) -> None:
        self.host = host
        self.port = port
        self._kwargs = kwargs
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._free = threading.BoundedSemaphore(size)
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def acquire(self, wait: float) -> Any:
        if not self._free.acquire(timeout=wait):
            raise _PoolExhausted(f"all connections to {self.address} stayed busy for {wait} s")
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            kwargs = dict(self._kwargs)
            cls = kwargs.pop("connection_class")
            conn = cls(host=self.host, port=self.port, **kwargs)
        try:
            conn.connect()
        except BaseException:
            self.release(conn, broken=True)
            raise
        return conn

    def release(self, conn: Any, *, broken: bool = False) -> None:
        if broken or self._closed:
            conn.disconnect()
        with self._lock:
            self._idle.append(conn)
        self._free.release()

    def reset(self) -> None:
        """Drop idle connections: after an outage they may point at a dead socket."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()
            with self._lock:
                self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        self.reset()

    def call(self, wait: float, *args: bytes) -> Any:
        """One command, one reply (control commands only: PING, INFO, CLUSTER SLOTS)."""
        conn = self.acquire(wait)
        try:
            conn.send_packed_command([_command(*args)], check_health=False)
            reply = conn.read_response()
        except BaseException:
            self.release(conn, broken=True)
            raise
        self.release(conn)
        return reply


@dataclass(frozen=True)
class _Topology:
    """Who serves what: the master nodes, and for a cluster the node of every slot."""

    cluster: bool
    nodes: list[_Node]
    slot_node: np.ndarray  # int64[NUM_SLOTS], index into nodes
    version: str

    def node_of(self, layout: _Layout) -> np.ndarray:
        """Node index of every partition of a table."""
        return np.asarray(self.slot_node[layout.slots])


@dataclass
class _Cmd:
    """One packed command for one node, and what to do with its reply."""

    node: int
    parts: list[Any]
    on_reply: Callable[[Any], None] | None = None
    best_effort: bool = False  # a metadata write: its error reply must not fail the call


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, (rex.AuthenticationError, rex.NoPermissionError)):
        return "auth"
    if isinstance(exc, (rex.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, rex.BusyLoadingError):
        return "loading"
    if isinstance(exc, (rex.MovedError, rex.AskError, rex.TryAgainError, rex.ClusterDownError,
                        rex.MasterDownError, rex.ReadOnlyError, _ClusterIncomplete)):
        return "cluster"
    return "connection"


def _is_tls_error(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ssl.SSLError) or "SSL" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class _ClusterIncomplete(Exception):
    """CLUSTER SLOTS does not cover every slot (a failover is under way)."""


def _redirects() -> tuple[type[BaseException], ...]:
    return (rex.MovedError, rex.AskError, rex.TryAgainError, rex.ClusterDownError,
            rex.MasterDownError, rex.ReadOnlyError, rex.BusyLoadingError)


def _network_errors() -> tuple[type[BaseException], ...]:
    # AuthenticationError is a redis ConnectionError: a password changed under a running
    # tier makes Redis unavailable to it, like an outage (it was checked at start).
    return (rex.ConnectionError, rex.TimeoutError, OSError, _ClusterIncomplete)


# -- circuit breaker ------------------------------------------------------------------------


class _Breaker:
    """Closed: calls go to Redis. Open: calls fail at once while a background thread
    reconnects with exponential backoff (with jitter) and closes it on success."""

    def __init__(
        self,
        failures: dict[str, int],
        probe: Callable[[], None],
        backoff: float,
        backoff_max: float,
    ) -> None:
        self._failures = failures
        self._probe = probe
        self._backoff = backoff
        self._backoff_max = backoff_max
        self._lock = threading.Lock()
        self._open = False
        self._since = 0.0
        self._reason = ""
        self._rejected = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.episodes = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def count(self, kind: str) -> None:
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1

    def check(self) -> None:
        """Raise TierUnavailableError, without network, while the breaker is open."""
        if not self._open:
            return
        with self._lock:
            if not self._open:
                return
            self._failures["rejected"] = self._failures.get("rejected", 0) + 1
            self._rejected += 1
            age = time.monotonic() - self._since
            reason = self._reason
        raise TierUnavailableError(
            f"redis tier unavailable for {age:.1f} s ({reason}); reconnecting in the background"
        )

    def trip(self, kind: str, exc: BaseException) -> None:
        """Count a failure; the first of an episode opens the breaker and is logged."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            if self._open or self._stop.is_set():
                return
            self._open = True
            self._since = time.monotonic()
            self._reason = f"{kind}: {exc}"
            self._rejected = 0
            self.episodes += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._reconnect, name="hps-redis-reconnect", daemon=True
                )
                self._thread.start()
        log.warning(
            "redis tier unavailable (%s: %s); lookups fall through to the next tier, "
            "reconnecting with backoff", kind, exc,
        )

    def _reconnect(self) -> None:
        delay = self._backoff
        last = ""
        while not self._stop.wait(delay * random.uniform(0.8, 1.2)):
            try:
                self._probe()
            except Exception as exc:  # noqa: BLE001 - any failure means: try again later
                if isinstance(exc, TierSetupError) and str(exc) != last:
                    log.error("redis tier cannot reconnect: %s", exc)
                last = str(exc)
                log.debug("redis reconnect failed (%s); next try in %.2f s", exc, delay)
                delay = min(delay * 2.0, self._backoff_max)
                continue
            with self._lock:
                self._open = False
                self._thread = None
                age = time.monotonic() - self._since
                rejected = self._rejected
            log.info(
                "redis tier is back after %.1f s (%d calls failed fast meanwhile)", age, rejected
            )
            return
        with self._lock:
            self._thread = None

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)


# -- background writes ----------------------------------------------------------------------

_STOP = object()


class _Worker:
    """One daemon thread draining a bounded queue; `submit` never blocks (False = full)."""

    def __init__(self, name: str, size: int, run: Callable[[Any], None]) -> None:
        import queue

        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._full = queue.Full
        self._name = name
        self._run = run
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, item: Any) -> bool:
        if self._closed:
            return False
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
        try:
            self._queue.put_nowait(item)
        except self._full:
            return False
        return True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._run(item)
            except TierUnavailableError as exc:
                log.debug("%s: background write skipped: %s", self._name, exc)
            except Exception:  # noqa: BLE001 - a background thread must not die
                log.exception("%s: background write failed", self._name)
            finally:
                self._queue.task_done()

    def wait_idle(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float) -> None:
        self._closed = True
        if self._thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except self._full:
            log.warning("%s: %d queued writes dropped at close", self._name,
                        self._queue.qsize())
            return
        self._thread.join(timeout=timeout)


# -- the tier -------------------------------------------------------------------------------


def _parse_address(address: str) -> list[tuple[str, int]]:
    seeds = []
    for item in address.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise TierSetupError(
                f"volatile_db.address {address!r}: {item!r} is not host:port "
                "(expected a comma list such as '127.0.0.1:7000,127.0.0.1:7001')"
            )
        seeds.append((host, int(port)))
    if not seeds:
        raise TierSetupError(f"volatile_db.address {address!r} names no Redis server")
    return seeds


def _quiet_handshake() -> dict[str, Any]:
    """Connection options of recent redis-py: RESP2 (redis-py 8 would speak RESP3), and
    no extra round trips on connect (CLIENT SETINFO, CLIENT MAINT_NOTIFICATIONS). Older
    versions do not know these options and behave so anyway."""
    import inspect

    params: set[str] = set()
    for cls in Connection.__mro__:  # Connection passes **kwargs on to its bases
        init = cls.__dict__.get("__init__")
        if init is not None:
            params.update(inspect.signature(init).parameters)
    extra: dict[str, Any] = {}
    if "protocol" in params:
        extra["protocol"] = 2  # RESP2: every Redis speaks it, and HGETALL stays a flat list
    if "driver_info" in params:
        extra["driver_info"] = None
    if "maint_notifications_config" in params:
        try:
            from redis.maint_notifications import MaintNotificationsConfig

            extra["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
        except ImportError:  # pragma: no cover - depends on the redis-py version
            pass
    return extra


def _connection_kwargs(config: VolatileDBConfig) -> dict[str, Any]:
    import os

    kwargs: dict[str, Any] = {
        "connection_class": Connection,
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "socket_keepalive": True,
        "retry": Retry(NoBackoff(), 0),  # we retry, with backoff, in one place: the breaker
        "client_name": "hps",
    }
    kwargs.update(_quiet_handshake())
    if config.password:
        kwargs["password"] = config.password
        if config.user_name and config.user_name != "default":
            kwargs["username"] = config.user_name
    elif config.user_name and config.user_name != "default":
        raise TierSetupError(
            f"volatile_db.user_name is {config.user_name!r} but volatile_db.password is empty: "
            "an ACL user needs its password"
        )
    if not config.enable_tls:
        return kwargs

    defaults = VolatileDBConfig()

    def tls_file(key: str, required: bool) -> str | None:
        path: str = getattr(config, key)
        if os.path.exists(path):
            return path
        if required or path != getattr(defaults, key):
            raise TierSetupError(
                f"volatile_db.{key} {path!r} does not exist (enable_tls is true)"
            )
        return None  # HugeCTR's default name and no such file: no client certificate

    ca = tls_file("tls_ca_certificate", required=True)
    cert = tls_file("tls_client_certificate", required=False)
    key = tls_file("tls_client_key", required=False)
    if (cert is None) != (key is None):
        raise TierSetupError(
            "volatile_db.tls_client_certificate and tls_client_key go together: "
            f"found only {cert or key!r}"
        )
    kwargs.update(
        connection_class=_TLSConnection,
        ssl_cert_reqs="required",
        ssl_check_hostname=True,
        ssl_certfile=cert,
        ssl_keyfile=key,
        server_name=config.tls_server_name_identification or None,
    )
    if ca is not None and os.path.isdir(ca):
        kwargs["ssl_ca_path"] = ca
    else:
        kwargs["ssl_ca_certs"] = ca
    return kwargs


class RedisTier(Tier):
    """The volatile tier on a Redis server or a Redis Cluster (detected from the server).

    `config.address` is a comma list of `host:port` seeds; the first one that answers says
    whether it is a cluster (`cluster_enabled` in INFO) and, if so, where every slot lives.

    Beyond the `Tier` contract:
    - `insert_async(table, keys, vectors)` queues an insert on a background thread (for
      `cache_missed_embeddings`): never blocks, drops and counts when the queue is full.
    - `failures`: failures by kind ("connection", "timeout", "cluster", "loading", "auth",
      "metadata", "pool", and "rejected" for calls failed fast while the breaker was open);
      `dropped`: keys whose background write was dropped ("insert", "metadata");
      `stats()` bundles them with the state for metrics.
    - `wait_idle(timeout)` waits for the background writes queued so far.

    `fetch`, `insert`, `remove`, `size` and `drop_table` raise `TierUnavailableError` when
    Redis cannot answer (at once while the breaker is open), `TierError` when Redis holds
    data that is not this table's layout (rows of another width, a key of another type).
    """

    name = "redis"

    def __init__(
        self, config: VolatileDBConfig, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__()
        if redis is None:
            raise MissingExtraError("redis", "redis", "the Redis volatile tier")
        self.config = config
        self.failures: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self._clock = clock
        self._seeds = _parse_address(config.address)
        self._kwargs = _connection_kwargs(config)
        self._nodes: dict[tuple[str, int], _Node] = {}
        self._nodes_lock = threading.Lock()
        self._topology: _Topology | None = None
        self._layouts: dict[str, _Layout] = {}
        self._pool_wait = max(10.0 * config.socket_timeout, 1.0)
        self._closed = False
        self._breaker = _Breaker(
            self.failures, self._reconnect, config.reconnect_backoff,
            max(config.reconnect_backoff_max, config.reconnect_backoff),
        )
        self._inserter = _Worker("hps-redis-insert", config.async_queue_size, self._run_insert)
        self._toucher = _Worker("hps-redis-metadata", config.async_queue_size, self._run_touch)
        try:
            self._connect()
        except TierSetupError:
            self._close_nodes()
            raise
        except _network_errors() as exc:
            if isinstance(exc, (rex.AuthenticationError, rex.NoPermissionError)):
                self._close_nodes()
                raise TierSetupError(self._auth_message(exc)) from exc
            if self.config.enable_tls and _is_tls_error(exc):
                self._close_nodes()
                raise TierSetupError(
                    f"TLS connection to Redis at {self.config.address} failed: {exc}. Check "
                    "volatile_db.enable_tls, tls_ca_certificate, tls_client_certificate, "
                    "tls_client_key and tls_server_name_identification"
                ) from exc
            self._breaker.trip(_failure_kind(exc), exc)

    # -- connection management ----------------------------------------------------------

    def _auth_message(self, exc: BaseException) -> str:
        user = self.config.user_name or "default"
        if not self.config.password:
            return (f"Redis at {self.config.address} requires authentication ({exc}): set "
                    "volatile_db.password (and volatile_db.user_name for an ACL user)")
        return (f"Redis at {self.config.address} refused user {user!r} with the configured "
                f"password ({exc}): check volatile_db.user_name and volatile_db.password")

    def _node(self, host: str, port: int) -> _Node:
        with self._nodes_lock:
            node = self._nodes.get((host, port))
            if node is None:
                node = _Node(host, port, self._kwargs, self.config.num_node_connections)
                self._nodes[(host, port)] = node
            return node

    def _discover(self, first: tuple[str, int] | None = None) -> _Topology:
        """Ask `first` (the node a MOVED reply named), then the seeds, then the nodes known
        so far, what serves the slots."""
        known = [(n.host, n.port) for n in self._topology.nodes] if self._topology else []
        candidates = list(dict.fromkeys(([first] if first else []) + self._seeds + known))
        last: BaseException | None = None
        for host, port in candidates:
            node = self._node(host, port)
            try:
                info = node.call(self.config.connect_timeout, b"INFO")
                fields = dict(
                    line.split(":", 1) for line in info.decode().splitlines() if ":" in line
                )
                version = fields.get("redis_version", "")
                if fields.get("cluster_enabled", "0").strip() != "1":
                    return _Topology(False, [node], np.zeros(NUM_SLOTS, dtype=np.int64), version)
                return self._cluster_topology(node, version)
            except (rex.AuthenticationError, rex.NoPermissionError):
                raise
            except _network_errors() as exc:
                last = exc
                if self.config.enable_tls and _is_tls_error(exc):
                    raise
        assert last is not None
        raise last

    def _cluster_topology(self, node: _Node, version: str) -> _Topology:
        entries = node.call(self.config.connect_timeout, b"CLUSTER", b"SLOTS")
        slot_node = np.full(NUM_SLOTS, -1, dtype=np.int64)
        nodes: list[_Node] = []
        index: dict[tuple[str, int], int] = {}
        for entry in entries:
            start, stop, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if master[0] else ""
            if host in ("", "?"):
                host = node.host  # no announced endpoint: the node we asked knows it by ours
            addr = (host, int(master[1]))
            if addr not in index:
                index[addr] = len(nodes)
                nodes.append(self._node(*addr))
            slot_node[start:stop + 1] = index[addr]
        if (slot_node < 0).any():
            raise _ClusterIncomplete(
                f"cluster at {node.address} serves {int((slot_node >= 0).sum())} of "
                f"{NUM_SLOTS} slots"
            )
        return _Topology(True, nodes, slot_node, version)

    def _connect(self, first: tuple[str, int] | None = None) -> None:
        """Discover the topology and PING every master; swap it in when all answer."""
        topology = self._discover(first)
        for node in topology.nodes:
            node.call(self.config.connect_timeout, b"PING")
        self._topology = topology
        if topology.cluster:
            log.debug("redis cluster of %d masters: %s", len(topology.nodes),
                      ", ".join(n.address for n in topology.nodes))

    def _reconnect(self) -> None:
        if self._closed:
            raise TierUnavailableError("redis tier is closed")
        for node in list(self._nodes.values()):
            node.reset()
        try:
            self._connect()
        except (rex.AuthenticationError, rex.NoPermissionError) as exc:
            raise TierSetupError(self._auth_message(exc)) from exc

    def _unavailable(self, exc: BaseException, where: str) -> TierUnavailableError:
        if isinstance(exc, _PoolExhausted):
            self._breaker.count("pool")
            return TierUnavailableError(f"redis tier saturated: {exc}")
        kind = _failure_kind(exc)
        self._breaker.trip(kind, exc)
        return TierUnavailableError(f"redis tier: {kind} failure at {where}: {exc}")

    # -- round trips --------------------------------------------------------------------

    def _roundtrip(self, topology: _Topology, cmds: list[_Cmd]) -> BaseException | None:
        """Send every node its commands, then read every reply (the nodes work meanwhile).

        Returns the first redirect-type error reply (MOVED, ASK, CLUSTERDOWN, LOADING…),
        after reading all replies so that the connections stay clean; raises network
        errors, and TierError for other error replies.
        """
        by_node: dict[int, list[_Cmd]] = {}
        for cmd in cmds:
            by_node.setdefault(cmd.node, []).append(cmd)
        conns: dict[int, Any] = {}
        redirect: BaseException | None = None
        failure: BaseException | None = None
        try:
            for index, node_cmds in by_node.items():
                node = topology.nodes[index]
                conn = node.acquire(self._pool_wait)
                conns[index] = conn
                parts = [part for cmd in node_cmds for part in cmd.parts]
                if sum(memoryview(p).nbytes for p in parts) < (1 << 22):
                    parts = [b"".join(parts)]
                conn.send_packed_command(parts, check_health=False)
            for index, node_cmds in by_node.items():
                conn = conns[index]
                for cmd in node_cmds:
                    try:
                        reply = conn.read_response()
                    except rex.ResponseError as exc:
                        if cmd.best_effort:
                            self._metadata_failed(exc)
                        elif isinstance(exc, _redirects()):
                            redirect = redirect or exc
                        else:
                            failure = failure or exc
                        continue
                    if cmd.on_reply is not None and redirect is None and failure is None:
                        cmd.on_reply(reply)
                topology.nodes[index].release(conns.pop(index))
        finally:
            for index, conn in conns.items():
                topology.nodes[index].release(conn, broken=True)
        if failure is not None:
            if isinstance(failure, rex.NoPermissionError):
                raise TierError(
                    f"redis refused a command to user {self.config.user_name!r}: {failure}"
                ) from failure
            raise TierError(f"redis answered an error: {failure}") from failure
        return redirect

    def _execute(self, build: Callable[[_Topology], list[_Cmd]], what: str) -> None:
        """Build the commands for the current topology and run them; after a redirect
        (slots moved, failover) rediscover the topology and run them once more."""
        self._breaker.check()
        for attempt in (0, 1):
            topology = self._topology
            if topology is None or self._closed:
                raise TierUnavailableError("redis tier is not connected")
            try:
                redirect = self._roundtrip(topology, build(topology))
                if redirect is None:
                    return
                if attempt == 0 and topology.cluster:
                    # the new owner of a moved slot knows the new layout first
                    host, port = getattr(redirect, "host", None), getattr(redirect, "port", None)
                    self._connect((str(host), int(port)) if host and port else None)
                    continue
            except _network_errors() as exc:
                raise self._unavailable(exc, what) from exc
            except _PoolExhausted as exc:
                raise self._unavailable(exc, what) from exc
            raise self._unavailable(redirect, what) from redirect

    def _metadata_failed(self, exc: BaseException) -> None:
        self._breaker.count("metadata")
        if self.failures.get("metadata") == 1:
            log.warning("redis tier: eviction metadata not written (%s); overflow "
                        "resolution falls back to treating such keys as oldest/least used", exc)

    def _table_layout(self, table: str) -> _Layout:
        layout = self._layouts.get(table)
        if layout is None:
            layout = _layout(table, self.config.num_partitions)
            self._layouts[table] = layout
        return layout

    # -- reads --------------------------------------------------------------------------

    def fetch(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of `keys` (int64[n]) from Redis: `(float32[n, dim], bool[n] found)`.

        Raises TierUnavailableError when Redis cannot answer (at once while the breaker
        is open), TierError when a stored row is not `dim` float32 wide.
        """
        dim = self.dim(table)
        keys = as_keys(keys)
        n = keys.size
        vectors = np.zeros((n, dim), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return vectors, found
        self._breaker.check()
        grouped = _group(keys, self.config.num_partitions)
        fields = _pack_fields(grouped.keys)
        layout = self._table_layout(table)
        row_bytes = 4 * dim
        order = grouped.order

        def decode(a: int, b: int) -> Callable[[Any], None]:
            def on_reply(reply: list[Any]) -> None:
                m = b - a
                misses = reply.count(None)
                if misses == m:
                    return
                data = b"".join(filter(None, reply)) if misses else b"".join(reply)
                if len(data) != (m - misses) * row_bytes:
                    raise TierError(
                        f"redis holds rows of {table!r} that are not {dim} float32 wide "
                        f"(partition hash {layout.values[0].decode()}…): is "
                        "embedding_vecsize_per_table right?"
                    )
                rows = np.frombuffer(data, dtype="<f4").reshape(m - misses, dim)
                at = order[a:b]
                if misses:
                    at = at[np.fromiter(map(bool, reply), dtype=bool, count=m)]
                vectors[at] = rows
                found[at] = True

            return on_reply

        def build(topology: _Topology) -> list[_Cmd]:
            node_of = topology.node_of(layout)
            return [
                _Cmd(int(node_of[p]),
                     [_head(2 + b - a, b"HMGET", layout.values[p]),
                      fields[a * _FIELD_WIDTH:b * _FIELD_WIDTH]],
                     decode(a, b))
                for p, a, b in grouped.chunks(self.config.max_batch_size)
            ]

        self._execute(build, f"fetch from {table!r}")
        if self._touch_on_fetch:
            hit = found[order]
            if hit.any():
                self._queue_touch(table, grouped.keys[hit])
        return vectors, found

    @property
    def _touch_on_fetch(self) -> bool:
        policy = self.config.overflow_policy
        return policy == "evict_least_used" or (
            policy == "evict_oldest" and self.config.refresh_time_after_fetch
        )

    def size(self, table: str) -> int:
        """Keys `table` holds now (HLEN of every partition, summed)."""
        layout = self._table_layout(table)
        total = np.zeros(1, dtype=np.int64)

        def add(reply: int) -> None:
            total[0] += int(reply)

        def build(topology: _Topology) -> list[_Cmd]:
            total[0] = 0
            node_of = topology.node_of(layout)
            return [_Cmd(int(node_of[p]), [_command(b"HLEN", name)], add)
                    for p, name in enumerate(layout.values)]

        self._execute(build, f"size of {table!r}")
        return int(total[0])

    # -- writes -------------------------------------------------------------------------

    def insert(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Write rows (HSET per partition), then prune partitions over `overflow_margin`.

        Raises TierUnavailableError when Redis cannot answer; nothing is retried.
        """
        dim = self.dim(table)
        keys = as_keys(keys)
        vectors = as_vectors(vectors, dim)
        if keys.size != vectors.shape[0]:
            raise LookupInputError(
                f"insert into {table!r}: {keys.size} keys but {vectors.shape[0]} rows"
            )
        if keys.size == 0:
            return
        self._breaker.check()
        for start in range(0, keys.size, _WINDOW_KEYS):
            stop = start + _WINDOW_KEYS
            self._insert_window(table, keys[start:stop], vectors[start:stop])

    def _insert_window(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        config = self.config
        grouped = _group(keys, config.num_partitions)
        layout = self._table_layout(table)
        rows = np.ascontiguousarray(vectors[grouped.order], dtype="<f4").view(np.uint8)
        pairs, width = _pack_pairs(grouped.keys, rows)
        meta = self._meta_writer(grouped.keys, layout)
        bounded = config.overflow_margin < UNBOUNDED
        sizes = np.zeros(config.num_partitions, dtype=np.int64)

        def store_size(p: int) -> Callable[[Any], None]:
            def on_reply(reply: int) -> None:
                sizes[p] = int(reply)

            return on_reply

        def build(topology: _Topology) -> list[_Cmd]:
            node_of = topology.node_of(layout)
            cmds = []
            last = -1
            for p, a, b in grouped.chunks(config.max_batch_size):
                node = int(node_of[p])
                cmds.append(_Cmd(node, [_head(2 + 2 * (b - a), b"HSET", layout.values[p]),
                                        pairs[a * width:b * width]]))
                if meta is not None:
                    cmds.append(meta(node, p, a, b))
                if bounded and p != last:
                    cmds.append(_Cmd(node, [_command(b"HLEN", layout.values[p])], store_size(p)))
                last = p
            return cmds

        self._execute(build, f"insert into {table!r}")
        if bounded:
            over = np.flatnonzero(sizes > config.overflow_margin)
            if over.size:
                self._resolve_overflow(table, over)

    def _meta_writer(
        self, keys: np.ndarray, layout: _Layout
    ) -> Callable[[int, int, int, int], _Cmd] | None:
        """The `t`-hash write that goes with an insert or a touch of sorted `keys`."""
        policy = self.config.overflow_policy
        if policy == "evict_random":
            return None
        if policy == "evict_least_used":
            fields = _pack_fields(keys)

            def lfu(node: int, p: int, a: int, b: int) -> _Cmd:
                head = _head(4 + b - a, b"EVAL", _LFU_SCRIPT, b"1", layout.metas[p])
                return _Cmd(node, [head, fields[a * _FIELD_WIDTH:b * _FIELD_WIDTH]],
                            best_effort=True)

            return lfu
        now = np.full(keys.size, int(self._clock()), dtype="<i8").view(np.uint8).reshape(-1, 8)
        pairs, width = _pack_pairs(keys, now)

        def lru(node: int, p: int, a: int, b: int) -> _Cmd:
            head = _head(2 + 2 * (b - a), b"HSET", layout.metas[p])
            return _Cmd(node, [head, pairs[a * width:b * width]], best_effort=True)

        return lru

    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys` (and their metadata); returns how many were present."""
        self.dim(table)
        keys = np.unique(as_keys(keys))
        if keys.size == 0:
            return 0
        self._breaker.check()
        grouped = _group(keys, self.config.num_partitions)
        layout = self._table_layout(table)
        fields = _pack_fields(grouped.keys)
        removed = np.zeros(1, dtype=np.int64)

        def add(reply: int) -> None:
            removed[0] += int(reply)

        def build(topology: _Topology) -> list[_Cmd]:
            removed[0] = 0
            node_of = topology.node_of(layout)
            cmds = []
            for p, a, b in grouped.chunks(self.config.max_batch_size):
                body = fields[a * _FIELD_WIDTH:b * _FIELD_WIDTH]
                node = int(node_of[p])
                cmds.append(_Cmd(node, [_head(2 + b - a, b"HDEL", layout.values[p]), body], add))
                cmds.append(_Cmd(node, [_head(2 + b - a, b"HDEL", layout.metas[p]), body]))
            return cmds

        self._execute(build, f"remove from {table!r}")
        return int(removed[0])

    def drop_table(self, table: str) -> None:
        """Delete every partition hash of `table` (rows and metadata), then forget it."""
        layout = self._table_layout(table)

        def build(topology: _Topology) -> list[_Cmd]:
            node_of = topology.node_of(layout)
            return [_Cmd(int(node_of[p]), [_command(b"UNLINK", layout.values[p], layout.metas[p])])
                    for p in range(len(layout.values))]

        self._execute(build, f"drop of {table!r}")
        super().drop_table(table)

    # -- overflow -------------------------------------------------------------------------

    def _resolve_overflow(self, table: str, partitions: np.ndarray) -> None:
        """Prune every partition in `partitions` to overflow_margin × resolution target.

        Victims: random keys, the least used (lowest count) or the oldest (lowest time);
        keys without metadata count as least used / oldest. Metadata of keys that are no
        longer in the value hash is deleted too.
        """
        config = self.config
        layout = self._table_layout(table)
        target = int(config.overflow_margin * config.overflow_resolution_target)
        policy = config.overflow_policy
        present: dict[int, list[bytes]] = {}
        metadata: dict[int, list[bytes]] = {}

        def keep(into: dict[int, list[bytes]], p: int) -> Callable[[Any], None]:
            def on_reply(reply: list[bytes]) -> None:
                into[p] = reply

            return on_reply

        def survey(topology: _Topology) -> list[_Cmd]:
            node_of = topology.node_of(layout)
            cmds = []
            for p in partitions.tolist():
                node = int(node_of[p])
                cmds.append(_Cmd(node, [_command(b"HKEYS", layout.values[p])], keep(present, p)))
                if policy != "evict_random":
                    cmds.append(_Cmd(node, [_command(b"HGETALL", layout.metas[p])],
                                     keep(metadata, p)))
            return cmds

        self._execute(survey, f"overflow survey of {table!r}")

        victims: dict[int, np.ndarray] = {}
        orphans: dict[int, np.ndarray] = {}
        for p in partitions.tolist():
            keys = _parse_keys(present.get(p, []))
            excess = keys.size - target
            if policy == "evict_random":
                if excess > 0:
                    rng = np.random.default_rng()
                    victims[p] = keys[rng.choice(keys.size, size=excess, replace=False)]
                continue
            score, stale = _eviction_scores(keys, metadata.get(p, []), policy)
            if excess > 0:
                victims[p] = keys[np.argsort(score, kind="stable")[:excess]]
            if stale.size:
                orphans[p] = stale

        if not victims and not orphans:
            return
        none = np.empty(0, dtype=np.int64)
        delete_v = victims
        delete_t = {p: np.concatenate([victims.get(p, none), orphans.get(p, none)])
                    for p in set(victims) | set(orphans)}

        def prune(topology: _Topology) -> list[_Cmd]:
            node_of = topology.node_of(layout)
            cmds = []
            for names, doomed in ((layout.values, delete_v), (layout.metas, delete_t)):
                for p, keys in doomed.items():
                    fields = _pack_fields(keys)
                    for a in range(0, keys.size, config.max_batch_size):
                        b = min(a + config.max_batch_size, keys.size)
                        cmds.append(_Cmd(int(node_of[p]), [
                            _head(2 + b - a, b"HDEL", names[p]),
                            fields[a * _FIELD_WIDTH:b * _FIELD_WIDTH]]))
            return cmds

        self._execute(prune, f"overflow pruning of {table!r}")
        log.debug("redis tier: pruned %d keys of %s in %d partitions", sum(
            k.size for k in victims.values()), table, len(victims))

    # -- background writes ----------------------------------------------------------------

    def insert_async(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> bool:
        """Queue an insert on the background writer; returns False if it was dropped.

        Never blocks and never raises for Redis being down: the write is dropped (counted
        in `dropped["insert"]`, in keys) when the queue is full or the breaker is open.
        Takes copies, so the caller may reuse its buffers.
        """
        dim = self.dim(table)
        keys = np.array(as_keys(keys), copy=True)
        vectors = np.array(as_vectors(vectors, dim), copy=True)
        if keys.size == 0:
            return True
        if self._breaker.is_open or not self._inserter.submit((table, keys, vectors)):
            self._drop("insert", keys.size)
            return False
        return True

    def _run_insert(self, item: tuple[str, np.ndarray, np.ndarray]) -> None:
        table, keys, vectors = item
        if table not in self._dims:
            return  # dropped meanwhile
        try:
            self.insert(table, keys, vectors)
        except TierUnavailableError:
            self._drop("insert", keys.size)
            raise

    def _queue_touch(self, table: str, keys: np.ndarray) -> None:
        if not self._toucher.submit((table, keys)):
            self._drop("metadata", keys.size)

    def _run_touch(self, item: tuple[str, np.ndarray]) -> None:
        table, keys = item
        grouped = _group(keys, self.config.num_partitions)
        layout = self._table_layout(table)
        meta = self._meta_writer(grouped.keys, layout)
        if meta is None:
            return

        def build(topology: _Topology) -> list[_Cmd]:
            node_of = topology.node_of(layout)
            return [meta(int(node_of[p]), p, a, b)
                    for p, a, b in grouped.chunks(self.config.max_batch_size)]

        try:
            self._execute(build, f"metadata refresh of {table!r}")
        except TierUnavailableError:
            self._drop("metadata", keys.size)
            raise

    def _drop(self, kind: str, count: int) -> None:
        with self._nodes_lock:
            self.dropped[kind] = self.dropped.get(kind, 0) + int(count)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the background inserts and metadata writes queued so far are done."""
        return self._inserter.wait_idle(timeout) and self._toucher.wait_idle(timeout)

    # -- state ----------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the breaker is open (Redis is considered down)."""
        return not self._breaker.is_open and self._topology is not None

    @property
    def cluster(self) -> bool | None:
        """True for a Redis Cluster, False for a standalone server, None before connecting."""
        return None if self._topology is None else self._topology.cluster

    def nodes(self) -> list[str]:
        """`host:port` of the masters in use (empty before the first connection)."""
        return [] if self._topology is None else [n.address for n in self._topology.nodes]

    def stats(self) -> dict[str, Any]:
        """State and counters, for metrics."""
        return {
            "available": self.available,
            "cluster": self.cluster,
            "nodes": self.nodes(),
            "episodes": self._breaker.episodes,
            "failures": dict(self.failures),
            "dropped": dict(self.dropped),
        }

    def _close_nodes(self) -> None:
        with self._nodes_lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

    def close(self) -> None:
        """Finish queued background writes (a few seconds at most), stop reconnecting,
        close every connection."""
        if self._closed:
            return
        self._inserter.close(timeout=5.0)
        self._toucher.close(timeout=5.0)
        self._closed = True
        self._breaker.close()
        self._close_nodes()
