"""The GPU benchmarks' rows as a plain-text table (hps/tools/bench/gpu.py and its profiles).

Every profile returns rows (dicts); `format_rows(rows, columns)` prints the columns any row
has, in `COLUMNS` order by default, right-aligned, floats to three places below 100.
"""

from __future__ import annotations

from typing import Any

#: the profiles of `hps bench gpu --profile` (hps/tools/bench/gpu.py runs them); here, where
#: the command line reads them without importing the benchmarks
PROFILES = ("kernels", "public", "threads", "hugectr", "misses", "uvm", "devices", "sharded",
            "storage", "torch", "processes")

COLUMNS = ("bench", "table", "keys", "phase", "layout", "devices", "shards", "dim", "batch",
           "mode", "family", "processes", "mps", "gpu_used_mib", "group", "unroll", "waves",
           "hints", "gkeys_s",
           "mkeys_s", "M_keys_per_s", "floor_M_keys_per_s", "bound_M_keys_per_s", "vs_whole",
           "vs_bound", "vs_float4", "vs_torch", "hugectr", "hit_rate", "mean_us", "p50_us",
           "p99_us", "floor_mkeys_s", "floor_p99_us", "events_p50_us", "over_inner_us",
           "vs_floor", "vs_hugectr_mean",
           "vs_hugectr_p99", "vs_one", "vs_tier_fetch", "wrong_rows", "load_s", "gb_s",
           "write_s", "gpu_mib", "host_mib", "gpucacheper", "power_gkeys_s",
           "uniform_gkeys_s", "settle_s", "rows_moved", "uniform_vs_h2d", "power_vs_dynamic",
           "uniform_vs_dynamic", "p50_vs_dynamic", "vs_float32", "goal", "table_mib", "rss_mib",
           "vs_float32_mem", "err_vs_bound", "us_per_call", "over_baseline_us", "vs_baseline",
           "workload", "dynamic", "uvm", "static", "uvm_vs_dynamic", "hkv_hybrid",
           "promoted_on_lookup")


def format_rows(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    """A plain-text table of the rows."""
    cols = [c for c in columns if any(c in r for r in rows)]

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    table = [cols] + [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True))
                     for line in table)
