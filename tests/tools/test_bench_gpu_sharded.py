"""The sharded profile's targets (`hps bench gpu --profile sharded`, issue 61's figures)
read off rows shaped as hps/tools/bench/gpu_sharded.py makes them: which rows are held to
which bound, one GPU's rows, the copy path's and the sweep's never; the warm-up's against
the replicated table's."""

from __future__ import annotations

from typing import Any

from hps.tools.bench.gpu_sharded import targets


def _row(table: str, keys: str, batch: int, layout: str, **figures: Any) -> dict[str, Any]:
    return {"bench": "sharded", "table": table, "keys": keys, "batch": batch,
            "layout": layout, "wrong_rows": 0, **figures}


def test_each_one_pass_row_is_held_to_its_own_bound() -> None:
    rows = [
        _row("all hits", "uniform", 2000, "whole, one GPU", M_keys_per_s=80.0),
        _row("all hits", "uniform", 2000, "sharded, one pass", vs_whole=0.81, vs_bound=0.81),
        _row("all hits", "uniform", 2000, "sharded, copies", vs_whole=0.1, vs_bound=0.1),
        _row("all hits", "uniform", 1 << 20, "sharded, one pass", vs_whole=0.45, vs_bound=0.7),
        _row("a quarter cached", "alpha 1.1", 2000, "sharded, one pass", phase="steady state",
             vs_whole=0.79, hit_rate=0.99),
        _row("all hits", "uniform", 1 << 20,
             "sharded, one pass (sweep: 4 lanes a key, 2 keys a round, pushed)",
             vs_whole=0.2, vs_bound=0.3, mode="(sweep)"),
        _row("warm-up at load", "the file's", 1 << 22, "replicated", warm_up_s=2.0),
        _row("warm-up at load", "the file's", 1 << 22, "sharded", warm_up_s=2.5,
             vs_replicated=0.8),
        _row("half a table a GPU", "uniform", 2000, "sharded, one pass",
             phase="steady state", vs_whole=2.3, vs_bound=0.7),
    ]
    rows[-1]["wrong_rows"] = 3
    got = {t["target"]: (t["measured"], t["met"]) for t in targets(rows)}
    assert got == {
        "sharded, all hits, uniform, batch 2000: >= 0.8x one GPU": (0.81, "yes"),
        "sharded, all hits, uniform, batch 2000: wrong rows 0": (0, "yes"),
        "sharded, all hits, uniform, batch 1048576: >= 0.8x the link bound": (0.7, "NO"),
        "sharded, all hits, uniform, batch 1048576: wrong rows 0": (0, "yes"),
        "sharded, a quarter cached, steady state, alpha 1.1, batch 2000: >= 0.8x one GPU":
            (0.79, "NO"),
        "sharded, a quarter cached, steady state, alpha 1.1, batch 2000: wrong rows 0":
            (0, "yes"),
        "sharded, warm-up at load: >= 1.0x replicated": (0.8, "NO"),
        "sharded, half a table a GPU, steady state, uniform, batch 2000: >= 1.0x one GPU":
            (2.3, "yes"),
        "sharded, half a table a GPU, steady state, uniform, batch 2000: wrong rows 0":
            (3, "NO"),
    }


def test_the_self_filled_copies_are_held_to_the_link_bound_after_a_load_and_a_reload() -> None:
    """The rows of hps/tools/bench/gpu_hot_fill.py (issue 74): 1M power-law keys within
    10 s of traffic, no user call, each phase against the link bound."""
    table = "hot copies filled in the background"
    rows = [
        _row(table, "power-law", 1 << 20, "sharded, one pass", phase="after the load",
             vs_bound=0.93, first_fill_s=0.25),
        _row(table, "power-law", 1 << 20, "sharded, one pass", phase="after a reload",
             vs_bound=0.79, first_fill_s=0.03),
    ]
    rows[1]["wrong_rows"] = 2
    got = {t["target"]: (t["measured"], t["met"]) for t in targets(rows)}
    what = "sharded, hot copies filled in the background"
    assert got == {
        f"{what}, after the load: 1M power-law >= 0.8x the link bound": (0.93, "yes"),
        f"{what}, after the load: wrong rows 0": (0, "yes"),
        f"{what}, after a reload: 1M power-law >= 0.8x the link bound": (0.79, "NO"),
        f"{what}, after a reload: wrong rows 0": (2, "NO"),
    }
