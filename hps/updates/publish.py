"""Publishing rows as update messages of a table: from a keys/vectors pair of arrays, or
from a table's model files (a sparse model folder or any format hps reads).

    publish_arrays("ps.json", "m", "sparse_embedding0", keys, vectors)
    publish_table("ps.json", "m", "sparse_embedding0", "/models/new/t0")   # or None: the
                                                                          # config's files

Messages go to `hps_et.<model>.<table>` of the config's `update_source` (Kafka or Redis
Streams), `max_batch_size` rows each, with 8-byte keys (4-byte without
`supportlonglong`, or `key_bytes` when set). What a consumer would skip is refused before
anything is sent: rows of another width, NaN or infinite values, keys out of range of a
uint32 table (BadUpdateError); an unknown model or table raises UnknownModelError /
UnknownTableError. Progress goes to a `LoadProgress` (the CLI draws a bar from it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.config import ModelConfig, PSConfig, load_config
from hps.errors import BadUpdateError, UnknownModelError, UnknownTableError
from hps.modelfiles.formats import ReadOptions, open_model
from hps.modelfiles.formats.spec import TableSpec
from hps.modelfiles.source import SourceOptions
from hps.rows.storage_types import FLOAT32, StorageType, first_unencodable_row
from hps.server.loader import LoadProgress
from hps.tiers.contract import table_name
from hps.updates import codec
from hps.updates.contract import UpdatePublisher
from hps.updates.open import open_publisher

#: messages handed to the publisher at once (one Redis pipeline, one produce burst)
_MESSAGES_PER_CALL = 16


@dataclass(frozen=True)
class _Table:
    """Where and how one table's messages are written."""

    topic: str
    dim: int
    key_bytes: int
    rows_per_message: int
    storage: StorageType = FLOAT32


def _table(config: PSConfig, model: str, table: str | int) -> tuple[ModelConfig, int, _Table]:
    try:
        mc = config.model(model)
    except KeyError:
        known = ", ".join(m.model for m in config.models)
        raise UnknownModelError(f"the config has no model {model!r} (models: {known})") \
            from None
    names = mc.embedding_table_names
    if isinstance(table, int) or (isinstance(table, str) and table.isdigit()
                                  and table not in names):
        index = int(table)
        if not 0 <= index < len(names):
            raise UnknownTableError(f"model {model!r} has no table {table!r} "
                                    f"(tables: {', '.join(names)})")
    elif table in names:
        index = names.index(table)
    else:
        raise UnknownTableError(f"model {model!r} has no table {table!r} "
                                f"(tables: {', '.join(names)})")
    updates = config.update_source
    key_bytes = updates.key_bytes or (8 if config.supportlonglong else 4)
    return mc, index, _Table(table_name(model, names[index]),
                             int(mc.embedding_vecsize_per_table[index]), key_bytes,
                             updates.max_batch_size, mc.storage)


def publish_arrays(config: Any, model: str, table: str | int, keys: Any, vectors: Any, *,
                   publisher: UpdatePublisher | None = None,
                   progress: LoadProgress | None = None) -> int:
    """Publish `keys` (int [n]) with their `vectors` (float32 [n, dim]) as updates of
    `table` (a name or index) of `model`; returns the messages sent.

    `config` is a ps.json / YAML path, a dict of it or a PSConfig; `publisher` defaults to
    one for its `update_source` (closed afterwards). Raises BadUpdateError, having sent
    nothing, for arrays a consumer would skip.
    """
    config = load_config(config)
    _, _, target = _table(config, model, table)
    keys = np.asarray(keys)
    vectors = np.asarray(vectors)
    if keys.dtype.kind not in "iu":
        raise BadUpdateError(f"keys must be integers, got {keys.dtype}", "key_range")
    keys = keys.reshape(-1)
    if vectors.shape != (keys.size, target.dim):
        raise BadUpdateError(f"{keys.size} keys of {target.topic} need vectors of shape "
                             f"({keys.size}, {target.dim}), got {vectors.shape}", "value_size")
    vectors = vectors.astype(np.float32, copy=False)
    _check(keys, vectors, target, config)
    num_bytes = keys.size * (target.key_bytes + 4 * target.dim)
    return _send(config, target, iter([(keys, vectors)]), keys.size, num_bytes,
                 publisher, progress)


def publish_table(config: Any, model: str, table: str | int,
                  source: str | TableSpec | None = None, *,
                  publisher: UpdatePublisher | None = None,
                  progress: LoadProgress | None = None) -> int:
    """Publish every row of a table's files as updates of `table` of `model`; returns the
    messages sent. `source` is the files (a sparse model folder, or any format and URI
    `sparse_files` takes); None publishes the files the config names for the table.

    Raises ModelFileError / SourceError when the files cannot be read (before anything
    is sent when their headers are wrong), BadUpdateError for rows a consumer would skip
    (the messages before that chunk are sent).
    """
    config = load_config(config)
    mc, index, target = _table(config, model, table)
    spec = mc.table_spec(index) if source is None else TableSpec.of(source)
    read = ReadOptions(target.dim, uint32_keys=not config.supportlonglong)
    reader = open_model(spec, read, SourceOptions(s3_endpoint=config.s3_endpoint))
    with reader:
        checked = (_checked(keys, rows, target, config) for keys, rows in
                   reader.chunks(chunk_keys=target.rows_per_message * _MESSAGES_PER_CALL))
        return _send(config, target, checked, reader.num_keys, reader.num_bytes,
                     publisher, progress)


def _check(keys: np.ndarray, vectors: np.ndarray, target: _Table, config: PSConfig) -> None:
    if target.key_bytes == 4 or not config.supportlonglong:
        codec.check_uint32(keys)
    if not np.isfinite(vectors).all():
        raise BadUpdateError(f"the rows for {target.topic} hold NaN or infinite values",
                             "non_finite")
    bad = first_unencodable_row(target.storage, vectors)
    if bad is not None:
        raise BadUpdateError(
            f"row {bad} for {target.topic} holds a value its {target.storage.name} storage "
            f"cannot hold (magnitude {target.storage.max_magnitude:g} or more)",
            "value_range")


def _checked(keys: np.ndarray, vectors: np.ndarray, target: _Table, config: PSConfig
             ) -> tuple[np.ndarray, np.ndarray]:
    _check(keys, vectors, target, config)
    return keys, vectors


def _send(config: PSConfig, target: _Table, chunks: Iterable[tuple[np.ndarray, np.ndarray]],
          num_keys: int, num_bytes: int, publisher: UpdatePublisher | None,
          progress: LoadProgress | None) -> int:
    progress = progress or LoadProgress()
    own = publisher is None
    out = publisher or open_publisher(config.update_source)
    started = time.perf_counter()
    bytes_per_key = num_bytes / max(1, num_keys)
    sent = 0
    try:
        progress.start_table(target.topic, num_keys, num_bytes)
        for keys, vectors in chunks:
            payloads = list(_messages(keys, vectors, target))
            for first in range(0, len(payloads), _MESSAGES_PER_CALL):
                out.publish(target.topic, payloads[first:first + _MESSAGES_PER_CALL])
            sent += len(payloads)
            progress.advance(int(keys.size), int(keys.size * bytes_per_key))
        out.flush(60.0)
        progress.finish_table(target.topic, time.perf_counter() - started)
    finally:
        if own:
            out.close()
    return sent


def _messages(keys: np.ndarray, vectors: np.ndarray, target: _Table) -> Iterator[bytes]:
    step = target.rows_per_message
    for first in range(0, keys.size, step):
        yield codec.encode(keys[first:first + step], vectors[first:first + step],
                           key_bytes=target.key_bytes)
