"""The processes profile's reading of its rows (hps/tools/bench/gpu_processes.py), with no
GPU: rows of both MPS modes kept apart in the table, issue 59's targets read off the rows
with MPS on, the threads rows held to their own floor, and the options passed to the
child runs of `--mps both`."""

from __future__ import annotations

from typing import Any

from hps.tools.bench.gpu_processes import (
    _without_option,
    format_processes,
    per_process_mib,
    targets,
)


def _row(family: str, n: int, rate: float, mps: bool, **extra: Any) -> dict[str, Any]:
    return {"bench": "processes", "family": family, "workload": "all hits", "processes": n,
            "mkeys_s": rate, "p50_us": 20.0, "p99_us": 50.0, "wrong_rows": 0, "mps": mps,
            "each_mkeys_s": [rate], "hit_rate": 1.0, "gpu_used_mib": 100,
            "per_process_mib": [50], **extra}


def test_rows_of_both_modes_are_compared_within_their_mode() -> None:
    rows = [_row("floor", 8, 15.0, False), _row("own caches", 8, 13.0, False),
            _row("shared cache", 8, 6.5, False),
            _row("floor", 8, 800.0, True), _row("own caches", 8, 600.0, True),
            _row("shared cache", 8, 570.0, True)]
    table = format_processes(rows).splitlines()
    shared_off = next(line for line in table
                      if line.startswith("shared cache") and " off " in line)
    assert " 0.43 " in shared_off and " 0.50 " in shared_off  # x floor, x own: MPS off's
    found = {t["target"]: t for t in targets(rows)}
    # only the MPS-on rows are held to the targets: 570 / 600 = 0.95
    assert found["shared cache, all hits, 8 processes: >= 0.9 x own caches"]["met"] == "yes"
    assert abs(found["shared cache, all hits, 8 processes: >= 0.9 x own caches"]["measured"]
               - 0.95) < 1e-9


def test_threads_are_held_to_their_own_floor_and_a_1_ms_tail() -> None:
    rows = [_row("threads", 2, 60.0, True, vs_threads_floor=0.5),
            _row("threads", 8, 70.0, True, vs_threads_floor=1.1, p99_us=1500.0)]
    found = {t["target"]: t["met"] for t in targets(rows)}
    assert found["threads, all hits, 2 threads: >= their floor"] == "NO"
    assert found["threads, all hits, 8 threads: >= their floor"] == "yes"
    assert found["threads, all hits, 8 threads: p99 <= 1 ms"] == "NO"


def test_the_child_runs_get_the_options_but_mps_and_json() -> None:
    argv = ["--seconds", "2", "--mps", "both", "--json=rows.json", "--workload", "cache 25%"]
    assert _without_option(_without_option(argv, "--json"), "--mps") == [
        "--seconds", "2", "--workload", "cache 25%"]


def test_nvidia_smis_process_lines_by_process_id() -> None:
    listing = "4211, 856\n4212, 540\n[N/A], 66\n\n4213, [N/A]\n"
    assert per_process_mib(listing) == {4211: 856, 4212: 540, -3: 66}
    assert per_process_mib("") == {}
