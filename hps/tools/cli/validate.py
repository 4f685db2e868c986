"""`hps validate`: the load gate on a table's files, offline.

The same checks a load or reload makes (hps/gate/: width, non-finite rows, repeated
keys, and with `--against` the drift of row norms and keys from another version's files),
under the `validation` limits of a config (`--config`: its top-level section with the
model's own over it) or the defaults. Prints one row per check and exits 1 when the
gate would refuse the files (or they cannot be read as a model), 2 on a usage or config
error, 0 when a load would take them (warnings included).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from hps.errors import ConfigError, HPSError
from hps.tools.cli.files import _reads_a_table, _TableRead
from hps.tools.cli.root import console, err_console, fail


@_reads_a_table
def validate(
    source: str = typer.Argument(..., help="A table's files: folder or file, path or URI."),
    config: Optional[str] = typer.Option(
        None, "--config", "-c", help="ps.json / YAML whose validation limits apply (and "
        "the width of the table whose sparse_files entry is SOURCE)."),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="The model of --config whose limits apply (default: "
        "the one naming SOURCE, else the only one)."),
    against: Optional[str] = typer.Option(
        None, "--against", help="The version served now (files, read the same way): "
        "measure the drift of row norms and keys from it."),
    *,
    read: _TableRead,
) -> None:
    """Check a table's files as a load would: width, NaN/Inf, repeated keys, drift.

    Exits 1 when the load gate would refuse them, 0 when a load would take them.
    """
    from hps.gate.verdict import GateVerdict

    # the findings are printed below, once: not as the server's log records too
    logging.getLogger("hps.gate").setLevel(logging.ERROR)
    try:
        settings, width, sources = _limits(config, model, source, read.width)
        verdict = _check(source, against, read, settings, width, sources)
    except ConfigError as exc:
        fail(exc)
    except HPSError as exc:
        err_console.print(f"[bold red]invalid:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(code=1) from None
    assert isinstance(verdict, GateVerdict)
    _print_verdict(source, verdict, settings)
    if not verdict.passed:
        err_console.print(f"[bold red]refused:[/] {escape(verdict.refusal.message)}",  # type: ignore[union-attr]
                          soft_wrap=True)
        raise typer.Exit(code=1)
    for finding in verdict.findings:
        err_console.print(f"[yellow]warning:[/] {escape(finding.message)}", soft_wrap=True)


def _limits(config: str | None, model: str | None, source: str, width: int | None
            ) -> tuple[Any, int | None, Any]:
    """(the ValidationConfig that applies, the width expected, how sources are reached)
    from --config and --model."""
    from hps.config import load_config
    from hps.gate.settings import ValidationConfig, effective
    from hps.modelfiles.source import SourceOptions
    from hps.server.loader import source_options

    if config is None:
        if model is not None:
            raise ConfigError("--model needs --config")
        return ValidationConfig(), width, SourceOptions()
    ps = load_config(config)
    sources = source_options(ps)
    chosen = None
    if model is not None:
        try:
            chosen = ps.model(model)
        except KeyError:
            names = ", ".join(m.model for m in ps.models)
            raise ConfigError(f"{config} has no model {model!r} (models: {names})") from None
    else:
        naming = [m for m in ps.models if _table_of(m, source) is not None]
        chosen = naming[0] if naming else (ps.models[0] if len(ps.models) == 1 else None)
    if chosen is None:
        return ps.validation, width, sources
    index = _table_of(chosen, source)
    if width is None and index is not None:
        width = chosen.embedding_vecsize_per_table[index]
    return effective(ps.validation, chosen.validation), width, sources


def _table_of(model: Any, source: str) -> int | None:
    """The index of the table of `model` read from `source`, None if none is."""
    import os

    def same(a: str, b: str) -> bool:
        local = "://" not in a and "://" not in b
        return (os.path.realpath(a) == os.path.realpath(b)) if local else a.rstrip("/") == \
            b.rstrip("/")

    for i in range(model.num_tables):
        if same(model.table_spec(i).path, source):
            return i
    return None


def _check(source: str, against: str | None, read: _TableRead, settings: Any,
           width: int | None, sources: Any) -> Any:
    """The gate's verdict on `source`'s files (LoadGateError caught: it is the verdict)."""
    from hps.gate.drift import FileRows
    from hps.gate.table_gate import TableGate, width_refusal
    from hps.gate.verdict import GateVerdict, LoadGateError
    from hps.modelfiles.formats import ReadOptions, open_model

    with open_model(read.spec(source), ReadOptions(None), sources) as reader:
        if width is not None and reader.vec_size != width:
            verdict = GateVerdict("", "", reader.uri, rows=0)
            return width_refusal(verdict, reader.vec_size, width).verdict
        served_reader = (open_model(read.spec(against), ReadOptions(reader.vec_size),
                                    sources) if against is not None else None)
        try:
            gate = TableGate(settings, model="", table="", uri=reader.uri,
                             dim=reader.vec_size, num_keys=reader.num_keys,
                             served=FileRows(served_reader) if served_reader else None,
                             count_duplicates=True)
            try:
                for _ in gate.check(reader.chunks()):
                    pass
                return gate.finish()
            except LoadGateError as exc:
                return exc.verdict
        finally:
            if served_reader is not None:
                served_reader.close()


def _print_verdict(source: str, verdict: Any, settings: Any) -> None:
    """One row per check: its figure, its limit, and what the gate makes of it."""
    found = {f.check: f for f in verdict.findings}
    drift = verdict.drift or {}
    rows: list[tuple[str, str, str, str]] = []

    def row(check: str, figure: str, limit: str) -> None:
        f = found.get(check)
        result = ("[bold red]refused[/]" if f and f.refused else
                  "[yellow]warning[/]" if f else "ok")
        rows.append((check, figure, limit, result))

    width = found.get("width")
    if width is not None:
        row("width", f"{width.figure:g}", f"{width.limit:g}")
    else:
        row("width", "as expected", "-")
        row("non_finite", _rows(verdict.non_finite_rows), _rows(settings.max_nan_rows))
        if "encodable" in found:
            row("encodable", f"{found['encodable'].figure:g}", f"{found['encodable'].limit:g}")
        row("duplicates", _rows(verdict.duplicate_keys),
            "0 rows" if settings.duplicates == "refuse" else f"{settings.duplicates} wins")
        if "size" in found:  # no keys, or far fewer than the version given by --against
            row("size", f"{found['size'].figure:,.0f} keys", f"{found['size'].limit:,.0f} keys")
        if verdict.drift is not None:
            ratio = drift.get("norm_ratio")
            row("norm_ratio", "-" if ratio is None else f"{ratio:.3g}×",
                f"{settings.max_norm_ratio:g}× ({settings.drift})")
            churn = drift.get("key_churn")
            row("key_churn", "-" if churn is None else
                f"{churn:.1%} (+{drift['keys_added']:.1%} −{drift['keys_removed']:.1%})",
                f"{settings.max_key_churn:.0%} ({settings.drift})")
    table = Table(title=f"load gate: {source} ({verdict.rows:,} rows read)")
    for name, justify in (("check", "left"), ("figure", "right"), ("limit", "right"),
                          ("result", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(*(escape(c) if i < 3 else c for i, c in enumerate(r)))
    console.print(table)
    if drift.get("note"):
        console.print(f"drift: {escape(drift['note'])}")


def _rows(n: int) -> str:
    return f"{n:,} row" + ("" if n == 1 else "s")
