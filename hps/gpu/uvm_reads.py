"""How a uvm table's queries read the rows kept only in host memory (hps/gpu/uvm_table.py
queues the kernels of cuda/uvm_table.cu).

- A batch of `grouped_reads_from` keys or more reads its host rows grouped by 2 MiB region
  of host memory (cuda/uvm_table.cu says why: random reads over gigabytes of host memory
  are bound by address translation): the query kernel serves GPU rows and misses and notes
  the host rows by batch position, three small kernels put them in region order and read
  them; the miss count is published after the last of them.
- A smaller batch reads its host rows at once (one launch: its latency counts more than
  the bus).

A grouped query leaves the rows it read in its workspace's HostReadLists, for the
promotion after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

REGION_BYTES = 2 << 20  # host memory read in any order within a region ran at full speed
_MAX_REGIONS = 32768  # uvm_region_scan: one block of 1024 threads, 32 regions each
SCAN_BLOCK = 1024


def region_shift(num_rows: int, row_bytes: int, region_bytes: int = REGION_BYTES) -> int:
    """log2 of the rows per region of host memory: at most region_bytes (one row at
    least), more where the rows would need more than _MAX_REGIONS regions."""
    shift = max(0, (int(region_bytes) // max(int(row_bytes), 1)).bit_length() - 1)
    while (int(num_rows) >> shift) + 1 > _MAX_REGIONS:
        shift += 1
    return shift


class HostReadLists:
    """One workspace's buffers for the host rows a grouped query read (device): the
    number of them and of the promotions claimed (u32 [2]); the slot deferred at each
    batch position (NO_ROW where none); the slots and their positions in region order
    (u32 [capacity] each); and per region its count and its start in the order. Between
    queries every region count is 0 (the kernels leave them so)."""

    def __init__(self, cupy: Any, capacity: int, regions: int) -> None:
        self.capacity = capacity
        self.listed = cupy.zeros(2, np.uint32)  # rows read; promotions claimed
        self.lists = cupy.empty((3, capacity), np.uint32)  # by position, ordered slot, pos
        self.region_count = cupy.zeros(regions, np.uint32)
        self.region_start = cupy.empty(regions, np.uint32)
        self.promoted = cupy.cuda.Event(block=False, disable_timing=True)
        base, row = int(self.lists.data.ptr), capacity * 4
        self.ptrs = (int(self.listed.data.ptr), base, base + row, base + 2 * row,
                     int(self.region_count.data.ptr), int(self.region_start.data.ptr))
