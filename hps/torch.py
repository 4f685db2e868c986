"""`hps.torch.LookupLayer`: the HPS plugin for PyTorch's layer, over `lookup_fromdlpack`.

    from hps.torch import LookupLayer          # was: import hps_torch; hps_torch.LookupLayer
    layer = LookupLayer("ps.json", "model", 0, 16)   # or a ParameterServerConfig, a PSConfig
    vectors = layer(keys)                      # keys.shape + (16,), float32, on keys.device

- The lookup is the `torch.library` custom op `hps::lookup` with a fake (meta)
  implementation, so `torch.compile(model, fullgraph=True)` traces a model that calls the
  layer without a graph break. Outside compilation the layer calls the op's
  implementation directly: the dispatcher would add its own cost to every call and does
  nothing for a tensor that needs no autograd.
- Layers built from the same config share one server (hps/server/shared.py: a file path by
  its real path, any other config object by its identity), also with hps.tensorflow's
  layers and with an `HPS` of that config open in the process. Building layers and
  looking up from many threads is safe, `torch.jit.fork` included.
- The output carries no gradient: the vectors are served, not trained (`requires_grad`
  is False and nothing flows back to the table). Train the tables elsewhere and load
  them; a model can still train its dense layers on top of the looked-up vectors.
- The output is allocated on the keys' device; keys on a CUDA device are looked up on
  that device (it must be in the model's `deployed_device_list`), host keys on the
  model's first deployed device. For CUDA keys the layer allocates the output of its next
  call while the GPU answers this one (hps/gpu/overlap.py) and keeps it as a spare, used
  when the next call has the same shape, device and current stream: the allocation then
  costs the caller nothing. Spares are kept for outputs up to 8 MiB (larger lookups
  dwarf their allocation), at most four per layer. A spare is never
  shared across streams (nor across threads on the per-thread default stream).
  Likewise the layer holds each output it returned until its next call's GPU wait, so
  the allocator takes back an output the caller dropped there, not on the caller's time
  (through the allocator as ever: streams recorded on the output are still waited for).
- Servers live until `close_servers()` (or the process) ends them, as the plugin's
  single global server did; one that an open `HPS` still uses stays open for it.
"""

from __future__ import annotations

import os
from typing import Any

from hps.errors import ConfigError, MissingExtraError, UnknownTableError
from hps.gpu import overlap
from hps.gpu.streams import same_stream
from hps.intake.array_ref import torch_stream_reader
from hps.server.shared import servers

try:
    import torch
except ImportError:
    raise MissingExtraError("torch", "torch", "hps.torch.LookupLayer") from None

from hps.torch_deltas import DeltaPublisher  # noqa: E402 - needs torch, checked above


def close_servers() -> None:
    """Let go of every server the layers use (closed unless an `HPS` still holds it);
    layers built before fail afterwards."""
    servers.close_all()


# nn.Module.__call__'s hook registries, which LookupLayer.__call__ checks before skipping
# it; if a torch release moves them, the layer always takes Module.__call__
_GLOBAL_HOOKS = tuple(vars(torch.nn.modules.module).get(name) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
    "_global_backward_hooks"))
_KNOWN_HOOKS = all(isinstance(hooks, dict) for hooks in _GLOBAL_HOOKS)

#: outputs up to this many bytes get a spare (see the module doc)
SPARE_BYTES = 8 << 20
_SPARE_FLOATS = SPARE_BYTES // 4
#: spares a layer keeps at most (one per thread calling it at once)
_MAX_SPARES = 4


def _lookup(keys: torch.Tensor, handle: int, model_name: str, table_id: int,
            emb_vec_size: int, device_id: int) -> torch.Tensor:
    # new_empty: the keys' device without building a torch.device (a few µs a call)
    out = keys.new_empty((*keys.shape, emb_vec_size), dtype=torch.float32)
    servers.server(handle).lookup_into(model_name, table_id, keys, out, device_id)
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
    widened) and returns `keys.shape + (emb_vec_size,)` float32 on the keys' device, with
    no gradient (the tables are served, not trained: `requires_grad` is False). Raises
    ConfigError when `emb_vec_size` is not the table's width, UnknownModelError or
    UnknownTableError for a model or table the config does not serve.
    """

    def __init__(self, ps_config_file_or_object: str | os.PathLike[str] | Any,
                 model_name: str, table_id: int, emb_vec_size: int) -> None:
        super().__init__()
        self._handle = servers.acquire(ps_config_file_or_object)
        loaded = servers.server(self._handle).model(model_name)
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
        # (output, keys' shape, device, raw stream) allocated while the GPU answered a call
        self._spares: list[tuple[torch.Tensor, torch.Size, int, int]] = []
        # outputs returned by calls since the last GPU wait (see forward)
        self._returned: list[torch.Tensor] = []
        self._stream = torch_stream_reader() if torch.cuda.is_available() else None

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Module.__call__ cost 3.5 µs a call on the H100 machine's host (its hook and
        # tracing checks and two more Python frames), as much as the rest of the layer:
        # called only where it does something (hooks, jit tracing, Module.compile)
        if (not _KNOWN_HOOKS or self._forward_pre_hooks or self._forward_hooks
                or self._backward_pre_hooks or self._backward_hooks
                or any(_GLOBAL_HOOKS) or self._compiled_call_impl is not None
                or torch._C._get_tracing_state()):
            return super().__call__(keys)  # type: ignore[no-any-return]
        return self.forward(keys)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            device_id = keys.get_device() if keys.is_cuda else self._host_device
            return lookup(keys, self._handle, self.model_name,  # type: ignore[no-any-return]
                          self.table_id, self.emb_vec_size, device_id)
        if not keys.is_cuda:
            return _lookup(keys, self._handle, self.model_name, self.table_id,
                           self.emb_vec_size, self._host_device)
        device_id = keys.get_device()
        out = None
        if self._spares:
            try:
                spare = self._spares.pop()  # atomic: one thread gets a spare
            except IndexError:
                spare = None
            if spare is not None and spare[1] == keys.shape and spare[2] == device_id \
                    and same_stream(spare[3], self._stream(device_id)):  # type: ignore[misc]
                out = spare[0]
        if out is None:
            out = keys.new_empty((*keys.shape, self.emb_vec_size), dtype=torch.float32)
        small = out.numel() <= _SPARE_FLOATS  # spares and held outputs: small ones only
        if small:
            overlap.set_task(self._make_spare, keys)
        try:
            servers.server(self._handle).lookup_into(
                self.model_name, self.table_id, keys, out, device_id)
        finally:
            overlap.set_task(None)
        if small:
            # held until the next call's GPU wait: a caller that drops it frees nothing on
            # its own time (on the H100's host a torch.empty made and freed costs 5.8 µs)
            returned = self._returned
            if len(returned) >= _MAX_SPARES:  # no GPU wait took them (no kernel queued)
                returned.clear()
            returned.append(out)
        return out

    def _make_spare(self, keys: torch.Tensor) -> None:
        # on the caller's thread, device and current stream, while its lookup runs:
        # outputs of earlier calls go back to the allocator (where the caller dropped
        # them; through the allocator, so streams it recorded are still waited for),
        # then the next call's output is allocated
        self._returned.clear()
        if len(self._spares) >= _MAX_SPARES:
            return
        device_id = keys.get_device()
        try:
            out = keys.new_empty((*keys.shape, self.emb_vec_size), dtype=torch.float32)
        except RuntimeError:  # out of memory: the next call allocates its own
            return
        self._spares.append((out, keys.shape, device_id,
                             self._stream(device_id)))  # type: ignore[misc]

    def extra_repr(self) -> str:
        return (f"model_name={self.model_name!r}, table_id={self.table_id}, "
                f"emb_vec_size={self.emb_vec_size}")


__all__ = ["DeltaPublisher", "LookupLayer", "close_servers", "lookup"]
