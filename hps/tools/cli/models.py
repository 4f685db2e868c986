"""`hps models list|add|reload|remove|keys|prefetch`: the models of a running server,
through its routes (`keys`: a table's hot or missing keys; `prefetch`: a warm-up).

Also `print_models`, the table of loaded models that `hps load` prints too: one row per
table, the keys each tier holds, the sources listed below it (whole paths, 80 columns).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from hps.errors import HPSError
from hps.tools.admin_client import DEFAULT_URL
from hps.tools.cli.choices import one_of
from hps.tools.cli.root import HELP_OPTIONS, console, fail

models_app = typer.Typer(add_completion=False, rich_markup_mode=None,
                         context_settings=HELP_OPTIONS, no_args_is_help=True,
                         help="Models of a running server: list, add, reload, remove; "
                              "their hot and missing keys; prefetch.")

#: where the running server is, and its token: the options of every models command
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
        fail(exc)
    if answer["models"]:
        print_models(answer["models"])
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
        fail(exc)
    tables = ", ".join(t["name"] for t in answer["tables"])
    console.print(f"added model {answer['model']} (tables {tables}) in "
                  f"{answer['seconds']:.2f} s", highlight=False, soft_wrap=True)


@models_app.command("reload")
def models_reload(
    name: str = typer.Argument(..., help="The model to reload."),
    files: Optional[list[str]] = typer.Argument(
        None, help="New files, one per table, in table order (paths or URIs); without "
                   "them the model's own files are read again."),
    allow_empty: bool = typer.Option(
        False, "--allow-empty", help="Load a table of no keys (it answers the default "
                                     "vector for every key); the load gate refuses it "
                                     "otherwise."),
    allow_shrink: bool = typer.Option(
        False, "--allow-shrink", help="Load a version holding fewer than "
                                      "validation.min_key_ratio of the served keys; the "
                                      "load gate refuses it otherwise."),
    url: str = _URL, token: Optional[str] = _TOKEN,
) -> None:
    """Reload a model of a running server from its files, or from new ones.

    Lookups get the old version until the new one is whole; a failed reload leaves it
    serving. Relative paths resolve from the current folder; the server reads only under
    its allowed roots (hps serve --allow-root).
    """
    from urllib.parse import quote

    from hps.tools.admin_client import absolute_sources, call

    body: dict[str, Any] = {"sparse_files": absolute_sources(files, Path.cwd())} if files else {}
    body.update({k: True for k, v in (("allow_empty", allow_empty),
                                      ("allow_shrink", allow_shrink)) if v})
    try:
        answer = call(url, "POST", f"/v1/models/{quote(name, safe='')}/reload", token,
                      body or None)
    except HPSError as exc:
        fail(exc)
    tables = ", ".join(t["name"] for t in answer["tables"])
    console.print(f"reloaded model {answer['model']} (tables {tables}) in "
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
        fail(exc)
    console.print(f"removed model {name}", highlight=False)


@models_app.command("keys")
def models_keys(
    model: str = typer.Argument(..., help="The model."),
    table: str = typer.Argument(..., help="The table (name or index)."),
    kind: str = typer.Option("hot", callback=one_of(("hot", "missing")),
                             help="hot (looked-up keys) or missing (found in no tier)."),
    top: int = typer.Option(20, help="How many keys."),
    url: str = _URL, token: Optional[str] = _TOKEN,
) -> None:
    """A table's hot or missing keys on a running server, heaviest first, with their
    estimated counts (docs/operating.md)."""
    from urllib.parse import quote, urlencode

    from hps.tools.admin_client import call

    path = (f"/v1/models/{quote(model, safe='')}/tables/{quote(table, safe='')}/keys?"
            + urlencode({"kind": kind, "top": top}))
    try:
        answer = call(url, "GET", path, token)
    except HPSError as exc:
        fail(exc)
    shown = Table(title=f"{kind} keys of {answer['model']} / {answer['table']}",
                  caption=f"counted: {answer['total']:,} ({answer['sampling']}; "
                          f"{answer['source']}); each count within -{answer['error']:,}")
    shown.add_column("key", justify="right")
    shown.add_column("count", justify="right")
    shown.add_column("share", justify="right")
    for entry in answer["keys"]:
        share = entry["count"] / answer["total"] if answer["total"] else 0.0
        shown.add_row(str(entry["key"]), f"{entry['count']:,}", f"{share:.2%}")
    console.print(shown)


@models_app.command("prefetch")
def models_prefetch(
    model: str = typer.Argument(..., help="The model."),
    table: Optional[str] = typer.Option(None, help="One table (default: every table, with "
                                                   "--hot-set)."),
    keys_file: Optional[Path] = typer.Option(
        None, help="A file of little-endian int64 keys (a hot-set export); needs --table."),
    wait: bool = typer.Option(False, "--wait", help="Follow the jobs to their end (a "
                                                    "progress bar each); exit 1 if one "
                                                    "did not finish."),
    url: str = _URL, token: Optional[str] = _TOKEN,
) -> None:
    """Warm a running server's volatile tier and GPU caches: with the keys of a file, or
    (without --keys-file) with the server's own hot keys. Prints the jobs started, and
    with --wait what each found and wrote."""
    from urllib.parse import quote

    import numpy as np

    from hps.errors import ConfigError
    from hps.tools.admin_client import call

    body: dict[str, Any] = {"from": "hot-set"}
    try:
        if keys_file is not None:
            if table is None:
                raise ConfigError("--keys-file needs --table: the table the keys belong to")
            data = keys_file.read_bytes()
            if len(data) % 8:
                raise ConfigError(f"{keys_file}: {len(data)} bytes is not a whole number of "
                                  "int64 keys")
            body = {"keys": np.frombuffer(data, "<i8").tolist()}
        if table is not None:
            body["table"] = table
        answer = call(url, "POST", f"/v1/models/{quote(model, safe='')}/prefetch", token,
                      body)
    except OSError as exc:
        fail(ConfigError(f"cannot read {keys_file}: {exc.strerror or exc}"))
    except HPSError as exc:
        fail(exc)
    for job in answer["jobs"]:
        console.print(f"{job['model']} / {job['table']}: job {job['job']}, {job['keys']:,} "
                      f"keys, {job['status']}", highlight=False)
    if not wait:
        return
    try:
        ended = follow_prefetches(url, token, model, answer["jobs"])
    except HPSError as exc:
        fail(exc)
    for job in ended:
        console.print(prefetch_summary(job), highlight=False)
    if any(job["status"] != "done" for job in ended):
        raise typer.Exit(code=1)


@models_app.command("hot-rows")
def models_hot_rows(
    model: str = typer.Argument(..., help="The model."),
    table: Optional[str] = typer.Option(None, help="One table (default: every table that "
                                                   "keeps hot copies)."),
    url: str = _URL, token: Optional[str] = _TOKEN,
) -> None:
    """Fill the hot copies of a running server's tables sharded over GPUs from their hot
    keys now (the server also does so in the background, every
    gpu_hot_rows_refresh_seconds). Prints the keys offered and what each device's copy
    holds; under --workers N every worker fills its own."""
    from urllib.parse import quote

    from hps.tools.admin_client import call

    body: dict[str, Any] = {} if table is None else {"table": table}
    try:
        answer = call(url, "POST", f"/v1/models/{quote(model, safe='')}/hot-rows", token,
                      body)
    except HPSError as exc:
        fail(exc)
    for filled in answer["tables"]:
        held = ", ".join(f"cuda:{d} {n:,}" for d, n in filled["held"].items())
        console.print(f"{answer['model']} / {filled['table']}: {filled['keys']:,} hot keys "
                      f"offered; each device's copy holds {held}", highlight=False)


def follow_prefetches(url: str, token: str | None, model: str, jobs: list[dict[str, Any]],
                      poll: float = 0.2) -> list[dict[str, Any]]:
    """The jobs' answers once each ended, with a progress bar each on stderr (keys looked
    at, of the job's keys)."""
    import time
    from urllib.parse import quote

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from hps.tools.admin_client import call
    from hps.tools.cli.root import err_console

    ended: dict[str, dict[str, Any]] = {}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("keys"), console=err_console) as bars:
        tasks = {job["job"]: bars.add_task(f"{job['table']} ({job['job']})",
                                           total=max(job["keys"], 1)) for job in jobs}
        while len(ended) < len(jobs):
            for job in jobs:  # a loop over the jobs asked for (one per table)
                if job["job"] in ended:
                    continue
                now = call(url, "GET", f"/v1/models/{quote(model, safe='')}/prefetch/"
                           f"{quote(job['job'], safe='')}", token)
                bars.update(tasks[job["job"]], completed=now["found"] + now["missing"])
                if now["status"] not in ("queued", "running"):
                    ended[job["job"]] = now
            if len(ended) < len(jobs):
                time.sleep(poll)
    return [ended[job["job"]] for job in jobs]


def prefetch_summary(job: dict[str, Any]) -> str:
    """One line of what an ended prefetch job found and wrote (each worker's part too)."""
    line = (f"{job['model']} / {job['table']}: job {job['job']} {job['status']}: "
            f"{job['found']:,} found, {job['missing']:,} in no tier, "
            f"{job['volatile_filled']:,} into the volatile tier, {job['gpu_inserted']:,} "
            f"GPU rows, {job['seconds']:.2f} s")
    if job.get("error"):
        line += f" ({job['error']})"
    if "workers" in job:
        line += "; workers: " + ", ".join(f"{p['worker']} {p['status']}"
                                          for p in job["workers"])
    return line


#: what users call the tiers (tier.name is the config's spelling)
_TIER_LABELS = {"hash_map": "in-process", "rocksdb": "RocksDB", "redis": "Redis"}


def print_models(models: list[dict[str, Any]]) -> None:
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
