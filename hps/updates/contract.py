"""The contract of an update source (where the consumer reads messages) and of an update
publisher (where `hps publish` writes them); open.py opens the one a config names.

A source delivers messages of topics `hps_et.<model>.<table>` (a Kafka topic, a Redis
stream) in order per topic, and forgets them only when they are committed: a consumer
that stops before `commit` gets them again (at-least-once). A group seen for the first
time starts at the earliest message the source still holds.

Like the tiers (hps/tiers/contract.py), a source declares what it can do instead of
callers probing for methods: `reports_backlog` says whether `backlog()` answers.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hps.tiers.contract import TABLE_PREFIX


@dataclass(frozen=True)
class UpdateMessage:
    """One message as a source delivered it.

    topic      hps_et.<model>.<table>
    payload    the HCTR message (codec.py)
    position   where it sits in its topic, as the source spells it ("3:1207": partition
               and offset; "1718000000000-0": a stream entry id)
    offset     the same as one number where the source has one (Kafka), else None
    published  when the source took the message, seconds since the epoch
    """

    topic: str
    payload: bytes
    position: str
    offset: int | None
    published: float


class UpdateSource(ABC):
    """The consumer's side of a message log, for one consumer group.

    Thread safety: one thread (the consumer's) calls every method but `close`.
    """

    #: short name for logs and metric labels ("kafka", "redis_stream")
    name: str = "source"
    #: whether `backlog()` answers (else it raises NotImplementedError)
    reports_backlog: bool = False
    #: whether `follow` drops this group's position on the topics of a model it no
    #: longer follows (a Redis stream's consumer group, one per stream); a Kafka group
    #: spans every topic it reads, and its committed offsets stay
    leaves_topics: bool = False

    @abstractmethod
    def follow(self, tables: Mapping[str, Sequence[str]]) -> None:
        """Read the topics of these models from now on (`tables`: model name → its table
        names): every `hps_et.<model>.*` topic, also topics of tables the model lacks
        (their messages are rejected as "unknown_table") and topics created later (found
        within `metadata_refresh_interval_ms`). Models an earlier call followed that
        `tables` leaves out are left: a source that keeps a position per topic for this
        group drops it where the topics stay for others (`leaves_topics`). Raises
        UpdateSourceUnavailableError."""

    @abstractmethod
    def rewind(self) -> None:
        """Deliver every message the source holds again, from the earliest, whatever this
        group committed: for a server whose tiers lost the rows at its restart (an
        in-process tier alone), the log is the only record of them. Call before
        `follow`."""

    @abstractmethod
    def poll(self, max_messages: int, timeout: float) -> list[UpdateMessage]:
        """Up to `max_messages` messages not yet committed, in order per topic, waiting
        at most `timeout` seconds for the first. Raises UpdateSourceUnavailableError when
        the source cannot be reached."""

    @abstractmethod
    def commit(self, messages: Sequence[UpdateMessage]) -> None:
        """Mark `messages` (some earlier `poll`'s, applied) as done for this group, so a
        restart resumes after them. Raises UpdateSourceUnavailableError."""

    def backlog(self) -> dict[str, int]:
        """Messages of each followed topic not yet delivered to this group. May do I/O;
        raises UpdateSourceUnavailableError, or NotImplementedError unless
        `reports_backlog`."""
        raise NotImplementedError(f"{type(self).__name__} does not report its backlog")

    def faults(self) -> dict[str, str]:
        """Followed topics that cannot be read now, with why (a key of another type where
        a stream should be); the source reads the others meanwhile. No I/O."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Leave the group (keeping its committed position) and release connections."""


class UpdatePublisher(ABC):
    """The producer's side: appends messages to topics."""

    name: str = "publisher"

    @abstractmethod
    def publish(self, topic: str, payloads: Sequence[bytes]) -> None:
        """Append `payloads` to `topic` in order. Raises UpdateSourceUnavailableError."""

    @abstractmethod
    def flush(self, timeout: float) -> None:
        """Wait until everything published so far is stored by the source."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release connections."""


def topic_pattern(model: str) -> str:
    """The regular expression of every topic of `model` (`^hps_et\\.<model>\\.`)."""
    return f"^{re.escape(TABLE_PREFIX)}\\.{re.escape(model)}\\..+$"
