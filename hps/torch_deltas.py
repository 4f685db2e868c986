"""`hps.torch.DeltaPublisher`: the rows a PyTorch training step changed, sent to serving
servers as HugeCTR update messages (Kafka or Redis Streams), so training and serving run
in one loop.

    publisher = DeltaPublisher(model, "ps.json", model_name="m")   # or {"table": module}
    for batch in data:
        loss(model(batch)).backward()
        optimizer.step()
        publisher.publish()            # the rows this step changed, with their new values
        optimizer.zero_grad()
    publisher.close()                  # everything queued is sent

Tables: each `nn.Embedding` / `nn.EmbeddingBag` of the module (TorchRec's unsharded
EmbeddingBagCollection / EmbeddingCollection hold those too) is the table
`table_name_of("<path>.weight")` of the config's model (hps/modelfiles/formats/torch_state:
`embedding.weight` → `embedding`, `ebc.embedding_bags.t_user.weight` → `t_user`), the name
`hps config from-torch` writes; a dict {table name: module or 2-D weight} names them
itself; a module that is one embedding maps to a model of one table. Key of row i is
`i + key_offsets[table]` (default 0), as the files were loaded.

How changed rows are found (`track`, per table; "auto" picks by the gradient's layout):
  gradient   the indices of the step's gradients, recorded by a hook on the weight during
             `backward()` (sparse gradients: `sparse=True`; dense ones: rows whose gradient
             is not all zero). Cost: O(rows touched) per step, no extra memory. Exact for
             optimizers that move only rows with a gradient: SGD without momentum, Adagrad
             and SparseAdam on sparse gradients, Adagrad on dense ones without weight decay.
  shadow     a compare of the weight against a copy kept at the last publish. Cost: one
             copy of the table in memory and a full read of the table and the copy per
             publish (about 2 × rows × dim × 4 bytes of memory traffic); exact for any
             optimizer (momentum, Adam, weight decay move rows with no gradient).

A row is published with the value it has when `publish()` is called (copied then), in
messages of the config's `update_source.max_batch_size` rows, to topic
`hps_et.<model>.<table>`, with its key width (8 bytes, 4 without supportlonglong). A
sender thread encodes and sends; at most `max_pending` messages wait for it, and
`publish()` blocks while the queue is full (back-pressure: training slows down rather
than memory grows). A row that holds NaN or infinity is refused (BadUpdateError) before
anything of that publish is queued; a send that fails is raised by the next `publish()`,
`flush()` or `close()`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hps.config import load_config
from hps.errors import BadUpdateError, ConfigError, UnknownTableError
from hps.modelfiles.formats.torch_state import table_name_of
from hps.updates import codec
from hps.updates.contract import UpdatePublisher
from hps.updates.open import open_publisher
from hps.updates.publish import _table as table_target

#: messages handed to the publisher at once (one Redis pipeline, one produce burst)
MESSAGES_PER_CALL = 16
TRACKS = ("auto", "gradient", "shadow")


@dataclass
class _Tracked:
    """One table: its weight, where its messages go, how its changed rows are found."""

    name: str
    weight: torch.Tensor
    topic: str
    key_offset: int
    key_bytes: int
    rows_per_message: int
    track: str
    shadow: torch.Tensor | None = None
    touched: list[torch.Tensor] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_grad(self, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            rows = grad._indices()[0]
        else:
            rows = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().reshape(-1)
        with self.lock:
            self.touched.append(rows.detach().to("cpu", torch.int64))

    def changed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values now) of the rows changed since the last call (indices sorted,
        unique, on the host; values a copy, on the weight's device)."""
        weight = self.weight.detach()
        if self.shadow is not None:
            rows = _differing_rows(weight, self.shadow)
            values = weight.index_select(0, rows.to(weight.device))
            self.shadow.index_copy_(0, rows.to(weight.device), values)
            return rows, values
        with self.lock:
            touched, self.touched = self.touched, []
        if not touched:
            return torch.empty(0, dtype=torch.int64), weight[:0]
        rows = torch.unique(torch.cat(touched))
        return rows, weight.index_select(0, rows.to(weight.device))


class DeltaPublisher:
    """Publishes the rows of `module_or_tables` changed since the last `publish()` as
    updates of model `model_name` of `sink` (a ps.json / YAML path, a dict of it or a
    PSConfig, whose `update_source` is where they go); see the module docstring.

    `publisher` sends through an UpdatePublisher of the caller's (not closed here);
    `key_offsets` maps table names to the offset added to row indices; `track` is
    "auto", "gradient" or "shadow" (one for every table, or a dict by table name).
    Raises UnknownTableError / UnknownModelError for tables the config's model lacks,
    ConfigError for a width that does not match it or an unknown `track`.
    Thread safety: one training thread calls `publish`; `close` from any.
    """

    def __init__(self, module_or_tables: torch.nn.Module | Mapping[str, Any], sink: Any, *,
                 model_name: str, publisher: UpdatePublisher | None = None,
                 key_offsets: Mapping[str, int] | None = None,
                 track: str | Mapping[str, str] = "auto", max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        config = load_config(sink)
        names = config.model(model_name).embedding_table_names if any(
            m.model == model_name for m in config.models) else []
        weights = _weights(module_or_tables, names)
        offsets = dict(key_offsets or {})
        unknown = sorted(set(offsets) - set(weights))
        if unknown:
            raise UnknownTableError(f"key_offsets name tables {unknown} that are not "
                                    f"published (tables: {', '.join(weights)})")
        self.tables: list[_Tracked] = []
        self._hooks: list[Any] = []
        for name, weight in weights.items():
            _, _, target = table_target(config, model_name, name)
            if weight.dim() != 2 or weight.shape[1] != target.dim:
                raise ConfigError(f"table {name!r} is {list(weight.shape)} but model "
                                  f"{model_name!r} serves it {target.dim} wide")
            mode = track.get(name, "auto") if isinstance(track, Mapping) else track
            if mode not in TRACKS:
                raise ConfigError(f"track {mode!r} is not one of {', '.join(TRACKS)}")
            table = _Tracked(name, weight, target.topic, int(offsets.get(name, 0)),
                             target.key_bytes, target.rows_per_message,
                             _resolve(mode, module_or_tables, name, weight))
            if table.track == "shadow":
                table.shadow = weight.detach().clone()
            else:
                self._hooks.append(weight.register_hook(table.on_grad))
            self.tables.append(table)
        self._own = publisher is None
        self._out = publisher or open_publisher(config.update_source)
        self._queue: queue.Queue[tuple[str, list[bytes]] | None] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self.rows_published = 0
        self._sender = threading.Thread(target=self._send, name="hps-delta-publisher",
                                        daemon=True)
        self._sender.start()

    def publish(self) -> int:
        """Queue the rows changed since the last call, with their values now; returns how
        many rows. Blocks while `max_pending` messages wait for the sender."""
        self._raise_failure()
        if self._closed:
            raise RuntimeError("DeltaPublisher is closed")
        batches = []
        for table in self.tables:
            rows, values = table.changed()
            if rows.numel() == 0:
                continue
            vectors = values.to("cpu", torch.float32).numpy()
            if not np.isfinite(vectors).all():
                raise BadUpdateError(f"table {table.name!r}: a changed row holds NaN or "
                                     "infinite values; nothing of this step was published",
                                     "non_finite")
            keys = rows.numpy() + table.key_offset
            if table.key_bytes == 4:
                codec.check_uint32(keys)
            batches.append((table, keys, vectors))
        count = 0
        for table, keys, vectors in batches:
            step = table.rows_per_message * MESSAGES_PER_CALL
            for first in range(0, keys.size, step):
                self._put((table.topic, table.key_bytes, table.rows_per_message,
                           keys[first:first + step], vectors[first:first + step]))
            count += int(keys.size)
        self.rows_published += count
        return count

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until everything queued is with the broker (raises a send's failure)."""
        self._queue.join()
        self._raise_failure()
        self._out.flush(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Send what is queued, stop the sender, remove the gradient hooks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None)
            self._sender.join(timeout)
            for hook in self._hooks:
                hook.remove()
            self._raise_failure()
            self._out.flush(timeout)
        finally:
            if self._own:
                self._out.close()

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, item: Any) -> None:
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _send(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure, drain without sending
                    topic, key_bytes, per_message, keys, vectors = item
                    payloads = [codec.encode(keys[i:i + per_message],
                                             vectors[i:i + per_message], key_bytes=key_bytes)
                                for i in range(0, keys.size, per_message)]
                    self._out.publish(topic, payloads)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self._error = exc
            finally:
                self._queue.task_done()


#: the integer type of each float's width: rows compared bit for bit
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differing_rows(weight: torch.Tensor, shadow: torch.Tensor) -> torch.Tensor:
    """Indices (host, int64) of the rows whose bits differ from the shadow's. On the host
    the compare is NumPy's over integer views: about 4x faster than torch's `ne().any()`
    (200k × 64 float32: 0.04 s against 0.16 s on the 2-core machine), and bit for bit, so a
    row that became NaN counts as changed."""
    if weight.device.type == "cpu" and weight.is_contiguous() and \
            weight.element_size() in _BITS:
        bits = _BITS[weight.element_size()]
        now = weight.view(bits).numpy().reshape(weight.shape[0], -1)
        before = shadow.view(bits).numpy().reshape(weight.shape[0], -1)
        return torch.from_numpy(np.flatnonzero((now != before).any(axis=1)))
    return weight.ne(shadow).reshape(weight.shape[0], -1).any(dim=1).nonzero().reshape(-1).cpu()


def _weights(source: torch.nn.Module | Mapping[str, Any], names: list[str]
             ) -> dict[str, torch.Tensor]:
    """Table name → weight of a dict of tables or of a module's embeddings."""
    embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    if isinstance(source, Mapping):
        found = {}
        for name, table in source.items():
            weight = table.weight if isinstance(table, embeddings) else table
            if not isinstance(weight, torch.Tensor):
                raise ConfigError(f"table {name!r} is a {type(table).__name__}; give an "
                                  "nn.Embedding, nn.EmbeddingBag or a 2-D weight tensor")
            found[str(name)] = weight
        return found
    if isinstance(source, embeddings):
        if len(names) != 1:
            raise UnknownTableError(f"one embedding module maps to a model of one table; "
                                    f"this model has {names}: pass {{table name: module}}")
        return {names[0]: source.weight}
    found = {table_name_of(f"{path}.weight"): module.weight
             for path, module in source.named_modules() if isinstance(module, embeddings)}
    if not found:
        raise ConfigError(f"{type(source).__name__} holds no nn.Embedding or nn.EmbeddingBag")
    return found


def _resolve(mode: str, source: Any, name: str, weight: torch.Tensor) -> str:
    """"auto" → "gradient" for a table with sparse gradients, else "shadow"."""
    if mode != "auto":
        return mode
    modules = source.values() if isinstance(source, Mapping) else source.modules()
    sparse = any(getattr(m, "weight", None) is weight and getattr(m, "sparse", False)
                 for m in modules)
    return "gradient" if sparse else "shadow"
