"""A warm restart's refill of the volatile tier, before and after online updates.

The demo's model (`hps demo`'s two tables, `scale` of their size) is loaded into a
server (in-process hash map over RocksDB, no GPU cache) and closed. Then:

1. the server is started again `restarts` times over the store it filled: each table's
   refill rate and source (the files, the store) as the restart's own log line says
   (logger `hps.server.loader`, hps/server/restart_fill.py);
2. `updated` keys of each table get new rows, written to the persistent tier the way
   online updates write a round (`insert` of `batch` rows at a time, a WriteBatch each):
   rows/s of those writes;
3. step 1 again, over the store that now holds the updated rows.

Only calls that every `hps` since the restart refill has are used, so the same file
run with another checkout first on `PYTHONPATH` measures that code (before and after a
change). Run `hps bench restart-fill` or `python3 -m hps.tools.bench.restart_fill`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

#: the refill's log line: "<table>: the <tier> tier took <n> keys from the <source> in
#: <s>s (<rate> keys/s): <why>"
_FILL_LINE = re.compile(r"^(\S+): the \S+ tier took (\d+) keys from the (\w+) in "
                        r"[\d.]+s \((\d+) keys/s\): (.*)$")


class _FillLines(logging.Handler):
    """Keeps the refill lines logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[re.Match[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = _FILL_LINE.match(record.getMessage())
        if found:
            self.lines.append(found)


def _restarts(config: dict[str, Any], restarts: int) -> dict[str, dict[str, Any]]:
    """Per table: the refill's source, why, and its median keys/s over `restarts`."""
    from hps import HierarchicalParameterServer

    logger = logging.getLogger("hps.server.loader")
    handler, level, propagate = _FillLines(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # kept here, not printed by the command's own handler
    try:
        for _ in range(restarts):
            HierarchicalParameterServer(config).close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    tables: dict[str, dict[str, Any]] = {}
    for line in handler.lines:
        row = tables.setdefault(line[1], {"rates": []})
        row.update(keys=int(line[2]), source=line[3], why=line[5])
        row["rates"].append(int(line[4]))
    for row in tables.values():
        row["keys_per_s"] = statistics.median(row.pop("rates"))
    return tables


def bench_restart_fill(updated: int = 10_000, scale: float = 1.0, batch: int = 1000,
                       restarts: int = 3, seed: int = 0) -> dict[str, Any]:
    """The figures of the profile (see the module docstring)."""
    from hps import HierarchicalParameterServer
    from hps.modelfiles.formats.sparse_folder import SparseModelReader
    from hps.tools.demo import MODEL, TABLES, write_model

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="hps-bench-restart-") as tmp:
        folder = Path(tmp)
        config = json.loads(write_model(folder / "demo", scale=scale).read_text())
        block = config["models"][0]
        block["sparse_files"] = [str(folder / "demo" / f) for f in block["sparse_files"]]
        block["gpucache"] = False
        config["persistent_db"]["path"] = str(folder / "rocks")
        HierarchicalParameterServer(config).close()  # the load
        before = _restarts(config, restarts)
        writes: dict[str, float] = {}
        with HierarchicalParameterServer(config) as server:
            persistent: Any = server.persistent
            for name, _, dim in TABLES:
                with SparseModelReader(str(folder / "demo" / name)) as reader:
                    keys = rng.choice(reader.read_keys(0, reader.num_keys),
                                      min(updated, reader.num_keys), replace=False)
                rows = rng.standard_normal((keys.size, dim), dtype=np.float32)
                stored = f"hps_et.{MODEL}.{name}"
                started = time.perf_counter()
                for start in range(0, keys.size, batch):  # a loop over update rounds
                    persistent.insert(stored, keys[start:start + batch],
                                      rows[start:start + batch])
                writes[stored] = keys.size / (time.perf_counter() - started)
        after = _restarts(config, restarts)
    return {"updated": updated, "scale": scale, "batch": batch, "restarts": restarts,
            "before": before, "after": after, "update_rows_per_s": writes}


def format_restart_fill(result: dict[str, Any]) -> str:
    """The figures of `bench_restart_fill` as a plain-text table."""
    lines = [f"{'table':<28} {'keys':>9}  {'restart':>18}  "
             f"{'after ' + format(result['updated'], ',') + ' updated keys':>30}  "
             f"{'update writes':>14}",
             f"{'':<28} {'':>9}  {'source':>7} {'keys/s':>10}  {'source':>7} {'keys/s':>10}"
             f"{'':>12}  {'rows/s':>14}"]
    for name, row in result["before"].items():
        after = result["after"].get(name, {})
        lines.append(
            f"{name:<28} {row['keys']:>9,}  {row['source']:>7} {row['keys_per_s']:>10,.0f}  "
            f"{after.get('source', '-'):>7} {after.get('keys_per_s', 0):>10,.0f}{'':>12}  "
            f"{result['update_rows_per_s'].get(name, 0):>14,.0f}")
    for name, row in result["after"].items():
        lines.append(f"after the updates, {name}: {row['why']}")
    lines.append(f"median of {result['restarts']} restarts each; update writes: insert of "
                 f"{result['batch']} rows at a time into RocksDB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updated", type=int, default=10_000, help="keys updated a table")
    parser.add_argument("--scale", type=float, default=1.0, help="of the demo's size")
    parser.add_argument("--batch", type=int, default=1000, help="rows an update write")
    parser.add_argument("--restarts", type=int, default=3)
    args = parser.parse_args(argv)
    print(format_restart_fill(bench_restart_fill(args.updated, args.scale, args.batch,
                                                 args.restarts)))


if __name__ == "__main__":
    main()
