"""The parameter server: models, their tables, and the lookup path.

Lookup path (docs/architecture.md): keys → GPU cache (when there is one) → volatile tier →
persistent tier → the table's default value. Vectors of keys found only in the
persistent tier are copied into the volatile tier when `cache_missed_embeddings` is set.

- `parameter_server.py`: `HierarchicalParameterServer`, the one object callers hold;
- `registry.py`: the loaded models, versioned loads, one-assignment swaps, retirement;
- `host_lookup.py`: the tiers, top down, on host arrays (also a GPU cache's misses);
- `gpu_caches.py`: GPU caches of the tables, attached, warmed up, refreshed, closed;
- `cache_journal.py`: with several workers, the leader's updated keys for the others' caches;
- `models.py`: a loaded model, its tables and their counters.

The server opens its tiers with `db.open_tiers` and knows them only through the
`db/base.py` contract.
"""

from hps.server.models import LoadedModel, LoadedTable, TableStats
from hps.server.parameter_server import HierarchicalParameterServer
from hps.server.registry import STAGING_SUFFIX

__all__ = [
    "STAGING_SUFFIX",
    "HierarchicalParameterServer",
    "LoadedModel",
    "LoadedTable",
    "TableStats",
]
