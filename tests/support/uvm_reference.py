"""A NumPy model of the uvm table's placement (hps/gpu/uvm_table.py), for
tests/gpu/test_uvm_table.py.

The model works on slots, as the table does: which slot a key landed in depends on the
order of a parallel build, so a test reads the table's slots (`UvmEmbeddingTable.state()`)
and asks the model what the placement must be after accesses, a build's placement and
promotion passes. It is written for clarity, key by key, and shares no code with the
table.

    ref = UvmReference.from_state(table.state(), gpu_rows)
    ref.access(slots)        # lookups of held keys, in any order
    ref.place(slots, first)  # uvm_place after a build of these slots (no repeats)
    moved = ref.promote(max_moves)
    ref.gpu_row, ref.owner, ref.hits   # compare with table.state()

Promotion on the lookup path picks its victims in whatever order the GPU's warps take
the clock hand, so the model does not replay it: `check_lookup_promotion(before, after,
read_slots, budget)` says whether a placement change obeys its rules.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hps.gpu.uvm_moves import MIN_HITS, NO_ROW, PROMOTE_FACTOR
from hps.gpu.uvm_table import HITS_CAP


class UvmReference:
    """Placement of a uvm table: gpu_row and hits per slot, owner per GPU row."""

    def __init__(self, gpu_row: np.ndarray, owner: np.ndarray, hits: np.ndarray) -> None:
        self.gpu_row = np.array(gpu_row, dtype=np.uint32)
        self.owner = np.array(owner, dtype=np.uint32)
        self.hits = np.array(hits, dtype=np.uint32)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> UvmReference:
        return cls(state["gpu_row"], state["owner"], state["hits"])

    @property
    def gpu_rows(self) -> int:
        return int(self.owner.size)

    def access(self, slots: np.ndarray) -> None:
        """Counts one access per entry of `slots`, each counter stopping at HITS_CAP."""
        for s in np.asarray(slots, dtype=np.int64).tolist():
            if self.hits[s] < HITS_CAP:
                self.hits[s] += 1

    def place(self, slots: np.ndarray, first_row: int) -> None:
        """Initial placement: the i-th slot built takes GPU row first_row + i when that row
        exists and is free and the slot has none."""
        for i, s in enumerate(np.asarray(slots, dtype=np.int64).tolist()):
            row = first_row + i
            if row < self.gpu_rows and self.gpu_row[s] == NO_ROW and \
                    self.owner[row] == NO_ROW:
                self.gpu_row[s] = row
                self.owner[row] = s

    def promote(self, max_moves: int) -> int:
        """One promotion pass; returns the rows moved."""
        hits = [min(int(h), 2**31 - 1) for h in self.hits.tolist()]
        candidates = sorted(
            (s for s in range(len(hits)) if self.gpu_row[s] == NO_ROW and hits[s] >= MIN_HITS),
            key=lambda s: (-hits[s], s))
        victims = sorted(range(self.gpu_rows), key=lambda r: (
            -1 if self.owner[r] == NO_ROW else hits[int(self.owner[r])], r))
        moved = 0
        for slot, row in zip(candidates, victims, strict=False):
            if moved == max_moves:
                break
            old = int(self.owner[row])
            victim_hits = -1 if old == NO_ROW else hits[old]
            if not hits[slot] > PROMOTE_FACTOR * victim_hits:
                break
            if old != NO_ROW:
                self.gpu_row[old] = NO_ROW
            self.gpu_row[slot] = row
            self.owner[row] = slot
            moved += 1
        self.hits >>= 1
        return moved


def check_lookup_promotion(before: UvmReference, after: UvmReference, read_slots: np.ndarray,
                           budget: int) -> list[str]:
    """The rule-breaks (none: []) of one lookup-path promotion that turned the placement
    `before` into `after`, for a batch that read the host rows of `read_slots` (their
    slots, repeats allowed) and promotes at most `budget` rows: a slot gains a GPU row only
    if the batch read its host row and it has MIN_HITS accesses or more and more than the
    row's previous key (a free row: any); a slot loses its row only to such a promotion;
    owner and gpu_row stay each other's inverse; counts do not change."""
    errors: list[str] = []
    read = set(np.asarray(read_slots, dtype=np.int64).tolist())
    hits = before.hits.astype(np.int64)
    if not np.array_equal(before.hits, after.hits):
        errors.append("counts changed")
    gained = np.flatnonzero((before.gpu_row == NO_ROW) & (after.gpu_row != NO_ROW)).tolist()
    if len(gained) > budget:
        errors.append(f"{len(gained)} rows promoted, more than the budget {budget}")
    taken: dict[int, int] = {}
    for slot in gained:
        row = int(after.gpu_row[slot])
        old = int(before.owner[row])
        taken[row] = old
        if slot not in read:
            errors.append(f"slot {slot} promoted without a host read")
        if hits[slot] < MIN_HITS:
            errors.append(f"slot {slot} promoted with {hits[slot]} hits")
        if old != NO_ROW and not hits[slot] > hits[old]:
            errors.append(f"slot {slot} ({hits[slot]} hits) took row {row} from slot {old} "
                          f"({hits[old]} hits)")
    for slot in np.flatnonzero(before.gpu_row != after.gpu_row).tolist():
        if before.gpu_row[slot] != NO_ROW and (
                after.gpu_row[slot] != NO_ROW or taken.get(int(before.gpu_row[slot])) != slot):
            errors.append(f"slot {slot} lost row {before.gpu_row[slot]} to no promotion")
    for row, slot in enumerate(after.owner.tolist()):
        if slot != NO_ROW and after.gpu_row[slot] != row:
            errors.append(f"row {row}'s owner {slot} links to {after.gpu_row[slot]}")
    for slot in np.flatnonzero(after.gpu_row != NO_ROW).tolist():
        if after.owner[after.gpu_row[slot]] != slot:
            errors.append(f"slot {slot} links to row {after.gpu_row[slot]} owned by "
                          f"{after.owner[after.gpu_row[slot]]}")
    return errors
