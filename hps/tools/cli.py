"""The `hps` command: demo, load, lookup, inspect, bench (and serve, with the server extra).

Output is made for an 80-column terminal: help in click's plain layout, tables with few
columns and human labels, error messages on one line. Log records and Python warnings
share one format (rich's log handler on stderr).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from inspect import Parameter, signature
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from hps.tools.admin_client import DEFAULT_URL
from hps.errors import BindError, HPSError, UnknownModelError
from hps.server.loader import LoadProgress

#: -h beside --help
_HELP = {"help_option_names": ["-h", "--help"]}
# rich_markup_mode=None: click's plain help (no metavar column, wraps at the terminal)
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  context_settings=_HELP,
                  help="Hierarchical parameter server for recommender embeddings.")
bench_app = typer.Typer(add_completion=False, rich_markup_mode=None, context_settings=_HELP,
                        help="Benchmarks: each tier beside its baseline, same run.")
app.add_typer(bench_app, name="bench")
models_app = typer.Typer(add_completion=False, rich_markup_mode=None, context_settings=_HELP,
                         no_args_is_help=True,
                         help="Models of a running server: list, add, remove.")
app.add_typer(models_app, name="models")
config_app = typer.Typer(help="Configuration: ps.json, YAML, HugeCTR's Python objects.",
                         no_args_is_help=True)
app.add_typer(config_app, name="config")
console = Console()
err_console = Console(stderr=True)


class BarProgress(LoadProgress):
    """A rich progress bar per table: bytes, bytes/s, keys."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None
        self.keys = 0

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        self.keys = 0
        self.task = self.progress.add_task(table, total=num_bytes, keys="0")

    def advance(self, keys: int, num_bytes: int) -> None:
        self.keys += keys
        if self.task is not None:
            self.progress.update(self.task, advance=num_bytes, keys=f"{self.keys:,}")

    def finish_table(self, table: str, seconds: float) -> None:
        if self.task is not None:
            task = self.progress.tasks[self.task]
            self.progress.update(self.task, completed=task.total)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TextColumn("{task.fields[keys]} keys"), TimeElapsedColumn(),
        console=err_console, transient=False,
    )


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)], force=True,
    )
    warnings.showwarning = _log_warning


def _log_warning(message: Warning | str, category: type[Warning], filename: str,
                 lineno: int, file: Any = None, line: str | None = None) -> None:
    """Python warnings as log records, in the log's one format (not warnings' own)."""
    logging.getLogger("py.warnings").warning("%s: %s", category.__name__, message)


def _fail(exc: Exception, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(code=code)


def _version(show: bool) -> None:
    if show:
        from hps import __version__

        console.print(f"hps {__version__} (distribution hps-server)", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    _setup_logging(verbose)


@app.command()
def demo(
    folder: Path = typer.Option(
        Path("models/demo"), help="Where to write the demo model; configs/demo.json reads "
        "models/demo of the repository."),
    scale: float = typer.Option(1.0, help="Model size relative to the default ~1M keys."),
    serve_after: bool = typer.Option(
        False, "--serve/--no-serve",
        help="After the checks, serve the demo model over HTTP until Ctrl-C."),
    host: str = typer.Option("127.0.0.1", help="With --serve: address to bind."),
    port: int = typer.Option(8000, help="With --serve: port."),
) -> None:
    """Write a demo model, load it, check every looked-up vector.

    The model (HugeCTR's format: tables user_item, width 16, and item_category, width
    64; keys 17, 42 and -3 are in both) and its ps.json go to --folder, by default
    models/demo, which configs/demo.json serves: `hps serve configs/demo.json`. With
    --serve the demo model is then served over HTTP; without it the demo ends.
    """
    from hps.tools.demo import TABLES, run_demo

    if serve_after:  # before minutes of demo, not after
        try:
            import hps.http  # noqa: F401
        except HPSError as exc:
            _fail(exc)
    total = sum(int(c * scale) for _, c, _ in TABLES)
    console.print(f"Writing a {total:,}-key model (widths 16 and 64) to {folder} …")
    try:
        with _progress() as bars:
            report = run_demo(folder, progress=BarProgress(bars), scale=scale)
    except HPSError as exc:
        _fail(exc)
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
        console.print(f"Serve it over HTTP: [bold]hps serve {folder / 'ps.json'}[/] "
                      "(or [bold]hps demo --serve[/])", soft_wrap=True)
        return
    _serve(folder / "ps.json", host=host, port=port, token=None,
           max_body_bytes=_DEFAULT_MAX_BODY, access_log=False)


_DEFAULT_MAX_BODY = 16 << 20


@app.command()
def serve(
    config: Path = typer.Argument(..., help="ps.json or YAML config."),
    host: str = typer.Option(
        "127.0.0.1", help="Address to bind; 0.0.0.0 serves every interface."),
    port: int = typer.Option(8000, help="TCP port."),
    token: Optional[str] = typer.Option(
        None, envvar="HPS_TOKEN", show_envvar=True,
        help="Bearer token every route but /healthz and /readyz requires."),
    max_body_bytes: int = typer.Option(
        _DEFAULT_MAX_BODY, help="Largest request body accepted (413 above)."),
    lookup_threads: Optional[int] = typer.Option(
        None, min=0, help="Threads lookups run on; 0: on the event loop. Default: 0 when "
        "every tier is in memory (hash map, no RocksDB, no GPU), else 2."),
    access_log: bool = typer.Option(False, "--access-log/--no-access-log",
                                    help="Log every request."),
    allow_root: Optional[list[str]] = typer.Option(
        None, "--allow-root", help="A folder or URI prefix models added at runtime (POST "
        "/v1/models) may be read from; repeatable. Default: the folders holding the "
        "config's model folders."),
) -> None:
    """Serve lookups over HTTP (/v1 and KServe v2), metrics, health.

    Lookups: binary and JSON on /v1, and the KServe v2 / Triton protocol on /v2 (inputs
    KEYS, NUMKEYS; output OUTPUT0). Binds at once and loads the models in the
    background: /healthz answers now, /readyz
    turns 200 when every model is loaded, and a working curl line is printed then.
    """
    _serve(config, host=host, port=port, token=token or None,
           max_body_bytes=max_body_bytes, lookup_threads=lookup_threads,
           access_log=access_log, allow_roots=allow_root or None)


def _serve(config: Path, *, host: str, port: int, token: str | None, max_body_bytes: int,
           access_log: bool, lookup_threads: int | None = None,
           allow_roots: list[str] | None = None) -> None:
    try:
        from hps.http import serve as run_server

        run_server(str(config), host=host, port=port, token=token,
                   max_body_bytes=max_body_bytes, access_log=access_log,
                   lookup_threads=lookup_threads,
                   echo=_echo_plain, allow_roots=allow_roots)
    except BindError as exc:  # one line, exit 1, before anything says "serving"
        _fail(exc, code=1)
    except HPSError as exc:
        _fail(exc)


def _echo_plain(text: str) -> None:
    # no markup, no wrapping: the curl line must stay copy-pasteable
    console.print(text, markup=False, highlight=False, soft_wrap=True)


@app.command()
def load(config: Path = typer.Argument(..., help="ps.json or YAML config.")) -> None:
    """Load every model of a config into its tiers (RocksDB keeps them)."""
    from hps.server import HierarchicalParameterServer

    try:
        cfg = _without_updates(str(config))
        with _progress() as bars:
            server = HierarchicalParameterServer(cfg, progress=BarProgress(bars))
    except HPSError as exc:
        _fail(exc)
    with server:
        _print_models(server.describe())


#: what users call the tiers (tier.name is the config's spelling)
_TIER_LABELS = {"hash_map": "in-process", "rocksdb": "RocksDB", "redis": "Redis"}


def _print_models(models: list[dict[str, Any]]) -> None:
    """One row per table, keys held per tier; sources listed below (80 columns)."""
    tiers = list(dict.fromkeys(k for m in models for t in m["tables"] for k in t["tiers"]))
    table = Table(title="loaded models", caption="keys: in the model's files; "
                  + ", ".join(_TIER_LABELS.get(t, t) for t in tiers) + ": keys the tier holds")
    table.add_column("model")
    table.add_column("table")
    table.add_column("width", justify="right")
    table.add_column("keys", justify="right")
    for tier in tiers:
        table.add_column(_TIER_LABELS.get(tier, tier), justify="right")
    table.add_column("load", justify="right")
    sources = []
    for m in models:
        for t in m["tables"]:
            src = t["source"]
            held = [t["tiers"].get(tier, {}) for tier in tiers]
            table.add_row(m["model"] if t["index"] == 0 else "", t["name"], str(t["dim"]),
                          f"{src['num_keys']:,}",
                          *[f"{h['keys']:,}" if h.get("keys") is not None else "unavailable"
                            for h in held],
                          "reused" if src["reused"] else f"{src['load_seconds']:.2f} s")
            sources.append(f"{m['model']} / {t['name']} ({t['storage_name']}): {src['uri']}")
    console.print(table)
    console.print("sources:\n  " + "\n  ".join(sources), highlight=False, soft_wrap=True)


@app.command()
def lookup(
    config: Path = typer.Argument(..., help="ps.json or YAML config."),
    keys: list[int] = typer.Argument(
        ..., help="Keys to look up; put -- before them when one is negative."),
    model: str = typer.Option(..., "--model", "-m", help="Model name."),
    table: str = typer.Option("0", "--table", "-t", help="Table index or name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    read_only: bool = typer.Option(
        False, "--read-only", help="Open RocksDB read-only: works while a server has it "
        "open, and reads what that server loaded."),
) -> None:
    """Look up keys and print their vectors."""
    from hps.server import HierarchicalParameterServer

    try:
        cfg = _without_updates(str(config))
        if cfg.persistent_db.enabled:
            # RocksDB holds every table: no need to fill the in-process tier for a few keys
            cfg.volatile_db.__dict__["initial_cache_rate"] = 0.0
            if read_only:
                cfg.persistent_db.__dict__["read_only"] = True
        with HierarchicalParameterServer(cfg) as server:
            # the server checks the keys (int64 range) and the table (name or index)
            vectors = server.lookup(model, table, keys)
    except HPSError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps({"keys": keys, "vectors": vectors.tolist()}))
        return
    np.set_printoptions(precision=4, suppress=True, linewidth=78)
    for key, row in zip(keys, vectors, strict=True):
        console.print(f"[bold]{key}[/]: {np.array2string(row, threshold=16)}")


def _without_updates(path: str) -> Any:
    """The config at `path` with no update source: a one-off command reads no updates (and
    commits nothing for the serving replica's consumer group)."""
    from hps.config import UpdateSourceConfig, load_config

    return load_config(path).model_copy(update={"update_source": UpdateSourceConfig()})


@app.command()
def publish(
    config: Path = typer.Argument(..., help="ps.json or YAML config with an update_source."),
    model: str = typer.Argument(..., help="Model name."),
    source: Optional[str] = typer.Argument(
        None, help="A table's files (sparse model folder, or any format sparse_files "
                   "takes). Default: each table's files from the config."),
    table: Optional[str] = typer.Option(
        None, "--table", "-t", help="Table name or index (needed with SOURCE, --keys)."),
    keys: Optional[Path] = typer.Option(None, help="A .npy file of keys (with --vectors)."),
    vectors: Optional[Path] = typer.Option(None, help="A .npy file of float32 [n, width] "
                                                      "vectors (with --keys)."),
) -> None:
    """Publish rows as online updates (Kafka or Redis Streams, as update_source says).

    Each message holds max_batch_size rows of one table, on topic (stream)
    hps_et.<model>.<table>; serving replicas apply them to every tier and GPU cache.
    """
    from hps.config import load_config
    from hps.updates.publish import publish_arrays, publish_table

    if (keys is None) != (vectors is None):
        _fail(ValueError("--keys and --vectors go together"))
    if (source is not None or keys is not None) and table is None:
        _fail(ValueError("name the table (--table) the rows belong to"))
    try:
        cfg = load_config(str(config))
        if not cfg.update_source.enabled:
            raise HPSError(f"{config}: update_source has no type (kafka_message_queue or "
                           "redis_stream): there is nowhere to publish")
        models = {m.model: m for m in cfg.models}
        if model not in models:
            raise UnknownModelError(f"the config has no model {model!r} (models: "
                                    f"{', '.join(models)})")
        tables = [table] if table is not None else list(models[model].embedding_table_names)
        sent = 0
        with _progress() as bars:
            bar = BarProgress(bars)
            if keys is not None and vectors is not None:
                sent = publish_arrays(cfg, model, tables[0], np.load(keys), np.load(vectors),
                                      progress=bar)
            else:
                for name in tables:
                    sent += publish_table(cfg, model, name, source, progress=bar)
    except (HPSError, OSError, ValueError) as exc:
        _fail(exc)
    console.print(f"{sent} messages published to {cfg.update_source.type} "
                  f"({', '.join(f'hps_et.{model}.{t}' for t in tables)})")


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
        "--format", help="sparse_folder, parquet, numpy or safetensors (default: from the "
                         "suffix or the folder's contents).")],
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


_URL = typer.Option(DEFAULT_URL, "--url", envvar="HPS_URL", show_envvar=True,
                   help="The running server.")
_TOKEN = typer.Option(None, "--token", envvar="HPS_TOKEN", show_envvar=True,
                      help="The server's token.")


@models_app.command("list")
def models_list(url: str = _URL, token: Optional[str] = _TOKEN) -> None:
    """List the models a running server serves, loads or failed to load."""
    from hps.tools.admin_client import call

    try:
        answer = call(url, "GET", "/v1/models", token)
    except HPSError as exc:
        _fail(exc)
    if answer["models"]:
        _print_models(answer["models"])
    else:
        console.print("no model is served")
    for name in answer.get("loading", []):
        console.print(f"{name}: loading", highlight=False)
    for name, why in answer.get("failed", {}).items():
        console.print(f"{name}: failed: {why}", highlight=False, markup=False, soft_wrap=True)


@models_app.command("add")
def models_add(
    file: Path = typer.Argument(..., help="A model block, or a ps.json / YAML config."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="The model to add when FILE has several."),
    url: str = _URL, token: Optional[str] = _TOKEN,
) -> None:
    """Add a model to a running server; the others keep serving.

    Relative paths in FILE resolve from its folder; the server reads only under its
    allowed roots (hps serve --allow-root).
    """
    from hps.tools.admin_client import call, model_block

    try:
        answer = call(url, "POST", "/v1/models", token, model_block(file, model))
    except HPSError as exc:
        _fail(exc)
    tables = ", ".join(t["name"] for t in answer["tables"])
    console.print(f"added model {answer['model']} (tables {tables}) in "
                  f"{answer['seconds']:.2f} s", highlight=False, soft_wrap=True)


@models_app.command("remove")
def models_remove(name: str = typer.Argument(..., help="The model to remove."),
                  url: str = _URL, token: Optional[str] = _TOKEN) -> None:
    """Remove a model from a running server; the others keep serving."""
    from urllib.parse import quote

    from hps.tools.admin_client import call

    try:
        call(url, "DELETE", f"/v1/models/{quote(name, safe='')}", token)
    except HPSError as exc:
        _fail(exc)
    console.print(f"removed model {name}", highlight=False)


@app.command()
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

    try:
        report = inspect_model(read.spec(source), read.width)
    except HPSError as exc:
        err_console.print(f"[bold red]invalid:[/] {escape(str(exc))}")
        raise typer.Exit(code=1) from None
    _print_report(f"{report.format} {source}",
                  report.rows() + _host_memory_rows(report.num_keys, report.vec_size)
                  + _gpu_memory_rows(report.num_keys, report.vec_size))
    if not report.valid:
        raise typer.Exit(code=1)


def _host_memory_rows(num_keys: int, dim: int) -> list[tuple[str, str]]:
    """Process memory the in-process hash map takes for the whole table, by
    embedding_storage_dtype (what hps/tiers/hash_map.py allocates for a load of it)."""
    from hps.tiers.hash_map import HashMapTier
    from hps.rows.storage_types import STORAGE_NAMES

    mib = 1 << 20
    return [(f"memory, in-process hash map, {name}",
             f"{HashMapTier.memory_required(num_keys, dim, name) / mib:,.1f} MiB")
            for name in STORAGE_NAMES]


def _gpu_memory_rows(num_keys: int, dim: int) -> list[tuple[str, str]]:
    """GPU memory one cache of the table takes per deployed device, by cache type and
    embedding_storage_dtype (float32 first, the compact types in parentheses): what
    hps/gpu/dynamic_cache.py allocates, its extra slots included (no GPU needed to tell)."""
    from hps.gpu.dynamic_cache import cache_memory_bytes
    from hps.gpu.static_table import StaticEmbeddingTable
    from hps.rows.storage_types import STORAGE_NAMES

    def by_storage(nbytes: Callable[[str], int]) -> str:
        mib = 1 << 20
        compact = ", ".join(f"{name} {nbytes(name) / mib:,.1f}" for name in STORAGE_NAMES[1:])
        return f"{nbytes('float32') / mib:,.1f} MiB per device ({compact})"

    def dynamic(p: float) -> str:
        return by_storage(lambda name: cache_memory_bytes(num_keys, dim, p, name))

    rows = [(f"GPU memory, dynamic cache, gpucacheper {p}", dynamic(p)) for p in (0.1, 0.5, 1.0)]
    static = by_storage(
        lambda name: StaticEmbeddingTable.memory_required(max(num_keys, 1), dim, storage=name))
    return [*rows, ("GPU memory, static table", static)]


def _print_report(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title)
    table.add_column("property")
    table.add_column("value", justify="right", overflow="fold")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


@app.command()
@_reads_a_table
def convert(
    source: str = typer.Argument(..., help="The table to read: folder or file, path or URI."),
    destination: str = typer.Argument(
        ..., help="Local path to write: .parquet, .npz, .safetensors, else a folder."),
    to: Optional[str] = typer.Option(
        None, help="Format to write (default: from DESTINATION's suffix; a folder is a "
                   "HugeCTR sparse folder unless --to numpy)."),
    *,
    read: _TableRead,
) -> None:
    """Convert a table to another format.

    Formats: HugeCTR sparse folder, Parquet, NumPy, safetensors.

    Streams chunk by chunk with a progress bar; rows are copied bit for bit (float16 and
    bfloat16 widened exactly to float32). A failed conversion leaves no DESTINATION.
    """
    from hps.modelfiles.convert import convert as run_convert

    try:
        spec = read.spec(source)
        with _progress() as bars:
            report = run_convert(spec, destination, to, vec_size=read.width,
                                 progress=BarProgress(bars))
    except HPSError as exc:
        _fail(exc)
    _print_report(f"{report.format} {source} → {destination}", report.rows())
    if report.duplicate_keys or report.non_finite_values:
        err_console.print("[yellow]warning:[/] the table has duplicate keys or non-finite "
                          "values (copied as they are)")


@config_app.command("dump")
def config_dump(
    source: str = typer.Argument(
        ..., help="ps.json or YAML, or a Python file that builds a ParameterServerConfig "
                  "(FILE.py, or FILE.py:NAME to pick the variable)."),
    defaults: bool = typer.Option(False, "--defaults", help="Also print keys at their default."),
) -> None:
    """Print the ps.json equivalent to a config (validated; HugeCTR objects converted)."""
    from hps.hugectr.params import dump_json

    try:
        config: Any = _config_from_script(source) if _is_script(source) else source
        raw = dump_json(config, defaults=defaults)
    except HPSError as exc:
        _fail(exc)
    print(json.dumps(raw, indent=2))


def _is_script(source: str) -> bool:
    return source.rpartition(":")[0].endswith(".py") or source.endswith(".py")


def _config_from_script(source: str) -> Any:
    """The config object a Python file builds: the variable NAME, or its only config.

    The file runs as a module that is not __main__ (its `if __name__ == "__main__":`
    block does not run), as `python -c "import file"` would run it.
    """
    import runpy

    from hps.config import PSConfig
    from hps.errors import ConfigError
    from hps.hugectr.params import ParameterServerConfig

    path, _, name = source.partition(".py:")
    path = path if not name else path + ".py"
    if not Path(path).is_file():
        raise ConfigError(f"{path!r} is not a file")
    found = {key: value for key, value in runpy.run_path(path).items()
             if isinstance(value, (ParameterServerConfig, PSConfig))}
    if name:
        if name not in found:
            raise ConfigError(f"{path} defines no config named {name!r} "
                              f"(configs: {', '.join(sorted(found)) or 'none'})")
        return found[name]
    if len(found) != 1:
        raise ConfigError(f"{path} defines {len(found)} configs "
                          f"({', '.join(sorted(found)) or 'none'}): pick one with {path}:NAME")
    return next(iter(found.values()))


# options several bench commands share
_DIM = typer.Option(64, help="Vector width.")


@bench_app.callback(invoke_without_command=True)
def bench_tiers(
    ctx: typer.Context,
    keys: int = typer.Option(10_000_000, help="Keys in the benchmark table."),
    dim: int = _DIM,
    batch: int = typer.Option(16_384, help="Keys per fetch."),
) -> None:
    """In-process and RocksDB tiers vs NumPy searchsorted and raw rocksdict multi_get."""
    if ctx.invoked_subcommand is not None:
        return
    from hps.tools.bench.tiers import bench_bulk_load, bench_hash_map, bench_rocksdb

    rows = []
    console.print(f"table of {keys:,} keys, width {dim}, batches of {batch:,} uniform keys")
    for fn in (bench_hash_map, bench_rocksdb):
        console.print(f"running {fn.__name__} …")
        rows.append(fn(num_keys=keys, dim=dim, batch=batch))
    console.print("running bench_bulk_load …")
    rows.append(bench_bulk_load(num_keys=keys, dim=dim))
    _print_bench(rows)


@bench_app.command("load")
def bench_load_cmd(
    formats: list[str] = typer.Option(
        [], "--format",
        help="Compare these formats' load rate with the sparse folder's (repeat the option: "
             "parquet, numpy, safetensors). Without it: the scale curve."),
    keys: str = typer.Option("1M,10M", help="Table sizes, comma-separated (1M, 250k, 2000000)."),
    dim: int = _DIM,
    rounds: int = typer.Option(3, help="Loads per size or format (median reported)."),
) -> None:
    """How fast files load into the hash map over RocksDB through HPS(config): the scale
    curve (keys/s, process RSS growth over the raw bytes) beside rocksdict's own SST
    writer on the same rows, or each --format beside the sparse folder."""
    from hps.tools.bench.load import (
        SCALE_HEADER,
        bench_load_formats,
        format_scale_row,
        parse_sizes,
        scale_rows,
    )
    from hps.runtime.cores import usable_cores

    try:
        sizes = parse_sizes(keys)
    except ValueError as exc:
        _fail(exc)
    if not formats:
        console.print(f"sparse folders of {keys} random keys, width {dim}; each loaded "
                      f"{rounds}× by HPS(config) into the hash map over RocksDB, in a fresh "
                      f"process (RSS measured there); {usable_cores()} CPUs …")
        _print_flushed(SCALE_HEADER)
        try:
            for row in scale_rows(sizes, dim, rounds, progress=err_console.print):
                _print_flushed(format_scale_row(row))
        except ValueError as exc:
            _fail(exc)
        return
    for num_keys in sizes:
        console.print(f"{num_keys:,} rows of width {dim} as a sparse folder and as "
                      f"{', '.join(formats)}; each loaded {rounds}× by HPS(config) into the "
                      "hash map over RocksDB …")
        try:
            rows = bench_load_formats(formats, num_keys, dim, rounds)
        except ValueError as exc:
            _fail(exc)
        _print_bench(rows)
        for row in rows[1:]:
            console.print(f"{row['name']}: {row['keys_per_s']:,.0f} keys/s, sparse folder "
                          f"{row['sparse_folder_keys_per_s']:,.0f} keys/s: {row['ratio']:.2f}× "
                          f"(best rounds: {row['best_ratio']:.2f}×, CPU time: "
                          f"{row['cpu_ratio']:.2f}×)")


def _print_flushed(line: str) -> None:
    """A line of a benchmark's table, out at once (a run cut off keeps what it printed)."""
    console.file.write(line + "\n")
    console.file.flush()


# the options of the benchmarks that look up a table loaded from files (storage, tiers)
_TABLE_KEYS = typer.Option(1_000_000, help="Keys in the table (a model loaded from files).")
_BATCHES = typer.Option("1,256,16384", help="Keys per lookup, comma-separated.")


def _batch_sizes(text: str) -> tuple[int, ...]:
    """--batches as key counts; one clear line (exit 2) for anything else."""
    try:
        sizes = tuple(int(b) for b in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        _fail(ValueError(f"--batches takes positive key counts, comma-separated (e.g. "
                         f"1,256,16384), got {text!r}"))
    return sizes


@bench_app.command("storage")
def bench_storage_cmd(
    keys: int = _TABLE_KEYS,
    dim: int = _DIM,
    batches: str = _BATCHES,
    repeats: int = typer.Option(2000, help="Timed lookups per type at 256 keys (fewer for "
                                           "larger batches)."),
) -> None:
    """Each embedding_storage_dtype beside float32 through HPS.lookup on the embedded
    default (hash map over RocksDB), and the process RSS growth of each type's load."""
    sizes = _batch_sizes(batches)
    from hps.tools.bench.storage import bench_storage, format_storage

    console.print(f"loading a table of {keys:,} keys, width {dim}, from files, once per "
                  "storage type; lookups of uniform keys, all hits …")
    result = bench_storage(keys, dim, sizes, repeats)
    print(format_storage(result))


@bench_app.command("tiers")
def bench_tiers_cmd(
    keys: int = _TABLE_KEYS,
    dim: int = _DIM,
    batches: str = _BATCHES,
    repeats: int = typer.Option(2000, help="Timed lookups per side at 256 keys (fewer for "
                                           "larger batches)."),
    thread_batch: int = typer.Option(16_384, help="Keys per lookup in the thread scaling."),
    rounds: int = typer.Option(5, help="Rounds of the thread scaling (median)."),
) -> None:
    """HPS.lookup on the embedded default (hash map over RocksDB) vs NumPy searchsorted +
    take at each batch size, and two threads' keys/s over one thread's."""
    sizes = _batch_sizes(batches)
    from hps.tools.bench.tiers import bench_public_lookup, format_public_lookup

    console.print(f"loading a table of {keys:,} keys, width {dim}, from files; lookups of "
                  "uniform keys, all hits …")
    result = bench_public_lookup(keys, dim, sizes, repeats=repeats,
                                 thread_batch=thread_batch, rounds=rounds)
    console.print(format_public_lookup(result), markup=False, highlight=False)


@bench_app.command("updates")
def bench_updates_cmd(
    rows: int = typer.Option(2_000_000, help="Update rows published before the ingest."),
    table_keys: int = typer.Option(500_000, help="Keys of the served table."),
    dim: int = _DIM,
    batch: int = typer.Option(1024, help="Keys per lookup."),
    per_message: int = typer.Option(8192, help="Rows per update message."),
    seconds: float = typer.Option(5.0, help="Seconds of lookups alone (the baseline)."),
    samples: int = typer.Option(100, help="Visibility samples."),
) -> None:
    """Online updates from Redis Streams: ingest rows/s and publish-to-visible p50/p99,
    beside the lookup rate and p50 without ingest (in-process tier; with RocksDB)."""
    from hps.tools.bench.updates import bench_updates

    try:
        results = bench_updates(rows, table_keys, dim, batch, per_message, seconds, samples)
    except (HPSError, RuntimeError) as exc:
        _fail(exc)
    _print_bench(results, title="hps bench updates (Redis Streams)")


@bench_app.command("redis")
def bench_redis_cmd(
    address: Optional[str] = typer.Option(
        None, help="A running Redis or cluster seeds (default: start a standalone server "
                   "and a 3-master cluster on loopback for the run)."),
    keys: int = typer.Option(1_000_000, help="Keys loaded."),
    dim: int = _DIM,
    batch: int = typer.Option(16_384, help="Keys per fetch."),
    repeats: int = typer.Option(30, help="Timed batches per side."),
) -> None:
    """Redis tier fetch vs a raw redis-py pipelined HMGET over prepared byte keys."""
    from hps.tools.bench.redis import bench_redis, bench_redis_both

    if address:
        rows = [bench_redis(address, keys, dim, batch, repeats=repeats)]
    else:
        rows = bench_redis_both(keys, dim, batch, repeats)
    _print_bench(rows)


@bench_app.command("gpu")
def bench_gpu_cmd(
    dims: str = typer.Option("16,64,128", help="Vector widths, comma-separated."),
    slots: int = typer.Option(1 << 24, help="Cache slots."),
    batch: int = typer.Option(1 << 20, help="Keys per lookup."),
    repeats: int = typer.Option(20, help="Timed runs per measure."),
    device: int = typer.Option(0, help="CUDA device id."),
    profile: list[str] = typer.Option(
        ["kernels"], help="kernels: the cache kernels beside a dense gather; public: "
        "lookup_fromdlpack/lookup latency beside torch.index_select; hugectr: HugeCTR's "
        "hps_profiler workload; misses: 1M-key miss batches; uvm: the uvm cache type beside "
        "dynamic (equal GPU memory) and static, 20M keys dim 64; devices: every GPU driven "
        "by a thread each beside one; storage: each embedding_storage_dtype beside float32, "
        "1M keys dim 128, with memory; torch: hps.torch.LookupLayer over lookup_fromdlpack, "
        "2,000 keys. Repeatable."),
) -> None:
    """GPU cache benchmarks, each beside its baseline measured in the same run."""
    from hps.gpu.table import cuda_available

    if not cuda_available():
        _fail(RuntimeError("hps bench gpu needs a CUDA device and CuPy: "
                           "pip install 'hps-server[gpu]'"))
    from hps.tools.bench.gpu import PROFILES, bench_gpu, bench_profile, format_rows, targets

    rows = []
    for name in profile:
        if name not in PROFILES:
            _fail(ValueError(f"--profile must be one of {', '.join(PROFILES)}, got {name!r}"))
        if name == "kernels":
            rows += bench_gpu(tuple(int(d) for d in dims.split(",")), slots, batch, False,
                              device, repeats)
        else:
            rows += bench_profile(name, device)
    console.print(format_rows(rows), markup=False, highlight=False)
    summary = targets(rows)
    if summary:
        console.print(format_rows(summary, ("target", "measured", "met")), markup=False,
                      highlight=False)


@bench_app.command("torch")
def bench_torch_cmd(
    device: str = typer.Option("cpu", help="cpu or cuda (the GPU cache serves the table)."),
    keys: int = typer.Option(2000, help="Keys per lookup."),
    dim: int = typer.Option(16, help="Vector width."),
    table_keys: int = typer.Option(100_000, help="Keys in the table."),
    rounds: int = typer.Option(30, help="Rounds; the measures take turns in each."),
    calls: int = typer.Option(100, help="Calls per measure and round."),
) -> None:
    """hps.torch.LookupLayer (eager, custom op, compiled) vs lookup_fromdlpack."""
    if device not in ("cpu", "cuda"):
        _fail(ValueError(f"--device must be cpu or cuda, got {device!r}"))
    from hps.tools.bench.torch_layer import bench_torch_layer, format_rows

    try:
        rows = bench_torch_layer(keys, dim, table_keys, device, rounds, calls)
    except (HPSError, ImportError) as exc:
        _fail(exc)
    console.print(format_rows(rows, device, keys, dim), markup=False, highlight=False)


_PLOT = typer.Option(None, "--plot", help="Write a picture of the latency distributions (and "
                     "throughput) to FILE (png, svg, pdf); needs the plot extra.")


@bench_app.command("http")
def bench_http_cmd(
    keys: int = typer.Option(1_000_000, help="Keys in the served table."),
    dim: int = _DIM,
    batch: str = typer.Option("1024", help="Keys per request; a comma list runs each "
                              "(throughput against batch size, with --plot)."),
    clients: int = typer.Option(8, help="Concurrent clients (threads, one connection each)."),
    seconds: float = typer.Option(5.0, help="Timed seconds per path and round."),
    rounds: int = typer.Option(3, help="Rounds; the paths take turns in each."),
    lookup_threads: Optional[int] = typer.Option(
        None, help="The server's --lookup-threads (default: its own choice)."),
    pin: bool = typer.Option(True, "--pin/--no-pin",
                             help="Servers on one half of the CPUs, clients on the other."),
    plot: Optional[Path] = _PLOT,
) -> None:
    """HTTP lookups (v1, v2) beside direct Redis HMGET and a bare uvicorn floor."""
    from hps.tools.bench.http import bench_http

    batches = [int(b) for b in batch.split(",") if b.strip()]
    if plot is not None:
        from hps.tools.bench.plot import require_matplotlib

        try:
            require_matplotlib()  # the plot extra, checked before minutes of benchmark
        except HPSError as exc:
            _fail(exc)
    results = []
    for size in batches:
        console.print(f"table of {keys:,} keys, width {dim}; {clients} clients, {size:,} "
                      f"keys per request; {rounds} rounds of {seconds:g} s per path …")
        result = bench_http(keys, dim, size, clients, seconds=seconds, rounds=rounds,
                            lookup_threads=lookup_threads, pin=pin)
        results.append(result)
        _print_bench([{"name": r["path"], "requests/s": r["requests_per_s"],
                       "keys/s": r["keys_per_s"], "p50 ms": r["p50_ms"],
                       "p99 ms": r["p99_ms"], "server CPU µs/req": r["server_cpu_us"]}
                      for r in result["rows"]],
                     title=f"{clients} clients, {size:,} keys per request")
        _print_bench([{"name": r["path"], "p50 ms": r["p50_ms"], "p99 ms": r["p99_ms"],
                       "server CPU µs/req": r["server_cpu_us"]}
                      for r in result["single"]], title="one client alone")
        for name, value in result["ratios"].items():
            console.print(f"keys/s, {name}: {value:.2f}×", highlight=False)
        console.print(f"client: {result['client']}; {result['cpus']} CPUs; pinned: "
                      f"{result['pinned']}", highlight=False, soft_wrap=True)
    if plot is not None:
        from hps.tools.bench.plot import plot_http

        plot_http(results, plot)
        console.print(f"plot written to {plot}", highlight=False)


@bench_app.command("soak")
def bench_soak_cmd(
    minutes: float = typer.Option(5.0, help="How long to run."),
    clients: int = typer.Option(8, help="Client threads, one connection each."),
    reload_every: float = typer.Option(5.0, help="Seconds between reloads."),
    redis_restarts: int = typer.Option(2, help="Times Redis is killed and restarted."),
) -> None:
    """hps serve under lookups, reloads and Redis restarts: failed and wrong lookups."""
    from hps.tools.bench.soak import print_result, soak

    console.print(f"soak of {minutes:g} min: {clients} clients, a reload every "
                  f"{reload_every:g} s, {redis_restarts} Redis restarts …")
    result = soak(minutes * 60, clients=clients, reload_every=reload_every,
                  redis_restarts=redis_restarts, log=lambda line: console.print(f"  {line}"))
    print_result(result)
    if result.failed or result.wrong or result.reloads_failed:
        raise typer.Exit(1)


@bench_app.command("slowloris")
def bench_slowloris_cmd(
    connections: int = typer.Option(2000, help="Slow connections (half a header each)."),
    requests: int = typer.Option(500, help="Timed requests of the normal client per phase."),
    max_connections: int = typer.Option(512, help="The server's http.max_connections."),
) -> None:
    """A normal client's p50/p99 alone and beside a slowloris crowd; server descriptors."""
    from hps.tools.bench.slow_clients import bench_slowloris, print_result

    console.print(f"hps serve, a normal client, then {connections:,} slow connections …")
    print_result(bench_slowloris(connections, requests, max_connections=max_connections))


#: human labels of the measures the benchmarks return (others: underscores to spaces)
_MEASURE_LABELS = {
    "num_keys": "keys in the table", "dim": "width", "batch": "keys per batch",
    "ours_keys_per_s": "ours, keys/s", "baseline_keys_per_s": "baseline, keys/s",
    "ratio": "ours / baseline", "ours_batch_ms": "ours, ms per batch",
    "baseline_batch_ms": "baseline, ms per batch", "load_keys_per_s": "load, keys/s",
    "memory_over_raw": "memory / raw bytes", "rss_growth_over_raw": "RSS growth / raw",
    "peak_rss_bytes": "peak RSS", "baseline_same_options_keys_per_s":
    "baseline (our options), keys/s", "ratio_same_options": "ours / baseline (our options)",
    "ours_seconds": "ours, s", "baseline_seconds": "baseline, s", "nodes": "Redis nodes",
    "ingest_rows_per_s": "ingest, rows/s", "ingest_seconds": "ingest, s",
    "visibility_p50_ms": "publish → visible p50, ms",
    "visibility_p99_ms": "publish → visible p99, ms",
    "lookups_per_s_alone": "lookups/s, no ingest",
    "lookups_per_s_during_ingest": "lookups/s, during ingest",
    "lookup_p50_ms_alone": "lookup p50 ms, no ingest",
    "lookup_p50_ms_during_ingest": "lookup p50 ms, during ingest",
    "lookup_p50_ratio": "lookup p50, during / no ingest",
    "lookup_p99_ms_alone": "lookup p99 ms, no ingest",
    "lookup_p99_ms_during_ingest": "lookup p99 ms, during ingest",
    "rows_per_message": "rows per message", "lookup_batch": "keys per lookup",
    "table_keys": "keys in the table", "rows": "update rows",
}
_RUN_LABELS = {"hash_map": "in-process", "rocksdb": "RocksDB",
               "rocksdb_bulk_load": "RocksDB load", "redis": "Redis",
               "redis cluster": "Redis Cluster"}


def _print_bench(rows: list[dict[str, Any]], title: str = "hps bench") -> None:
    """One column per run, one row per measure: ratios stay readable in a terminal."""
    table = Table(title=title)
    table.add_column("measure", no_wrap=True)
    for i, row in enumerate(rows):
        name = str(row.get("tier") or row.get("name") or f"run {i + 1}")
        table.add_column(_RUN_LABELS.get(name, name), justify="right", overflow="fold")
    measures: list[str] = []
    for row in rows:
        measures += [k for k in row if k not in measures and k not in ("tier", "name")]
    for measure in measures:
        label = _MEASURE_LABELS.get(measure, measure.replace("_per_s", "/s").replace("_", " "))
        table.add_row(label, *[_fmt(row.get(measure), measure) for row in rows])
    console.print(table)


def _fmt(value: Any, measure: str = "") -> str:
    if value is None:
        return ""
    if measure.endswith("_bytes") and isinstance(value, (int, float)):
        return f"{value / (1 << 20):,.0f} MiB"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
