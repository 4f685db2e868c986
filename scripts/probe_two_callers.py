"""Which part of a lookup keeps several caller threads from adding up (GPU machine).

N threads (1, 2, 4), each on its own torch stream made current once, each with its own
keys, output and hps workspace, loop one variant then synchronize their stream, for
`--seconds` a point; a dynamic cache holding the whole table (4M x 64), 2,000 power-law
keys. The variants peel the public call down to its launch:

- floor: `torch.index_select` of the same rows;
- public: `HPS.lookup_fromdlpack` as shipped (the spin on the miss count keeps the GIL);
- public, no wait: the same with the wait for the miss count replaced by "none" (right
  here: every key is held);
- query, no wait: `DeviceTable.query_ptr` on the thread's workspace, no wait;
- launch + record: the query kernel's launch and its event record alone (`_enqueue`);
- launch: the launch alone (no event recorded).

Prints M keys/s per variant and N, and each over the floor at the same N.

`--nogil-launch` makes the query's launch and event record (one compiled call) release the
GIL, as torch's operators do around their dispatch; `--spin-released` makes the wait for
the miss count release it at every size (hps/gpu/device_table.py _HELD_SPIN_KEYS).

    python scripts/probe_two_callers.py [--seconds 1.0] [--nogil-launch] [--spin-released]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--table-keys", type=int, default=1 << 22)
    parser.add_argument("--nogil-launch", action="store_true")
    parser.add_argument("--spin-released", action="store_true")
    args = parser.parse_args()
    if args.nogil_launch:
        _launch_without_the_gil()
    if args.spin_released:
        from hps.gpu import device_table as dt

        dt._HELD_SPIN_KEYS = 0

    import torch

    from hps import write_sparse_model
    from hps.gpu import device_table
    from hps.intake.keys import device_pair
    from hps.tools.bench.gpu_public import MODEL, server_over_folder
    from hps.tools.bench.gpu_threads import _draws, _drive

    dim, n, most = 64, 2000, 8
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, args.table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((args.table_keys, dim)).astype(np.float32)
    dense = torch.as_tensor(rows, device="cuda:0")
    all_keys = torch.as_tensor(keys, device="cuda:0")
    streams = [torch.cuda.Stream() for _ in range(most)]
    pos = [torch.as_tensor(p, device="cuda:0")
           for p in _draws(rng, args.table_keys, n, most, 1.1, False)]
    dkeys = [all_keys[p].contiguous() for p in pos]
    outs = [torch.empty((n, dim), device="cuda:0") for _ in range(most)]
    with tempfile.TemporaryDirectory() as tmp:
        write_sparse_model(Path(tmp) / "t0", keys, rows)
        hps = server_over_folder(Path(tmp), dim, n, 0, embedding_cache_type="dynamic",
                                 gpucacheper=1.0, hit_rate_threshold=1.0)
    gpu = hps.server.model(MODEL).tables[0].gpu[0]
    table = gpu._table
    held = device_table.wait_while_held
    ctx: dict[int, tuple[object, ...]] = {}

    def setup(t: int) -> None:
        torch.cuda.set_stream(streams[t])
        pair = device_pair(dkeys[t], outs[t])
        assert pair is not None
        kp, count, op, _, _, sp, out_type = pair
        ws = gpu._state().ws
        ctx[t] = (kp, count, op, sp, out_type, ws)

    def none(address: int, sentinel: int, spins: int) -> int:
        return 0

    def floor(t: int) -> None:
        torch.index_select(dense, 0, pos[t], out=outs[t])

    def public(t: int) -> None:
        hps.lookup_fromdlpack(dkeys[t], outs[t], MODEL, 0)

    def query(t: int) -> None:
        kp, count, op, sp, out_type, ws = ctx[t]
        table.query_ptr(kp, count, op, 0.0, ws, sp, out_type)

    def launch_record(t: int) -> None:
        kp, count, op, sp, out_type, ws = ctx[t]
        table._enqueue(kp, count, op, 0.0, ws, sp, out_type, ws.event_ptr)

    def launch(t: int) -> None:
        kp, count, op, sp, out_type, ws = ctx[t]
        table._enqueue(kp, count, op, 0.0, ws, sp, out_type, 0)

    variants: list[tuple[str, Callable[[int], None], bool]] = [
        ("floor", floor, False), ("public", public, False),
        ("public, no wait", public, True), ("query, no wait", query, True),
        ("launch + record", launch_record, False), ("launch", launch, False)]

    def drive(threads: int, call: Callable[[int], None]) -> float:
        """M keys/s of `threads` threads looping call(t) and their stream's sync (the
        threads profile's driver; each thread's first call before the timing)."""
        def ready(t: int) -> None:
            setup(t)
            call(t)
            streams[t].synchronize()

        def once(t: int, i: int) -> int:
            call(t)
            streams[t].synchronize()
            return n

        return _drive(threads, args.seconds, once, ready)[0] / 1e6

    try:
        counts = [int(c) for c in args.threads.split(",")]
        print("M keys/s (x floor at the same N), threads " + ", ".join(map(str, counts)))
        floors: dict[int, float] = {}
        for name, call, no_wait in variants:
            device_table.wait_while_held = none if no_wait else held
            cells = []
            for threads in counts:
                rate = drive(threads, call)
                if name == "floor":
                    floors[threads] = rate
                cells.append(f"{rate:7.1f} ({rate / floors[threads]:.2f})")
            print(f"  {name:18s} " + "  ".join(cells), flush=True)
        device_table.wait_while_held = held
        public(0)
        torch.cuda.synchronize()
        assert np.array_equal(outs[0].cpu().numpy(), rows[pos[0].cpu().numpy()])
    finally:
        device_table.wait_while_held = held
        hps.close()


def _launch_without_the_gil() -> None:
    """Every launch-and-record through kernels._held_launcher's nogil twin (before any
    table binds its launches)."""
    from hps.gpu import kernels

    released = kernels._held_launcher(nogil=True)
    kernels._held_launcher = lambda nogil=False: released  # type: ignore[assignment]


if __name__ == "__main__":
    main()
