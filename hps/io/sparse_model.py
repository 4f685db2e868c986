"""Where HugeCTR sparse folders were read before the formats package: kept for imports.

The reader and writer live in `hps.io.formats.sparse_folder`; this module re-exports
them so code written against `hps.io.sparse_model` keeps working.
"""

from hps.io.formats.base import DEFAULT_CHUNK_BYTES
from hps.io.formats.sparse_folder import (
    FLOAT_BYTES,
    KEY_BYTES,
    KEY_FILE,
    VECTOR_FILE,
    SparseFolderWriter,
    SparseModelInfo,
    SparseModelReader,
    read_info,
    write_sparse_model,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FLOAT_BYTES",
    "KEY_BYTES",
    "KEY_FILE",
    "VECTOR_FILE",
    "SparseFolderWriter",
    "SparseModelInfo",
    "SparseModelReader",
    "read_info",
    "write_sparse_model",
]
