"""`hps.tensorflow`: the calls of HugeCTR's HPS plugin for TensorFlow, as Keras layers.

    import hps.tensorflow as hps              # was: import hierarchical_parameter_server as hps
    hps.Init(global_batch_size=1024, ps_config_file="ps.json")
    lookup = hps.LookupLayer(model_name="m", table_id=0, emb_vec_size=16,
                             emb_vec_dtype=tf.float32)
    vectors = lookup(keys)                    # keys.shape + [16], float32
    pooled = hps.SparseLookupLayer("m", 1, 16, tf.float32)(sp_ids, None, combiner="mean")

- `Init` is optional, as in the plugin since v23: a layer given `ps_config_file` starts
  (or shares) the server itself. Servers are shared with hps.torch and with an `HPS` of
  the same config open in the process (hps/server/shared.py).
- Lookups carry no gradient: the tables are served, not trained.
- Eagerly, keys reach the server through DLPack without a copy; inside `tf.function`
  (and Keras `fit`/`predict`) the lookup runs as a `tf.py_function`, i.e. in Python.
  Output rows are host memory for host keys; for keys on a GPU they are a CuPy array on
  that device handed to TensorFlow through DLPack.
- What does not carry over: the plugin's custom TensorFlow op is not reproduced, so a
  SavedModel that calls these layers needs this Python runtime to run (`py_function` is
  not serialised) and cannot be served by TensorFlow Serving alone; `global_batch_size`
  is accepted and has no effect (no per-replica split of lookups).
"""

from __future__ import annotations

from typing import Any

from hps.errors import ConfigError, KeyTypeError, MissingExtraError
from hps.server.shared import servers

try:
    import tensorflow as tf
except ImportError:
    raise MissingExtraError("tensorflow", "tensorflow", "hps.tensorflow") from None

_COMBINERS = ("mean", "sqrtn", "sum")
_default_config: list[Any] = []  # the ps_config_file of the last Init


def Init(global_batch_size: int, ps_config_file: Any) -> str:  # noqa: N802 - the plugin's name
    """Start (or share) the server of `ps_config_file`; layers built without a
    `ps_config_file` use it. Returns "OK", as the plugin's status did.

    `ps_config_file` may also be a ParameterServerConfig, PSConfig or dict.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a positive integer, "
                          f"got {global_batch_size!r}")
    servers.acquire(ps_config_file)
    _default_config[:] = [ps_config_file]
    return "OK"


class _TableLayer(tf.keras.layers.Layer):  # type: ignore[misc]
    """What both layers share: the server, the table, the lookup of unique-free keys."""

    def __init__(self, model_name: str, table_id: int, emb_vec_size: int,
                 emb_vec_dtype: Any, ps_config_file: Any = "", global_batch_size: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if tf.as_dtype(emb_vec_dtype) != tf.float32:
            raise ConfigError(f"emb_vec_dtype must be tf.float32, got {emb_vec_dtype!r}")
        if isinstance(table_id, bool) or not isinstance(table_id, int):
            raise ConfigError(f"table_id must be the table's index, got {table_id!r}")
        self.model_name = model_name
        self.table_id = table_id
        self.emb_vec_size = int(emb_vec_size)
        self.emb_vec_dtype = tf.float32
        self.ps_config_file = ps_config_file
        self.global_batch_size = global_batch_size
        self._handle: int | None = None
        if ps_config_file != "" or _default_config:
            self._server()  # errors surface when the layer is built

    def _server(self) -> Any:
        if self._handle is None:
            source = self.ps_config_file if self.ps_config_file != "" else (
                _default_config[0] if _default_config else None)
            if source is None:
                raise ConfigError("no HPS config: call hps.tensorflow.Init(global_batch_size, "
                                  "ps_config_file) or pass ps_config_file to the layer")
            handle = servers.acquire(source)
            table = servers.server(handle).model(self.model_name).table(self.table_id)
            if table.dim != self.emb_vec_size:
                raise ConfigError(f"emb_vec_size={self.emb_vec_size} but table "
                                  f"{self.table_id} of model {self.model_name!r} has width "
                                  f"{table.dim}")
            self._handle = handle
        return servers.server(self._handle)

    def _lookup_now(self, keys: tf.Tensor) -> tf.Tensor:
        """Eager lookup of an integer tensor: keys.shape + [emb_vec_size] float32."""
        import numpy as np

        server = self._server()
        loaded = server.model(self.model_name)
        shape = (*keys.shape, self.emb_vec_size)
        spec = tf.DeviceSpec.from_string(keys.device or "/cpu:0")
        if spec.device_type == "GPU":
            import cupy

            with cupy.cuda.Device(spec.device_index or 0):
                out = cupy.empty(shape, dtype=cupy.float32)
                server.lookup_into(self.model_name, self.table_id,
                                   tf.experimental.dlpack.to_dlpack(keys), out,
                                   spec.device_index or 0)
                return tf.experimental.dlpack.from_dlpack(out.toDlpack())
        host = np.empty(shape, dtype=np.float32)
        server.lookup_into(self.model_name, self.table_id,
                           tf.experimental.dlpack.to_dlpack(keys), host,
                           loaded.config.deployed_device_list[0])
        return tf.convert_to_tensor(host)

    def _lookup(self, keys: tf.Tensor) -> tf.Tensor:
        if not keys.dtype.is_integer:
            raise KeyTypeError(f"keys must be an integer tensor, got {keys.dtype.name}")
        if tf.executing_eagerly():
            return self._lookup_now(keys)
        out = tf.py_function(self._lookup_now, [keys], Tout=tf.float32)
        out.set_shape(keys.shape.concatenate([self.emb_vec_size]))
        return out

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        ps_config = self.ps_config_file if isinstance(self.ps_config_file, str) else ""
        config.update(model_name=self.model_name, table_id=self.table_id,
                      emb_vec_size=self.emb_vec_size, emb_vec_dtype="float32",
                      ps_config_file=ps_config, global_batch_size=self.global_batch_size)
        return config


class LookupLayer(_TableLayer):
    """The plugin's `LookupLayer(model_name, table_id, emb_vec_size, emb_vec_dtype,
    ps_config_file="", global_batch_size=1)`: `call(inputs)` maps an integer tensor of any
    shape to `inputs.shape + [emb_vec_size]` float32 (a RaggedTensor to a RaggedTensor)."""

    def call(self, inputs: Any) -> Any:
        if isinstance(inputs, tf.RaggedTensor):
            return tf.ragged.map_flat_values(self._lookup, inputs)
        return self._lookup(tf.convert_to_tensor(inputs))


class SparseLookupLayer(_TableLayer):
    """The plugin's `SparseLookupLayer`: per row of `sp_ids` (a 2-D SparseTensor or a
    RaggedTensor of ids), the `combiner` ("mean" by default, "sum", "sqrtn") of its
    vectors weighted by `sp_weights` (None: all 1). Rows without ids give zeros; each
    vector is clipped to L2 norm `max_norm` first when given. Returns
    [rows, emb_vec_size] float32. Each distinct id is looked up once.
    """

    def call(self, sp_ids: Any, sp_weights: Any = None, name: str | None = None,
             combiner: str | None = None, max_norm: float | None = None) -> Any:
        combiner = combiner or "mean"
        if combiner not in _COMBINERS:
            raise ValueError(f"combiner must be one of {', '.join(_COMBINERS)}, "
                             f"got {combiner!r}")
        if isinstance(sp_ids, tf.RaggedTensor):
            sp_ids = sp_ids.to_sparse()
        if isinstance(sp_weights, tf.RaggedTensor):
            sp_weights = sp_weights.to_sparse()
        if not isinstance(sp_ids, tf.SparseTensor):
            raise TypeError(f"sp_ids must be a SparseTensor or RaggedTensor, "
                            f"got {type(sp_ids).__name__}")
        if sp_weights is not None and not isinstance(sp_weights, tf.SparseTensor):
            raise TypeError(f"sp_weights must be None, a SparseTensor or a RaggedTensor, "
                            f"got {type(sp_weights).__name__}")
        with tf.name_scope(name or "hps_sparse_lookup"):
            unique, position = tf.unique(sp_ids.values)
            vectors = tf.gather(self._lookup(unique), position)
            if max_norm is not None:
                vectors = tf.clip_by_norm(vectors, max_norm, axes=[1])
            weights = (tf.ones_like(sp_ids.values, dtype=tf.float32) if sp_weights is None
                       else tf.cast(sp_weights.values, tf.float32))
            rows = sp_ids.indices[:, 0]
            num_rows = sp_ids.dense_shape[0]
            pooled = tf.math.unsorted_segment_sum(vectors * weights[:, None], rows, num_rows)
            if combiner == "sum":
                return pooled
            scale = weights if combiner == "mean" else weights * weights
            total = tf.math.unsorted_segment_sum(scale, rows, num_rows)
            if combiner == "sqrtn":
                total = tf.sqrt(total)
            return tf.math.divide_no_nan(pooled, total[:, None])


__all__ = ["Init", "LookupLayer", "SparseLookupLayer"]
