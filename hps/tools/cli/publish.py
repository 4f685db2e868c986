"""`hps publish`: rows as online updates, to the Kafka topics or Redis streams a config's
update_source names (hps.updates.publish does the publishing; this is the command)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hps.errors import HPSError, UnknownModelError
from hps.tools.cli.root import console, fail


def publish(
    config: Path = typer.Argument(..., help="ps.json or YAML config with an update_source."),
    model: str = typer.Argument(..., help="Model name."),
    source: Optional[str] = typer.Argument(
        None, help="A table's files (sparse model folder, or any format sparse_files "
                   "takes). Default: each table's files from the config."),
    table: Optional[str] = typer.Option(
        None, "--table", "-t", help="Table name or index (needed with SOURCE, --keys)."),
    keys: Optional[Path] = typer.Option(None, help="A .npy file of keys (with --vectors)."),
    vectors: Optional[Path] = typer.Option(None, help="A .npy file of float32 [n, width] "
                                                      "vectors (with --keys)."),
) -> None:
    """Publish rows as online updates (Kafka or Redis Streams, as update_source says).

    Each message holds max_batch_size rows of one table, on topic (stream)
    hps_et.<model>.<table>; serving replicas apply them to every tier and GPU cache.
    """
    import numpy as np

    from hps.config import load_config
    from hps.tools.cli.progress import load_progress
    from hps.updates.publish import publish_arrays, publish_table

    if (keys is None) != (vectors is None):
        fail(ValueError("--keys and --vectors go together"))
    if (source is not None or keys is not None) and table is None:
        fail(ValueError("name the table (--table) the rows belong to"))
    try:
        cfg = load_config(str(config))
        if not cfg.update_source.enabled:
            raise HPSError(f"{config}: update_source has no type, so there is nowhere to "
                           "publish: add an update_source block with type kafka_message_queue "
                           "or redis_stream and its address")
        models = {m.model: m for m in cfg.models}
        if model not in models:
            raise UnknownModelError(f"the config has no model {model!r} (models: "
                                    f"{', '.join(models)})")
        tables = [table] if table is not None else list(models[model].embedding_table_names)
        sent = 0
        with load_progress(verb="publishing to") as bar:
            if keys is not None and vectors is not None:
                sent = publish_arrays(cfg, model, tables[0], np.load(keys), np.load(vectors),
                                      progress=bar)
            else:
                for name in tables:
                    sent += publish_table(cfg, model, name, source, progress=bar)
    except (HPSError, OSError, ValueError) as exc:
        fail(exc)
    console.print(f"{sent} messages published to {cfg.update_source.type} "
                  f"({', '.join(f'hps_et.{model}.{t}' for t in tables)})")
