"""The memory a table would take once loaded, told from its key count and width alone (no
GPU needed): the rows `hps inspect` prints below a table's description. The numbers are
hps/tools/plan/memory.py's (the tiers' own sizing functions), the ones `hps plan` prints
for every tier."""

from __future__ import annotations

from hps.rows.storage_types import STORAGE_NAMES
from hps.tools.plan.memory import dynamic_cache_bytes, hash_map_bytes, static_table_bytes

_MIB = 1 << 20


def host_memory_rows(num_keys: int, dim: int) -> list[tuple[str, str]]:
    """Process memory the in-process hash map takes for the whole table, by
    embedding_storage_dtype (what hps/tiers/hash_map/ allocates for a load of it)."""
    nbytes = hash_map_bytes(num_keys, dim)
    return [(f"memory, in-process hash map, {name}", f"{nbytes[name] / _MIB:,.1f} MiB")
            for name in STORAGE_NAMES]


def gpu_memory_rows(num_keys: int, dim: int) -> list[tuple[str, str]]:
    """GPU memory one cache of the table takes per deployed device, by cache type and
    embedding_storage_dtype (float32 first, the compact types in parentheses): what
    hps/gpu/open.py sizes, its extra slots included (no GPU needed to tell)."""

    def by_storage(nbytes: dict[str, int]) -> str:
        compact = ", ".join(f"{name} {nbytes[name] / _MIB:,.1f}" for name in STORAGE_NAMES[1:])
        return f"{nbytes['float32'] / _MIB:,.1f} MiB per device ({compact})"

    rows = [(f"GPU memory, dynamic cache, gpucacheper {p}",
             by_storage(dynamic_cache_bytes(num_keys, dim, p))) for p in (0.1, 0.5, 1.0)]
    return [*rows, ("GPU memory, static table", by_storage(static_table_bytes(num_keys, dim)))]
