"""Where a bench's servers and clients run: the servers on one half of the physical cores
and the clients on the other (`split_cpus`), each process pinned (`pin`), so that a server
never shares a core with the clients that load it and every server of a run gets the same
cores."""

from __future__ import annotations

import os
from pathlib import Path


def pin(pid: int, cpus: set[int] | None) -> None:
    """Process `pid` (0: this one) on `cpus` (None: left as it is)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, cpus)


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(server CPUs, client CPUs): the servers on one half of the physical cores, the
    clients on the other, each core's hardware threads on one side (a core shared by a
    server and a client would time the client's work as the server's). Unpinned, one
    `hps serve` process of the same config read 375 and 470 µs a request in one run on an
    H200 machine, as the scheduler placed it and its clients."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cores = physical_cores(cpus)
    if len(cores) < 2:  # one core's threads: split them
        half = len(cpus) // 2
        return set(cpus[half:]), set(cpus[:half])
    half = len(cores) // 2
    return ({c for core in cores[half:] for c in core},
            {c for core in cores[:half] for c in core})


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """`cpus` grouped by physical core (Linux's thread siblings; each CPU alone where the
    topology cannot be read), in the order of their first CPU."""
    groups: dict[str, list[int]] = {}
    for cpu in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            siblings = path.read_text().strip()
        except OSError:
            siblings = str(cpu)
        groups.setdefault(siblings, []).append(cpu)
    return sorted(groups.values())
