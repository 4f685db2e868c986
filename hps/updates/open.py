"""The update source or publisher of a config: `open_source(config)` and
`open_publisher(config)`, the one place that maps `update_source.type` to a class.

The backends (kafka.py, redis_stream.py) are imported when their type is asked for, so a
server that reads one never imports the other's client library.
"""

from __future__ import annotations

import os
import socket

from hps.config import UpdateSourceConfig
from hps.errors import ConfigError
from hps.updates.contract import UpdatePublisher, UpdateSource


def default_group() -> str:
    """The consumer group of a replica that names none: `hps-<host name>`."""
    return f"hps-{socket.gethostname() or os.getpid()}"


def open_source(config: UpdateSourceConfig) -> UpdateSource:
    """The source `config.type` names, not yet following any model.

    Raises ConfigError for type "null" and MissingExtraError when the client library of
    the type is not installed.
    """
    group = config.group or default_group()
    if config.type == "kafka_message_queue":
        from hps.updates.kafka import KafkaSource

        return KafkaSource(config, group)
    if config.type == "redis_stream":
        from hps.updates.redis_stream import RedisStreamSource

        return RedisStreamSource(config, group)
    raise ConfigError("update_source.type is 'null': there is no update source to read")


def open_publisher(config: UpdateSourceConfig) -> UpdatePublisher:
    """The publisher for `config.type` (see open_source for what is raised)."""
    if config.type == "kafka_message_queue":
        from hps.updates.kafka import KafkaPublisher

        return KafkaPublisher(config)
    if config.type == "redis_stream":
        from hps.updates.redis_stream import RedisStreamPublisher

        return RedisStreamPublisher(config)
    raise ConfigError("update_source.type is 'null': there is nowhere to publish updates")
