"""hps: a hierarchical parameter server for recommender embeddings.

The successor of HugeCTR's HPS: a GPU embedding cache over a volatile database
(in-process hash map, Redis, Redis Cluster) over a persistent one (RocksDB).
"""

from __future__ import annotations

from hps import inference as _inference
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
    ModelExistsError,
    ModelFileError,
    ModelsNotLoadedError,
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
from hps.inference import *  # noqa: F403 - HugeCTR's names: hps.inference lists them
from hps.modelfiles.formats.sparse_folder import SparseModelReader, write_sparse_model
from hps.server import HierarchicalParameterServer

__version__ = "0.1.0"

__all__ = [
    "BadUpdateError",
    "BatchTooLargeError",
    "BindError",
    "ConfigError",
    "DeviceError",
    "HPSError",
    "HierarchicalParameterServer",
    "KeyTypeError",
    "LookupInputError",
    "MissingExtraError",
    "ModelConfig",
    "ModelExistsError",
    "ModelFileError",
    "ModelsNotLoadedError",
    "OutputBufferError",
    "PSConfig",
    "PersistentDBConfig",
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
    "UpdateSourceUnavailableError",
    "VolatileDBConfig",
    "__version__",
    "load_config",
    "write_sparse_model",
]
__all__ += _inference.__all__
