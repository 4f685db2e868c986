"""`HPS`: the HugeCTR-compatible Python face of the parameter server.

Code written for `hugectr.inference.HPS` runs unchanged apart from the import:

    from hps import HPS
    hps = HPS("ps.json")                                  # or a dict of the same JSON
    vectors = hps.lookup(keys, "model", 0)                # NumPy float32 [n, dim]
    hps.lookup_fromdlpack(key_capsule, out_capsule, "model", 1)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hps.config import PSConfig
from hps.loader import LoadProgress
from hps.server import HierarchicalParameterServer


class HPS:
    """Loads every model of a ps config into the tiers and serves lookups."""

    def __init__(
        self,
        config: str | dict[str, Any] | PSConfig,
        *,
        progress: LoadProgress | None = None,
    ) -> None:
        self.server = HierarchicalParameterServer(config, progress=progress)

    def lookup(self, keys: Any, model_name: str, table_id: int | str, device_id: int = 0
               ) -> np.ndarray:
        """Vectors of `keys` (any integer array, any shape) as float32 [n, dim] on the host.

        n is the number of key elements. Raises UnknownModelError, UnknownTableError,
        KeyTypeError or BatchTooLargeError for bad input.
        """
        return self.server.lookup(model_name, table_id, keys, device_id=device_id)

    def lookup_fromdlpack(self, keys: Any, vectors: Any, model_name: str,
                          table_id: int | str, device_id: int = 0) -> None:
        """Write the vectors of `keys` into `vectors` in place.

        Both may be DLPack capsules (they are not consumed), `__dlpack__` objects
        (PyTorch, CuPy, NumPy) or arrays, on the host or a CUDA device. `vectors` must
        be float32, C-contiguous, with at least n × dim elements.
        """
        self.server.lookup_into(model_name, table_id, keys, vectors, device_id=device_id)

    def refresh(self, model_name: str | None = None) -> int:
        """Re-read GPU-cached vectors from the databases; returns keys refreshed."""
        return self.server.refresh(model_name)

    def close(self) -> None:
        """Stop background work and close the tiers."""
        self.server.close()

    def __enter__(self) -> HPS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
