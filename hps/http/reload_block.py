"""The model block a reload without sources starts from (`POST /v1/models/{m}/reload`
with no `sparse_files`).

A server started from a config file reads that file again at every such reload, so that
a fix to it (a mistyped folder, a new default value) is what the reload loads. The
precedence, each case for a stated reason:

- a model that the file has: the file's block as it is now;
- sources a reload body named (other than those the file named at start and names now)
  persist: the file's block with those sources, as a reload body promises ("later
  reloads keep them"), until another body names others;
- a model the file does not have (added at run time with `POST /v1/models`, or taken
  out of the file since): the block it was loaded with, which is in no file;
- a server built from a config object (no file): the block it was loaded with, else the
  config's own.

Under `hps serve --workers N` each worker holds a copy of the config in the run folder,
which no one edits: the worker that answers the reload reads the file the server was
started with (its path is in the run folder's serve options), and the block it read goes
to every worker through the op log (hps/http/workers_ops.py).
"""

from __future__ import annotations

from pathlib import Path

from hps.config import ModelConfig, PSConfig, load_config
from hps.errors import ConfigError


def reload_block(name: str, *, config_file: str | None, started: PSConfig,
                 loaded: ModelConfig | None) -> ModelConfig | None:
    """The block a reload of model `name` without sources loads (see the module), None
    when neither the file, the started config nor a loaded version has one. `started`:
    the config the server was started with; `loaded`: the block of the version served
    (None: none is). Raises ConfigError when the file cannot be read or is no valid
    config now, naming the file."""
    at_start = next((m for m in started.models if m.model == name), None)
    fallback = loaded if loaded is not None else at_start
    if config_file is None:
        return fallback
    try:
        now = load_config(config_file)
    except ConfigError as exc:
        raise ConfigError(f"cannot reload {name!r} from {config_file}, the config file "
                          f"the server was started with: {exc}") from None
    block = next((m for m in now.models if m.model == name), None)
    if block is None:
        return fallback
    named = loaded.sparse_files if loaded is not None else None
    if named is not None and named != block.sparse_files and (
            at_start is None or named != at_start.sparse_files):
        return block.model_copy(update={"sparse_files": named})
    return block


def absolute_config_file(config: object) -> str | None:
    """The absolute path of a config given as a path (str or Path), else None."""
    if isinstance(config, (str, Path)):
        return str(Path(config).resolve())
    return None
