"""What to run while another process holds a config's RocksDB store for writing.

The store (hps/tiers/rocksdb/store.py) knows only its own path; the server opening it
knows the config it came from (a file's path as the caller gave it, or an object) and its
models, which is what a command that runs as printed needs. `read_only_ways` builds that
text for a config file: an `hps lookup` line, and the Python steps that open the same
config read-only. A config object has no line to print: the store's own words
(persistent_db.read_only) are then the way, and a command that built the object adds its own
(`hps lookup --write-store`: hps/tools/cli/local.py).
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from hps.config import PSConfig

#: the key the printed `hps lookup` line looks up, for the reader to replace with theirs
EXAMPLE_KEY = 0


def read_only_ways(source: Any, config: PSConfig) -> str:
    """How to read the store of `config` read-only while its writer runs, for a config
    file `source` (a path, as the caller spelt it): the `hps lookup` line of its first
    model and the Python steps; "" for a config object."""
    if not isinstance(source, (str, os.PathLike)) or not config.models:
        return ""
    model = config.models[0].model
    others = [m.model for m in config.models[1:]]
    which = f" (-m names the model: {', '.join([model, *others])})" if others else ""
    path = os.fspath(source)
    command = f"hps lookup {shlex.quote(path)} -m {shlex.quote(model)} -- {EXAMPLE_KEY}"
    return (f"From a shell: `{command}` (your keys for {EXAMPLE_KEY}){which}; from "
            "Python: `from hps import HPS, load_config; "
            f"config = load_config({path!r}); config.persistent_db.read_only = True; "
            "hps = HPS(config)`")
