"""Reading ModelInferRequests (`hps/http/grpc/tensors.py`): the shortcut through a known
layout reads every request exactly as the general path does (the message built and
checked whole), for well-formed requests and a bounded fuzz of damaged ones."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hps.errors import LookupInputError
from hps.http.grpc import tensors
from hps.http.grpc.tensors import read_request
from tests.http.grpc_support import raw_request


def outcome(data: bytes) -> tuple[Any, ...]:
    """What reading `data` gives: its fields and inputs, or the error's message."""
    try:
        reading = read_request(data)
        keys, numkeys = reading.inputs()
    except LookupInputError as exc:
        return ("error", str(exc))
    return ("ok", reading.model, reading.version, reading.request_id, keys.dtype.str,
            keys.tobytes(), numkeys.dtype.str, numkeys.tolist())


def general(data: bytes) -> tuple[Any, ...]:
    """`outcome` with no layout known: the general path alone."""
    tensors._LAYOUTS.clear()
    try:
        return outcome(data)
    finally:
        tensors._LAYOUTS.clear()


def requests() -> list[bytes]:
    keys, numkeys = np.arange(5, dtype=np.int64) * 7, np.array([3, 2])
    return [raw_request("m", keys, numkeys).SerializeToString(),
            raw_request("m", keys, numkeys, id="req-1").SerializeToString(),
            raw_request("m", keys, numkeys, id="req-2", model_version="1").SerializeToString(),
            raw_request("m", keys[:1], numkeys[:1] - 2).SerializeToString()]


@pytest.fixture(autouse=True)
def no_layouts() -> Any:
    tensors._LAYOUTS.clear()
    yield
    tensors._LAYOUTS.clear()


def test_known_layouts_read_as_the_general_path() -> None:
    for data in requests():
        first = outcome(data)  # read whole; its layout is kept
        assert first[0] == "ok"
        assert tensors._LAYOUTS  # the next ones take the shortcut
        assert outcome(data) == first == general(data)
    # same head, other ids and other keys of the same sizes: through the layout
    base = requests()[1]
    outcome(base)
    other = raw_request("m", np.arange(5, dtype=np.int64) + 100, np.array([3, 2]),
                        id="another").SerializeToString()
    assert len(tensors._LAYOUTS) >= 1
    got = outcome(other)
    assert got == general(other) and got[3] == "another"
    assert np.frombuffer(got[5], np.int64).tolist() == [100, 101, 102, 103, 104]


def test_damaged_requests_read_as_the_general_path() -> None:
    """Every byte changed, cut or added, with the layouts of the intact requests known:
    the same answer or the same error as the general path."""
    rng = np.random.default_rng(7)
    checked = 0
    for data in requests():
        for _ in range(150):
            damaged = bytearray(data)
            where = int(rng.integers(0, len(data)))
            kind = rng.integers(0, 4)
            if kind == 0:
                damaged[where] = int(rng.integers(0, 256))
            elif kind == 1:
                del damaged[where:]
            elif kind == 2:
                damaged[where:where] = bytes(rng.integers(0, 256, int(rng.integers(1, 4)),
                                                      dtype=np.uint8))
            else:  # an id that is not UTF-8, or other fields appended
                damaged += b"\x1a\x02\xff\xfe" if rng.integers(0, 2) else b"\x38\x01"
            for intact in requests():  # every layout known
                outcome(intact)
            expected = general(bytes(damaged))
            for intact in requests():
                outcome(intact)
            assert outcome(bytes(damaged)) == expected, bytes(damaged)
            checked += 1
    assert checked == 600


def test_layouts_are_bounded() -> None:
    for i in range(tensors._LAYOUTS_MAX + 10):
        outcome(raw_request(f"m{i}", np.arange(2, dtype=np.int64), np.array([2]))
                .SerializeToString())
    assert 0 < len(tensors._LAYOUTS) <= tensors._LAYOUTS_MAX
