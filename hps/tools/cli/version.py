"""The line `hps --version` prints: its own module, so that the command prints it before
importing typer and rich (a third of a second on a loaded machine)."""

from __future__ import annotations


def version_line() -> str:
    """`hps 0.1.0 (distribution hps-server)`: the package's version and distribution."""
    from hps import __version__

    return f"hps {__version__} (distribution hps-server)"
