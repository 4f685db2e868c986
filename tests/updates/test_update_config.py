"""`update_source` in ps.json and in HugeCTR's UpdateSourceParams: HugeCTR's keys, the
hps extensions (redis_stream and its address, group, ...), and bad values refused."""

from __future__ import annotations

from typing import Any

import pytest

from hps.config import load_config
from hps.errors import ConfigError
from hps.hugectr.databases import UpdateSourceParams
from hps.hugectr.enums import UpdateSourceType_t
from hps.hugectr.params import ParameterServerConfig


def _config(update_source: dict[str, Any]) -> dict[str, Any]:
    return {"models": [{"model": "m", "sparse_files": ["/x"], "embedding_vecsize_per_table": [4],
                        "maxnum_catfeature_query_per_table_per_sample": [1],
                        "deployed_device_list": [0], "default_value_for_each_table": [0.0]}],
            "update_source": update_source}


def test_hugectrs_keys_and_ours_round_trip_through_the_python_objects() -> None:
    typed = load_config(_config({
        "type": "redis_stream", "address": "h:6379", "group": "replica-a",
        "gpu_cache_insert": True, "metadata_refresh_interval_ms": 100,
        "kafka_options": {"security.protocol": "SSL"}}))
    objects = ParameterServerConfig.from_config(typed)
    assert objects.update_source.type is UpdateSourceType_t.RedisStream
    assert objects.update_source.metadata_refresh_interval_ms == 100  # used, not ignored
    assert objects.update_source.hps_options == {
        "address": "h:6379", "group": "replica-a", "gpu_cache_insert": True,
        "kafka_options": {"security.protocol": "SSL"}}
    assert objects.to_config() == typed
    params = UpdateSourceParams(type=UpdateSourceType_t.KafkaMessageQueue, brokers="k:9092",
                                hps_options={"group": "g"})
    assert params.to_json()["type"] == "kafka_message_queue"
    assert params.to_json()["group"] == "g"


@pytest.mark.parametrize("bad", [
    {"type": "rabbitmq"}, {"type": "redis_stream", "key_bytes": 2},
    {"type": "kafka_message_queue", "max_commit_interval": 0},
    {"type": "kafka_message_queue", "poll_timeout_ms": -1},
    {"type": "redis_stream", "group": ""},
])
def test_bad_values_are_config_errors(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="update_source"):
        load_config(_config(bad))


def test_null_type_means_no_updates() -> None:
    assert not load_config(_config({"type": None})).update_source.enabled
    assert load_config(_config({"type": "redis_stream"})).update_source.enabled
