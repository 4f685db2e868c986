"""hps/intake/keys.py: keys and outputs of every producer checked and read as arrays (the
general path), and the GPU shortcut leaving what is not its common case to that path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from hps.errors import KeyTypeError, OutputBufferError
from hps.intake.keys import (
    as_key_array,
    as_output_array,
    device_output_view,
    device_pair,
    key_view,
    output_view,
)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.int16, np.uint64])
def test_integer_keys_are_widened(dtype: type) -> None:
    keys = np.arange(12, dtype=dtype).reshape(3, 4)
    got = as_key_array(keys)
    assert got.dtype == np.int64 and got.shape == (12,)
    assert got.tolist() == list(range(12))


def test_int64_keys_are_not_copied() -> None:
    keys = np.arange(10, dtype=np.int64)
    assert np.shares_memory(as_key_array(keys), keys)


def test_torch_tensor_and_capsule_keys() -> None:
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3) * 7
    assert as_key_array(t).tolist() == [0, 7, 14, 21, 28, 35]
    capsule = to_dlpack(t)
    assert as_key_array(capsule).tolist() == [0, 7, 14, 21, 28, 35]
    # the capsule is not consumed: torch can still import it
    assert from_dlpack(capsule).tolist() == t.tolist()


def test_numpy_capsule_and_strided_keys() -> None:
    base = np.arange(20, dtype=np.int64)
    assert as_key_array(base[::2].__dlpack__()).tolist() == list(range(0, 20, 2))
    transposed = torch.arange(6).reshape(2, 3).t()
    assert as_key_array(transposed).tolist() == transposed.reshape(-1).tolist()


def test_consumed_capsule_is_refused() -> None:
    capsule = to_dlpack(torch.arange(3))
    from_dlpack(capsule)
    with pytest.raises(KeyTypeError, match="already consumed"):
        as_key_array(capsule)


@pytest.mark.parametrize("bad", [np.ones(3, np.float32), torch.ones(3), np.array(["a"]),
                                 np.ones(3, bool)])
def test_non_integer_keys(bad: object) -> None:
    with pytest.raises(KeyTypeError, match="keys must be integers"):
        as_key_array(bad)


def test_unsupported_object() -> None:
    with pytest.raises(KeyTypeError, match="expected a NumPy/CuPy array"):
        as_key_array(object())


def test_output_view_is_written_in_place_through_capsule() -> None:
    out = torch.zeros(1, 12)  # HugeCTR's tests pass (1, n × dim)
    capsule = to_dlpack(out)
    view = as_output_array(capsule, 3, 4)
    assert view.shape == (3, 4)
    view[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert from_dlpack(capsule).reshape(-1).tolist() == list(range(12))


@pytest.mark.parametrize(
    ("out", "match"),
    [
        (np.zeros((2, 4), np.float64), "must be float32"),
        (np.zeros(7, np.float32), "holds 7 floats but 2 keys × width 4 = 8"),
        (np.zeros((4, 4), np.float32)[:, :2], r"strided output must have shape \[2, 4\]"),
        (torch.zeros(16)[::2], r"strided output must have shape \[2, 4\], got \[8\]"),
    ],
)
def test_bad_outputs(out: object, match: str) -> None:
    with pytest.raises(OutputBufferError, match=match):
        as_output_array(out, 2, 4)


def test_strided_output_of_shape_n_dim_is_written_in_place() -> None:
    base = np.zeros((3, 10), np.float32)
    view = as_output_array(base[:, 2:6], 3, 4)
    view[:] = 1.0
    assert base[:, 2:6].sum() == 12 and base.sum() == 12
    t = torch.zeros(4, 3)
    as_output_array(t.t(), 3, 4)[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert t.t().reshape(-1).tolist() == list(range(12))


def test_read_only_output() -> None:
    out = np.zeros(8, np.float32)
    out.flags.writeable = False
    with pytest.raises(OutputBufferError, match="read-only"):
        as_output_array(out, 2, 4)


# -- arrays already in the GPU tier's form (key_view, output_view) --------------------------


def test_key_view_takes_1d_int64_as_is_and_makes_strided_keys_contiguous() -> None:
    keys = np.arange(5, dtype=np.int64)
    assert key_view(keys) is keys
    strided = np.arange(10, dtype=np.int64)[::2]
    view = key_view(strided)
    assert view.flags.c_contiguous and view.tolist() == [0, 2, 4, 6, 8]


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (np.arange(3, dtype=np.int32), "must be int64, got dtype int32"),
        (np.zeros((3, 1), np.int64), r"must be 1-D, got shape \(3, 1\)"),
        ([1, 2, 3], "NumPy or CuPy array, got list"),
    ],
)
def test_key_view_rejects_other_keys(keys: object, match: str) -> None:
    with pytest.raises(KeyTypeError, match=match):
        key_view(keys)


def test_output_view_checks_dtype_shape_layout_and_writability() -> None:
    out = np.zeros((3, 4), np.float32)
    assert output_view(out, 3, 4) is out
    with pytest.raises(OutputBufferError, match="float32"):
        output_view(np.zeros((3, 4), np.float64), 3, 4)
    with pytest.raises(OutputBufferError, match=r"shape \[3, 4\], got \[3, 5\]"):
        output_view(np.zeros((3, 5), np.float32), 3, 4)
    with pytest.raises(OutputBufferError, match="C-contiguous"):
        output_view(np.zeros((4, 3), np.float32).T, 3, 4)
    out.flags.writeable = False
    with pytest.raises(OutputBufferError, match="read-only"):
        output_view(out, 3, 4)
    with pytest.raises(OutputBufferError, match="NumPy or CuPy array, got list"):
        output_view([[0.0] * 4] * 3, 3, 4)


def test_device_output_view_wants_a_cupy_array() -> None:
    with pytest.raises(OutputBufferError, match="CuPy array on device 0, got ndarray"):
        device_output_view(np.zeros((3, 4), np.float32), 3, 4, 0)


def test_device_pair_leaves_host_arrays_and_mixed_producers_to_the_general_path() -> None:
    """Without a GPU: host arrays of every producer are never read as the common CUDA
    case (they take the general path, which serves and checks them)."""
    keys = torch.arange(6, dtype=torch.int64)
    out = torch.zeros((6, 4))
    assert device_pair(keys, out) is None
    assert device_pair(to_dlpack(keys), to_dlpack(out)) is None
    assert device_pair(keys.numpy(), out.numpy()) is None
    assert device_pair(keys, out.numpy()) is None
    assert device_pair([1, 2, 3], np.zeros((3, 4), np.float32)) is None
