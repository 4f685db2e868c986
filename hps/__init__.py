"""hps: a hierarchical parameter server for recommender embeddings.

The successor of HugeCTR's HPS: a GPU embedding cache over a volatile database
(in-process hash map, Redis, Redis Cluster) over a persistent one (RocksDB).

`import hps` imports only the error classes: every other public name is imported on its
first use (PEP 562's module `__getattr__`), so the `hps` command and a program that only
catches `hps.HPSError` do not pay for NumPy, numba, the tiers and the server (seconds on
a loaded machine).
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

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

if _typing.TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from hps.config import (
        ModelConfig,
        PersistentDBConfig,
        PSConfig,
        VolatileDBConfig,
        load_config,
    )
    from hps.config_keys import UnknownConfigKeyWarning
    from hps.inference import (
        HPS,
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
    from hps.modelfiles.formats.sparse_folder import SparseModelReader, write_sparse_model
    from hps.server import HierarchicalParameterServer

__version__ = "0.1.0"

#: each public name imported on first use → the module that defines it
_LAZY = {
    "HierarchicalParameterServer": "hps.server",
    "ModelConfig": "hps.config",
    "PSConfig": "hps.config",
    "PersistentDBConfig": "hps.config",
    "VolatileDBConfig": "hps.config",
    "load_config": "hps.config",
    "UnknownConfigKeyWarning": "hps.config_keys",
    "SparseModelReader": "hps.modelfiles.formats.sparse_folder",
    "write_sparse_model": "hps.modelfiles.formats.sparse_folder",
    # HugeCTR's names (hps.inference.__all__, which a test holds equal to these)
    "HPS": "hps.inference",
    "DatabaseOverflowPolicy_t": "hps.inference",
    "DatabaseType_t": "hps.inference",
    "EmbeddingCacheType_t": "hps.inference",
    "InferenceParams": "hps.inference",
    "ParameterServerConfig": "hps.inference",
    "PersistentDatabaseParams": "hps.inference",
    "UpdateSourceParams": "hps.inference",
    "UpdateSourceType_t": "hps.inference",
    "VolatileDatabaseParams": "hps.inference",
}

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


def __getattr__(name: str) -> object:
    """A lazy public name, imported from its module on first use and kept here after."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hps' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
