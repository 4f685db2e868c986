"""hps/intake/fast.py without a GPU: host arrays of every producer are never read as the
common CUDA case (they take the general path, which serves and checks them)."""

from __future__ import annotations

import numpy as np
import torch
import torch.utils.dlpack as tdl

from hps.intake.fast import device_pair


def test_host_arrays_and_mixed_producers_are_left_to_the_general_path() -> None:
    keys = torch.arange(6, dtype=torch.int64)
    out = torch.zeros((6, 4))
    assert device_pair(keys, out) is None
    assert device_pair(tdl.to_dlpack(keys), tdl.to_dlpack(out)) is None
    assert device_pair(keys.numpy(), out.numpy()) is None
    assert device_pair(keys, out.numpy()) is None
    assert device_pair([1, 2, 3], np.zeros((3, 4), np.float32)) is None
