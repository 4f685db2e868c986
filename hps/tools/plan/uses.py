"""Which of a table's planned rows (memory.py) its config uses, which are alternatives to
them, and what the config's choices add up to: what `hps plan` prints so that its table
reads alone.

- The GPU layouts (a dynamic cache, a static table, a uvm table with its pinned host
  rows) are alternatives to each other: the config's `embedding_cache_type` uses one, the
  others are marked with the setting that would use them. With `gpucache: false` the
  table uses no GPU row at all: those rows are left out of the printed table (`--json`
  keeps them), and a line says so.
- The volatile tiers (the in-process hash map, Redis) are alternatives the same way
  (`volatile_db.type`), and RocksDB is used with `persistent_db` alone.
- The totals add up the rows the config uses, in each storage type: on each GPU the table
  is deployed on (its layout and one lookup thread's query buffers), in host memory (the
  in-process hash map, uvm's pinned rows, the pinned query buffers) and on disk (RocksDB).
  Redis holds its rows in its own process, named apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from hps.rows.storage_types import STORAGE_NAMES
from hps.tools.plan.memory import TierBytes
from hps.tools.plan.tables import TableShape

#: the parts each embedding_cache_type uses
_LAYOUT_PARTS = {"dynamic": ("dynamic",), "static": ("static",), "uvm": ("uvm", "uvm_rows")}
#: the parts any GPU layout uses
_GPU_PARTS = frozenset({"dynamic", "static", "uvm", "uvm_rows", "query", "query_host"})
#: the volatile part of each volatile_db type
_VOLATILE_PARTS = {"hash_map": "hash_map", "parallel_hash_map": "hash_map",
                   "multi_process_hash_map": "hash_map", "redis_cluster": "redis"}


@dataclass(frozen=True)
class PlannedRow:
    """A row of the printed plan: its bytes and, for a row the config does not use, the
    setting that would (empty for the config's own)."""

    bytes: TierBytes
    instead: str = ""


def gpu_in_use(shape: TableShape) -> bool:
    """Whether the table is served through a GPU cache at all."""
    return shape.gpucache and shape.devices > 0


def planned_rows(shape: TableShape, memory: list[TierBytes]) -> list[PlannedRow]:
    """The rows to print, in `memory`'s order: the GPU rows only where the GPU is used."""
    rows = []
    for tier in memory:
        if tier.part in _GPU_PARTS and not gpu_in_use(shape):
            continue
        rows.append(PlannedRow(tier, _instead(shape, tier.part)))
    return rows


def _instead(shape: TableShape, part: str) -> str:
    """The setting that would use a row of `part` ("" where the config uses it)."""
    for cache_type, parts in _LAYOUT_PARTS.items():
        if part in parts and cache_type != shape.cache_type:
            return f"embedding_cache_type: {cache_type}"
    volatile = _VOLATILE_PARTS.get(shape.volatile_type, "")
    if part == "hash_map" and volatile != "hash_map":
        return "volatile_db.type: hash_map"
    if part == "redis" and volatile != "redis":
        return "volatile_db.type: redis_cluster"
    if part == "rocksdb" and not shape.persistent:
        return "persistent_db.type: rocks_db"
    return ""


def totals(shape: TableShape, rows: list[PlannedRow]) -> list[TierBytes]:
    """The config's rows added up in each storage type: per GPU (when it uses one), host
    memory and disk (when it uses some); the Redis row stands apart (its own process)."""
    used = [r.bytes for r in rows if not r.instead and r.bytes.part != "redis"]
    thread = ", one lookup thread" if gpu_in_use(shape) else ""
    out = []
    for where, label, note in (
            ("device", "total per GPU", f"the config's layout{thread}"),
            ("host", "total host memory", f"this process{thread}"),
            ("disk", "total disk", "")):
        parts = [t for t in used if t.where == where]
        if parts:
            out.append(TierBytes(label, where, {s: sum(t.by_storage[s] for t in parts)
                                                for s in STORAGE_NAMES}, note, "total"))
    return out
