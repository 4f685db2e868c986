"""HPS.bind_lookup on the host path (hps/server/bound_lookup.py): a bound lookup serves what
lookup_fromdlpack serves for the keys its buffer holds at each call, follows a reload,
refuses what lookup_fromdlpack refuses, and belongs to its thread. (Its GPU path, with the
GIL released: tests/gpu/test_lookup.py.)"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hps import HPS, LookupInputError, UnknownModelError
from tests.conftest import make_table, model_config, write_table

DIM = 8


@pytest.fixture
def served(tmp_path: Path, rng: np.random.Generator) -> tuple[HPS, np.ndarray, np.ndarray]:
    keys, vectors = make_table(rng, 500, DIM)
    write_table(tmp_path / "t0", keys, vectors)
    hps = HPS({"models": [model_config([str(tmp_path / "t0")], [DIM])]})
    yield hps, keys, vectors
    hps.close()


def test_each_call_looks_up_the_keys_the_buffer_holds(
        served: tuple[HPS, np.ndarray, np.ndarray]) -> None:
    hps, keys, vectors = served
    buffer = torch.from_numpy(keys[:64].copy())
    out = torch.empty((64, DIM))
    lookup = hps.bind_lookup("m", 0, buffer, out)
    np.testing.assert_array_equal(out.numpy(), vectors[:64])  # looked up once on binding
    for start in (100, 300, 436):
        buffer.copy_(torch.from_numpy(keys[start:start + 64]))
        lookup()
        want = torch.empty((64, DIM))
        hps.lookup_fromdlpack(buffer, want, "m", 0)
        np.testing.assert_array_equal(out.numpy(), vectors[start:start + 64])
        np.testing.assert_array_equal(out.numpy(), want.numpy())


def test_bad_buffers_and_names_are_refused_when_bound(
        served: tuple[HPS, np.ndarray, np.ndarray]) -> None:
    hps, keys, _ = served
    out = torch.empty((4, DIM))
    with pytest.raises(UnknownModelError):
        hps.bind_lookup("nope", 0, torch.from_numpy(keys[:4].copy()), out)
    with pytest.raises(LookupInputError):  # an output too small for the keys
        hps.bind_lookup("m", 0, torch.from_numpy(keys[:8].copy()), out)


def test_a_bound_lookup_belongs_to_its_thread(
        served: tuple[HPS, np.ndarray, np.ndarray]) -> None:
    hps, keys, _ = served
    lookup = hps.bind_lookup("m", 0, torch.from_numpy(keys[:4].copy()), torch.empty((4, DIM)))
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            lookup()
        except BaseException as exc:  # noqa: BLE001 - carried to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], LookupInputError)
    assert "thread" in str(errors[0])
    lookup()  # its own thread still may


def test_a_reload_is_followed(served: tuple[HPS, np.ndarray, np.ndarray], tmp_path: Path,
                              rng: np.random.Generator) -> None:
    hps, keys, _ = served
    buffer, out = torch.from_numpy(keys[:16].copy()), torch.empty((16, DIM))
    lookup = hps.bind_lookup("m", 0, buffer, out)
    fresh = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    write_table(tmp_path / "t1", keys, fresh)
    hps.server.reload_model("m", [str(tmp_path / "t1")])
    assert hps.server.wait_retired(10.0)
    lookup()  # the retired version's table is gone: the call binds the new one
    np.testing.assert_array_equal(out.numpy(), fresh[:16])
    lookup()
    np.testing.assert_array_equal(out.numpy(), fresh[:16])
