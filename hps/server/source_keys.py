"""Which config key named a table's files, and errors about those files that say it.

An error about a file or folder a config names (missing, unreadable, not a model, cut
short; local, S3 or HDFS; any format) is raised deep in hps/modelfiles/, which knows the
URI but not the key that named it. The loader knows both: it opens each table's files
`naming_the_key` of the table, which puts the key in front of the message
(`models[0].sparse_files[1]: sparse folder '…' does not exist`) and leaves the error's
class, kind and other arguments as they were (they still reach a worker pickled).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hps.config import ModelConfig, PSConfig
from hps.errors import ModelFileError, SourceError
from hps.gate.verdict import LoadGateError


def source_key(config: PSConfig, model: ModelConfig, index: int) -> str:
    """The key that named table `index`'s files of `model`: `models[i].sparse_files[index]`
    when block i of `config` names them, else `sparse_files[index]` of the model (a block
    added at run time, or sources a reload named)."""
    for i, block in enumerate(config.models):
        if block.model == model.model and index < len(block.sparse_files) \
                and block.sparse_files[index] == model.sparse_files[index]:
            return f"models[{i}].sparse_files[{index}]"
    return f"sparse_files[{index}] of model {model.model!r}"


@contextlib.contextmanager
def naming_the_key(key: str) -> Iterator[None]:
    """Errors about the files (SourceError, ModelFileError) raised inside say `key`
    first; the load gate's refusals name their model and table already."""
    try:
        yield
    except (SourceError, ModelFileError) as exc:
        message = str(exc)
        if not isinstance(exc, LoadGateError) and not message.startswith(key):
            exc.args = (f"{key}: {message}", *exc.args[1:])
        raise
