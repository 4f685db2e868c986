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

Standalone Redis only (one server, or the node of a cluster that holds the streams).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hps.config import UpdateSourceConfig
from hps.db.base import TABLE_PREFIX, table_name
from hps.errors import ConfigError, MissingExtraError, UpdateSourceUnavailableError
from hps.updates.source import UpdateMessage, UpdatePublisher, UpdateSource

try:
    import redis
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

#: the field of a stream entry that holds the payload
FIELD = b"u"
#: the consumer name of a replica inside its group (one consumer per group)
CONSUMER = "hps"
#: id to read a stream's own pending entries from / to read new entries
_PENDING, _NEW = "0", ">"


def _client(config: UpdateSourceConfig, socket_timeout: float) -> Any:
    if redis is None:
        raise MissingExtraError("redis", "redis", "Redis Streams updates")
    host, sep, port = config.address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"update_source.address {config.address!r} is not host:port "
                          "(expected e.g. '127.0.0.1:6379')")
    return redis.Redis(
        host=host.strip("[]"), port=int(port),
        username=config.user_name if config.password else None,
        password=config.password or None,
        socket_timeout=socket_timeout, socket_connect_timeout=2.0, protocol=2,
    )


@contextmanager
def _reachable(what: str, address: str) -> Iterator[None]:
    """Network failures of the block as UpdateSourceUnavailableError."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
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

    def __init__(self, config: UpdateSourceConfig, group: str) -> None:
        self.address = config.address
        self.group = group
        self._redis = _client(config, socket_timeout=config.poll_timeout_ms / 1000.0 + 5.0)
        self._rescan_every = config.metadata_refresh_interval_ms / 1000.0
        self._rescan_at = 0.0
        self._tables: dict[str, tuple[str, ...]] = {}
        self._streams: dict[str, str] = {}  # stream → id to read after (_PENDING…, or _NEW)
        self._rewind = False
        self._closed = threading.Event()

    def rewind(self) -> None:
        self._rewind = True

    def follow(self, tables: Mapping[str, Sequence[str]]) -> None:
        self._tables = {m: tuple(t) for m, t in tables.items()}
        prefixes = tuple(f"{TABLE_PREFIX}.{m}." for m in self._tables)
        self._streams = {s: at for s, at in self._streams.items() if s.startswith(prefixes)}
        with _reachable("joining the streams", self.address):
            self._join_tables()
        self._rescan_at = 0.0

    def _join_tables(self) -> None:
        for model, names in self._tables.items():
            for table in names:
                self._join(table_name(model, table), create=True)

    def _join(self, stream: str, *, create: bool) -> None:
        if stream in self._streams:
            return
        try:
            self._redis.xgroup_create(stream, self.group, id="0", mkstream=create)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            if self._rewind:  # the group exists: read it from the start again
                self._redis.xgroup_setid(stream, self.group, id="0")
        self._streams[stream] = _PENDING

    def _discover(self) -> None:
        for model in self._tables:
            pattern = _glob(f"{TABLE_PREFIX}.{model}.") + "*"
            for key in self._redis.scan_iter(match=pattern, count=1000, _type="STREAM"):
                self._join(key.decode(), create=False)

    def poll(self, max_messages: int, timeout: float) -> list[UpdateMessage]:
        with _reachable("reading updates", self.address):
            try:
                return self._poll(max_messages, timeout)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # the stream or its group went away (deleted, Redis restarted empty):
                # join again from what exists now
                self._streams = {}
                self._join_tables()
                self._rescan_at = 0.0
                return []

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
        reply = self._redis.xreadgroup(self.group, CONSUMER, streams, count=count,
                                       block=block) or []
        out = []
        for raw_stream, entries in reply:
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

    def commit(self, messages: Sequence[UpdateMessage]) -> None:
        ids: dict[str, list[str]] = {}
        for m in messages:
            ids.setdefault(m.topic, []).append(m.position)
        with _reachable("acknowledging updates", self.address):
            pipe = self._redis.pipeline(transaction=False)
            for stream, entry_ids in ids.items():
                pipe.xack(stream, self.group, *entry_ids)
            pipe.execute()

    def backlog(self) -> dict[str, int]:
        """Entries of each stream not acknowledged by this group (XINFO GROUPS: lag +
        pending)."""
        streams = list(self._streams)
        with _reachable("reading the backlog", self.address):
            pipe = self._redis.pipeline(transaction=False)
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
        self._redis.close()


class RedisStreamPublisher(UpdatePublisher):
    """Appends messages to streams with XADD (pipelined), trimmed to about
    `stream_maxlen` entries when that is set."""

    name = "redis_stream"

    def __init__(self, config: UpdateSourceConfig) -> None:
        self.address = config.address
        self._maxlen = config.stream_maxlen
        self._redis = _client(config, socket_timeout=30.0)

    def publish(self, topic: str, payloads: Sequence[bytes]) -> None:
        with _reachable("publishing updates", self.address):
            pipe = self._redis.pipeline(transaction=False)
            for payload in payloads:
                pipe.xadd(topic, {FIELD: payload}, maxlen=self._maxlen, approximate=True)
            pipe.execute()

    def flush(self, timeout: float) -> None:
        """Nothing to wait for: `publish` returns once Redis has the entries."""

    def close(self) -> None:
        self._redis.close()
