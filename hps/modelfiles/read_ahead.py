"""Reading the next chunk of a model while the tiers take the current one.

Decoding (Parquet pages, inflating an `.npz`) and remote reads release the GIL, so a
thread that reads one chunk ahead overlaps them with the tiers' writes: a load then
costs the slower of the two, not their sum. The reader runs at most `depth` chunks ahead,
so a load still holds only a few chunks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


def read_ahead(items: Iterator[T], depth: int = 1, name: str = "hps-read-ahead") -> Iterator[T]:
    """What `items` yields, in order, produced by a thread up to `depth` items ahead.

    An exception raised by `items` is raised here, where the item would have come. When
    the consumer stops early (breaks, or raises), the thread stops after its current
    item and `items` is closed.
    """
    ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((True, _DONE))
        except BaseException as exc:  # handed to the consumer, raised there
            put((False, exc))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            ok, item = ready.get()
            if not ok:
                try:
                    raise item
                finally:  # the error's traceback holds this frame: no cycle through it
                    del item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()
        close = getattr(items, "close", None)
        if close is not None:
            close()
