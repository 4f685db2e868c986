"""`hps bench …`: the benchmarks, each beside its baseline measured in the same run.

The measuring is hps.tools.bench's, one module per benchmark; this is each one's command:
options, what it says as it runs, its figures as a table (`_print_bench`). Bare `hps bench`
runs `tier-fetch`.

Defaults fit a laptop (1M keys, well under 2 GiB); a command that builds a table says the
memory it expects first (`_expect_memory`). Counts are read by key_counts.py (`100k`, `1M`,
`2_000_000`). Options before the command name are bare `hps bench`'s: refused with one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from hps.errors import HPSError
from hps.tools.bench.gpu_rows import PROFILES
from hps.tools.cli.choices import one_of, values_of
from hps.tools.cli.key_counts import count_option, counts_option
from hps.tools.cli.root import HELP_OPTIONS, console, err_console, fail

bench_app = typer.Typer(add_completion=False, rich_markup_mode=None,
                        context_settings=HELP_OPTIONS,
                        help="Benchmarks: each tier beside its baseline, same run.\n\n"
                             "Without a command: tier-fetch, with the options below.")

# options several bench commands share
_DIM = typer.Option(64, help="Vector width.")
# the options of tier-fetch, which bare `hps bench` takes too
_TIER_KEYS = typer.Option(1_000_000, parser=count_option,
                          help="Keys in the benchmark table (100k, 1M, 10M …).")
_TIER_BATCH = typer.Option(16_384, parser=count_option, help="Keys per fetch.")


@bench_app.callback(invoke_without_command=True)
def bench_bare(ctx: typer.Context, keys: int = _TIER_KEYS, dim: int = _DIM,
               batch: int = _TIER_BATCH) -> None:
    """Bare `hps bench`: tier-fetch. With a command, give the options after it."""
    if ctx.invoked_subcommand is None:
        _tier_fetch(keys, dim, batch)
        return
    given = [f"--{name} {ctx.params[name]}" for name in ("keys", "dim", "batch")
             if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]
    if given:
        fail(ValueError(f"options before the command belong to bare `hps bench`; put them "
                        f"after it: hps bench {ctx.invoked_subcommand} {' '.join(given)}"))


#: process memory a table costs per raw byte (8-byte key + 4 bytes per value), and the
#: process before it: measured peaks of each command at 500k keys, width 64, rounded up
_MEMORY_PER_RAW_BYTE = {"tier-fetch": 2.8, "tiers": 3.5, "storage": 7.5, "load": 2.5,
                        "redis": 3.0, "updates": 5.0, "http": 3.0}
_BASE_MEMORY = 250 << 20


def _expect_memory(command: str, num_keys: int, dim: int) -> None:
    """Say, before a table is built, about how much memory the run will take at its peak."""
    raw = num_keys * (8 + 4 * dim)
    peak = _BASE_MEMORY + raw * _MEMORY_PER_RAW_BYTE[command]
    console.print(f"expected peak memory: about {peak / 2**30:,.1f} GiB "
                  f"({num_keys:,} keys of width {dim}; fewer with --keys)", highlight=False)


@bench_app.command("tier-fetch")
def bench_tier_fetch_cmd(keys: int = _TIER_KEYS, dim: int = _DIM,
                         batch: int = _TIER_BATCH) -> None:
    """The tiers' own calls: the in-process tier's fetch vs NumPy searchsorted + take,
    RocksDB's fetch vs raw rocksdict multi_get, RocksDB's bulk load vs WriteBatch inserts.

    Bare `hps bench` runs it too.
    """
    _tier_fetch(keys, dim, batch)


def _tier_fetch(keys: int, dim: int, batch: int) -> None:
    from hps.tools.bench.tiers import bench_bulk_load, bench_hash_map, bench_rocksdb

    _expect_memory("tier-fetch", keys, dim)
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
    formats: list[str] = typer.Option([], "--format", callback=one_of(values_of(
        "hps.tools.bench.load", "BENCH_FORMATS", "BASELINE")),
        help="Compare these formats' load rate with the sparse folder's (repeat the option: "
             "parquet, numpy, safetensors, torch, dcp; torch and dcp also with safetensors'; "
             "sparse_folder, the baseline, is always measured). Without it: the scale curve."),
    keys: str = typer.Option("250k,1M", parser=counts_option,
                             help="Table sizes, comma-separated (250k,1M,10M)."),
    dim: int = _DIM,
    rounds: int = typer.Option(3, help="Loads per size or format (median reported)."),
) -> None:
    """How fast files load into the hash map over RocksDB through HPS(config): the scale
    curve (keys/s, process RSS growth over the raw bytes) beside rocksdict's own SST
    writer on the same rows, or each --format beside the sparse folder."""
    from hps.runtime.cores import usable_cores
    from hps.tools.bench.load import (
        SCALE_HEADER,
        bench_load_formats,
        format_scale_row,
        scale_rows,
    )

    sizes: list[int] = keys  # type: ignore[assignment]  # counts_option reads the text
    _expect_memory("load", max(sizes), dim)
    if not formats:
        console.print(f"sparse folders of {', '.join(f'{n:,}' for n in sizes)} random keys, "
                      f"width {dim}; each loaded {rounds}× by HPS(config) into the hash map "
                      "over RocksDB, in a fresh "
                      f"process (RSS measured there); {usable_cores()} CPUs …")
        _print_flushed(SCALE_HEADER)
        try:
            for row in scale_rows(sizes, dim, rounds, progress=err_console.print):
                _print_flushed(format_scale_row(row))
        except ValueError as exc:
            fail(exc)
        return
    for num_keys in sizes:
        console.print(f"{num_keys:,} rows of width {dim} as a sparse folder and as "
                      f"{', '.join(formats)}; each loaded {rounds}× by HPS(config) into the "
                      "hash map over RocksDB …")
        try:
            rows = bench_load_formats(formats, num_keys, dim, rounds)
        except ValueError as exc:
            fail(exc)
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
_TABLE_KEYS = typer.Option(1_000_000, parser=count_option,
                           help="Keys in the table (a model loaded from files).")
_BATCHES = typer.Option("1,256,16384", parser=counts_option,
                        help="Keys per lookup, comma-separated.")


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
    sizes: tuple[int, ...] = tuple(batches)  # counts_option reads the text
    from hps.tools.bench.storage import bench_storage, format_storage

    _expect_memory("storage", keys, dim)
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
    thread_batch: int = typer.Option(16_384, parser=count_option,
                                     help="Keys per lookup in the thread scaling."),
    rounds: int = typer.Option(5, help="Rounds of the thread scaling (median)."),
) -> None:
    """The public call: HPS.lookup on the embedded default (hash map over RocksDB) vs NumPy
    searchsorted + take at each batch size, and two threads' keys/s over one thread's;
    then what the hot- and missing-key sketches cost it at 1, 256 and 2,000 keys.

    The tiers' own calls, without the public call around them: tier-fetch.
    """
    sizes: tuple[int, ...] = tuple(batches)  # counts_option reads the text
    from hps.tools.bench.tiers import (
        bench_key_sketch,
        bench_public_lookup,
        format_key_sketch,
        format_public_lookup,
    )

    _expect_memory("tiers", keys, dim)

    console.print(f"loading a table of {keys:,} keys, width {dim}, from files; lookups of "
                  "uniform keys, all hits …")
    result = bench_public_lookup(keys, dim, sizes, repeats=repeats,
                                 thread_batch=thread_batch, rounds=rounds)
    console.print(format_public_lookup(result), markup=False, highlight=False)
    console.print("the same table and lookups with the hot-key sampling on and off …")
    console.print(format_key_sketch(bench_key_sketch(keys, dim, repeats=repeats)),
                  markup=False, highlight=False)


@bench_app.command("warm-start")
def bench_warm_start_cmd(
    keys: int = _TABLE_KEYS,
    dim: int = _DIM,
    batch: int = typer.Option(256, parser=count_option, help="Keys per lookup."),
    lookups: int = typer.Option(2000, parser=count_option,
                                help="Lookups the peer answers before its hot set is read."),
    first: int = typer.Option(100, help="Lookups measured on each server."),
    gpu: bool = typer.Option(False, "--gpu", help="With a GPU cache on device 0 (not "
                                                  "warmed from the files); GPU hit rates."),
) -> None:
    """A replica's first lookups, cold and warmed from a peer's hot set (warm_from),
    beside the peer's warm p50 and p99: HPS.lookup of Zipf keys (docs/operating.md)."""
    from hps.tools.bench.warm_start import bench_warm_start, format_warm_start

    _expect_memory("tiers", keys, dim)
    console.print(f"a peer and two replicas of a table of {keys:,} keys, width {dim} …")
    try:
        result = bench_warm_start(keys, dim, batch, lookups, first, gpu=gpu)
    except HPSError as exc:
        fail(exc)
    console.print(format_warm_start(result), markup=False, highlight=False)


@bench_app.command("updates")
def bench_updates_cmd(
    rows: int = typer.Option(500_000, parser=count_option,
                             help="Update rows published before the ingest."),
    table_keys: int = typer.Option(500_000, parser=count_option, help="Keys of the served table."),
    dim: int = _DIM,
    batch: int = typer.Option(1024, parser=count_option, help="Keys per lookup."),
    per_message: int = typer.Option(8192, parser=count_option, help="Rows per update message."),
    seconds: float = typer.Option(5.0, help="Seconds of lookups alone (the baseline)."),
    samples: int = typer.Option(100, help="Visibility samples."),
) -> None:
    """Online updates from Redis Streams: ingest rows/s and publish-to-visible p50/p99,
    beside the lookup rate and p50 without ingest (in-process tier; with RocksDB)."""
    from hps.tools.bench.updates import bench_updates

    _expect_memory("updates", max(rows, table_keys), dim)
    try:
        results = bench_updates(rows, table_keys, dim, batch, per_message, seconds, samples)
    except (HPSError, RuntimeError) as exc:
        fail(exc)
    _print_bench(results, title="hps bench updates (Redis Streams)")


@bench_app.command("redis")
def bench_redis_cmd(
    address: Optional[str] = typer.Option(
        None, help="A running Redis or cluster seeds (default: start a standalone server "
                   "and a 3-master cluster on loopback for the run)."),
    keys: int = typer.Option(1_000_000, parser=count_option, help="Keys loaded."),
    dim: int = _DIM,
    batch: int = typer.Option(16_384, parser=count_option, help="Keys per fetch."),
    repeats: int = typer.Option(30, help="Timed batches per side."),
) -> None:
    """Redis tier fetch vs a raw redis-py pipelined HMGET over prepared byte keys."""
    from hps.tools.bench.redis import bench_redis, bench_redis_both
    from hps.tools.bench.redis_servers import RedisBinaryMissing

    _expect_memory("redis", keys, dim)
    try:
        if address:
            rows = [bench_redis(address, keys, dim, batch, repeats=repeats)]
        else:
            rows = bench_redis_both(keys, dim, batch, repeats)
    except (HPSError, RedisBinaryMissing) as exc:
        fail(exc)
    _print_bench(rows)


@bench_app.command("gpu")
def bench_gpu_cmd(
    dims: str = typer.Option("16,64,128", help="Vector widths, comma-separated."),
    slots: int = typer.Option(1 << 24, parser=count_option, help="Cache slots."),
    batch: int = typer.Option(1 << 20, parser=count_option, help="Keys per lookup."),
    repeats: int = typer.Option(20, help="Timed runs per measure."),
    device: int = typer.Option(0, help="CUDA device id."),
    profile: list[str] = typer.Option(["kernels"], callback=one_of(PROFILES), help=(
        "kernels: the cache kernels beside a dense gather; public: lookup_fromdlpack/lookup "
        "latency beside torch.index_select; threads: lookup_fromdlpack from 1, 2, 4 and 8 "
        "threads, each on its own CUDA stream, beside torch.index_select from as many; "
        "hugectr: HugeCTR's hps_profiler workload; misses: 1M-key miss batches; uvm: the uvm "
        "cache type beside dynamic (equal GPU memory) and static, 20M keys dim 64; devices: "
        "every GPU driven by a thread each beside one; sharded: a table split row-wise into "
        "shards beside it whole; storage: each embedding_storage_dtype beside float32, 1M "
        "keys dim 128, with memory; torch: hps.torch.LookupLayer over lookup_fromdlpack, "
        "2,000 keys; processes: 1-8 processes with own GPU caches, then sharing one, beside "
        "index_select from one IPC-shared table. Repeatable.")),
    updates: int = typer.Option(0, parser=count_option, help="hugectr profile: rows a second "
                                "of an update stream (Redis Streams) applied meanwhile."),
    stream_per_thread: bool = typer.Option(
        True, "--stream-per-thread/--stream-per-call", help="threads profile: each thread "
        "sets its stream once, as a model server's worker does, or around every call."),
) -> None:
    """GPU cache benchmarks, each beside its baseline measured in the same run."""
    from hps.gpu.table import cuda_available

    if not cuda_available():
        fail(RuntimeError("hps bench gpu needs a CUDA device and CuPy: pip install "
                           "'hps-server[gpu]'"))
    from hps.tools.bench.gpu import bench_gpu, bench_profile, format_rows, targets

    rows: list[dict[str, Any]] = []
    options: dict[str, dict[str, Any]] = {"hugectr": {"updates": updates},
                                          "threads": {"stream_per_thread": stream_per_thread}}
    for name in profile:
        if name == "kernels":
            rows += bench_gpu(tuple(int(d) for d in dims.split(",")), slots, batch, False,
                              device, repeats)
        else:
            rows += bench_profile(name, device, **options.get(name, {}))
    console.print(format_rows(rows), markup=False, highlight=False)
    summary = targets(rows)
    if summary:
        console.print(format_rows(summary, ("target", "measured", "met")), markup=False,
                      highlight=False)


@bench_app.command("torch")
def bench_torch_cmd(
    device: str = typer.Option("cpu", callback=one_of(("cpu", "cuda")),
                               help="cpu or cuda (the GPU cache serves the table)."),
    keys: int = typer.Option(2000, parser=count_option, help="Keys per lookup."),
    dim: int = typer.Option(16, help="Vector width."),
    table_keys: int = typer.Option(100_000, parser=count_option, help="Keys in the table."),
    rounds: int = typer.Option(30, help="Rounds; the measures take turns in each."),
    calls: int = typer.Option(100, help="Calls per measure and round."),
) -> None:
    """hps.torch.LookupLayer (eager, custom op, compiled) vs lookup_fromdlpack."""
    if device not in ("cpu", "cuda"):
        fail(ValueError(f"--device must be cpu or cuda, got {device!r}"))
    from hps.tools.bench.torch_layer import bench_torch_layer, format_rows

    try:
        rows = bench_torch_layer(keys, dim, table_keys, device, rounds, calls)
    except (HPSError, ImportError) as exc:
        fail(exc)
    console.print(format_rows(rows, device, keys, dim), markup=False, highlight=False)


_PLOT = typer.Option(None, "--plot", help="Write a picture of the latency distributions (and "
                     "throughput) to FILE (png, svg, pdf); needs the plot extra.")


@bench_app.command("http")
def bench_http_cmd(
    keys: int = typer.Option(1_000_000, parser=count_option, help="Keys in the served table."),
    dim: int = _DIM,
    batch: str = typer.Option("1024", parser=counts_option,
                              help="Keys per request; a comma list runs each (throughput "
                                   "against batch size, with --plot)."),
    clients: int = typer.Option(8, help="Concurrent clients (threads, one connection each)."),
    seconds: float = typer.Option(5.0, help="Timed seconds per path and round."),
    rounds: int = typer.Option(3, help="Rounds; the paths take turns in each (with "
                               "--overload: every level once a round)."),
    lookup_threads: Optional[int] = typer.Option(
        None, help="The server's --lookup-threads (default: its own choice)."),
    pin: bool = typer.Option(True, "--pin/--no-pin",
                             help="Servers on one half of the CPUs, clients on the other."),
    plot: Optional[Path] = _PLOT,
    overload: bool = typer.Option(
        False, "--overload", help="Instead: 1 to --clients client processes (default 64 "
        "here) against `hps serve` and its admission queue; served req/s beside the peak, "
        "p99, shed (503) and expired (504) requests."),
    refusals: bool = typer.Option(
        False, "--refusals", help="Instead: the server's CPU per 503 refusal under "
        "overload, 20,000 refused lookups of one client process (docs/http.md)."),
    load_client: str = typer.Option("raw", callback=one_of(values_of(
        "hps.tools.bench.overload", "CLIENTS")), help="With --overload: "
        "each client process's HTTP client, 'raw' (prepared bytes on a socket, the least CPU "
        "taken from the server) or 'http.client'."),
    tier: str = typer.Option("hash_map", callback=one_of(values_of(
        "hps.tools.bench.overload", "TIERS")), help="With --overload: where the served "
        "table lives, 'hash_map' (in process) or 'rocksdb' (RocksDB alone, no volatile tier)."),
    workers: Optional[int] = typer.Option(
        None, min=1, help="Instead: `hps serve` with 1 and with this many workers beside "
        "the bare uvicorn floor with as many, driven by --client-processes; RSS and PSS "
        "of the workers (docs/workers.md)."),
    client_processes: str = typer.Option(
        "1,4,16", parser=counts_option, help="With --workers or --gpu: client processes "
        "(one connection each); a comma list runs each (with --gpu the default is 1,2,4,8)."),
    gpu: bool = typer.Option(
        False, "--gpu", help="Instead: `hps serve` with a GPU cache of the whole table "
        "beside it without one and the bare uvicorn floor, --batch power-law keys a request "
        "(2,000 here), driven by --client-processes; with --workers N every server, the "
        "floor too, runs N workers; --rounds: all up at once, timed in turn, medians."),
    grpc_one_key: bool = typer.Option(
        False, "--grpc-one-key", help="Instead: 1-key p50 of v2 over gRPC beside HTTP and "
        "both floors, the lightest client of each in a process of its own, the paths "
        "taking turns for --rounds rounds of --seconds (docs/grpc.md)."),
) -> None:
    """HTTP lookups (v1, v2) beside direct Redis HMGET and a bare uvicorn floor."""
    if grpc_one_key:
        from hps.tools.bench.grpc_one_key import one_key

        result = one_key(["sync"], rounds, seconds, tritonclient=True, num_keys=keys,
                         dim=dim)
        _print_bench([{"name": name, "p50 ms": f["p50_ms"], "p99 ms": f["p99_ms"],
                       "round p50s ms": " ".join(f"{x:.3f}" for x in f["round_p50_ms"])}
                      for name, f in result["paths"].items()], title="1 key, one client")
        for name, ratio in result["p50_ratios"].items():
            console.print(f"p50 {name}: {ratio:.2f}× (median of rounds)", highlight=False)
        return
    if refusals:
        from hps.tools.bench.refusals import print_refusals

        print_refusals(_say)
        return
    if overload:
        from hps.tools.bench.overload import print_overload

        print_overload(clients if clients != 8 else 64, seconds, rounds, load_client,
                       _print_bench, _say, tier)
        return
    if gpu:
        return _http_gpu(keys, dim, batch, client_processes, seconds, lookup_threads,
                         load_client, workers or 1, rounds)
    if workers is not None:
        from hps.tools.bench.http_workers import print_workers

        print_workers(keys, dim, batch, workers, client_processes, seconds,  # type: ignore[arg-type]
                      _print_bench)
        return
    from hps.tools.bench.http import bench_http
    from hps.tools.bench.redis_servers import RedisBinaryMissing, redis_binary

    batches: list[int] = batch  # type: ignore[assignment]  # counts_option reads the text
    try:
        redis_binary("redis-server")  # the direct-Redis path: checked before the run
    except RedisBinaryMissing as exc:
        fail(exc)
    if plot is not None:
        from hps.tools.bench.plot import require_matplotlib

        try:
            require_matplotlib()  # the plot extra, checked before minutes of benchmark
        except HPSError as exc:
            fail(exc)
    _expect_memory("http", keys, dim)
    results = []
    for size in batches:
        console.print(f"table of {keys:,} keys, width {dim}; {clients} clients, {size:,} "
                      f"keys per request; {rounds} rounds of {seconds:g} s per path …")
        result = bench_http(keys, dim, size, clients, seconds=seconds, rounds=rounds,
                            lookup_threads=lookup_threads, pin=pin)
        results.append(result)
        # the gRPC paths in tables of their own: seven columns do not fit a terminal
        for protocol, rows in _by_protocol(result["rows"]):
            _print_bench([{"name": r["path"], "requests/s": r["requests_per_s"],
                           "keys/s": r["keys_per_s"], "p50 ms": r["p50_ms"],
                           "p99 ms": r["p99_ms"], "server CPU µs/req": r["server_cpu_us"]}
                          for r in rows],
                         title=f"{protocol}: {clients} clients, {size:,} keys per request")
        for protocol, rows in _by_protocol(result["single"]):
            _print_bench([{"name": r["path"], "p50 ms": r["p50_ms"], "p99 ms": r["p99_ms"],
                           "server CPU µs/req": r["server_cpu_us"]}
                          for r in rows], title=f"{protocol}: one client alone")
        for name, value in result["ratios"].items():
            console.print(f"keys/s, {name}: {value:.2f}×", highlight=False)
        console.print(f"client: {result['client']}; {result['cpus']} CPUs; pinned: "
                      f"{result['pinned']}", highlight=False, soft_wrap=True)
    if plot is not None:
        from hps.tools.bench.plot import plot_http

        plot_http(results, plot)
        console.print(f"plot written to {plot}", highlight=False)


def _http_gpu(keys: int, dim: int, batch: Any, processes: Any, seconds: float,
              lookup_threads: int | None, client: str, workers: int, rounds: int) -> None:
    from hps.gpu.table import cuda_available
    from hps.tools.bench.http_gpu import BATCH, CLIENT_PROCESSES, print_http_gpu

    if not cuda_available():
        fail(RuntimeError("hps bench http --gpu needs a CUDA device and CuPy"))
    batch = [BATCH] if batch == [1024] else batch  # the other modes' default: this one's
    processes = list(CLIENT_PROCESSES) if processes == [1, 4, 16] else processes
    print_http_gpu(keys, dim, batch[0], processes, seconds, lookup_threads, client,
                   _print_bench, _say, workers=workers, rounds=rounds)


def _say(line: str) -> None:
    console.print(line, highlight=False, soft_wrap=True)


def _by_protocol(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The rows of `hps bench http` split into its HTTP paths and its gRPC paths."""
    grpc = [r for r in rows if "grpc" in str(r["path"]).lower()]
    http = [r for r in rows if r not in grpc]
    return [(name, part) for name, part in (("HTTP", http), ("gRPC", grpc)) if part]


@bench_app.command("soak")
def bench_soak_cmd(
    minutes: float = typer.Option(5.0, help="How long to run."),
    clients: int = typer.Option(8, help="Client threads, one connection each."),
    reload_every: float = typer.Option(5.0, help="Seconds between reloads."),
    redis_restarts: int = typer.Option(2, help="Times Redis is killed and restarted."),
    workers: int = typer.Option(1, help="hps serve --workers N."),
    update_rows: int = typer.Option(0, help="Update rows a second (a Redis stream; 0: none)."),
) -> None:
    """hps serve under lookups, reloads, Redis restarts and updates: what failed or lagged."""
    from hps.tools.bench.redis_servers import RedisBinaryMissing
    from hps.tools.bench.soak import print_result, soak

    try:  # redis-server is started first: missing, it fails before the run
        result = soak(minutes * 60, clients=clients, reload_every=reload_every,
                      redis_restarts=redis_restarts, workers=workers,
                      update_rows=update_rows, log=lambda line: console.print(f"  {line}"))
    except RedisBinaryMissing as exc:
        fail(exc)
    print_result(result)
    if not result.passed:
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
