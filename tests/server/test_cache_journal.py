"""The journal of updated keys that carries the leader's online updates to the other
workers' GPU caches (hps/server/cache_journal.py): rings written by one process and read
by another through the file, wrapped, overrun, and the follower that applies them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hps.server.cache_journal import CacheFollower, KeyRing, UpdateJournal, ring_path

ROOT = Path(__file__).resolve().parents[2]


def _append_in_another_process(folder: Path, model: str, table: str, batches: list[list[int]]
                               ) -> None:
    code = ("import sys, json, numpy as np\n"
            "from pathlib import Path\n"
            "from hps.server.cache_journal import UpdateJournal\n"
            "j = UpdateJournal(Path(sys.argv[1]))\n"
            "for batch in json.loads(sys.argv[4]):\n"
            "    j.append(sys.argv[2], sys.argv[3], np.array(batch, np.int64))\n"
            "j.close()\n")
    import json

    subprocess.run([sys.executable, "-c", code, str(folder), model, table,
                    json.dumps(batches)], check=True, cwd=ROOT, timeout=60)


def test_keys_appended_by_one_process_are_read_by_another(tmp_path: Path) -> None:
    _append_in_another_process(tmp_path, "m", "users", [[5, 6, 7], [9], []])
    ring = KeyRing.open(ring_path(tmp_path, "m", "users"))
    assert ring is not None and ring.head == 4
    keys, head = ring.read(0)
    assert keys is not None and keys.tolist() == [5, 6, 7, 9] and head == 4
    keys, head = ring.read(3)
    assert keys is not None and keys.tolist() == [9] and head == 4
    keys, _ = ring.read(4)
    assert keys is not None and keys.size == 0
    assert KeyRing.open(ring_path(tmp_path, "m", "items")) is None  # no updates yet
    # names of any characters get files of their own
    assert ring_path(tmp_path, "m", "a/b") != ring_path(tmp_path, "m/a", "b")
    assert ring_path(tmp_path, "m", "../x").parent == tmp_path / "gpu-updates"


def test_a_ring_wraps_and_a_reader_lapped_gets_none(tmp_path: Path) -> None:
    ring = KeyRing.create(tmp_path / "r.keys", capacity=8)
    ring.append(np.arange(6))
    keys, head = ring.read(0)
    assert keys is not None and keys.tolist() == list(range(6))
    ring.append(np.arange(6, 11))  # wraps: positions 6, 7, 0, 1, 2
    keys, head = ring.read(head)
    assert keys is not None and keys.tolist() == [6, 7, 8, 9, 10] and head == 11
    keys, _ = ring.read(3)  # the last 8 keys: 3..10, still all there
    assert keys is not None and keys.tolist() == list(range(3, 11))
    assert ring.read(2) == (None, 11)  # key 2 was overwritten
    ring.append(np.arange(100, 120))  # more than the ring: the last 8 stay
    assert ring.head == 31
    keys, _ = ring.read(23)
    assert keys is not None and keys.tolist() == list(range(112, 120))
    assert ring.read(22)[0] is None
    ring.close()


def test_a_file_that_is_not_a_ring_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.keys"
    bad.write_bytes(b"\0" * 200)
    with pytest.raises(ValueError, match="not a key ring"):
        KeyRing.open(bad)
    bad.write_bytes(b"x")
    with pytest.raises(ValueError, match="too short"):
        KeyRing.open(bad)


class _Table:
    """A table as the follower passes it back: what the callbacks were given."""

    def __init__(self) -> None:
        self.refetched: list[list[int]] = []
        self.refreshed = 0


def _follower(folder: Path, tables: dict[tuple[str, str], _Table],
              caught: list[str]) -> CacheFollower:
    def refetch(table: _Table, keys: np.ndarray) -> None:
        table.refetched.append(keys.tolist())

    def refresh(table: _Table) -> None:
        table.refreshed += 1

    return CacheFollower(folder, lambda: [(m, n, t) for (m, n), t in tables.items()],
                         refetch, refresh, lambda: caught.append("caught up"))


def test_the_follower_applies_each_key_once_in_order_of_rounds(tmp_path: Path) -> None:
    journal = UpdateJournal(tmp_path)
    users, items = _Table(), _Table()
    caught: list[str] = []
    follower = _follower(tmp_path, {("m", "users"): users, ("m", "items"): items}, caught)
    assert follower.step() == 0 and caught == []  # no ring yet: nothing read
    journal.append("m", "users", np.array([3, 1, 3, 2]))
    assert follower.step() == 3  # distinct keys, sorted
    assert users.refetched == [[1, 2, 3]] and items.refetched == [] and caught == ["caught up"]
    assert follower.step() == 0 and len(caught) == 1  # nothing new: no catch-up either
    journal.append("m", "items", np.array([7]))
    journal.append("m", "users", np.array([4]))
    follower.step()
    assert users.refetched[-1] == [4] and items.refetched == [[7]]
    # a version loaded here again: everything the rings hold is applied to it again
    follower.reset("m")
    follower.step()
    assert users.refetched[-1] == [1, 2, 3, 4] and items.refetched[-1] == [7]
    assert users.refreshed == 0
    follower.close()
    journal.close()


def test_a_follower_lapped_refreshes_the_table_whole(tmp_path: Path) -> None:
    path = ring_path(tmp_path, "m", "users")
    path.parent.mkdir(parents=True)
    ring = KeyRing.create(path, capacity=4)
    users = _Table()
    follower = _follower(tmp_path, {("m", "users"): users}, [])
    ring.append(np.arange(3))
    follower.step()
    ring.append(np.arange(10, 20))  # more than the ring holds since the last look
    follower.step()
    assert users.refreshed == 1 and users.refetched == [[0, 1, 2]]
    ring.append(np.array([30]))
    follower.step()  # back in step: keys again
    assert users.refetched[-1] == [30] and users.refreshed == 1
    follower.close()
    ring.close()


def test_the_follower_thread_applies_appends_within_polls(tmp_path: Path) -> None:
    import time

    journal = UpdateJournal(tmp_path)
    users = _Table()
    follower = _follower(tmp_path, {("m", "users"): users}, [])
    follower.start()
    try:
        journal.append("m", "users", np.array([42, 43]))
        deadline = time.monotonic() + 10
        while not users.refetched and time.monotonic() < deadline:
            time.sleep(0.01)
        assert users.refetched == [[42, 43]] and follower.applied == 2
    finally:
        follower.close()
        journal.close()


def test_an_idle_follower_looks_less_often_and_still_applies_the_next_update(
        tmp_path: Path) -> None:
    import time

    journal = UpdateJournal(tmp_path)
    users = _Table()
    looks: list[float] = []

    def tables() -> list[tuple[str, str, _Table]]:
        looks.append(time.monotonic())
        return [("m", "users", users)]

    follower = CacheFollower(tmp_path, tables, lambda t, keys: t.refetched.append(
        keys.tolist()), lambda t: None)
    follower.start()
    try:
        time.sleep(1.5)
        idle = len(looks)
        # a look every POLL would be 75; doubling to IDLE_POLL: under 15
        assert 1 <= idle < 15, looks
        journal.append("m", "users", np.array([8]))
        deadline = time.monotonic() + 10
        while not users.refetched and time.monotonic() < deadline:
            time.sleep(0.01)
        assert users.refetched == [[8]]
        journal.append("m", "users", np.array([9]))  # updates coming: looked at again
        while len(users.refetched) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert users.refetched == [[8], [9]]
        # a version loaded again (reset): applied again without waiting out the backoff
        time.sleep(1.0)
        follower.reset("m")
        while len(users.refetched) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert users.refetched[-1] == [8, 9]
    finally:
        follower.close()
        journal.close()
