"""`hps load` and `hps lookup`: a config's server opened in this process (no HTTP).

`hps load` fills the config's stores; `hps lookup` writes none unless asked
(`lookup_config` says what it opens instead).

Both read the config with no update source (`_without_updates`): a one-off command
applies no online updates and commits nothing for the serving replicas' consumer group.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from hps.errors import HPSError, StoreInUseError, UnknownModelError
from hps.tools.cli.models import print_models
from hps.tools.cli.root import console, err_console, fail

if TYPE_CHECKING:
    from hps.config import ModelConfig, PersistentDBConfig, PSConfig


def load(config: Path = typer.Argument(..., help="ps.json or YAML config.")) -> None:
    """Load every model of a config into its tiers (RocksDB keeps them)."""
    from hps.server import HierarchicalParameterServer
    from hps.tools.cli.progress import load_progress

    try:
        cfg = _without_updates(str(config))
        with load_progress() as progress:
            server = HierarchicalParameterServer(cfg, progress=progress)
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
        True, "--read-only/--write-store", help="--read-only (the default; the flag is "
        "kept for scripts that pass it): write nothing. A RocksDB store (persistent_db) "
        "that holds the model is read read-only, also while a server has it open; "
        "otherwise the model's files are read into this process's memory only, and no "
        "store is created. --write-store: load the model into the config's stores first "
        "(RocksDB, Redis), creating them if missing, as hps load does."),
) -> None:
    """Look up keys and print their vectors; writes no store unless --write-store."""
    import numpy as np

    from hps.server import HierarchicalParameterServer
    from hps.tools.cli.progress import load_progress

    try:
        cfg, note = lookup_config(_without_updates(str(config)), model, write=not read_only)
        if note:
            err_console.print(note, highlight=False, soft_wrap=True)
        with load_progress(quiet=True) as progress:  # a model read into memory takes a while
            server = HierarchicalParameterServer(cfg, progress=progress)
    except StoreInUseError as exc:  # only --write-store opens it for writing
        plain = shlex.join(["hps", "lookup", str(config), "-m", model,
                            *(["-t", table] if table != "0" else []),
                            *(["--json"] if as_json else []), "--", *map(str, keys)])
        fail(StoreInUseError(f"{exc}: without --write-store, `{plain}` reads it as it is"))
    except HPSError as exc:
        fail(exc)
    try:
        with server:
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


def lookup_config(cfg: PSConfig, model: str, *, write: bool) -> tuple[PSConfig, str]:
    """The config `hps lookup` opens for `model` (its block alone), and a line saying
    where its rows come from ("" for the config's own stores).

    With `write`, the config's stores as `hps load` fills them (RocksDB alone takes the
    rows when there is one: a few keys need no copy in memory). Without, nothing is
    created or written: a RocksDB store that holds every table of the model is read
    read-only with no volatile tier (which could be Redis); else the model's files are
    read into an in-process hash map only. UnknownModelError when the config has no
    `model`.
    """
    from hps.config import PersistentDBConfig, VolatileDBConfig

    blocks = [m for m in cfg.models if m.model == model]
    if not blocks:
        known = ", ".join(m.model for m in cfg.models)
        raise UnknownModelError(f"no model named {model!r} in the config (models: {known})")
    cfg = cfg.model_copy(update={"models": blocks})
    db = cfg.persistent_db
    if write:
        if not db.enabled:
            return cfg, ""
        return cfg.model_copy(update={"volatile_db": cfg.volatile_db.model_copy(
            update={"initial_cache_rate": 0.0})}), ""
    if db.enabled and _store_holds(db, blocks[0]):
        return cfg.model_copy(update={
            "volatile_db": VolatileDBConfig(type="disabled"),
            "persistent_db": db.model_copy(update={"read_only": True})}), ""
    in_memory = cfg.model_copy(update={"volatile_db": VolatileDBConfig(),
                                       "persistent_db": PersistentDBConfig()})
    if not db.enabled:
        return in_memory, ""
    where = (f"{db.path} holds no model {model!r}" if Path(db.path).is_dir() else
             f"there is no RocksDB store at {db.path}")
    return in_memory, (f"{where} yet: the model's files are read into memory only "
                       "(--write-store loads them into the store)")


def _store_holds(db: PersistentDBConfig, model: ModelConfig) -> bool:
    """Whether the RocksDB store of `db` exists and holds every table of `model` (opened
    read-only: nothing is created)."""
    from hps.tiers.contract import table_name
    from hps.tiers.rocksdb.tier import RocksDBTier

    if not Path(db.path).is_dir():
        return False
    store = RocksDBTier(db.model_copy(update={"read_only": True}))
    try:
        return all(store.metadata(table_name(model.model, name)) is not None
                   for name in model.embedding_table_names)
    finally:
        store.close()


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
