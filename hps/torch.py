"""`hps.torch.LookupLayer`: the HPS plugin for PyTorch's layer, over `lookup_fromdlpack`.

    from hps.torch import LookupLayer          # was: import hps_torch; hps_torch.LookupLayer
    layer = LookupLayer("ps.json", "model", 0, 16)   # or a ParameterServerConfig, a PSConfig
    vectors = layer(keys)                      # keys.shape + (16,), float32, on keys.device

- The lookup is the `torch.library` custom op `hps::lookup` with a fake (meta)
  implementation, so `torch.compile(model, fullgraph=True)` traces a model that calls the
  layer without a graph break. Outside compilation the layer calls the op's
  implementation directly: the dispatcher would add its own cost to every call and does
  nothing for a tensor that needs no autograd.
- Layers built from the same config share one server (hps/registry.py: a file path by
  its real path, any other config object by its identity), also with hps.tensorflow's
  layers. Building layers and looking up from many threads is safe, `torch.jit.fork`
  included.
- The output is allocated on the keys' device; keys on a CUDA device are looked up on
  that device (it must be in the model's `deployed_device_list`), host keys on the
  model's first deployed device.
- Servers live until `close_servers()` (or the process) ends them, as the plugin's
  single global server did.
"""

from __future__ import annotations

import os
from typing import Any

from hps.errors import ConfigError, MissingExtraError, UnknownTableError
from hps.registry import servers

try:
    import torch
except ImportError:
    raise MissingExtraError("torch", "torch", "hps.torch.LookupLayer") from None


def close_servers() -> None:
    """Close every server the layers started; layers built before fail afterwards."""
    servers.close_all()


def _lookup(keys: torch.Tensor, handle: int, model_name: str, table_id: int,
            emb_vec_size: int, device_id: int) -> torch.Tensor:
    # new_empty: the keys' device without building a torch.device (a few µs a call)
    out = keys.new_empty((*keys.shape, emb_vec_size), dtype=torch.float32)
    servers.server(handle).lookup_fromdlpack(keys, out, model_name, table_id, device_id)
    return out


@torch.library.custom_op("hps::lookup", mutates_args=())
def lookup(keys: torch.Tensor, handle: int, model_name: str, table_id: int,
           emb_vec_size: int, device_id: int) -> torch.Tensor:
    """Vectors of `keys` from the server `handle`: keys.shape + (emb_vec_size,) float32."""
    return _lookup(keys, handle, model_name, table_id, emb_vec_size, device_id)


@lookup.register_fake
def _lookup_fake(keys: torch.Tensor, handle: int, model_name: str, table_id: int,
                 emb_vec_size: int, device_id: int) -> torch.Tensor:
    return keys.new_empty((*keys.shape, emb_vec_size), dtype=torch.float32)


class LookupLayer(torch.nn.Module):
    """HugeCTR's `hps_torch.LookupLayer(ps_config_file, model_name, table_id, emb_vec_size)`.

    `ps_config_file_or_object`: a ps.json/YAML path, a ParameterServerConfig, a PSConfig
    or a dict. `forward(keys)` takes an integer tensor of any shape (int64; int32 is
    widened) and returns `keys.shape + (emb_vec_size,)` float32 on the keys' device. Raises
    ConfigError when `emb_vec_size` is not the table's width, UnknownModelError or
    UnknownTableError for a model or table the config does not serve.
    """

    def __init__(self, ps_config_file_or_object: str | os.PathLike[str] | Any,
                 model_name: str, table_id: int, emb_vec_size: int) -> None:
        super().__init__()
        self._handle = servers.acquire(ps_config_file_or_object)
        loaded = servers.server(self._handle).server.model(model_name)
        table = loaded.table(table_id)
        if isinstance(table_id, str):
            raise UnknownTableError(f"table_id must be the table's index, got {table_id!r} "
                                    f"(table {table.index} is named {table.name!r})")
        if table.dim != emb_vec_size:
            raise ConfigError(f"emb_vec_size={emb_vec_size} but table {table_id} of model "
                              f"{model_name!r} has width {table.dim}")
        self.model_name = model_name
        self.table_id = int(table_id)
        self.emb_vec_size = int(emb_vec_size)
        self._host_device = int(loaded.config.deployed_device_list[0])

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        device_id = keys.get_device() if keys.is_cuda else self._host_device
        args = (keys, self._handle, self.model_name, self.table_id, self.emb_vec_size,
                device_id)
        if torch.compiler.is_compiling():
            return lookup(*args)  # type: ignore[no-any-return]
        return _lookup(*args)

    def extra_repr(self) -> str:
        return (f"model_name={self.model_name!r}, table_id={self.table_id}, "
                f"emb_vec_size={self.emb_vec_size}")


__all__ = ["LookupLayer", "close_servers", "lookup"]
