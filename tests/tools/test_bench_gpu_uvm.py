"""`python -m hps.tools.bench.gpu_uvm` (`hps bench gpu --profile uvm`) on a small table: one
row per workload with both cache types side by side, uvm over dynamic and the published
HierarchicalKV figure; the bench itself checks that each mode returns the file's rows."""

from __future__ import annotations

from typing import Any

import pytest

from hps.tools.bench.gpu_uvm import ALPHAS, bench_uvm, targets


@pytest.mark.gpu
def test_each_workload_side_by_side(cp: Any, tmp_path: Any) -> None:
    rows = bench_uvm(num_keys=200_000, dim=16, modes=("uvm", "dynamic"), settle_seconds=1.0,
                     workdir=str(tmp_path), small_warmup_s=0.2)
    bench = {(r["bench"], r["workload"]): r for r in rows}
    assert bench[("baseline", "pinned H2D copy, 256 MiB, GB/s")]["uvm"] > 0
    for a in ALPHAS:  # each size ran on its own draws before it was timed
        assert bench[("uvm settle 1M", f"alpha {a}")]["uvm"] > 0
        assert bench[("uvm warm-up 2,000", f"alpha {a}")]["uvm"] == 0.2
        for workload in (f"1M power-law {a} keys G keys/s",
                         *(f"2,000 power-law {a} keys ({draws}) {q} us"
                           for draws in ("64 recurring", "fresh") for q in ("p50", "p99"))):
            row = bench[("uvm", workload)]
            assert row["uvm"] > 0 and row["dynamic"] > 0
            ratio = (row["uvm"] / row["dynamic"] if "G keys" in workload
                     else row["dynamic"] / row["uvm"])
            assert row["uvm_vs_dynamic"] == pytest.approx(ratio)
    uniform = bench[("uvm", "1M uniform keys G keys/s")]
    assert uniform["hkv_hybrid"] == 0.196 and uniform["uvm_vs_h2d"] > 0
    # one target per timed workload, and the copy-rate target of the uniform batches
    assert len(targets(rows)) == 5 * len(ALPHAS) + 2
