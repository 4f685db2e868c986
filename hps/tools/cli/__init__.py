"""The `hps` command: entry point `main` (`hps = "hps.tools.cli:main"`), or
`python -m hps.tools.cli`.

Nothing is imported until it is used: `app` is put together on first use (PEP 562's
module `__getattr__`), `hps --version` prints its line before importing typer and rich,
and each command imports what it runs when it runs, so `hps -h` stays quick.

This module puts the command tree together (`app`), in the order `hps --help` lists it;
each command lives in the module of its job:

- demo.py: `hps demo` (write, load and check a demo model; `--serve` serves it)
- serve.py: `hps serve` (a config's models over HTTP; the server extra)
- local.py: `hps load`, `hps lookup` (a config's server opened in this process)
- publish.py: `hps publish` (rows as online updates)
- files.py: `hps inspect`, `hps convert` (a table's files, any format); sizing.py: the
  memory a table would take, which inspect prints
- validate.py: `hps validate` (the load gate's checks on a table's files, offline)
- plan.py: `hps plan` (the memory a table needs in every tier, its GPU cache's hit rate)
- bench.py: `hps bench …` (the benchmarks, each beside its baseline); bench_ready.py:
  `hps bench ready` (real servers from start to first lookups); key_counts.py: the
  one reading of their key counts (100k, 1M, 2_000_000)
- models.py: `hps models list|add|reload|remove` (the models of a running server)
- mps.py: `hps mps start|status|stop` (NVIDIA's MPS daemon for a GPU host's processes)
- config.py: `hps config dump` (the ps.json a config, YAML or Python file amounts to)
- from_torch.py: `hps config from-torch` (the ps.json block of a PyTorch checkpoint)
- root.py: the root app and what every command shares: consoles, the one-line error exit,
  logging; version.py: the line `hps --version` prints; progress.py: loads and compiles
  as they go (bars on a terminal, plain lines elsewhere); choices.py: options that take
  one of a fixed set of values
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

__all__ = ["app", "main"]


@functools.cache
def _assembled() -> typer.Typer:
    """The root app with every command added, in the order `hps --help` lists them."""
    from hps.tools.cli import bench_ready  # noqa: F401 - adds `hps bench ready`
    from hps.tools.cli.bench import bench_app
    from hps.tools.cli.config import config_app
    from hps.tools.cli.demo import demo
    from hps.tools.cli.files import convert, inspect
    from hps.tools.cli.from_torch import from_torch
    from hps.tools.cli.local import load, lookup
    from hps.tools.cli.models import models_app
    from hps.tools.cli.mps import mps_app
    from hps.tools.cli.plan import plan
    from hps.tools.cli.publish import publish
    from hps.tools.cli.root import app
    from hps.tools.cli.serve import serve
    from hps.tools.cli.validate import validate

    for command in (demo, serve, load, lookup, publish, inspect, convert, plan, validate):
        # a dash followed by digits is a negative key to lookup (`hps lookup ps.json -m m
        # -3`), not an option it does not know
        app.command(context_settings={"ignore_unknown_options": command is lookup})(command)
    app.add_typer(bench_app, name="bench")
    app.add_typer(models_app, name="models")
    app.add_typer(mps_app, name="mps")
    config_app.command("from-torch")(from_torch)
    app.add_typer(config_app, name="config")
    return app


def __getattr__(name: str) -> object:
    if name == "app":  # the typer app, put together on first use
        return _assembled()
    raise AttributeError(f"module 'hps.tools.cli' has no attribute {name!r}")


def main() -> None:
    """Run the `hps` command; Ctrl-C exits with status 130, no traceback."""
    if sys.argv[1:] == ["--version"]:  # alone: the line, without typer's import
        from hps.tools.cli.version import version_line

        print(version_line())
        return
    try:
        _assembled()()
    except KeyboardInterrupt:
        sys.exit(130)
