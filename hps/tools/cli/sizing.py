"""The memory a table would take once loaded, told from its key count and width alone (no
GPU needed): the rows `hps inspect` prints below a table's description."""

from __future__ import annotations

from collections.abc import Callable


def host_memory_rows(num_keys: int, dim: int) -> list[tuple[str, str]]:
    """Process memory the in-process hash map takes for the whole table, by
    embedding_storage_dtype (what hps/tiers/hash_map/ allocates for a load of it)."""
    from hps.rows.storage_types import STORAGE_NAMES
    from hps.tiers.hash_map import HashMapTier

    mib = 1 << 20
    return [(f"memory, in-process hash map, {name}",
             f"{HashMapTier.memory_required(num_keys, dim, name) / mib:,.1f} MiB")
            for name in STORAGE_NAMES]


def gpu_memory_rows(num_keys: int, dim: int) -> list[tuple[str, str]]:
    """GPU memory one cache of the table takes per deployed device, by cache type and
    embedding_storage_dtype (float32 first, the compact types in parentheses): what
    hps/gpu/open.py sizes, its extra slots included (no GPU needed to tell)."""
    from hps.gpu.open import cache_memory_bytes
    from hps.gpu.static_table import StaticEmbeddingTable
    from hps.rows.storage_types import STORAGE_NAMES

    def by_storage(nbytes: Callable[[str], int]) -> str:
        mib = 1 << 20
        compact = ", ".join(f"{name} {nbytes(name) / mib:,.1f}" for name in STORAGE_NAMES[1:])
        return f"{nbytes('float32') / mib:,.1f} MiB per device ({compact})"

    def dynamic(p: float) -> str:
        return by_storage(lambda name: cache_memory_bytes(num_keys, dim, p, name))

    rows = [(f"GPU memory, dynamic cache, gpucacheper {p}", dynamic(p)) for p in (0.1, 0.5, 1.0)]
    static = by_storage(
        lambda name: StaticEmbeddingTable.memory_required(max(num_keys, 1), dim, storage=name))
    return [*rows, ("GPU memory, static table", static)]
