"""`hps plan`: what each table needs in every tier and storage type, and, given a key log,
the hit rate its GPU cache would have at several sizes. No GPU and no load needed.

The tables come from a config (sizes read from the files' headers, or given with
`--table`) or from `--table NAME:ROWS:DIM` alone; the numbers are hps/tools/plan/'s. The
output is one table of bytes per table (and one of hit rates with a key log), or one JSON
document with `--json`; `--plot` draws the hit-rate curve.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from hps.errors import ConfigError, HPSError
from hps.tools.cli.key_counts import count_option, parse_count
from hps.tools.cli.root import console, fail

#: the marks of a bytes table's notes, in order
_MARKS = ("†", "‡", "§", "¶", "#")
_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def plan(
    config: Optional[Path] = typer.Argument(
        None, help="ps.json or YAML config (optional with --table)."),
    table: list[str] = typer.Option(
        [], "--table", metavar="NAME:ROWS:DIM", help="e.g. t0:10M:64 (repeatable): a "
        "table to plan, or the size of a config's table (its files are then not read)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Only this model."),
    key_log: list[str] = typer.Option(
        [], "--key-log", metavar="[TABLE=]FILE", help="(repeatable) a table's looked-up keys (raw "
        "int64, .npy, or the hot-set JSON {\"keys\": [...]}); TABLE may be left out when "
        "one table is planned."),
    sizes: Optional[str] = typer.Option(
        None, "--sizes", metavar="PERCENTS", help="GPU cache sizes to replay, in % of the table "
        "(default 1,2,5,10,25,50,100)."),
    batch: int = typer.Option(
        4096, "--batch", parser=count_option, help="Keys per replayed lookup."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Draw the hit-rate curves to this PNG/SVG/PDF (the plot extra)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Plan a table's memory and GPU cache size.

    Bytes each tier needs in every storage dtype (GPU caches with their slots and query
    buffers, the in-process hash map, Redis and RocksDB estimates) and, with a key log,
    the hit rate of the dynamic GPU cache at several sizes, replayed through the NumPy
    model of the cache.
    """
    from hps.tools.plan.hit_rates import DEFAULT_SHARES, check_shares

    try:
        shapes = _shapes(config, table, model)
        logs = _key_logs(shapes, key_log)
        shares = check_shares(_percentages(sizes)) if sizes else list(DEFAULT_SHARES)
        if plot is not None and not logs:
            raise ConfigError("--plot draws the hit rates of a key log: give --key-log")
        report = [_plan_table(shape, logs.get(i), shares, batch)
                  for i, shape in enumerate(shapes)]
        if plot is not None:
            from hps.tools.plan.curve import plot_hit_rates

            plot_hit_rates({r["table"]: r["curve"] for r in report if r["curve"]}, plot)
    except HPSError as exc:
        fail(exc)
    if as_json:
        print(json.dumps({"tables": [_as_json(r) for r in report]}, indent=1))
        return
    for r in report:
        _print_table(r)
    if len(report) > 1:
        _print_sum(report)
    if plot is not None:
        console.print(f"hit-rate curves: {plot}", highlight=False)


def _shapes(config: Path | None, tables: list[str], model: str | None) -> list[Any]:
    from hps.tools.plan.tables import shapes_from_config, shapes_from_sizes

    sizes = [_table_size(t) for t in tables]
    if config is None:
        if not sizes:
            raise ConfigError("give a config, or tables with --table NAME:ROWS:DIM")
        if model is not None:
            raise ConfigError("--model picks a config's model: give the config")
        return shapes_from_sizes(sizes)
    from hps.config import load_config

    return shapes_from_config(load_config(str(config)), sizes, model)


def _table_size(text: str) -> Any:
    """`NAME:ROWS:DIM` (ROWS as every count of the command: 10M, 2_000_000)."""
    from hps.tools.plan.tables import TableSize

    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise ConfigError(f"--table takes NAME:ROWS:DIM (e.g. t0:10M:64), got {text!r}")
    try:
        num_keys = parse_count(parts[1])
        dim = int(parts[2])
    except ValueError as exc:
        raise ConfigError(f"--table {text!r}: {exc}") from None
    if dim < 1:
        raise ConfigError(f"--table {text!r}: DIM must be a positive width")
    return TableSize(parts[0], num_keys, dim)


def _key_logs(shapes: list[Any], options: list[str]) -> dict[int, str]:
    """Table index → key log path, from `[TABLE=]FILE` options."""
    from hps.tools.plan.tables import find_table

    logs: dict[int, str] = {}
    for option in options:
        name, sep, path = option.partition("=")
        if not sep or Path(option).is_file():
            if len(shapes) != 1:
                raise ConfigError(f"--key-log {option!r}: name its table (TABLE=FILE); "
                                  f"{len(shapes)} tables are planned")
            index, path = 0, option
        else:
            index = find_table(shapes, name, "--key-log")
        if index in logs:
            raise ConfigError(f"--key-log: two logs for table {shapes[index].label}")
        logs[index] = path
    return logs


def _percentages(text: str) -> list[float]:
    shares = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            shares.append(float(part.removesuffix("%")) / 100)
        except ValueError:
            raise ConfigError(f"--sizes takes percentages of the table, comma-separated "
                              f"(e.g. 1,5,25%), got {part!r}") from None
    return shares


def _plan_table(shape: Any, log: str | None, shares: list[float], batch: int
                ) -> dict[str, Any]:
    from hps.tools.plan.hit_rates import hit_rate_curve
    from hps.tools.plan.key_log import read_key_log
    from hps.tools.plan.layout import layout_choice
    from hps.tools.plan.memory import dynamic_cache_bytes, table_memory
    from hps.tools.plan.uses import gpu_in_use, planned_rows, totals

    memory = table_memory(shape)
    report: dict[str, Any] = {"shape": shape, "table": shape.label, "memory": memory,
                              "curve": None}
    keys = None
    if log is not None:
        keys = read_key_log(log)
        started = time.perf_counter()
        curve = hit_rate_curve(keys, shape.num_keys, shares, batch)
        report.update(
            curve=curve, key_log=log, log_keys=int(keys.size), batch=batch,
            replay_seconds=time.perf_counter() - started,
            cache_bytes=[dynamic_cache_bytes(shape.num_keys, shape.dim, r.share)[shape.storage]
                         for r in curve])
    dynamic = next(t for t in memory if t.part == "dynamic")
    report["layout"] = layout_choice(shape, dynamic.by_storage[shape.storage], keys, batch) \
        if gpu_in_use(shape) else None
    report["rows"] = planned_rows(shape, memory)
    report["totals"] = totals(shape, report["rows"])
    return report


def _as_json(report: dict[str, Any]) -> dict[str, Any]:
    shape = report["shape"]
    out: dict[str, Any] = {
        "model": shape.model, "table": shape.table, "num_keys": shape.num_keys,
        "dim": shape.dim,
        "settings": {"gpucacheper": shape.gpucacheper, "embedding_cache_type": shape.cache_type,
                     "embedding_storage_dtype": shape.storage, "lookup_keys": shape.lookup_keys,
                     "devices": shape.devices, "volatile_db": shape.volatile_type,
                     "volatile_keys": shape.held_by_volatile,
                     "num_partitions": shape.num_partitions,
                     "overflow_policy": shape.overflow_policy,
                     "persistent_db": shape.persistent, "gpucache": shape.gpucache},
        "memory": [t.as_dict() for t in report["memory"]],
        # the rows the config does not use, each with the setting that would use it
        "alternatives": {r.bytes.part: r.instead for r in report["rows"] if r.instead},
        "totals": [t.as_dict() for t in report["totals"]],
        "layout": None if report["layout"] is None else report["layout"].as_dict(),
        "hit_rates": None,
    }
    if report["curve"] is not None:
        out.update(key_log=report["key_log"], log_keys=report["log_keys"],
                   batch=report["batch"], replay_seconds=round(report["replay_seconds"], 3),
                   hit_rates=[{**r.as_dict(), "cache_bytes": b}
                              for r, b in zip(report["curve"], report["cache_bytes"],
                                              strict=True)])
    return out


def _print_sum(report: list[dict[str, Any]]) -> None:
    """One line adding up every planned table's totals, each in its config's storage
    type."""
    sums: dict[str, int] = {}
    for r in report:
        for total in r["totals"]:
            sums[total.tier] = sums.get(total.tier, 0) + total.by_storage[r["shape"].storage]
    parts = [f"{_size(nbytes)} {label.removeprefix('total ')}" for label, nbytes in
             sums.items()]
    shared = " (per GPU: where they share the GPUs)" if "total per GPU" in sums else ""
    console.print(f"all {len(report)} tables, each in its storage type: "
                  f"{', '.join(parts)}{shared}", highlight=False)


def _size(nbytes: int) -> str:
    for unit, name in _UNITS:
        if nbytes >= unit:
            return f"{nbytes / unit:,.1f} {name}"
    return f"{nbytes:,} B"


def _print_table(report: dict[str, Any]) -> None:
    from hps.rows.storage_types import STORAGE_NAMES
    from hps.tools.plan.uses import gpu_in_use

    shape = report["shape"]
    gpu = gpu_in_use(shape)
    cache = (f"{shape.cache_type} cache, gpucacheper {shape.gpucacheper:g}" if gpu
             else "no GPU cache: gpucache false")
    title = f"{shape.label}: {shape.num_keys:,} keys × {shape.dim} ({cache}, stored as " \
        f"{shape.storage})"
    out = Table(title=title, title_justify="left", caption_justify="left")
    out.add_column("tier")
    for name in STORAGE_NAMES:
        out.add_column(f"{name}*" if name == shape.storage else name, justify="right")
    notes: list[str] = []
    for row in report["rows"]:
        tier = row.bytes
        label = tier.tier + (f", if {row.instead}" if row.instead else "")
        if tier.note:
            if tier.note not in notes:
                notes.append(tier.note)
            label += f" {_MARKS[notes.index(tier.note)]}"
        out.add_row(label, *(_size(tier.by_storage[name]) for name in STORAGE_NAMES),
                    style="dim" if row.instead else None)
    out.add_section()
    for total in report["totals"]:
        label = f"{total.tier} ({total.note})" if total.note else total.tier
        out.add_row(label, *(_size(total.by_storage[name]) for name in STORAGE_NAMES),
                    style="bold")
    out.caption = "\n".join(f"{_MARKS[i]} {n}" for i, n in enumerate(notes)) + \
        "\n* the config's storage type; a row marked \"if …\" is an alternative, not " \
        "in the totals"
    console.print(out)
    if not gpu:
        console.print("GPU rows left out: the model has gpucache false (--json lists "
                      "what each GPU layout would take).", highlight=False)
    choice = report["layout"]
    if choice is not None:
        console.print(f"over {choice.devices} GPUs, {choice.faster} is expected faster: "
                      f"{choice.why}.", highlight=False)
    if report["curve"] is None:
        if gpu and shape.cache_type == "dynamic":
            model = shape.model or "MODEL"
            console.print(
                f"hit rates: give --key-log {shape.label}=FILE, keys this table is looked up "
                "with (raw int64, .npy, or what a server's GET /v1/models/"
                f"{model}/tables/{shape.table}/hot-set answers), to replay them through the "
                "cache at several sizes.", highlight=False)
        return
    rates = Table(title=f"{shape.label}: dynamic GPU cache on {report['key_log']}",
                  title_justify="left", caption_justify="left",
                  caption=f"{report['log_keys']:,} keys replayed in lookups of "
                          f"{report['batch']:,} through the cache's NumPy model "
                          f"({report['replay_seconds']:.1f} s), from an empty cache; "
                          "warm: the log's second half")
    for name in ("cache size", "keys held", f"GPU ({shape.storage})", "hit rate", "warm"):
        rates.add_column(name, justify="right")
    for r, nbytes in zip(report["curve"], report["cache_bytes"], strict=True):
        rates.add_row(f"{100 * r.share:g}%", f"{r.capacity:,}", _size(nbytes),
                      f"{r.hit_rate:.3f}", f"{r.warm_hit_rate:.3f}")
    console.print(rates)
