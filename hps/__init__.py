"""hps: a hierarchical parameter server for recommender embeddings.

The successor of HugeCTR's HPS: a GPU embedding cache over a volatile database
(in-process hash map, Redis, Redis Cluster) over a persistent one (RocksDB).
"""

from __future__ import annotations

from hps.api import HPS
from hps.config import (
    ModelConfig,
    PersistentDBConfig,
    PSConfig,
    UnknownConfigKeyWarning,
    VolatileDBConfig,
    load_config,
)
from hps.errors import (
    BadUpdateError,
    BatchTooLargeError,
    BindError,
    ConfigError,
    DeviceError,
    HPSError,
    KeyTypeError,
    LookupInputError,
    MissingExtraError,
    ModelFileError,
    OutputBufferError,
    SourceAccessError,
    SourceError,
    SourceNotFoundError,
    SourceUnreachableError,
    TierError,
    TierSetupError,
    TierUnavailableError,
    UnknownModelError,
    UnknownTableError,
    UnsupportedFormatError,
    UpdateError,
    UpdateSourceUnavailableError,
)
from hps.hugectr_config import (
    DatabaseOverflowPolicy_t,
    DatabaseType_t,
    EmbeddingCacheType_t,
    InferenceParams,
    ParameterServerConfig,
    PersistentDatabaseParams,
    UpdateSourceParams,
    UpdateSourceType_t,
    VolatileDatabaseParams,
)
from hps.io.formats.sparse_folder import SparseModelReader, write_sparse_model
from hps.server import HierarchicalParameterServer

__version__ = "0.1.0"

__all__ = [
    "HPS",
    "BadUpdateError",
    "BatchTooLargeError",
    "BindError",
    "ConfigError",
    "DatabaseOverflowPolicy_t",
    "DatabaseType_t",
    "DeviceError",
    "EmbeddingCacheType_t",
    "HPSError",
    "HierarchicalParameterServer",
    "InferenceParams",
    "KeyTypeError",
    "LookupInputError",
    "MissingExtraError",
    "ModelConfig",
    "ModelFileError",
    "OutputBufferError",
    "PSConfig",
    "ParameterServerConfig",
    "PersistentDBConfig",
    "PersistentDatabaseParams",
    "SourceAccessError",
    "SourceError",
    "SourceNotFoundError",
    "SourceUnreachableError",
    "SparseModelReader",
    "TierError",
    "TierSetupError",
    "TierUnavailableError",
    "UnknownConfigKeyWarning",
    "UnknownModelError",
    "UnknownTableError",
    "UnsupportedFormatError",
    "UpdateError",
    "UpdateSourceParams",
    "UpdateSourceUnavailableError",
    "UpdateSourceType_t",
    "VolatileDBConfig",
    "VolatileDatabaseParams",
    "__version__",
    "load_config",
    "write_sparse_model",
]
