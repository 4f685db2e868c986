"""`hps demo`: write a demo model, load it, check every looked-up vector; --serve serves it.

The model and its checks are hps.tools.demo's; this is the command around them: progress
while it compiles and loads (progress.py), a table of the figures, exit status 1 when a
vector does not match, and the commands that serve what it wrote.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from hps.errors import HPSError
from hps.tools.cli.root import console, err_console, fail
from hps.tools.cli.serve import DEFAULT_MAX_BODY, serve_config

#: where the demo writes by default
DEFAULT_FOLDER = Path("models/demo")


def demo(
    folder: Path = typer.Option(
        DEFAULT_FOLDER, help="Where to write the demo model and its ps.json."),
    scale: float = typer.Option(1.0, help="Model size relative to the default ~1M keys."),
    serve_after: bool = typer.Option(
        False, "--serve/--no-serve",
        help="After the checks, serve the demo model over HTTP until Ctrl-C."),
    host: str = typer.Option("127.0.0.1", help="With --serve: address to bind (without: "
                             "the one the closing hint names)."),
    port: int = typer.Option(8000, help="With --serve: port (without: the one the closing "
                             "hint names)."),
) -> None:
    """Write a demo model, load it, check every looked-up vector.

    The model (HugeCTR's format: tables user_item, width 16, and item_category, width
    64; keys 17, 42 and -3 are in both) and its ps.json go to --folder, by default
    models/demo: serve it with `hps serve models/demo/ps.json`, or pass --serve. The
    first run on a machine compiles what the demo runs, on a small model first (timed
    apart from the load). While `hps serve` serves the folder it refuses, writing nothing.
    """
    from hps.tools.cli.progress import compile_status, load_progress
    from hps.tools.demo import TABLES, check_not_served, run_demo, warm_up

    if serve_after:  # before minutes of demo, not after
        try:
            import hps.http  # noqa: F401
        except HPSError as exc:
            fail(exc)
    if scale <= 0:
        fail(ValueError(f"--scale must be above 0 (1.0 is ~1M keys), got {scale:g}"))
    try:
        check_not_served(folder)
        with compile_status("compiling what the demo runs (first run only)") as listener:
            warmed = warm_up(listener)
        console.print(_warm_up_line(warmed.compiled, warmed.cached, warmed.seconds),
                      highlight=False, soft_wrap=True)
        total = sum(int(c * scale) for _, c, _ in TABLES)
        console.print(f"Writing a {total:,}-key model (widths 16 and 64) to {folder} …")
        with load_progress() as progress:
            report = run_demo(folder, progress=progress, scale=scale, warmed=warmed)
    except HPSError as exc:
        fail(exc)
    table = Table(title="hps demo: embedded tiers (hash map over RocksDB)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in report.rows():
        table.add_row(name, value)
    console.print(table)
    if not report.ok:
        err_console.print("[bold red]demo check FAILED[/]")
        raise typer.Exit(code=1)
    console.print("[green]all looked-up vectors match the model files[/]")
    if not serve_after:
        serve_line, again = serve_hints(folder, scale, host, port)
        console.print(f"Serve it over HTTP: [bold]{escape(serve_line)}[/] (or "
                      f"[bold]{escape(again)}[/])", soft_wrap=True)
        return
    serve_config(folder / "ps.json", host=host, port=port, token=None,
                 max_body_bytes=DEFAULT_MAX_BODY, access_log=False)


def serve_hints(folder: Path, scale: float, host: str, port: int) -> tuple[str, str]:
    """The two commands that serve the model a demo with these options wrote: `hps
    serve` of its ps.json, and the same demo again with --serve; each names the options
    given that it needs (--folder, --scale, --host, --port), so it serves that model
    where the user asked."""
    where = [] if host == "127.0.0.1" else ["--host", host]
    where += [] if port == 8000 else ["--port", str(port)]
    demo = [] if folder == DEFAULT_FOLDER else ["--folder", str(folder)]
    demo += [] if scale == 1.0 else ["--scale", f"{scale:g}"]
    return (shlex.join(["hps", "serve", str(folder / "ps.json"), *where]),
            shlex.join(["hps", "demo", *demo, "--serve", *where]))


def _warm_up_line(compiled: int, cached: int, seconds: float) -> str:
    if compiled:
        return (f"compiled functions: {compiled} compiled in {seconds:.1f} s (first run "
                "only; numba caches them)")
    return f"compiled functions: {cached} read from numba's cache in {seconds:.2f} s"
