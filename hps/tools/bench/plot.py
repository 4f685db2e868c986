"""Pictures of `hps bench http`: latency distributions and throughput against batch size.

`plot_http(results, path)` takes one `bench_http` result per batch size and writes one
figure (PNG, SVG or PDF, by the file's suffix): on the left the distribution of request
latencies of every path at the largest batch (empirical CDFs on a log axis, so the tail
shows), on the right keys/s of every path against the batch size (the knee shows).
Needs the `plot` extra (matplotlib); it draws without a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hps.errors import MissingExtraError


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError("matplotlib", "plot", "hps bench --plot") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_http(results: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write the figure of `results` (bench_http results, one per batch size) to `path`."""
    plt = require_matplotlib()
    results = sorted(results, key=lambda r: r["batch"])
    last = results[-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, latencies in last["latencies_ms"].items():
        ms = np.sort(np.asarray(latencies))
        if ms.size:
            left.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=name,
                      linestyle="--" if name.endswith("1 client") else "-")
    left.set_xscale("log")
    left.set_xlabel("request latency (ms, log scale)")
    left.set_ylabel("fraction of requests at or below")
    left.set_title(f"latency, {last['batch']:,} keys per request, dim {last['dim']} "
                   f"({last['clients']} clients; dashed: 1 client)", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    batches = [r["batch"] for r in results]
    for name in [row["path"] for row in last["rows"]]:
        rates = [next(row["keys_per_s"] for row in r["rows"] if row["path"] == name)
                 for r in results]
        right.plot(batches, rates, marker="o", label=name)
    right.set_xscale("log", base=2)
    right.set_xlabel("keys per request")
    right.set_ylabel("keys/s")
    right.set_title(f"throughput, {last['clients']} clients", fontsize=10)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"hps bench http — client: {last['client']}; {last['cpus']} CPUs",
                 fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
