"""A lookup client process for the workers' tests: `python -m tests.support.lookup_client
PORT TABLE DIM CASE SECONDS`, where CASE.npz holds `keys` and `allowed` ([k, n, dim]: the
k rows each key may have, e.g. the file's and the ones updates wrote).

It sends binary lookups of random batches of those keys over keep-alive connections
(http.client, a new connection after one is reset: a worker killed under it) for SECONDS,
and checks every row of every answer is whole: one of its key's allowed rows. It prints
one JSON line: answers by status, rows checked, rows that were none of the allowed,
connections reset.
"""

from __future__ import annotations

import http.client
import json
import sys
import time

import numpy as np


def main() -> None:
    port, table, dim, case, seconds = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]),
                                       sys.argv[4], float(sys.argv[5]))
    data = np.load(case)
    keys, allowed = data["keys"], data["allowed"]
    rng = np.random.default_rng()
    statuses: dict[int, int] = {}
    rows = bad = resets = 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pick = rng.integers(0, keys.size, 64)
        body = keys[pick].astype("<i8").tobytes()
        try:
            conn.request("POST", f"/v1/models/m/tables/{table}/lookup", body,
                         {"Content-Type": "application/octet-stream"})
            answer = conn.getresponse()
            payload = answer.read()
        except (ConnectionError, http.client.HTTPException, OSError):
            resets += 1  # a worker died under this connection: a new one goes elsewhere
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            time.sleep(0.01)
            continue
        statuses[answer.status] = statuses.get(answer.status, 0) + 1
        if answer.status != 200:
            continue
        got = np.frombuffer(payload, "<f4").reshape(pick.size, dim)
        choices = allowed[:, pick]  # [k, batch, dim]
        whole = (choices == got[None]).all(axis=2).any(axis=0)
        rows += pick.size
        bad += int((~whole).sum())
    print(json.dumps({"statuses": statuses, "rows": rows, "bad": bad, "resets": resets}))


if __name__ == "__main__":
    main()
