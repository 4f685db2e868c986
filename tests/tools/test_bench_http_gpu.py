"""`hps bench http --gpu` and `--workers`: `hps serve` driven by client processes beside
the bare uvicorn floor, every answer checked against the table before timing. On a
machine without CUDA the GPU server is left out (`gpu=False`); the device machine runs
the whole bench."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from hps.modelfiles.formats.sparse_folder import write_sparse_model
from hps.tools.bench.http import TABLE, _free_port, _http_server, one_table_config
from hps.tools.bench.http_gpu import (
    CPU,
    FLOOR,
    GPU,
    _power_law_bodies,
    _wrong_rows,
    bench_http_gpu,
    gpu_table_config,
)
from hps.tools.bench.http_workers import bench_http_workers
from hps.tools.bench.tiers import make_table


def test_each_server_at_each_client_count_beside_the_floor() -> None:
    result = bench_http_gpu(num_keys=3000, dim=8, batch=64, client_processes=(1, 2),
                            seconds=0.4, warmup=0.1, gpu=False)
    assert [(r["server"], r["clients"]) for r in result["rows"]] == [
        (CPU, 1), (CPU, 2), (FLOOR, 1), (FLOOR, 2)]
    for row in result["rows"]:
        assert row["keys_per_s"] > 0 and row["failed"] == 0
        assert row["p99_ms"] >= row["p50_ms"] > 0
    assert result["wrong_rows"] == {CPU: 0}
    for ratio, p in zip(result["ratios"], (1, 2), strict=True):
        mine = next(r for r in result["rows"] if r["server"] == CPU and r["clients"] == p)
        floor = next(r for r in result["rows"] if r["server"] == FLOOR and r["clients"] == p)
        assert ratio["clients"] == p
        assert ratio["keys_per_s_vs_floor"] == mine["keys_per_s"] / floor["keys_per_s"]
        assert ratio["p99_vs_cpu"] == 1.0  # the CPU server over itself
    assert result["client"] == "one process per client, raw keep-alive"
    assert result["http_lookup"] == {}  # no GPU server: no path chosen to show


def test_with_workers_every_server_and_the_floor_run_that_many_processes() -> None:
    result = bench_http_gpu(num_keys=3000, dim=8, batch=64, client_processes=(2,),
                            seconds=0.4, warmup=0.1, gpu=False, workers=2)
    assert result["workers"] == 2 and result["wrong_rows"] == {CPU: 0}
    for row in result["rows"]:
        assert row["keys_per_s"] > 0 and row["failed"] == 0
        # the server's CPU: its processes together (a supervisor alone would use ~none)
        assert row["server_cpu_us"] > 20, row
        # of which the workers' event loops (their main threads) take most; the two are
        # read a moment apart in 10 ms ticks, so over 0.4 s they may differ by a tick
        assert 10 < row["server_loop_cpu_us"] <= row["server_cpu_us"] * 1.2, row


def test_the_answer_check_counts_every_row_that_differs() -> None:
    """Against a real `hps serve`: the table's own rows give 0; a table with one row
    changed gives the number of times the bodies ask for that row."""
    keys, vectors = make_table(2000, 4, seed=3)
    bodies, picks = _power_law_bodies(keys, 32, 8, 1.1, np.random.default_rng(4))
    assert all(np.frombuffer(b, dtype="<i8").tolist() == keys[p].tolist()
               for b, p in zip(bodies, picks, strict=True))
    tmp = Path(tempfile.mkdtemp(prefix="hps-test-http-gpu-"))
    try:
        write_sparse_model(tmp / TABLE, keys, vectors)
        (tmp / "ps.json").write_text(json.dumps(one_table_config(4, 32)))
        with _http_server(tmp / "ps.json", _free_port(), None, None) as url:
            assert _wrong_rows(url, bodies, picks, vectors) == 0
            changed = vectors.copy()
            hot = int(picks[0][0])
            changed[hot] += 1.0
            asked = sum(int((p == hot).sum()) for p in picks)
            assert _wrong_rows(url, bodies, picks, changed) == asked >= 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_workers_bench_runs_each_server_at_each_client_count() -> None:
    result = bench_http_workers(num_keys=2000, dim=8, batch=16, workers=2,
                                client_processes=(1, 2), seconds=0.4, warmup=0.1)
    assert [(r["server"], r["clients"]) for r in result["rows"]] == [
        (s, p) for s in ("hps serve, 1 worker", "hps serve, 2 workers",
                         "bare uvicorn, 2 workers (floor)") for p in (1, 2)]
    for row in result["rows"]:
        assert row["keys_per_s"] > 0 and row["failed"] == 0
    assert [r["clients"] for r in result["ratios"]] == [1, 2]


@pytest.mark.gpu
def test_hps_serve_with_a_gpu_cache_answers_exactly_from_client_processes() -> None:
    """On the GPU machine: `hps serve` with a GPU cache of the table, its lookups on the
    event loop (the default over in-memory tiers), every answer exact, every client
    count served."""
    result = bench_http_gpu(num_keys=20_000, dim=16, batch=500, client_processes=(1, 4),
                            seconds=0.4, warmup=0.1)
    assert result["wrong_rows"] == {GPU: 0, CPU: 0}
    served = [(r["server"], r["clients"]) for r in result["rows"] if r["keys_per_s"] > 0]
    assert served == [(s, p) for s in (GPU, CPU, FLOOR) for p in (1, 4)]
    assert all(r["failed"] == 0 for r in result["rows"])
    shown = result["http_lookup"][GPU]  # the path its HTTP lookups took, after the run
    assert shown["reason"] == "measured" and shown["path"] in ("gpu", "host", "by_size")
    assert sum(shown["answered"].values()) > 0


@pytest.mark.gpu
def test_lookups_over_a_gpu_cache_and_the_hash_map_run_on_the_event_loop(
        tmp_path: Path) -> None:
    from hps.http.state import DEFAULT_LOOKUP_THREADS, auto_lookup_threads
    from hps.server import HierarchicalParameterServer

    keys, vectors = make_table(1000, 8)
    write_sparse_model(tmp_path / TABLE, keys, vectors)
    config = gpu_table_config(8, 64)
    config["models"][0]["sparse_files"] = [str(tmp_path / TABLE)]
    server = HierarchicalParameterServer(config)
    try:
        assert server.gpu_enabled
        assert auto_lookup_threads(server) == 0
    finally:
        server.close()
    config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    server = HierarchicalParameterServer(config)
    try:
        assert auto_lookup_threads(server) == DEFAULT_LOOKUP_THREADS  # on disk: a pool
    finally:
        server.close()


def test_rounds_time_every_server_in_turn_and_report_the_medians() -> None:
    """With rounds, all servers are up at once and each round times each of them, in an
    order rotated a place a round; rows are the medians and each round's own ratio is
    kept."""
    result = bench_http_gpu(num_keys=3000, dim=8, batch=64, client_processes=(1,),
                            seconds=0.3, warmup=0.1, gpu=False, rounds=3)
    timed = result["timed"]
    # the floor started first (the first server started reads slower), then the order
    # rotated a place each round
    assert [t["server"] for t in timed] == [FLOOR, CPU, CPU, FLOOR, FLOOR, CPU]
    assert [t["round"] for t in timed] == [0, 0, 1, 1, 2, 2]
    for name in (CPU, FLOOR):
        row = next(r for r in result["rows"] if r["server"] == name)
        mine = sorted(t["keys_per_s"] for t in timed if t["server"] == name)
        assert row["keys_per_s"] == mine[1] > 0 and row["failed"] == 0
    (ratio,) = result["ratios"]
    assert ratio["rounds_keys_per_s_vs_cpu"] == [1.0, 1.0, 1.0]  # the CPU server over itself
    assert result["wrong_rows"] == {CPU: 0}


def test_pinned_servers_and_clients_take_whole_cores_of_their_own() -> None:
    import os

    from hps.tools.bench.cpus import physical_cores

    result = bench_http_gpu(num_keys=3000, dim=8, batch=64, client_processes=(1,),
                            seconds=0.3, warmup=0.1, gpu=False, pin=True)
    servers, clients = set(result["cpus"]["servers"]), set(result["cpus"]["clients"])
    mine = os.sched_getaffinity(0)
    assert servers and clients and not servers & clients and servers | clients == mine
    for core in physical_cores(sorted(mine)):  # a core's threads on one side only
        assert set(core) <= servers or set(core) <= clients
    assert all(r["keys_per_s"] > 0 and r["failed"] == 0 for r in result["rows"])
    assert os.sched_getaffinity(0) == mine  # the bench's own CPUs given back


def test_each_row_counts_the_servers_page_faults_per_request() -> None:
    result = bench_http_gpu(num_keys=3000, dim=8, batch=64, client_processes=(1,),
                            seconds=0.3, warmup=0.1, gpu=False)
    for row in result["rows"]:  # a count, finite and never negative
        assert row["server_minor_faults"] >= 0, row


def test_minor_faults_count_the_pages_a_process_touches_first() -> None:
    import os

    from hps.tools.bench.cpus import minor_faults

    before = minor_faults(os.getpid())
    touched = np.ones(64 << 20, np.uint8)  # 64 MiB written: 32 huge pages, or 16,384
    after = minor_faults(os.getpid())
    assert before is not None and after is not None
    # at least one fault per 2 MiB page (NumPy asks for huge pages on large arrays)
    assert after - before >= touched.nbytes >> 21


def test_interleaved_servers_take_turns_with_one_set_of_clients() -> None:
    """With a slice, the clients turn from server to server together; every server is
    timed in every round, its CPU counted in its own slices, and the control (a second
    server without a GPU cache) is compared with the first."""
    from hps.tools.bench.http_gpu import CONTROL

    result = bench_http_gpu(num_keys=3000, dim=8, batch=64, client_processes=(2,),
                            seconds=0.5, warmup=0.1, gpu=False, workers=2, rounds=2,
                            slice_s=0.25, control=True)
    timed = result["timed"]
    assert sorted((t["server"], t["round"]) for t in timed) == sorted(
        (name, r) for name in (CPU, CONTROL, FLOOR) for r in (0, 1))
    for t in timed:
        assert t["keys_per_s"] > 0 and t["failed"] == 0, t
        assert t["p99_ms"] >= t["p50_ms"] > 0
        assert 0 < t["server_loop_cpu_us"] and t["server_cpu_us"] > 0, t
    (ratio,) = result["ratios"]
    each = ratio["control_rounds_keys_per_s_vs_cpu"]
    assert len(each) == 2 and all(x > 0 for x in each)
    control = next(r for r in result["rows"] if r["server"] == CONTROL)
    first = next(r for r in result["rows"] if r["server"] == CPU)
    assert ratio["control_keys_per_s_vs_cpu"] == control["keys_per_s"] / first["keys_per_s"]
    assert result["wrong_rows"] == {CPU: 0, CONTROL: 0}
    assert result["slice_s"] == 0.25


def test_the_slices_go_round_the_servers_rotating_a_place_each_cycle() -> None:
    from hps.tools.bench.interleave import slice_server

    assert [slice_server(s, 3) for s in range(9)] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    # the warm-up's slices (before the first timed one) go round the same way
    assert [slice_server(s, 3) for s in range(-3, 0)] == [2, 0, 1]
    # over any n cycles every server holds every place once
    for n in (2, 3, 4):
        places = {(s % n, slice_server(s, n)) for s in range(n * n)}
        assert len(places) == n * n


def test_interleaving_refuses_what_it_cannot_time() -> None:
    from hps.tools.bench.interleave import interleaved

    with pytest.raises(ValueError):
        interleaved(["127.0.0.1:1"], [], 1, [b""], {}, 1.0, 1, 0.0)
    with pytest.raises(ValueError):
        interleaved(["127.0.0.1:1"], [1], 1, [b""], {}, 0.1, 1, 0.0, slice_s=0.5)
