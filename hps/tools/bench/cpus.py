"""Where a bench's servers and clients run, and what the servers take there.

The servers on one half of the physical cores and the clients on the other (`split_cpus`),
each process pinned (`pin`), so that a server never shares a core with the clients that
load it and every server of a run gets the same cores; a server's CPU time and minor page
faults (`counters`: its worker processes with it, from Linux /proc)."""

from __future__ import annotations

import contextlib
import glob
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


def counters(pid: int) -> tuple[float, int, float] | None:
    """(CPU seconds, user + system, and minor page faults) that process `pid` and its
    live descendants (the workers of a server with several) have used so far, threads
    that ended included, and the CPU seconds of their main threads alone (a server's
    event loops: the rest is its other threads'), from one read of each process's /proc
    entries; None where `pid`'s cannot be read. A minor fault is a page the kernel mapped
    on first touch: memory a process takes from the kernel and gives back per request
    shows there."""
    ticks, faults, main, todo = 0, 0, 0, [pid]
    while todo:  # a walk over processes
        p = todo.pop()
        try:
            thread = _stat(f"/proc/{p}/task/{p}/stat")  # first: never past the process
            fields = _stat(f"/proc/{p}/stat")
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            faults += int(fields[7])  # minflt
            main += int(thread[11]) + int(thread[12])
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
            continue  # a child that ended meanwhile
        todo += children(p)
    tick = os.sysconf("SC_CLK_TCK")
    return ticks / tick, faults, main / tick


def _stat(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name, which may itself hold
    spaces and ")"."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float | None:
    """The CPU seconds of `counters`."""
    counted = counters(pid)
    return None if counted is None else counted[0]


def minor_faults(pid: int) -> int | None:
    """The minor page faults of `counters`."""
    counted = counters(pid)
    return None if counted is None else counted[1]


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux)."""
    found: list[int] = []
    for listing in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            found += [int(p) for p in Path(listing).read_text().split()]
    return sorted(set(found))
