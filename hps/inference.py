"""`hps.inference`: the names of `hugectr.inference`, so that the import is the only change.

    from hps.inference import HPS, ParameterServerConfig, InferenceParams   # was: hugectr.inference
"""

from __future__ import annotations

from hps.api import HPS
from hps.hugectr.databases import (
    PersistentDatabaseParams,
    UpdateSourceParams,
    VolatileDatabaseParams,
)
from hps.hugectr.enums import (
    DatabaseOverflowPolicy_t,
    DatabaseType_t,
    EmbeddingCacheType_t,
    UpdateSourceType_t,
)
from hps.hugectr.params import InferenceParams, ParameterServerConfig

__all__ = [
    "HPS",
    "DatabaseOverflowPolicy_t",
    "DatabaseType_t",
    "EmbeddingCacheType_t",
    "InferenceParams",
    "ParameterServerConfig",
    "PersistentDatabaseParams",
    "UpdateSourceParams",
    "UpdateSourceType_t",
    "VolatileDatabaseParams",
]
