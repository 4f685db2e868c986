"""Which rows a uvm table's promotion pass moves (hps/gpu/uvm_table.py runs the pass and
queues the moves): the candidates (keys read from host memory often enough) against the
victims (GPU rows, free ones first, then those of the keys with the fewest hits), pair by
pair while a candidate is clearly hotter. Pure CuPy on the table's arrays, on the caller's
stream and device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NO_ROW = 0xFFFFFFFF  # gpu_row of a slot without a GPU copy; owner of a free GPU row
MIN_HITS = 2  # fewer accesses since the last pass never promote a key
PROMOTE_FACTOR = 2  # a candidate needs more than this many times its victim's hits
_DECIDE_CAP = 2**31 - 1  # counts as compared by a pass (sort keys stay in 64 bits)


def choose_moves(cp: Any, hits_u32: Any, gpu_row: Any, owner: Any, max_moves: int
                 ) -> tuple[Any, Any, Any] | None:
    """(slots promoted, their GPU rows, slots demoted) as int64 device arrays, or None.

    hits_u32 and gpu_row: per slot; owner: per GPU row (NO_ROW where free). At most
    max_moves pairs: the i-th candidate (most hits first, ties: lower slot) takes the i-th
    victim's row (free rows first, then fewest hits, ties: lower row) while its hits exceed
    PROMOTE_FACTOR × the victim's (a free row counts as -1)."""
    gpu_rows = int(owner.shape[0])
    hits = cp.minimum(hits_u32, _DECIDE_CAP).astype(np.int64)
    cand = cp.flatnonzero((gpu_row == NO_ROW) & (hits >= MIN_HITS))
    if cand.size == 0:
        return None
    cand_hits = hits[cand]
    # most hits first, then lower slot: one unique uint64 sort key each
    order = cp.argsort(((_DECIDE_CAP - cand_hits).astype(np.uint64) << np.uint64(32))
                       | cand.astype(np.uint64))
    k = min(int(cand.size), gpu_rows, max_moves)
    order = order[:k]
    cand, cand_hits = cand[order], cand_hits[order]
    held = owner != NO_ROW
    victim_hits = cp.where(held, hits[cp.where(held, owner, 0).astype(np.int64)], -1)
    # free rows first (-1), then fewest hits, then lower row
    vorder = cp.argsort(((victim_hits + 1).astype(np.uint64) << np.uint64(32))
                        | cp.arange(gpu_rows, dtype=np.uint64))[:k]
    wins = cand_hits > PROMOTE_FACTOR * victim_hits[vorder]
    m = int(cp.count_nonzero(wins))  # a prefix: candidates fall, victims rise
    if m == 0:
        return None
    rows = vorder[:m].astype(np.int64)
    out = owner[rows]
    demoted = out[out != NO_ROW].astype(np.int64)
    return cand[:m], rows, demoted


def compile_pass_kernels(cp: Any) -> None:
    """Runs choose_moves and a pass's halving once on a made-up table of five slots and two
    GPU rows (one candidate wins a free row, one a held row), on the caller's stream, so
    CuPy compiles the pass's kernels then, at load, rather than on the promotion task's
    first pass beside lookups: on a fresh machine that took the task's thread seconds of
    NVRTC, and a caller's 2,000-key lookups took ~12 µs longer meanwhile (H200,
    scripts/probe_uvm_small.py)."""
    links = cp.zeros((5, 2), np.uint32)  # per slot: GPU row, hits (the table's pairs)
    links[:, 0] = NO_ROW
    links[2, 0] = 0
    links[:, 1] = cp.asarray([4, 3, 0, 1, 0], np.uint32)
    owner = cp.asarray([2, NO_ROW], np.uint32)
    choose_moves(cp, links[:, 1], links[:, 0], owner, 2)  # both candidates win a row
    cp.right_shift(links[:, 1], 1, out=links[:, 1])
