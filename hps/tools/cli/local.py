"""`hps load` and `hps lookup`: a config's server opened in this process (no HTTP).

Both read the config with no update source (`_without_updates`): a one-off command
applies no online updates and commits nothing for the serving replicas' consumer group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import typer

from hps.errors import HPSError
from hps.tools.cli.app import BarProgress, console, fail, progress_bars
from hps.tools.cli.models import print_models


def load(config: Path = typer.Argument(..., help="ps.json or YAML config.")) -> None:
    """Load every model of a config into its tiers (RocksDB keeps them)."""
    from hps.server import HierarchicalParameterServer

    try:
        cfg = _without_updates(str(config))
        with progress_bars() as bars:
            server = HierarchicalParameterServer(cfg, progress=BarProgress(bars))
    except HPSError as exc:
        fail(exc)
    with server:
        print_models(server.describe())


def lookup(
    config: Path = typer.Argument(..., help="ps.json or YAML config."),
    keys: list[int] = typer.Argument(
        ..., parser=lambda text: _key(text), help="Keys to look up (negative ones too: -3)."),
    model: str = typer.Option(..., "--model", "-m", help="Model name."),
    table: str = typer.Option("0", "--table", "-t", help="Table index or name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    read_only: bool = typer.Option(
        False, "--read-only", help="Open RocksDB read-only: works while a server has it "
        "open, and reads what that server loaded."),
) -> None:
    """Look up keys and print their vectors."""
    from hps.server import HierarchicalParameterServer

    try:
        cfg = _without_updates(str(config))
        if cfg.persistent_db.enabled:
            # RocksDB holds every table: no need to fill the in-process tier for a few keys
            update: dict[str, Any] = {"volatile_db": cfg.volatile_db.model_copy(
                update={"initial_cache_rate": 0.0})}
            if read_only:
                update["persistent_db"] = cfg.persistent_db.model_copy(
                    update={"read_only": True})
            cfg = cfg.model_copy(update=update)
        with HierarchicalParameterServer(cfg) as server:
            # the server checks the keys (int64 range) and the table (name or index)
            vectors = server.lookup(model, table, keys)
    except HPSError as exc:
        fail(exc)
    if as_json:
        print(json.dumps({"keys": keys, "vectors": vectors.tolist()}))
        return
    np.set_printoptions(precision=4, suppress=True, linewidth=78)
    for key, row in zip(keys, vectors, strict=True):
        console.print(f"[bold]{key}[/]: {np.array2string(row, threshold=16)}")


def _key(text: Any) -> int:
    """A key of `hps lookup`; what is not one was most likely a mistyped option."""
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is neither a key (an integer) nor an option of "
                                 "hps lookup (see hps lookup -h)") from None


def _without_updates(path: str) -> Any:
    """The config at `path` with no update source: a one-off command reads no updates (and
    commits nothing for the serving replica's consumer group)."""
    from hps.config import UpdateSourceConfig, load_config

    return load_config(path).model_copy(update={"update_source": UpdateSourceConfig()})
