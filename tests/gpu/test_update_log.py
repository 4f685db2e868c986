"""UpdateLog (hps/gpu/update_log.py): which of a miss fill's keys the online updates
since its mark wrote; all of them once those updates are no longer kept."""

from __future__ import annotations

import numpy as np

from hps.gpu.update_log import KEPT, UpdateLog


def test_no_update_since_the_mark_leaves_every_key() -> None:
    log = UpdateLog()
    log.wrote(np.array([1, 2, 3]))
    mark = log.mark()
    keys = np.array([1, 2, 3, 4], np.int64)
    stale = log.raced(mark, keys)
    assert stale.size == 0 and stale.dtype == np.int64


def test_only_the_keys_updates_wrote_are_stale() -> None:
    log = UpdateLog()
    mark = log.mark()
    log.wrote(np.array([5, 9], np.int64))
    log.wrote(np.array([7], np.int32))  # any integer width
    keys = np.array([1, 5, 7, 8], np.int64)
    np.testing.assert_array_equal(log.raced(mark, keys), [5, 7])
    np.testing.assert_array_equal(log.raced(log.mark() - 1, keys), [7])
    assert log.raced(mark, np.array([2, 3], np.int64)).size == 0


def test_the_log_copies_what_it_is_given() -> None:
    log = UpdateLog()
    mark = log.mark()
    buffer = np.array([4, 6], np.int64)
    log.wrote(buffer)
    buffer[:] = [100, 101]  # the update's buffer is reused for the next batch
    np.testing.assert_array_equal(log.raced(mark, np.array([4, 100], np.int64)), [4])


def test_a_mark_older_than_the_kept_updates_makes_every_key_stale() -> None:
    log = UpdateLog()
    mark = log.mark()
    for i in range(KEPT + 1):
        log.wrote(np.array([1000 + i], np.int64))
    keys = np.array([1, 2], np.int64)
    stale = log.raced(mark, keys)
    np.testing.assert_array_equal(stale, keys)
    stale[0] = 99
    assert keys[0] == 1  # a new array, never the caller's
