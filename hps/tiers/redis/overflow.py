"""Overflow pruning of the Redis tier: partitions grown past `overflow_margin` are cut
to `overflow_margin` x `overflow_resolution_target` keys by `overflow_policy`.

One survey round trip (the partitions' keys and, for the LRU/LFU policies, their
metadata) and one round trip of `HDEL`s; victims are chosen in NumPy per partition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.config import VolatileDBConfig
from hps.tiers.redis.connection import Cmd, RedisClient, Topology
from hps.tiers.redis.layout import (
    FIELD_WIDTH,
    TableLayout,
    command,
    eviction_scores,
    head,
    pack_fields,
    parse_keys,
)

log = logging.getLogger("hps.tiers.redis")


def prune_overflow(client: RedisClient, config: VolatileDBConfig, layout: TableLayout,
                   table: str, partitions: np.ndarray) -> None:
    """Prune every partition in `partitions` to overflow_margin × resolution target.

    Victims: random keys, the least used (lowest count) or the oldest (lowest time);
    keys without metadata count as least used / oldest. Metadata of keys that are no
    longer in the value hash is deleted too.
    """
    target = int(config.overflow_margin * config.overflow_resolution_target)
    policy = config.overflow_policy
    present: dict[int, list[bytes]] = {}
    metadata: dict[int, list[bytes]] = {}

    def keep(into: dict[int, list[bytes]], p: int) -> Callable[[Any], None]:
        def on_reply(reply: list[bytes]) -> None:
            into[p] = reply

        return on_reply

    def survey(topology: Topology) -> list[Cmd]:
        node_of = topology.node_of(layout)
        cmds = []
        for p in partitions.tolist():
            node = int(node_of[p])
            cmds.append(Cmd(node, [command(b"HKEYS", layout.values[p])], keep(present, p)))
            if policy != "evict_random":
                cmds.append(Cmd(node, [command(b"HGETALL", layout.metas[p])],
                                 keep(metadata, p)))
        return cmds

    client.execute(survey, f"overflow survey of {table!r}")

    victims: dict[int, np.ndarray] = {}
    orphans: dict[int, np.ndarray] = {}
    for p in partitions.tolist():
        keys = parse_keys(present.get(p, []))
        excess = keys.size - target
        if policy == "evict_random":
            if excess > 0:
                rng = np.random.default_rng()
                victims[p] = keys[rng.choice(keys.size, size=excess, replace=False)]
            continue
        score, stale = eviction_scores(keys, metadata.get(p, []), policy)
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

    def prune(topology: Topology) -> list[Cmd]:
        node_of = topology.node_of(layout)
        cmds = []
        for names, doomed in ((layout.values, delete_v), (layout.metas, delete_t)):
            for p, keys in doomed.items():
                fields = pack_fields(keys)
                for a in range(0, keys.size, config.max_batch_size):
                    b = min(a + config.max_batch_size, keys.size)
                    cmds.append(Cmd(int(node_of[p]), [
                        head(2 + b - a, b"HDEL", names[p]),
                        fields[a * FIELD_WIDTH:b * FIELD_WIDTH]]))
        return cmds

    client.execute(prune, f"overflow pruning of {table!r}")
    log.debug("redis tier: pruned %d keys of %s in %d partitions", sum(
        k.size for k in victims.values()), table, len(victims))
