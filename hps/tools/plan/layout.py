"""Which GPU layout `hps plan` expects to serve a table faster over its devices, and why.

A table deployed on N > 1 GPUs is either replicated (a whole cache on each GPU: every
lookup reads its own device) or sharded row-wise (`gpu_sharding: row_wise`: each GPU
caches 1/N of the keys, and (N-1)/N of a lookup's rows cross the peer link). The two are
compared at the same bytes per GPU, the config's own:

- replicated at gpucacheper p takes the bytes a sharded table of N × p (at most the whole
  table) takes on each GPU; a sharded config of p compares with replicated at p / N;
- where the replicated cache holds the whole table, it wins: every key is a local hit,
  while sharded lookups pay the link (two H200s over NVLink, all hits: 0.45-0.81x one GPU,
  docs/gpu-cache.md "What sharding costs and what it wins");
- otherwise sharding serves more of the keys from GPU memory. What that is worth depends
  on the keys: with a key log, the two caches' hit rates are replayed (hit_rates.py) and
  sharding is expected faster when it misses measurably less (by MISS_MARGIN of the
  lookups): a miss costs a host-tier fetch, tens of times a peer row; without one, the
  plan says which is likelier and asks for a log.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hps.tools.plan.tables import TableShape

#: how much less often (a share of lookups) the sharded cache must miss to be expected faster
MISS_MARGIN = 0.005


@dataclass(frozen=True)
class LayoutChoice:
    """The layout expected faster for a table over its GPUs, with what decided it."""

    faster: str  # "replicated" or "row_wise sharded"
    why: str
    devices: int
    replicated_share: float  # gpucacheper of the replicated cache at these bytes per GPU
    sharded_share: float  # of the sharded cache at the same bytes per GPU
    bytes_per_gpu: int  # the config's, in its storage type
    link_share: float  # of a sharded lookup's rows, read from other GPUs
    replicated_hit_rate: float | None = None  # from the key log, if any
    sharded_hit_rate: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def layout_choice(shape: TableShape, bytes_per_gpu: int, keys: np.ndarray | None = None,
                  batch: int = 4096) -> LayoutChoice | None:
    """The choice for `shape` over its devices (None on one GPU or for a static or uvm
    table, which hold every key they serve), `keys` its key log if there is one."""
    devices = shape.devices
    if devices < 2 or shape.cache_type != "dynamic":
        return None
    p = shape.gpucacheper
    if shape.shards > 1:
        replicated, sharded = p / devices, min(1.0, p)
    else:
        replicated, sharded = min(1.0, p), min(1.0, p * devices)
    link = (devices - 1) / devices
    common = {"devices": devices, "replicated_share": replicated, "sharded_share": sharded,
              "bytes_per_gpu": bytes_per_gpu, "link_share": link}
    if replicated >= 1.0:
        return LayoutChoice("replicated", (
            f"each GPU's cache holds the whole table: every key is a hit on its own GPU, "
            f"where sharded, {link:.0%} of the rows would cross the peer link"), **common)
    if keys is None:
        return LayoutChoice("row_wise sharded", (
            f"at the same bytes per GPU a sharded cache holds {sharded:.0%} of the keys, a "
            f"replicated one {replicated:.0%}; a miss costs a host-tier fetch, a peer row "
            f"far less ({link:.0%} of the rows cross the link). Keys so skewed that "
            f"{replicated:.0%} already hits them all favour replicated: give --key-log "
            "to know"), **common)
    from hps.tools.plan.hit_rates import hit_rate

    h_rep = hit_rate(keys, shape.num_keys, replicated, batch).warm_hit_rate
    h_shard = hit_rate(keys, shape.num_keys, sharded, batch).warm_hit_rate
    rates = {"replicated_hit_rate": h_rep, "sharded_hit_rate": h_shard}
    if h_shard - h_rep >= MISS_MARGIN:
        return LayoutChoice("row_wise sharded", (
            f"on the key log, at the same bytes per GPU, sharded misses {1 - h_shard:.2%} "
            f"of the keys, replicated {1 - h_rep:.2%}: the misses it saves (host-tier "
            f"fetches) cost more than its peer reads ({link:.0%} of the rows)"),
            **common, **rates)
    return LayoutChoice("replicated", (
        f"on the key log, at the same bytes per GPU, both hit about as often "
        f"({h_rep:.2%} replicated, {h_shard:.2%} sharded): replicated reads every row "
        f"from its own GPU, sharded {link:.0%} over the peer link"), **common, **rates)
