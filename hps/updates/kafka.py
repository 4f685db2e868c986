"""Updates through Kafka (confluent-kafka, i.e. librdkafka), as HugeCTR published them.

One topic per table, `hps_et.<model>.<table>`; a message value is the HCTR payload
(codec.py). `KafkaSource` subscribes its consumer group to `^hps_et\\.<model>\\..+$` of
every followed model, so topics created later are found at the next metadata refresh
(`metadata_refresh_interval_ms`). Offsets are committed by hand, after the messages are
applied (`enable.auto.commit` off); a group without a committed offset starts at the
earliest retained message (`auto.offset.reset` earliest). librdkafka reconnects to
brokers by itself (backoff from `failure_backoff_ms`); while no broker answers, `poll`
raises UpdateSourceUnavailableError so the consumer reports the source as down.

`KafkaPublisher` writes every message of a topic to partition 0: the rows of one table
then keep the order they were published in, which is what makes the last update win.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hps.config import UpdateSourceConfig
from hps.errors import BadUpdateError, MissingExtraError, UpdateSourceUnavailableError
from hps.runtime.throttled_log import ThrottledLog
from hps.updates.contract import UpdateMessage, UpdatePublisher, UpdateSource, topic_pattern

try:
    import confluent_kafka as ck
except ImportError:  # pragma: no cover - exercised only without the extra
    ck = None  # type: ignore[assignment]

log = logging.getLogger("hps.updates.kafka")

#: the largest message a publisher sends (a batch of 8192 rows of width 128 is 4 MiB)
MAX_MESSAGE_BYTES = 256 << 20


class _ClientLog:
    """Where librdkafka's own log lines go: it logs every failed reconnect of every
    broker, so its warnings and errors are logged once a minute per kind (its facility:
    FAIL, REQTMOUT, ...), the rest at debug level. Counters and state are in the stats."""

    def __init__(self) -> None:
        self._throttled = ThrottledLog(log)

    def log(self, level: int, message: str, *args: object) -> None:
        if level >= logging.WARNING:
            text = message % args if args else message
            self._throttled.warning(text.split(" ", 1)[0], "Kafka client: %s", text)
        else:
            log.debug(message, *args)


def _require() -> None:
    if ck is None:
        raise MissingExtraError("confluent-kafka", "kafka", "Kafka updates")


def _outage_codes() -> frozenset[int]:
    e = ck.KafkaError
    return frozenset({e._ALL_BROKERS_DOWN, e._TRANSPORT, e._RESOLVE, e._TIMED_OUT,
                      e._WAIT_COORD})


def _ignored_codes() -> frozenset[int]:
    # no such topic yet (a table nobody published to), end of a partition
    e = ck.KafkaError
    return frozenset({e._PARTITION_EOF, e.UNKNOWN_TOPIC_OR_PART, e._UNKNOWN_TOPIC,
                      e._UNKNOWN_PARTITION})


class KafkaSource(UpdateSource):
    """A Kafka consumer of group `group` over the topics of the followed models."""

    name = "kafka"
    reports_backlog = True

    def __init__(self, config: UpdateSourceConfig, group: str) -> None:
        _require()
        self.brokers = config.brokers
        self.group = group
        self._outage: str | None = None  # set by librdkafka's error callback
        self._outage_lock = threading.Lock()
        self._patterns: list[str] = []
        self._rewind = False
        self._rewound: set[tuple[str, int]] = set()
        self._consumer = ck.Consumer({
            "bootstrap.servers": config.brokers,
            "group.id": group,
            "client.id": f"hps-{group}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "topic.metadata.refresh.interval.ms": config.metadata_refresh_interval_ms,
            "socket.receive.buffer.bytes": config.receive_buffer_size,
            "reconnect.backoff.ms": config.failure_backoff_ms,
            "reconnect.backoff.max.ms": max(config.failure_backoff_ms,
                                            config.failure_backoff_max_ms),
            "error_cb": self._on_error,
            "logger": _ClientLog(),
            **config.kafka_options,
        })

    def _on_error(self, error: Any) -> None:
        if error.code() in _outage_codes():
            with self._outage_lock:
                self._outage = str(error)

    def _unavailable(self, what: str, detail: object) -> UpdateSourceUnavailableError:
        return UpdateSourceUnavailableError(f"Kafka at {self.brokers} ({what}): {detail}")

    def rewind(self) -> None:
        self._rewind = True

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        """Partitions given to this consumer: once each, from the start when rewinding."""
        if self._rewind:
            for tp in partitions:
                if (tp.topic, tp.partition) not in self._rewound:
                    self._rewound.add((tp.topic, tp.partition))
                    tp.offset = ck.OFFSET_BEGINNING
        consumer.assign(partitions)

    def follow(self, tables: Mapping[str, Sequence[str]]) -> None:
        patterns = [topic_pattern(model) for model in sorted(tables)]
        if patterns == self._patterns:
            return
        try:
            if patterns:
                self._consumer.subscribe(patterns, on_assign=self._on_assign)
            else:
                self._consumer.unsubscribe()
        except ck.KafkaException as exc:
            raise self._unavailable("subscribing", exc) from exc
        self._patterns = patterns

    def poll(self, max_messages: int, timeout: float) -> list[UpdateMessage]:
        if not self._patterns:
            time.sleep(timeout)
            return []
        try:
            received = self._consumer.consume(num_messages=max_messages, timeout=timeout)
        except ck.KafkaException as exc:
            raise self._unavailable("reading updates", exc) from exc
        out = []
        for m in received:
            error = m.error()
            if error is not None:
                if error.code() in _ignored_codes():
                    continue
                if error.code() in _outage_codes() or error.retriable():
                    raise self._unavailable("reading updates", error)
                log.warning("Kafka consumer error: %s", error)
                continue
            kind, stamp = m.timestamp()
            published = stamp / 1000.0 if kind != ck.TIMESTAMP_NOT_AVAILABLE else time.time()
            out.append(UpdateMessage(m.topic() or "", m.value() or b"",
                                     f"{m.partition()}:{m.offset()}", m.offset(), published))
        if out:
            self._clear_outage()
        elif self._outage is not None:
            self._probe()
        return out

    def _clear_outage(self) -> None:
        with self._outage_lock:
            self._outage = None

    def _probe(self) -> None:
        """After an outage report and an empty poll: ask a broker for metadata; clears
        the outage when one answers, else raises UpdateSourceUnavailableError."""
        try:
            self._consumer.list_topics(timeout=1.0)
        except ck.KafkaException as exc:
            raise self._unavailable("no broker answers", self._outage or exc) from exc
        self._clear_outage()

    def commit(self, messages: Sequence[UpdateMessage]) -> None:
        ends: dict[tuple[str, int], int] = {}
        for m in messages:
            partition = int(m.position.split(":", 1)[0])
            key = (m.topic, partition)
            ends[key] = max(ends.get(key, -1), int(m.offset or 0) + 1)
        offsets = [ck.TopicPartition(t, p, o) for (t, p), o in ends.items()]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except ck.KafkaException as exc:
            error: Any = exc.args[0] if exc.args else None
            if error is not None and (error.code() in _outage_codes() or error.retriable()):
                raise self._unavailable("committing offsets", exc) from exc
            # the group was rebalanced meanwhile: whoever gets these partitions reads the
            # messages again and writes the same rows
            log.info("Kafka commit not taken (%s); the messages will be applied again", exc)

    def backlog(self) -> dict[str, int]:
        """Messages of each assigned topic after the group's committed offset."""
        try:
            assigned = self._consumer.assignment()
            if not assigned:
                return {}
            committed = self._consumer.committed(assigned, timeout=2.0)
            out: dict[str, int] = {}
            for tp in committed:
                low, high = self._consumer.get_watermark_offsets(tp, timeout=2.0,
                                                                 cached=False)
                start = tp.offset if tp.offset >= 0 else low
                out[tp.topic] = out.get(tp.topic, 0) + max(0, high - start)
            return out
        except ck.KafkaException as exc:
            raise self._unavailable("reading the backlog", exc) from exc

    def close(self) -> None:
        self._consumer.close()


def _producer_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`kafka_options` without the consumer's own settings (librdkafka warns about them)."""
    consumer_only = ("session.", "heartbeat.", "group.", "max.poll.", "fetch.",
                     "auto.offset.", "partition.assignment.", "enable.auto.")
    return {k: v for k, v in options.items() if not k.startswith(consumer_only)}


class KafkaPublisher(UpdatePublisher):
    """A Kafka producer; every message of a topic goes to partition 0 (see above)."""

    name = "kafka"

    def __init__(self, config: UpdateSourceConfig) -> None:
        _require()
        self.brokers = config.brokers
        self._failed: list[Any] = []  # delivery errors (KafkaError)
        self._producer = ck.Producer({
            "bootstrap.servers": config.brokers,
            "message.max.bytes": MAX_MESSAGE_BYTES,
            "linger.ms": 5,
            "enable.idempotence": True,
            "reconnect.backoff.ms": config.failure_backoff_ms,
            "logger": _ClientLog(),
            **_producer_options(config.kafka_options),
        })

    def _delivered(self, error: Any, message: Any) -> None:
        if error is not None:
            self._failed.append(error)

    def publish(self, topic: str, payloads: Sequence[bytes]) -> None:
        for payload in payloads:
            try:
                self._producer.produce(topic, payload, partition=0,
                                       on_delivery=self._delivered)
            except BufferError:
                self._producer.flush(30.0)  # the local queue is full: let it drain once
                self._producer.produce(topic, payload, partition=0,
                                       on_delivery=self._delivered)
            except ck.KafkaException as exc:
                raise BadUpdateError(f"Kafka refused a message of {len(payload)} bytes for "
                                     f"{topic}: {exc} (lower max_batch_size)",
                                     "message_size") from exc
            self._producer.poll(0)
        self._raise_failures()

    def flush(self, timeout: float) -> None:
        left = self._producer.flush(timeout)
        self._raise_failures()
        if left:
            raise UpdateSourceUnavailableError(
                f"Kafka at {self.brokers}: {left} messages not delivered in {timeout} s")

    def _raise_failures(self) -> None:
        if not self._failed:
            return
        failed, self._failed = self._failed, []
        if any(e.code() == ck.KafkaError.MSG_SIZE_TOO_LARGE for e in failed):
            raise BadUpdateError(
                f"Kafka at {self.brokers} refused messages as too large for the broker "
                "(its message.max.bytes): lower update_source.max_batch_size",
                "message_size")
        raise UpdateSourceUnavailableError(
            f"Kafka at {self.brokers} did not take {len(failed)} messages: {failed[0]}")

    def close(self) -> None:
        self.flush(30.0)
