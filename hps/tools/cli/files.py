"""`hps inspect` and `hps convert`: a table's files in any format (HugeCTR sparse folder,
Parquet, NumPy, safetensors), described or rewritten in another.

Both take one list of options saying how to read the table (`_TABLE_READ_OPTIONS`, handed to
the command as one `_TableRead`), so the two cannot drift apart. The reading and writing
are hps.modelfiles'; what a table would take in memory, sizing.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from inspect import Parameter, signature
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from hps.errors import HPSError
from hps.tools.cli.choices import one_of, values_of
from hps.tools.cli.root import console, err_console, fail


@dataclass(frozen=True)
class _TableRead:
    """How a table's files are read, as `hps inspect` and `hps convert` take it."""

    width: int | None
    fmt: str | None
    key_column: str | None
    vector_column: str | None
    tensor: str | None
    keys_tensor: str | None
    key_offset: int | None

    def spec(self, path: str) -> Any:
        """The TableSpec of `path` read this way; ConfigError for options that do not fit."""
        from hps.errors import ConfigError
        from hps.modelfiles.formats import TableSpec
        try:
            return TableSpec(path, self.fmt, self.key_column,  # type: ignore[arg-type]
                             self.vector_column, self.tensor, self.keys_tensor,
                             self.key_offset)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


#: the options of _TableRead, in the order `--help` lists them
_TABLE_READ_OPTIONS: dict[str, Any] = {
    "width": Annotated[Optional[int], typer.Option(
        help="Vector width (from the files if omitted; HugeCTR folders infer it).")],
    "fmt": Annotated[Optional[str], typer.Option(
        "--format", callback=one_of(values_of("hps.modelfiles.formats.spec", "FORMATS")),
        help="sparse_folder, parquet, numpy, safetensors, torch (a torch.save state_dict) or "
             "dcp (a PyTorch distributed checkpoint folder) (default: from the suffix or the "
             "folder's contents).")],
    "key_column": Annotated[Optional[str], typer.Option(
        help="Parquet: the key column (default key).")],
    "vector_column": Annotated[Optional[str], typer.Option(
        help="Parquet: the vector column (default vector).")],
    "tensor": Annotated[Optional[str], typer.Option(
        help="safetensors: the rows tensor (default the only 2-D one, else weight).")],
    "keys_tensor": Annotated[Optional[str], typer.Option(
        help="safetensors: a 1-D keys tensor (default keys, if present).")],
    "key_offset": Annotated[Optional[int], typer.Option(
        help="safetensors: key of row i is i + this (default 0).")],
}


def _reads_a_table(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the options of _TABLE_READ_OPTIONS after its own, handed to it as
    one _TableRead in its keyword argument `read`: one list of options for the commands
    that read a table, so they cannot drift apart."""
    own = signature(command, eval_str=True)
    added = [Parameter(name, Parameter.KEYWORD_ONLY, default=None, annotation=option)
             for name, option in _TABLE_READ_OPTIONS.items()]

    @functools.wraps(command)
    def run(**kwargs: Any) -> None:
        read = _TableRead(**{name: kwargs.pop(name) for name in _TABLE_READ_OPTIONS})
        command(**kwargs, read=read)

    run.__signature__ = own.replace(parameters=[  # type: ignore[attr-defined]
        *(p for p in own.parameters.values() if p.name != "read"), *added])
    return run


@_reads_a_table
def inspect(
    source: str = typer.Argument(..., help="A table's files: folder or file, path or URI."),
    *,
    read: _TableRead,
) -> None:
    """Describe a table in any format: keys, width, sizes, validity.

    Also the dtypes and the key range.
    """
    from hps.modelfiles.inspect import inspect_model
    from hps.tools.cli.sizing import gpu_memory_rows, host_memory_rows

    try:
        report = inspect_model(read.spec(source), read.width)
    except HPSError as exc:
        err_console.print(f"[bold red]invalid:[/] {escape(str(exc))}")
        raise typer.Exit(code=1) from None
    _print_report(f"{report.format} {source}",
                  report.rows() + host_memory_rows(report.num_keys, report.vec_size)
                  + gpu_memory_rows(report.num_keys, report.vec_size))
    if not report.valid:
        raise typer.Exit(code=1)


def _print_report(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title)
    table.add_column("property")
    table.add_column("value", justify="right", overflow="fold")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


@_reads_a_table
def convert(
    source: str = typer.Argument(..., help="The table to read: folder or file, path or URI."),
    destination: str = typer.Argument(
        ..., help="Local path to write: .parquet, .npz, .safetensors, or no suffix for a "
                  "folder."),
    to: Optional[str] = typer.Option(
        None, callback=one_of(values_of("hps.modelfiles.convert", "WRITABLE")),
        help="Format to write: sparse_folder, parquet, numpy or safetensors (default: from "
             "DESTINATION's suffix; without one a HugeCTR sparse folder; another suffix "
             "needs --to)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing DESTINATION."),
    *,
    read: _TableRead,
) -> None:
    """Convert a table to another format.

    Formats: HugeCTR sparse folder, Parquet, NumPy, safetensors.

    Streams chunk by chunk with a progress bar; rows are copied bit for bit (float16 and
    bfloat16 widened exactly to float32). A failed conversion leaves no DESTINATION (and
    an existing one, replaced with --force, as it was). The destination's format, an
    existing destination and the packages the formats need are checked before any read.
    """
    from hps.modelfiles.convert import convert as run_convert
    from hps.tools.cli.progress import load_progress

    try:
        spec = read.spec(source)
        with load_progress(verb="") as progress:  # the table's name: "writing DESTINATION"
            report = run_convert(spec, destination, to, vec_size=read.width,
                                 progress=progress, force=force)
    except HPSError as exc:
        fail(exc)
    _print_report(f"{report.format} {source} → {destination}", report.rows())
    if report.duplicate_keys or report.non_finite_values:
        err_console.print("[yellow]warning:[/] the table has duplicate keys or non-finite "
                          "values (copied as they are); `hps inspect DESTINATION` counts "
                          "them", soft_wrap=True)
