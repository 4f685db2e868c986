"""Updates through Redis Streams: `XADD hps_et.<model>.<table> * u <HCTR payload>`.

A deployment that already runs Redis needs nothing more. The consumer side
(`RedisStreamSource`) reads with a consumer group per serving replica (`XGROUP CREATE …
0`: a new group starts at the earliest entry the stream holds) and one consumer name in
it, "hps", so a restarted replica first reads again what it had been given and not
acknowledged (its pending entries), then new entries (`XREADGROUP … >`), and
acknowledges (`XACK`) only what is applied. Streams of the followed models are found with
`SCAN … TYPE stream` every `metadata_refresh_interval_ms`; the streams of the tables a
model has are created at once (`MKSTREAM`), so their first entry is read without waiting
for a scan.

`address` is one server or the comma list of a Redis Cluster's nodes (seeds), told apart
as the volatile tier does (INFO's `cluster_enabled` of the first seed that answers). A
stream is one key, so on a cluster each table's stream lives on the node of its slot;
every command the source sends names one stream (XGROUP, XACK, XINFO; XREADGROUP per
stream, pipelined, since a cluster refuses one XREADGROUP over keys of several slots) and
the cluster client routes it there. Waiting for new entries: one blocking XREADGROUP over
every stream on a standalone server, or on a cluster where there is one stream; with
several streams on a cluster, a read of each without blocking every
CLUSTER_IDLE_SECONDS while they are idle.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hps.config import UpdateSourceConfig
from hps.errors import ConfigError, MissingExtraError, UpdateSourceUnavailableError
from hps.tiers.contract import TABLE_PREFIX, table_name
from hps.updates.contract import UpdateMessage, UpdatePublisher, UpdateSource

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.exceptions import (
        ClusterError,
        RedisClusterException,
        SlotNotCoveredError,
        TryAgainError,
    )
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

log = logging.getLogger("hps.updates")

#: the field of a stream entry that holds the payload
FIELD = b"u"
#: the consumer name of a replica inside its group (one consumer per group)
CONSUMER = "hps"
#: id to read a stream's own pending entries from / to read new entries
_PENDING, _NEW = "0", ">"
#: the errors of a read whose stream or group is gone: NOGROUP, and Redis 7's answer to
#: a read blocked on a stream deleted (or its group destroyed) meanwhile
_GONE = ("NOGROUP", "UNBLOCKED")


#: a cluster's streams live on different slots, so one XREADGROUP cannot wait on all of
#: them: with several streams the source reads each without blocking and, finding
#: nothing, waits this long before it reads again (the wait a new entry may add)
CLUSTER_IDLE_SECONDS = 0.02


def _seeds(address: str) -> list[tuple[str, int]]:
    """`host:port` seeds of a comma list; ConfigError naming update_source.address."""
    seeds = []
    for item in address.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"update_source.address {address!r}: {item.strip()!r} is not "
                              "host:port (expected e.g. '127.0.0.1:6379', or the comma list "
                              "of a cluster's nodes)")
        seeds.append((host.strip("[]"), int(port)))
    return seeds


class _Connection:
    """The client of the Redis that holds the streams: a standalone server (`redis.Redis`)
    or a Redis Cluster (`RedisCluster`, which sends each single-key command to the node of
    its key's slot). Which one is found out on first use from the first seed that answers
    (INFO's `cluster_enabled`), as the volatile tier does, so a source can be made while
    Redis is down. Network failures are raised as redis-py raises them (see _reachable).
    """

    def __init__(self, config: UpdateSourceConfig, socket_timeout: float) -> None:
        if redis is None:
            raise MissingExtraError("redis", "redis", "Redis Streams updates")
        self.address = config.address
        self.seeds = _seeds(config.address)
        self.options: dict[str, Any] = {
            "username": config.user_name if config.password else None,
            "password": config.password or None,
            "socket_timeout": socket_timeout, "socket_connect_timeout": 2.0, "protocol": 2,
            # no retry inside redis-py: it would send a read again whose reply was lost
            # (Redis killed after it logged the delivery), and `>` skips what the lost
            # reply held; the source's caller retries with backoff instead, after the
            # source took note to read its pending entries first
            "retry": Retry(NoBackoff(), 0),
        }
        self._client: Any = None
        self.cluster = False

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _connect(self) -> Any:
        last: BaseException | None = None
        for host, port in self.seeds:
            probe = redis.Redis(host=host, port=port, **self.options)
            try:
                enabled = int(probe.info("cluster").get("cluster_enabled", 0))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                probe.close()
                last = exc
                continue
            if not enabled:
                return probe
            probe.close()
            from redis.cluster import ClusterNode, RedisCluster

            try:
                client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self.seeds], **self.options)
            except RedisClusterException as exc:  # no node answered CLUSTER SLOTS
                raise redis.ConnectionError(str(exc)) from exc
            self.cluster = True
            return client
        assert last is not None
        raise last

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


@contextmanager
def _reachable(what: str, address: str) -> Iterator[None]:
    """Network failures of the block (a cluster's too: down, a slot without a node, a
    failover under way) as UpdateSourceUnavailableError."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, OSError, ClusterError,
            SlotNotCoveredError, TryAgainError) as exc:
        raise UpdateSourceUnavailableError(
            f"Redis at {address} ({what}): {type(exc).__name__}: {exc}") from exc


def _glob(text: str) -> str:
    """`text` with Redis glob characters escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _published(entry_id: str) -> float:
    """An entry id's time ("<ms>-<seq>") in seconds since the epoch."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


class RedisStreamSource(UpdateSource):
    """Reads the streams of the followed models as consumer group `group`."""

    name = "redis_stream"
    reports_backlog = True
    leaves_topics = True

    def __init__(self, config: UpdateSourceConfig, group: str) -> None:
        self.address = config.address
        self.group = group
        self._conn = _Connection(config, socket_timeout=config.poll_timeout_ms / 1000.0 + 5.0)
        self._rescan_every = config.metadata_refresh_interval_ms / 1000.0
        self._rescan_at = 0.0
        self._tables: dict[str, tuple[str, ...]] = {}
        self._streams: dict[str, str] = {}  # stream → id to read after (_PENDING…, or _NEW)
        self._rewind = False
        self._closed = threading.Event()
        #: streams of followed tables whose key is not a stream (WRONGTYPE) → why; tried
        #: again at every scan, never read meanwhile, so they never stall the others
        self._broken: dict[str, str] = {}

    def faults(self) -> dict[str, str]:
        return dict(self._broken)

    def rewind(self) -> None:
        self._rewind = True

    def follow(self, tables: Mapping[str, Sequence[str]]) -> None:
        left = {m: t for m, t in self._tables.items() if m not in tables}
        with _reachable("leaving the streams", self.address):
            self._leave(left)
        self._tables = {m: tuple(t) for m, t in tables.items()}
        prefixes = tuple(f"{TABLE_PREFIX}.{m}." for m in self._tables)
        self._streams = {s: at for s, at in self._streams.items() if s.startswith(prefixes)}
        self._broken = {s: why for s, why in self._broken.items() if s.startswith(prefixes)}
        with _reachable("joining the streams", self.address):
            self._join_tables()
        self._rescan_at = 0.0

    def _leave(self, models: Mapping[str, Sequence[str]]) -> None:
        """Destroy this group on every stream of `models` (removed from the server): a
        group nobody reads keeps its pending entries and its place in XINFO for good.
        The streams stay: other replicas read them through groups of their own."""
        if not models:
            return
        prefixes = tuple(f"{TABLE_PREFIX}.{m}." for m in models)
        streams = {table_name(m, t) for m, names in models.items() for t in names}
        streams.update(s for s in (*self._streams, *self._broken) if s.startswith(prefixes))
        for stream in sorted(streams):  # one command per stream: a cluster routes each
            try:
                self._conn.client.xgroup_destroy(stream, self.group)
            except redis.ResponseError as exc:
                # the key is gone or not a stream: no group to leave. Anything else is
                # logged, not raised: a round that failed on it would try again forever
                # and read no other model's updates meanwhile
                if "key to exist" not in str(exc) and "WRONGTYPE" not in str(exc):
                    log.warning("could not leave consumer group %s of stream %s: %s",
                                self.group, stream, exc)

    def _join_tables(self) -> None:
        for model, names in self._tables.items():
            for table in names:
                self._join(table_name(model, table), create=True)

    def _join(self, stream: str, *, create: bool) -> None:
        if stream in self._streams:
            return
        try:
            self._conn.client.xgroup_create(stream, self.group, id="0", mkstream=create)
        except redis.ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                self._broken[stream] = f"key {stream} is not a stream: {exc}"
                return
            if "BUSYGROUP" not in str(exc):
                raise
            if self._rewind:  # the group exists: read it from the start again
                self._conn.client.xgroup_setid(stream, self.group, id="0")
        self._broken.pop(stream, None)
        self._streams[stream] = _PENDING

    def _discover(self) -> None:
        for stream in list(self._broken):  # fixed meanwhile (the key deleted, say)?
            self._join(stream, create=True)
        for model in self._tables:
            pattern = _glob(f"{TABLE_PREFIX}.{model}.") + "*"
            for key in self._conn.client.scan_iter(match=pattern, count=1000, _type="STREAM"):
                self._join(key.decode(), create=False)

    def poll(self, max_messages: int, timeout: float) -> list[UpdateMessage]:
        with _reachable("reading updates", self.address), self._pending_again_on_failure():
            try:
                return self._poll(max_messages, timeout)
            except redis.ResponseError as exc:
                if "WRONGTYPE" in str(exc):
                    # a stream's key was replaced by another type: set it (and only it)
                    # aside, read the others at once
                    self._set_aside_non_streams()
                    return []
                if not str(exc).startswith(_GONE):
                    raise
                # the stream or its group went away (deleted, Redis restarted empty), or
                # a blocked read was told so (UNBLOCKED): join again from what exists
                # now, and the next poll reads the other streams at once. Raised on, it
                # would fail the round, whose retry pauses the other tables' updates.
                self._streams = {}
                self._join_tables()
                self._rescan_at = 0.0
                return []

    def _set_aside_non_streams(self) -> None:
        """Move the followed keys that are no longer streams to the broken ones."""
        streams = list(self._streams)
        pipe = self._conn.client.pipeline(transaction=False)
        for stream in streams:
            pipe.type(stream)
        for stream, kind in zip(streams, pipe.execute(), strict=True):
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind not in ("stream", "none"):
                del self._streams[stream]
                self._broken[stream] = f"key {stream} is a {kind}, not a stream"

    @contextmanager
    def _pending_again_on_failure(self) -> Iterator[None]:
        """A read that failed may have been carried out without its reply arriving (Redis
        killed after it wrote the entries to its log and to this group's pending list):
        `>` would never deliver them again, so the next poll reads each stream's own
        pending entries first. Entries received and still being written are delivered
        twice then (at-least-once; a replay ends in the same rows). The next poll also
        looks for streams at once, so it reaches Redis even where none is followed yet: a
        poll that answers without asking Redis would report the source running again."""
        try:
            yield
        except BaseException:
            self._streams = dict.fromkeys(self._streams, _PENDING)
            self._rescan_at = 0.0
            raise

    def _poll(self, max_messages: int, timeout: float) -> list[UpdateMessage]:
        if time.monotonic() >= self._rescan_at:
            self._discover()
            self._rescan_at = time.monotonic() + self._rescan_every
        if not self._streams:
            self._closed.wait(timeout)
            return []
        pending = {s: at for s, at in self._streams.items() if at != _NEW}
        if pending:
            messages = self._read(pending, max_messages, block=None)
            if messages:
                return messages
        new = {s: at for s, at in self._streams.items() if at == _NEW}
        if not new:
            return []
        block = int(timeout * 1000)
        return self._read(new, max_messages, block=block if block > 0 else None)

    def _read(self, streams: dict[str, str], count: int, block: int | None
              ) -> list[UpdateMessage]:
        out = []
        for raw_stream, entries in self._xreadgroup(streams, count, block):
            stream = raw_stream.decode()
            if streams[stream] != _NEW:  # reading our own pending entries
                if not entries:
                    self._streams[stream] = _NEW  # none left: new entries from now on
                    continue
                self._streams[stream] = entries[-1][0].decode()
            for raw_id, fields in entries:
                entry_id = raw_id.decode()
                out.append(UpdateMessage(stream, (fields or {}).get(FIELD, b""), entry_id,
                                         None, _published(entry_id)))
        return out

    def _xreadgroup(self, streams: dict[str, str], count: int, block: int | None
                    ) -> list[Any]:
        """XREADGROUP's reply ([stream, entries] pairs) for `streams`: one command on a
        standalone Redis; on a cluster one per stream (each on its slot's node), pipelined,
        blocking only where there is one stream to wait on."""
        client = self._conn.client
        if not self._conn.cluster or len(streams) == 1:
            reply: list[Any] = client.xreadgroup(self.group, CONSUMER, streams, count=count,
                                                 block=block) or []
            return reply
        pipe = client.pipeline(transaction=False)
        for stream, at in streams.items():
            pipe.xreadgroup(self.group, CONSUMER, {stream: at}, count=count)
        reply = [pair for part in pipe.execute() for pair in (part or [])]
        if block is not None and not any(entries for _, entries in reply):
            self._closed.wait(min(block / 1000.0, CLUSTER_IDLE_SECONDS))
        return reply

    def commit(self, messages: Sequence[UpdateMessage]) -> None:
        ids: dict[str, list[str]] = {}
        for m in messages:
            ids.setdefault(m.topic, []).append(m.position)
        with _reachable("acknowledging updates", self.address):
            pipe = self._conn.client.pipeline(transaction=False)
            for stream, entry_ids in ids.items():
                pipe.xack(stream, self.group, *entry_ids)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:  # one a stream
            # a stream replaced by another type since its entries were read has no group
            # to acknowledge them in (the next poll sets it aside): the others' acks stand
            if isinstance(reply, redis.ResponseError) and "WRONGTYPE" not in str(reply):
                raise reply

    def backlog(self) -> dict[str, int]:
        """Entries of each stream not acknowledged by this group (XINFO GROUPS: lag +
        pending)."""
        streams = list(self._streams)
        with _reachable("reading the backlog", self.address):
            pipe = self._conn.client.pipeline(transaction=False)
            for stream in streams:
                pipe.xinfo_groups(stream)
            replies = pipe.execute(raise_on_error=False)
        out = {}
        for stream, groups in zip(streams, replies, strict=True):
            if isinstance(groups, Exception):
                continue  # deleted meanwhile
            for g in groups:
                if g.get("name") in (self.group, self.group.encode()):
                    out[stream] = int(g.get("lag") or 0) + int(g.get("pending") or 0)
        return out

    def close(self) -> None:
        self._closed.set()
        self._conn.close()


class RedisStreamPublisher(UpdatePublisher):
    """Appends messages to streams with XADD (pipelined), trimmed to about
    `stream_maxlen` entries when that is set."""

    name = "redis_stream"

    def __init__(self, config: UpdateSourceConfig) -> None:
        self.address = config.address
        self._maxlen = config.stream_maxlen
        self._conn = _Connection(config, socket_timeout=30.0)

    def publish(self, topic: str, payloads: Sequence[bytes]) -> None:
        with _reachable("publishing updates", self.address):
            pipe = self._conn.client.pipeline(transaction=False)
            for payload in payloads:
                pipe.xadd(topic, {FIELD: payload}, maxlen=self._maxlen, approximate=True)
            pipe.execute()

    def flush(self, timeout: float) -> None:
        """Nothing to wait for: `publish` returns once Redis has the entries."""

    def close(self) -> None:
        self._conn.close()
