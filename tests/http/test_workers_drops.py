"""The leader's drops from the tiers every worker reads wait until every worker applied
the op that replaced the tables (hps/http/workers_drops.py), on a real RocksDB store."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hps.config import PersistentDBConfig
from hps.http.workers_drops import HeldDrops
from hps.tiers.rocksdb import RocksDBTier


def test_a_served_table_is_dropped_once_every_worker_acked(tmp_path: Path) -> None:
    tier = RocksDBTier(PersistentDBConfig.model_validate({"path": str(tmp_path / "rocks")}))
    acked = [0]
    drops = HeldDrops([tier], lambda: acked[0], wait=5.0)
    keys = np.arange(10, dtype=np.int64)
    for name in ("old", "new", "leftover"):
        tier.create_table(name, 4)
        tier.insert(name, keys, np.ones((10, 4), np.float32))
    drops.before_op(7, ["old"])  # op 7 starts while the workers serve "old"
    tier.drop_table("old")  # replaced by op 7: held
    tier.drop_table("leftover")  # nobody serves it: dropped at once
    assert "old" in tier.stored_tables() and "leftover" not in tier.stored_tables()
    drops.flush()
    assert "old" in tier.stored_tables()  # the others have not applied op 7 yet
    acked[0] = 7
    drops.flush()
    assert "old" not in tier.stored_tables() and "new" in tier.stored_tables()
    tier.close()


def test_the_next_op_waits_for_the_drops_held_before_it(tmp_path: Path) -> None:
    tier = RocksDBTier(PersistentDBConfig.model_validate({"path": str(tmp_path / "rocks")}))
    drops = HeldDrops([tier], lambda: 0, wait=0.2)  # a worker that never acks
    tier.create_table("old", 4)
    drops.before_op(3, ["old"])
    tier.drop_table("old")
    assert "old" in tier.stored_tables()
    # op 4 may write the name again: what op 3 held is dropped first (after the wait)
    drops.before_op(4, ["new"])
    assert "old" not in tier.stored_tables()
    tier.create_table("new", 4)
    tier.drop_table("new")
    assert "new" in tier.stored_tables()
    drops.release()  # the server stops: made at once, and any later drop too
    assert "new" not in tier.stored_tables()
    tier.create_table("new", 4)
    drops.before_op(5, ["new"])
    drops.release()
    tier.drop_table("new")
    assert "new" not in tier.stored_tables()
    tier.close()
