"""The root of the `hps` command and what every command shares.

The root typer app (-v, --version), the two consoles (results on stdout; errors, log
records and progress on stderr: progress.py), and the one-line error exit. Output is made
for an 80-column terminal: help in click's plain layout, tables with few columns and human
labels, error messages on one line. Log records and Python warnings share one format
(rich's log handler on stderr). Output that goes to no terminal (a pipe, a file, CI's
log) keeps its lines whole: nothing there re-wraps them to a window, so rich's 80 columns
would split them for good.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

#: -h beside --help
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
# rich_markup_mode=None: click's plain help (no metavar column, wraps at the terminal)
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  context_settings=HELP_OPTIONS,
                  help="Hierarchical parameter server for recommender embeddings.")
#: the width of output that goes to no terminal: wide enough that no line is split
UNWRAPPED_WIDTH = 1000


def _unwrapped(stream: Any) -> bool:
    """Whether output to `stream` is kept whole: not a terminal, and no COLUMNS asked for."""
    return not stream.isatty() and not os.environ.get("COLUMNS")


def _console(stderr: bool) -> Console:
    if _unwrapped(sys.stderr if stderr else sys.stdout):
        # tables take their own width (they do not expand), text is not wrapped
        return Console(stderr=stderr, width=UNWRAPPED_WIDTH, soft_wrap=True)
    return Console(stderr=stderr)  # a terminal's width, or COLUMNS


console = _console(stderr=False)
err_console = _console(stderr=True)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        handlers=[_log_handler()], force=True)
    warnings.showwarning = _log_warning


def _log_handler() -> logging.Handler:
    """Rich's log handler on a terminal; elsewhere the same fields on one plain line each
    (rich's handler pads every record to the console's width: 1,000 columns there)."""
    if not _unwrapped(sys.stderr):
        handler: logging.Handler = RichHandler(console=err_console, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)-8s %(message)s",
                                           datefmt="%x %X"))
    return handler


def _log_warning(message: Warning | str, category: type[Warning], filename: str,
                 lineno: int, file: Any = None, line: str | None = None) -> None:
    """Python warnings as log records, in the log's one format (not warnings' own)."""
    logging.getLogger("py.warnings").warning("%s: %s", category.__name__, message)


def fail(exc: Exception, code: int = 2) -> None:
    """Exit with `code` after one line on stderr saying what went wrong (no traceback)."""
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(code=code)


def _version(show: bool) -> None:
    if show:
        from hps.tools.cli.version import version_line

        console.print(version_line(), highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    _setup_logging(verbose)
