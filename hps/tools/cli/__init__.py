"""The `hps` command: entry point `main` (`hps = "hps.tools.cli:main"`), or
`python -m hps.tools.cli`.

This module puts the command tree together, in the order `hps --help` lists it; each
command lives in the module of its job:

- demo.py: `hps demo` (write, load and check a demo model; `--serve` serves it)
- serve.py: `hps serve` (a config's models over HTTP; the server extra)
- local.py: `hps load`, `hps lookup` (a config's server opened in this process)
- publish.py: `hps publish` (rows as online updates)
- files.py: `hps inspect`, `hps convert` (a table's files, any format); sizing.py: the
  memory a table would take, which inspect prints
- bench.py: `hps bench …` (the benchmarks, each beside its baseline)
- models.py: `hps models list|add|remove` (the models of a running server)
- config.py: `hps config dump` (the ps.json a config, YAML or Python file amounts to)
- app.py: the root app and what every command shares: consoles, the one-line error exit,
  logging, progress bars
"""

from __future__ import annotations

import sys

from hps.tools.cli.app import app
from hps.tools.cli.bench import bench_app
from hps.tools.cli.config import config_app
from hps.tools.cli.demo import demo
from hps.tools.cli.files import convert, inspect
from hps.tools.cli.local import load, lookup
from hps.tools.cli.models import models_app
from hps.tools.cli.publish import publish
from hps.tools.cli.serve import serve

__all__ = ["app", "main"]

for command in (demo, serve, load, lookup, publish, inspect, convert):
    app.command()(command)
app.add_typer(bench_app, name="bench")
app.add_typer(models_app, name="models")
app.add_typer(config_app, name="config")


def main() -> None:
    """Run the `hps` command; Ctrl-C exits with status 130, no traceback."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
