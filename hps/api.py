"""`HPS`: the HugeCTR-compatible Python face of the parameter server.

Code written for `hugectr.inference.HPS` runs unchanged apart from the import:

    from hps.inference import HPS
    hps = HPS("ps.json")              # or a ParameterServerConfig, a dict of the JSON, a PSConfig
    vectors = hps.lookup(keys, "model", 0)                # NumPy float32 [n, dim]
    hps.lookup_fromdlpack(key_capsule, out_capsule, "model", 1)

The argument names are HugeCTR's (`ps_config` / `hps_json_config_file`, `h_keys`,
`out_tensor`), so calls that name them run unchanged too.

Every `HPS` and every hps.torch / hps.tensorflow layer built from the same config in one
process shares one server (hps/server/shared.py): a file by its real path, any other
config object by its identity. `close()` lets go of it; the last user closes it.

`HPS(...)` prints nothing: without a `progress` of the caller's, a table that loads for
more than a few seconds logs its progress (logger `hps.progress`, INFO), and a first run
on a machine logs that it compiles (reads from numba's cache are no compile).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.config import PSConfig
from hps.errors import ConfigError
from hps.runtime.compile_notice import CompileLines
from hps.runtime.compile_on_use import compile_events
from hps.server.loader import LoadProgress
from hps.server.progress_lines import LineProgress
from hps.server.shared import SourceKey, servers

if TYPE_CHECKING:
    from hps.hugectr.params import ParameterServerConfig

#: where HPS(...) says how its load goes
log = logging.getLogger("hps.progress")


class HPS:
    """Loads every model of a ps config into the tiers and serves lookups."""

    def __init__(
        self,
        ps_config: str | os.PathLike[str] | dict[str, Any] | PSConfig | ParameterServerConfig
        | None = None,
        *,
        hps_json_config_file: str | os.PathLike[str] | None = None,
        progress: LoadProgress | None = None,
    ) -> None:
        if (ps_config is None) == (hps_json_config_file is None):
            raise ConfigError("HPS() takes one config: ps_config (a ParameterServerConfig, "
                              "PSConfig, dict or path) or hps_json_config_file (a path)")
        source = ps_config if ps_config is not None else hps_json_config_file
        logged = LineProgress(log.info, quiet=True) if progress is None else None
        compiling = CompileLines(log.info, "compiling what this config runs (the first load "
                                 "on this machine; numba caches it)")
        try:
            with contextlib.closing(compiling), compile_events(compiling):
                key, self.server = servers.open(source, progress=progress or logged)
        finally:
            if logged is not None:
                logged.close()
        self._key: SourceKey | None = key

    def lookup(self, h_keys: Any, model_name: str, table_id: int | str,
               device_id: int | None = None) -> np.ndarray:
        """Vectors of `h_keys` as float32 [n, dim] on the host.

        `h_keys`: any integer array of any shape (n is its number of elements), or a list
        of Python or NumPy integers. `device_id`: the GPU cache that serves them (default:
        that of CUDA keys, else the model's first deployed device). Raises
        UnknownModelError, UnknownTableError, KeyTypeError, BatchTooLargeError or
        DeviceError for bad input.
        """
        return self.server.lookup(model_name, table_id, h_keys, device_id=device_id)

    def lookup_fromdlpack(self, keys: Any, out_tensor: Any, model_name: str,
                          table_id: int | str, device_id: int | None = None) -> None:
        """Write the vectors of `keys` into `out_tensor` in place.

        Both may be DLPack capsules (they are not consumed), `__dlpack__` objects
        (PyTorch, CuPy, NumPy) or arrays, on the host or a CUDA device. `out_tensor` must
        be float32 with at least n × dim elements (C-contiguous, or strided of shape
        (n, dim)). CUDA arrays are served by the GPU cache of their device, from any
        thread, whatever its current device; `device_id` (default: the arrays' device,
        else the model's first deployed device) picks the cache for host arrays. Raises
        DeviceError for keys and output on different devices or a device the model is
        not deployed on.
        """
        self.server.lookup_into(model_name, table_id, keys, out_tensor, device_id=device_id)

    def refresh(self, model_name: str | None = None) -> int:
        """Re-read GPU-cached vectors from the databases; returns keys refreshed."""
        return self.server.refresh(model_name)

    def prefetch(self, model_name: str, table_id: int | str, keys: Any) -> Any:
        """Warm the GPU caches and the volatile tier (from the persistent one) with the
        rows of `keys`, in the background; returns the job: `status`, `as_dict()`,
        `wait(timeout)` (docs/operating.md#warm-ups)."""
        return self.server.prefetch(model_name, table_id, keys)

    def replicate_hot_rows(self, model_name: str, table_id: int | str, keys: Any = None
                           ) -> dict[str, Any]:
        """Copy the rows of `keys` (heaviest first; None: the keys lookups asked for most)
        of a table sharded over GPUs onto every device that reads them over the link, so
        lookups read them locally (docs/gpu-cache.md#hot-copies)."""
        return self.server.replicate_hot_rows(model_name, table_id, keys)

    def fill_hot_rows(self, model_name: str, table_id: int | str | None = None
                      ) -> dict[str, Any]:
        """Fill the hot copies of a table sharded over GPUs (None: of every such table of
        the model) now from the keys lookups asked for most, as the server does in the
        background every `gpu_hot_rows_refresh_seconds` (docs/gpu-cache.md#hot-copies)."""
        return self.server.fill_hot_rows(model_name, table_id)

    def close(self) -> None:
        """Let go of the server: the last of its users (this and other `HPS` of the same
        config, the framework layers) stops its background work and closes its tiers."""
        key, self._key = self._key, None
        if key is not None:
            servers.release(key)

    def __enter__(self) -> HPS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
