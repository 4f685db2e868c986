"""The hit-rate curve of `hps plan --plot`: predicted hit rate against cache size, one line
per table (whole log, solid; its warm second half, dashed). PNG, SVG or PDF by the file's
suffix; drawn without a display. Needs the `plot` extra (matplotlib)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from hps.errors import MissingExtraError
from hps.tools.plan.hit_rates import HitRate


def plot_hit_rates(curves: Mapping[str, Sequence[HitRate]], path: str | Path) -> Path:
    """Write the curves (table label → its hit rates by size) to `path`; returns it.
    Raises MissingExtraError naming the `plot` extra when matplotlib is missing."""
    from hps.tools.bench.plot import require_matplotlib

    try:
        plt = require_matplotlib()
    except MissingExtraError:
        raise MissingExtraError("matplotlib", "plot", "hps plan --plot") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rates in curves.items():
        shares = [100 * r.share for r in rates]
        line, = ax.plot(shares, [r.hit_rate for r in rates], marker="o", label=label)
        ax.plot(shares, [r.warm_hit_rate for r in rates], linestyle="--",
                color=line.get_color(), label=f"{label}, warm (second half of the log)")
    ax.set_xscale("log")
    ax.set_xlabel("GPU cache size (% of the table's keys, gpucacheper × 100)")
    ax.set_ylabel("predicted hit rate")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("hps plan: dynamic GPU cache hit rate on the key log", fontsize=10)
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
