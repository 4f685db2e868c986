"""hps.torch.DeltaPublisher end to end: an nn.Embedding (sparse gradients, SGD) and an
nn.EmbeddingBag (dense gradients, Adagrad) trained for a few steps while a server loaded
from their torch.save file serves them and follows Redis Streams or librdkafka's mock
Kafka cluster; after each published step every row of both tables is served with its
value after the step (changed rows new, unchanged rows as they were)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from hps import HierarchicalParameterServer
from hps.errors import BadUpdateError, ConfigError, UnknownTableError
from hps.torch import DeltaPublisher
from hps.updates import codec
from tests.conftest import model_config
from tests.support.redis_servers import RedisServer, eventually
from tests.updates import conftest as update_fixtures

DIM = 8

# the update tests' brokers: a real redis-server, librdkafka's mock Kafka cluster
stream_redis = update_fixtures.stream_redis
redis_updates = update_fixtures.redis_updates
kafka_cluster = update_fixtures.kafka_cluster
kafka_updates = update_fixtures.kafka_updates
updates = update_fixtures.updates


class Recommender(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embedding = torch.nn.Embedding(1000, DIM, sparse=True)
        self.bag = torch.nn.EmbeddingBag(300, DIM, mode="sum")

    def forward(self, ids: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        return (self.embedding(ids) ** 2).sum() + (self.bag(bags) ** 2).sum()


def config(tmp_path: Path, model: Recommender, updates: dict[str, Any]) -> dict[str, Any]:
    torch.save(model.state_dict(), tmp_path / "model.pt")
    files = [{"path": str(tmp_path / "model.pt"), "tensor": f"{name}.weight"}
             for name in ("embedding", "bag")]
    return {
        "models": [model_config(files, [DIM, DIM],  # type: ignore[list-item]
                                embedding_table_names=["embedding", "bag"])],
        "volatile_db": {"type": "hash_map"},
        "update_source": {"poll_timeout_ms": 50, "metadata_refresh_interval_ms": 200,
                          "max_batch_size": 64, **updates},
    }


def served(server: HierarchicalParameterServer, model: Recommender) -> None:
    for table, weight in ((0, model.embedding.weight), (1, model.bag.weight)):
        keys = np.arange(weight.shape[0], dtype=np.int64)
        np.testing.assert_array_equal(server.lookup("m", table, keys), weight.detach().numpy())


def test_training_steps_are_served(tmp_path: Path, updates: dict[str, Any]) -> None:
    model = Recommender()
    cfg = config(tmp_path, model, updates)
    sgd = torch.optim.SGD(model.embedding.parameters(), lr=0.3)
    adagrad = torch.optim.Adagrad(model.bag.parameters(), lr=0.3)
    rng = torch.Generator().manual_seed(1)
    with HierarchicalParameterServer(cfg) as server, DeltaPublisher(
            model, cfg, model_name="m") as publisher:
        assert [(t.name, t.track) for t in publisher.tables] == [("embedding", "gradient"),
                                                                  ("bag", "shadow")]
        served(server, model)
        for step in range(4):
            before = [model.embedding.weight.detach().clone(), model.bag.weight.detach().clone()]
            ids = torch.randint(0, 1000, (64, 5), generator=rng)
            bags = torch.randint(0, 300, (32, 4), generator=rng)
            model(ids, bags).backward()
            sgd.step()
            adagrad.step()
            changed = sum(int(w.detach().ne(b).any(dim=1).sum()) for w, b in
                          zip((model.embedding.weight, model.bag.weight), before, strict=True))
            assert 0 < publisher.publish() == changed
            publisher.flush()
            sgd.zero_grad()
            adagrad.zero_grad()
            # a Kafka consumer joins topics that appear after it started within a rebalance
            eventually(lambda: served(server, model), 40.0 if step == 0 else 20.0,
                       f"step {step} served")
        assert publisher.publish() == 0  # nothing changed since


def _entries(port: int, topic: str) -> list[tuple[np.ndarray, np.ndarray]]:
    with redis.Redis(port=port) as client:
        return [codec.decode(fields[b"u"], dim=DIM, key_bytes=8, uint32_keys=False)
                for _, fields in client.xrange(topic)]


def test_rows_go_in_batches_with_offsets_and_their_values_after_the_step(
        tmp_path: Path, redis_updates: dict[str, Any], stream_redis: RedisServer) -> None:
    model = Recommender()
    cfg = config(tmp_path, model, redis_updates)
    weight = model.bag.weight
    with DeltaPublisher({"bag": weight}, cfg, model_name="m", key_offsets={"bag": 10_000},
                        track="shadow", max_pending=1) as publisher:
        with torch.no_grad():
            weight[5:205] += 1.0
        assert publisher.publish() == 200
        expected = weight.detach().numpy()[5:205].copy()
        with torch.no_grad():
            weight[7] += 1.0  # after publish(): not in the first messages
        publisher.flush()
        got = _entries(stream_redis.port, "hps_et.m.bag")
        assert [len(k) for k, _ in got] == [64, 64, 64, 8]
        keys = np.concatenate([k for k, _ in got])
        np.testing.assert_array_equal(keys, np.arange(10_005, 10_205))
        rows = np.concatenate([v for _, v in got])
        np.testing.assert_array_equal(rows, expected)
        assert publisher.publish() == 1


def test_bad_tables_and_rows_are_refused(tmp_path: Path, redis_updates: dict[str, Any],
                                         stream_redis: RedisServer) -> None:
    model = Recommender()
    cfg = config(tmp_path, model, redis_updates)
    with pytest.raises(UnknownTableError, match="has no table 'nope'"):
        DeltaPublisher({"nope": model.bag}, cfg, model_name="m")
    with pytest.raises(ConfigError, match=r"is \[300, 4\] but model 'm' serves it 8 wide"):
        DeltaPublisher({"bag": torch.zeros(300, 4)}, cfg, model_name="m")
    with pytest.raises(ConfigError, match="track 'fast' is not one of"):
        DeltaPublisher(model, cfg, model_name="m", track="fast")
    with DeltaPublisher(model, cfg, model_name="m", track="shadow") as publisher:
        with torch.no_grad():
            model.bag.weight[3, 1] = float("nan")
            model.embedding.weight[4] += 1.0
        with pytest.raises(BadUpdateError, match="NaN or infinite"):
            publisher.publish()
        publisher.flush()
        assert _entries(stream_redis.port, "hps_et.m.embedding") == []


def test_publish_rate(tmp_path: Path, redis_updates: dict[str, Any]) -> None:
    """Rows per second into Redis Streams at dim 64 (printed; the issue's floor is 1 M/s
    on the 2-core machine, recorded in docs/pytorch.md, not asserted: timings never
    decide a test)."""
    table = torch.nn.Embedding(200_000, 64)
    cfg: dict[str, Any] = {
        "models": [model_config([str(tmp_path / "unused")], [64],
                                embedding_table_names=["t"])],
        "update_source": {**redis_updates, "max_batch_size": 8192},
    }
    with DeltaPublisher({"t": table}, cfg, model_name="m", track="shadow") as publisher:
        with torch.no_grad():
            table.weight += 1.0
        start = time.perf_counter()
        assert publisher.publish() == 200_000
        publisher.flush()
        seconds = time.perf_counter() - start
    print(f"DeltaPublisher: {200_000 / seconds / 1e6:.2f} M rows/s at dim 64 into Redis Streams")
