"""`hps bench ready`: real `hps serve` processes from their start to their first lookups;
`hps bench restart-fill`: a warm restart's volatile refill, before and after updates.

The measuring is hps.tools.bench.ready's (and restart_fill's); these are their commands:
options, a line before each server starts, the rows as a table with the load average
before and after. They live beside bench.py (the other profiles' commands) and add
themselves to `bench_app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hps.errors import HPSError
from hps.tools.cli.bench import bench_app
from hps.tools.cli.key_counts import count_option
from hps.tools.cli.root import console, fail


@bench_app.command("ready")
def bench_ready_cmd(
    checkout: Optional[list[Path]] = typer.Option(
        None, "--checkout", help="A checkout whose code the servers run (PYTHONPATH); "
        "repeatable: before and after in one run. Default: this hps's own."),
    demo_scale: float = typer.Option(1.0, help="The demo model's size (1.0: ~1M keys); "
                                               "0: no demo model."),
    keys: int = typer.Option(0, parser=count_option, help="Keys of a second model's one "
                             "table of --dim float32 (10M: the issue's; 0: none)."),
    dim: int = typer.Option(64, help="Width of that table."),
    workers: Optional[list[int]] = typer.Option(
        None, "--workers", min=1, help="Worker processes (repeatable). Default: 1 and 2."),
    folder: Optional[list[str]] = typer.Option(
        None, "--folder", help="Where each server starts: checkout (its code's folder) "
        "or other (repeatable). Default: both."),
    first: int = typer.Option(1000, parser=count_option,
                              help="Lookups measured after ready (the first window)."),
    later: int = typer.Option(10_000, parser=count_option,
                              help="Where the later window of as many lookups starts."),
    batch: int = typer.Option(16, parser=count_option, help="Keys per lookup."),
    gpu: bool = typer.Option(False, "--gpu", help="Tables in a GPU cache (gpucache: true)."),
    timeout: float = typer.Option(600.0, help="Seconds a server may take to get ready."),
) -> None:
    """Time to ready (cold: empty numba cache, no store; warm: a restart over that
    store; a worker the supervisor restarts) and the first lookups after ready against
    later ones, of `hps serve` subprocesses over http.client (docs/benchmarks.md)."""
    from hps.tools.bench.ready import bench_ready, default_checkout, format_ready

    folders = folder or ["checkout", "other"]
    for name in folders:
        if name not in ("checkout", "other"):
            fail(ValueError(f"--folder takes checkout or other, got {name!r}"))
    checkouts = checkout or [default_checkout()]
    console.print(f"{len(checkouts)} checkout(s) × model(s) × workers {workers or [1, 2]} × "
                  f"folders {folders}: each a cold start, its lookups and a warm restart …",
                  highlight=False)
    try:
        result = bench_ready(checkouts, demo_scale=demo_scale, keys=keys, dim=dim,
                             workers=workers or (1, 2), folders=folders, first=first,
                             later=later, batch=batch, gpu=gpu, timeout=timeout)
    except HPSError as exc:
        fail(exc)
    console.print(format_ready(result), markup=False, highlight=False, soft_wrap=True)


@bench_app.command("restart-fill")
def bench_restart_fill_cmd(
    updated: int = typer.Option(10_000, parser=count_option, help="Keys updated a table."),
    scale: float = typer.Option(1.0, help="Of the demo's size."),
    batch: int = typer.Option(1000, parser=count_option, help="Rows an update write."),
    restarts: int = typer.Option(3, help="Restarts timed before and after (the median)."),
) -> None:
    """The demo's warm restart: each table's volatile refill rate and source before and
    after online updates, and the update writes' rows/s (docs/operating.md#restarts)."""
    from hps.tools.bench.restart_fill import bench_restart_fill, format_restart_fill

    try:
        result = bench_restart_fill(updated, scale, batch, restarts)
    except HPSError as exc:
        fail(exc)
    console.print(format_restart_fill(result), markup=False, highlight=False)
