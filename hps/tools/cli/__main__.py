"""`python -m hps.tools.cli`: the `hps` command, for where the entry point is not installed."""

from __future__ import annotations

from hps.tools.cli import main

if __name__ == "__main__":
    main()
