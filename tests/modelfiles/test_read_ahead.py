"""read_ahead: the same items in order, errors where the item would be, clean early stops."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from hps.modelfiles.read_ahead import read_ahead


def test_items_in_order_at_most_depth_ahead() -> None:
    produced: list[int] = []

    def items() -> Iterator[int]:
        for i in range(50):
            produced.append(i)
            yield i

    seen = []
    for item in read_ahead(items(), depth=2):
        # the producer is at most depth items past the one handed out, plus the one it
        # holds while it waits for room
        assert len(produced) <= item + 1 + 2 + 1
        seen.append(item)
    assert seen == list(range(50))


def test_an_error_is_raised_where_its_item_would_be() -> None:
    def items() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("page 3 is corrupt")

    got = []
    with pytest.raises(ValueError, match="page 3 is corrupt"):
        for item in read_ahead(items()):
            got.append(item)
    assert got == [1, 2]


def test_stopping_early_stops_the_thread_and_closes_the_items() -> None:
    closed = threading.Event()

    def items() -> Iterator[int]:
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    before = threading.active_count()
    reader = read_ahead(items(), name="hps-read-ahead-test")
    assert [next(reader) for _ in range(3)] == [0, 1, 2]
    reader.close()
    assert closed.is_set()
    assert threading.active_count() == before
    assert not [t for t in threading.enumerate() if t.name == "hps-read-ahead-test"]
