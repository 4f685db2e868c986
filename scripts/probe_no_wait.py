"""What the threads profile would give if a lookup did not wait on the host for its miss
count: the upper bound of designs that leave the misses to another thread and order the
caller's stream after them on the device (a stream wait on a flag).

`python scripts/probe_no_wait.py --mode nowait` runs `hps bench gpu --profile threads`
(all hits, power law, streams set once) with the query's wait for its miss count
replaced by "no misses": right only where every key is held, which that workload's
outputs, all compared with the model, confirm. `--mode normal` runs it unchanged.
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("normal", "nowait"), default="normal")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--workload", default="all hits, power law")
    args = parser.parse_args()
    if args.mode == "nowait":
        from hps.gpu import device_table

        def no_misses(address: int, sentinel: int, spins: int) -> int:
            return 0

        device_table.wait_while_held = no_misses  # type: ignore[assignment]
        device_table.wait_while = no_misses  # type: ignore[assignment]
    from hps.tools.bench import gpu_threads

    sys.argv = [sys.argv[0], "--seconds", str(args.seconds), "--workload", args.workload,
                "--stream-per-thread"]
    print(f"== mode {args.mode} ==", flush=True)
    gpu_threads.main()


if __name__ == "__main__":
    main()
