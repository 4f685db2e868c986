"""The tier's client of a Redis server or Redis Cluster: node pools, topology, round trips.

`RedisClient` finds out from the first seed that answers whether it talks to a cluster
(`cluster_enabled` in INFO) and, if so, where every slot lives (CLUSTER SLOTS). Each
master gets a bounded pool of redis-py connections (`Node`). A round trip sends every node
its packed commands, then reads every reply, so the nodes work in parallel; a redirect
(MOVED, failover) rediscovers the topology and runs the commands once more.

Failures. Every network failure (refused, reset, socket timeout, cluster failover, server
loading) is counted in `failures[kind]`, opens the circuit breaker (`hps.runtime.breaker`) and is
logged once per episode (logger "hps.tiers.redis"). While the breaker is open every call
raises `TierUnavailableError` at once, without touching the network; a background thread
reconnects with the package's backoff (rediscovering the cluster's slots) and closes the
breaker when every master answers. Redis being down when the tier starts is such an
episode, not an error. Wrong credentials or TLS settings raise `TierSetupError` at start.
"""

from __future__ import annotations

import inspect
import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.config import VolatileDBConfig
from hps.errors import TierError, TierSetupError, TierUnavailableError
from hps.runtime.backoff import Backoff
from hps.runtime.breaker import CircuitBreaker
from hps.tiers.redis.layout import NUM_SLOTS, TableLayout, command

try:
    import redis
    from redis import exceptions as rex
    from redis.backoff import NoBackoff
    from redis.connection import Connection, SSLConnection
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

#: the redis extra is installed
HAVE_REDIS = redis is not None

log = logging.getLogger("hps.tiers.redis")


# -- connections ----------------------------------------------------------------------------


class PoolExhausted(Exception):
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


class Node:
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
            raise PoolExhausted(f"all connections to {self.address} stayed busy for {wait} s")
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
            conn.send_packed_command([command(*args)], check_health=False)
            reply = conn.read_response()
        except BaseException:
            self.release(conn, broken=True)
            raise
        self.release(conn)
        return reply


@dataclass(frozen=True)
class Topology:
    """Who serves what: the master nodes, and for a cluster the node of every slot."""

    cluster: bool
    nodes: list[Node]
    slot_node: np.ndarray  # int64[NUM_SLOTS], index into nodes
    version: str

    def node_of(self, layout: TableLayout) -> np.ndarray:
        """Node index of every partition of a table."""
        return np.asarray(self.slot_node[layout.slots])


@dataclass
class Cmd:
    """One packed command for one node, and what to do with its reply."""

    node: int
    parts: list[Any]
    on_reply: Callable[[Any], None] | None = None
    best_effort: bool = False  # a metadata write: its error reply must not fail the call
    #: takes an error reply (WRONGTYPE, …) instead of failing the call (redirects and
    #: a full Redis still fail it)
    on_error: Callable[[BaseException], None] | None = None


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, (rex.AuthenticationError, rex.NoPermissionError)):
        return "auth"
    if isinstance(exc, (rex.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, rex.BusyLoadingError):
        return "loading"
    if isinstance(exc, (rex.MovedError, rex.AskError, rex.TryAgainError, rex.ClusterDownError,
                        rex.MasterDownError, rex.ReadOnlyError, ClusterIncomplete)):
        return "cluster"
    return "connection"


def is_tls_error(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ssl.SSLError) or "SSL" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class ClusterIncomplete(Exception):
    """CLUSTER SLOTS does not cover every slot (a failover is under way)."""


def _is_full(exc: BaseException) -> bool:
    """An OOM error reply: Redis at `maxmemory` refuses writes (reads still work)."""
    oom = getattr(rex, "OutOfMemoryError", None)  # redis-py strips the "OOM" prefix
    return (oom is not None and isinstance(exc, oom)) or str(exc).startswith("OOM")


def _redirects() -> tuple[type[BaseException], ...]:
    return (rex.MovedError, rex.AskError, rex.TryAgainError, rex.ClusterDownError,
            rex.MasterDownError, rex.ReadOnlyError, rex.BusyLoadingError)


def network_errors() -> tuple[type[BaseException], ...]:
    # AuthenticationError is a redis ConnectionError: a password changed under a running
    # tier makes Redis unavailable to it, like an outage (it was checked at start).
    return (rex.ConnectionError, rex.TimeoutError, OSError, ClusterIncomplete)


def parse_address(address: str) -> list[tuple[str, int]]:
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


def connection_kwargs(config: VolatileDBConfig) -> dict[str, Any]:
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


class RedisClient:
    """The masters of one Redis deployment, as the tier talks to them.

    `config.address` is a comma list of `host:port` seeds. `failures` is the tier's
    counter dict (kind → count), shared with the breaker. `start()` connects or opens the
    breaker; `execute(build, what)` runs the commands `build(topology)` makes.
    Thread safety: every method may be called from any thread.
    """

    def __init__(self, config: VolatileDBConfig, failures: dict[str, int]) -> None:
        self.config = config
        self.failures = failures
        self._seeds = parse_address(config.address)
        self._kwargs = connection_kwargs(config)
        self._nodes: dict[tuple[str, int], Node] = {}
        self._nodes_lock = threading.Lock()
        self.topology: Topology | None = None
        self._pool_wait = max(10.0 * config.socket_timeout, 1.0)
        self.closed = False
        backoff = Backoff(initial=config.reconnect_backoff,
                          cap=max(config.reconnect_backoff_max, config.reconnect_backoff))
        self.breaker = CircuitBreaker("redis", failures, self._reconnect, backoff, log)

    def start(self) -> None:
        """Connect; Redis being down opens the breaker (the tier starts anyway).

        Raises TierSetupError for wrong credentials or TLS settings.
        """
        try:
            self._connect()
        except TierSetupError:
            self._close_nodes()
            raise
        except network_errors() as exc:
            if isinstance(exc, (rex.AuthenticationError, rex.NoPermissionError)):
                self._close_nodes()
                raise TierSetupError(self._auth_message(exc)) from exc
            if self.config.enable_tls and is_tls_error(exc):
                self._close_nodes()
                raise TierSetupError(
                    f"TLS connection to Redis at {self.config.address} failed: {exc}. Check "
                    "volatile_db.enable_tls, tls_ca_certificate, tls_client_certificate, "
                    "tls_client_key and tls_server_name_identification"
                ) from exc
            self.breaker.trip(failure_kind(exc), exc)

    def check(self) -> None:
        """Raise TierUnavailableError, without network, while the breaker is open."""
        self.breaker.check()

    @property
    def available(self) -> bool:
        """False while the breaker is open or before the first connection."""
        return not self.breaker.is_open and self.topology is not None

    def _auth_message(self, exc: BaseException) -> str:
        user = self.config.user_name or "default"
        if not self.config.password:
            return (f"Redis at {self.config.address} requires authentication ({exc}): set "
                    "volatile_db.password (and volatile_db.user_name for an ACL user)")
        return (f"Redis at {self.config.address} refused user {user!r} with the configured "
                f"password ({exc}): check volatile_db.user_name and volatile_db.password")

    def _node(self, host: str, port: int) -> Node:
        with self._nodes_lock:
            node = self._nodes.get((host, port))
            if node is None:
                node = Node(host, port, self._kwargs, self.config.num_node_connections)
                self._nodes[(host, port)] = node
            return node

    def _discover(self, first: tuple[str, int] | None = None) -> Topology:
        """Ask `first` (the node a MOVED reply named), then the seeds, then the nodes known
        so far, what serves the slots."""
        known = [(n.host, n.port) for n in self.topology.nodes] if self.topology else []
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
                    return Topology(False, [node], np.zeros(NUM_SLOTS, dtype=np.int64), version)
                return self._cluster_topology(node, version)
            except (rex.AuthenticationError, rex.NoPermissionError):
                raise
            except network_errors() as exc:
                last = exc
                if self.config.enable_tls and is_tls_error(exc):
                    raise
        assert last is not None
        raise last

    def _cluster_topology(self, node: Node, version: str) -> Topology:
        entries = node.call(self.config.connect_timeout, b"CLUSTER", b"SLOTS")
        slot_node = np.full(NUM_SLOTS, -1, dtype=np.int64)
        nodes: list[Node] = []
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
            raise ClusterIncomplete(
                f"cluster at {node.address} serves {int((slot_node >= 0).sum())} of "
                f"{NUM_SLOTS} slots"
            )
        return Topology(True, nodes, slot_node, version)

    def _connect(self, first: tuple[str, int] | None = None) -> None:
        """Discover the topology and PING every master; swap it in when all answer."""
        topology = self._discover(first)
        for node in topology.nodes:
            node.call(self.config.connect_timeout, b"PING")
        self.topology = topology
        if topology.cluster:
            log.debug("redis cluster of %d masters: %s", len(topology.nodes),
                      ", ".join(n.address for n in topology.nodes))

    def _reconnect(self) -> None:
        if self.closed:
            raise TierUnavailableError("redis tier is closed")
        for node in list(self._nodes.values()):
            node.reset()
        try:
            self._connect()
        except (rex.AuthenticationError, rex.NoPermissionError) as exc:
            raise TierSetupError(self._auth_message(exc)) from exc

    def _unavailable(self, exc: BaseException, where: str) -> TierUnavailableError:
        if isinstance(exc, PoolExhausted):
            self.breaker.count("pool")
            return TierUnavailableError(f"redis tier saturated: {exc}")
        kind = failure_kind(exc)
        self.breaker.trip(kind, exc)
        return TierUnavailableError(f"redis tier: {kind} failure at {where}: {exc}")

    # -- round trips --------------------------------------------------------------------

    def _roundtrip(self, topology: Topology, cmds: list[Cmd]) -> BaseException | None:
        """Send every node its commands, then read every reply (the nodes work meanwhile).

        Returns the first redirect-type error reply (MOVED, ASK, CLUSTERDOWN, LOADING…),
        after reading all replies so that the connections stay clean; raises network
        errors, and TierError for other error replies.
        """
        by_node: dict[int, list[Cmd]] = {}
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
                        elif cmd.on_error is not None and not _is_full(exc):
                            if redirect is None and failure is None:
                                cmd.on_error(exc)
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
            if _is_full(failure):
                self.breaker.count("full")
                raise TierError(f"redis is full (maxmemory reached, no eviction): {failure}"
                                ) from failure
            raise TierError(f"redis answered an error: {failure}") from failure
        return redirect

    def execute(self, build: Callable[[Topology], list[Cmd]], what: str) -> None:
        """Build the commands for the current topology and run them; after a redirect
        (slots moved, failover) rediscover the topology and run them once more."""
        self.breaker.check()
        for attempt in (0, 1):
            topology = self.topology
            if topology is None or self.closed:
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
            except network_errors() as exc:
                raise self._unavailable(exc, what) from exc
            except PoolExhausted as exc:
                raise self._unavailable(exc, what) from exc
            raise self._unavailable(redirect, what) from redirect

    def _metadata_failed(self, exc: BaseException) -> None:
        self.breaker.count("metadata")
        if self.failures.get("metadata") == 1:
            log.warning("redis tier: eviction metadata not written (%s); overflow "
                        "resolution falls back to treating such keys as oldest/least used", exc)


    def _close_nodes(self) -> None:
        with self._nodes_lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

    def close(self) -> None:
        """Stop reconnecting and close every connection."""
        self.closed = True
        self.breaker.close()
        self._close_nodes()
