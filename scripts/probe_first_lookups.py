"""What a new server's first lookups cost, per thread: HugeCTR's profile (630,000 keys of
width 16, power law 1.2, 2,000 keys a lookup, a dynamic GPU cache of 0.9 of the table on
device 0), torch tensors through `HPS.lookup_fromdlpack`, a sync of the stream after each.

A peer answers 8 lookups and exports its hot set (`hot_set`: its sketch's keys, then its
cache's); a replica warmed from it (`warm_from`) answers the same 8 and 2 more from the
thread that made it, then 10 others from a new thread. The first 8 are all hits for the
replica (the peer saw them), the others miss a little. Prints µs per lookup, in order: a
thread's first lookup shows what it builds (GPU tables keep a few lookup states built at
load, hps/gpu/workspace.py SpareStates).

    python3 scripts/probe_first_lookups.py          (on a machine with a GPU, torch)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

import torch

from hps.api import HPS
from hps.modelfiles.formats.sparse_folder import write_sparse_model
from hps.tools.bench.warm_start import MODEL, _gpu_config, _stream, make_table


def main() -> None:
    work = tempfile.mkdtemp(prefix="hps-first-")
    try:
        keys, vectors = make_table(630_000, 16)
        write_sparse_model(os.path.join(work, "table0"), keys, vectors)
        batches = torch.as_tensor(_stream(keys, 20, 2000, 1.2, True), device="cuda:0")
        out = torch.empty((2000, 16), dtype=torch.float32, device="cuda:0")

        def timed(hps: Any, some: Any) -> list[float]:
            stream = torch.cuda.current_stream()
            took = []
            for b in some:
                start = time.perf_counter()
                hps.lookup_fromdlpack(b, out, MODEL, 0)
                stream.synchronize()
                took.append(round((time.perf_counter() - start) * 1e6, 1))
            return took

        with HPS(_gpu_config(work, "peer", 16, 2000)) as peer:
            print("peer, the process's first lookups:", timed(peer, batches[:8]))
            export = peer.server.hot_set(MODEL, 0)
        path = os.path.join(work, "table0.hot-set")
        export.astype("<i8").tofile(path)
        with HPS(_gpu_config(work, "replica", 16, 2000, warm_from=path)) as replica:
            print("replica, its making thread:", timed(replica, batches[:10]))
            got: list[list[float]] = []
            thread = threading.Thread(target=lambda: got.append(timed(replica, batches[10:])))
            thread.start()
            thread.join()
            print("replica, a new thread:", got[0] if got else "failed (see above)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
