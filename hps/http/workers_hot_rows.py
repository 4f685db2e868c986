"""Fills of hot copies asked of one worker of `hps serve --workers N`, done in every worker.

Every worker keeps GPU caches of its own, so each has its own hot copies of its sharded
tables (hps/gpu/hot_rows.py) and its own background filler (hps/server/hot_fill.py),
which fills them from that worker's hot-key sketch. A fill asked on demand (`POST
/v1/models/{model}/hot-rows`) runs in the worker that took the request, and is written on
the run's hot-rows board, a file of JSON lines in the run folder (`hot-rows.jsonl`); every
other worker's filler reads the lines added since its last look at its next tick (every
hot_fill.TICK seconds) and fills its own copies the same way. The answer is the asked
worker's; the others' fills follow within a tick. A worker that starts later reads from
the board's end at its start (its copies fill from its own traffic).

The board only grows by a line a request (an admin's, rare); it goes with the run folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hps.http.workers_ops import ReplicatedServer
from hps.runtime.run_dir import file_lock, read_lines


class HotRowsBoard:
    """One worker's view of the run's hot-rows board (see the module)."""

    def __init__(self, run_folder: Path, index: int) -> None:
        self.path = run_folder / "hot-rows.jsonl"
        self._lock_path = run_folder / "hot-rows.lock"
        self.index = index
        with file_lock(self._lock_path):
            self.path.touch(exist_ok=True)
            self._read_at = self.path.stat().st_size  # what was asked before: not ours

    def ask(self, model: str, table: int | str | None) -> None:
        """Tell the other workers to fill the hot copies of `model` (`table`: one)."""
        line = json.dumps({"model": model, "table": None if table is None else str(table),
                           "from": self.index})
        with file_lock(self._lock_path), open(self.path, "a") as f:
            f.write(line + "\n")

    def new_requests(self) -> list[tuple[str, str | None]]:
        """The fills other workers asked for since the last call: [(model, table)]."""
        lines, self._read_at = read_lines(self.path, self._read_at)
        asked = [json.loads(line) for line in lines]
        return [(a["model"], a["table"]) for a in asked if a["from"] != self.index]


class HotRowsWorkerServer(ReplicatedServer):
    """A worker's parameter server whose on-demand fills of hot copies reach every worker
    (see the module)."""

    def __init__(self, config: Any, *, oplog: Any, index: int, workers: int | None = None
                 ) -> None:
        super().__init__(config, oplog=oplog, index=index, workers=workers)
        self.hot_board = HotRowsBoard(oplog.folder.parent, index)
        self.hot_fill.asked = self.hot_board.new_requests

    def fill_hot_rows(self, model: str, table: int | str | None = None) -> dict[str, Any]:
        """Fill here now, and ask every other worker to fill its own copies."""
        answer = super().fill_hot_rows(model, table)
        self.hot_board.ask(model, table)
        answer["workers"] = ("this worker's copies; every other worker fills its own from "
                             "its hot-key sketch within its next tick")
        return answer
