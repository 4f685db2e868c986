"""hps/intake/keys.py's device_pair on CUDA arrays: the common case (int64 keys, a float32,
float16 or bfloat16 output, both contiguous on one device, one producer) read as what it
is, and every deviation left to the general path; a public call through it checks sizes,
batch limits and the output types the table allows as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from hps.errors import BatchTooLargeError, OutputBufferError
from hps.intake.keys import device_pair

pytestmark = pytest.mark.gpu


def test_each_producer_pair_is_read_as_it_is(cp: Any) -> None:
    import torch
    import torch.utils.dlpack as tdl

    keys = torch.arange(6, dtype=torch.int64, device="cuda")
    out = torch.zeros((6, 4), device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    assert device_pair(keys, out) == (keys.data_ptr(), 6, out.data_ptr(), 24, 0, stream, 0)
    ck, co = cp.arange(6, dtype=cp.int64), cp.zeros((3, 8), cp.float32)
    cupy_stream = cp.cuda.get_current_stream().ptr
    assert device_pair(ck, co) == (ck.data.ptr, 6, co.data.ptr, 24, 0, cupy_stream, 0)
    kc, oc = tdl.to_dlpack(keys.view(2, 3)), tdl.to_dlpack(out)
    assert device_pair(kc, oc) == (keys.data_ptr(), 6, out.data_ptr(), 24, 0, cupy_stream, 0)


def test_16_bit_outputs_are_read_with_their_type(cp: Any) -> None:
    import torch
    import torch.utils.dlpack as tdl

    keys = torch.arange(6, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    cupy_stream = cp.cuda.get_current_stream().ptr
    for dtype, code in ((torch.float16, 1), (torch.bfloat16, 2)):
        out = torch.zeros((6, 4), dtype=dtype, device="cuda")
        assert device_pair(keys, out) == (keys.data_ptr(), 6, out.data_ptr(), 24, 0, stream,
                                          code)
        assert device_pair(tdl.to_dlpack(keys), tdl.to_dlpack(out)) == (
            keys.data_ptr(), 6, out.data_ptr(), 24, 0, cupy_stream, code)
    ck, co = cp.arange(6, dtype=cp.int64), cp.zeros((6, 4), cp.float16)
    assert device_pair(ck, co) == (ck.data.ptr, 6, co.data.ptr, 24, 0, cupy_stream, 1)


def test_every_other_case_goes_to_the_general_path(cp: Any) -> None:
    import torch

    keys = torch.arange(6, dtype=torch.int64, device="cuda")
    out = torch.zeros((6, 4), device="cuda")
    others = {
        "int32 keys": (keys.to(torch.int32), out),
        "float64 output": (keys, out.double()),
        "int16 output": (keys, out.to(torch.int16)),
        "cupy uint16 output": (cp.arange(6), cp.zeros((6, 4), cp.uint16)),
        "strided keys": (torch.arange(12, device="cuda")[::2], out),
        "strided output": (keys, torch.zeros((6, 8), device="cuda")[:, :4]),
        "host keys": (keys.cpu(), out),
        "host output": (keys, out.cpu()),
        "mixed producers": (keys, cp.zeros((6, 4), cp.float32)),
        "NumPy": (np.arange(6), np.zeros((6, 4), np.float32)),
        "cupy uint64 keys": (cp.arange(6, dtype=cp.uint64), cp.zeros((6, 4), cp.float32)),
        "cupy transposed output": (cp.arange(6), cp.zeros((4, 6), cp.float32).T),
    }
    if torch.cuda.device_count() > 1:
        others["devices differ"] = (keys, out.to("cuda:1"))
    for name, (k, o) in others.items():
        assert device_pair(k, o) is None, name


def test_public_calls_through_it_keep_their_checks(cp: Any, tmp_path: Path) -> None:
    import torch

    rng = np.random.default_rng(3)
    keys = rng.choice(2**40, 5000, replace=False).astype(np.int64)
    rows = rng.standard_normal((5000, 8)).astype(np.float32)
    write_sparse_model(tmp_path / "t0", keys, rows)
    config = {"supportlonglong": True, "models": [{
        "model": "m", "sparse_files": [str(tmp_path / "t0")],
        "embedding_vecsize_per_table": [8], "maxnum_catfeature_query_per_table_per_sample": [64],
        "default_value_for_each_table": [0.0], "deployed_device_list": [0], "max_batch_size": 1,
        "gpucache": True, "embedding_cache_type": "static"}]}
    with HPS(config) as hps:
        tk = torch.as_tensor(keys[:64], device="cuda")
        out = torch.full((64, 8), np.nan, device="cuda")
        hps.lookup_fromdlpack(tk, out, "m", 0)
        np.testing.assert_array_equal(out.cpu().numpy(), rows[:64])
        out.fill_(np.nan)
        hps.lookup_fromdlpack(tk, out, "m", 0, 0)  # HugeCTR's callers name the device
        np.testing.assert_array_equal(out.cpu().numpy(), rows[:64])
        small = torch.full((63, 8), np.nan, device="cuda")
        with pytest.raises(OutputBufferError):
            hps.lookup_fromdlpack(tk, small, "m", 0)
        assert small.isnan().all(), "a refused call wrote into the output"
        with pytest.raises(BatchTooLargeError):
            hps.lookup_fromdlpack(torch.as_tensor(keys[:65], device="cuda"),
                                  torch.empty((65, 8), device="cuda"), "m", 0)
        empty = torch.empty((0,), dtype=torch.int64, device="cuda")
        hps.lookup_fromdlpack(empty, torch.empty((0, 8), device="cuda"), "m", 0)


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_16_bit_public_calls_through_it(cp: Any, tmp_path: Path, storage: str) -> None:
    """A float16 / bfloat16 table's own outputs take the common case and get the stored
    bits; the other 16-bit type, or a 16-bit output of a float32 table, is refused as
    before (the general path names the dtypes allowed) and nothing is written."""
    import torch

    from hps.rows.storage_types import encode

    rng = np.random.default_rng(5)
    keys = rng.choice(2**40, 5000, replace=False).astype(np.int64)
    rows = rng.standard_normal((5000, 8)).astype(np.float32)
    write_sparse_model(tmp_path / "t0", keys, rows)
    models = []
    for name, dtype in (("m", storage), ("plain", "float32")):
        models.append({
            "model": name, "sparse_files": [str(tmp_path / "t0")],
            "embedding_vecsize_per_table": [8],
            "maxnum_catfeature_query_per_table_per_sample": [64],
            "default_value_for_each_table": [0.5], "deployed_device_list": [0],
            "max_batch_size": 1, "gpucache": True, "embedding_cache_type": "static",
            "embedding_storage_dtype": dtype})
    own = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    other = torch.bfloat16 if storage == "float16" else torch.float16
    with HPS({"supportlonglong": True, "models": models}) as hps:
        picked = np.concatenate([keys[:60], [-5, 7, 2**41, keys[3]]])  # misses, a repeat
        tk = torch.as_tensor(picked, device="cuda")
        out = torch.full((64, 8), 9.0, dtype=own[storage], device="cuda")
        hps.lookup_fromdlpack(tk, out, "m", 0)
        want = encode(storage, rows[np.r_[0:60, 0, 0, 0, 3]]).view(np.uint16).copy()
        want[60:63] = encode(storage, np.full((3, 8), 0.5, np.float32)).view(np.uint16)
        got = out.view(torch.int16).cpu().numpy().view(np.uint16)
        np.testing.assert_array_equal(got, want)
        for model, dtype in (("m", other), ("plain", own[storage])):
            wrong = torch.full((64, 8), 9.0, dtype=dtype, device="cuda")
            with pytest.raises(OutputBufferError, match="float32"):
                hps.lookup_fromdlpack(tk, wrong, model, 0)
            assert (wrong == 9.0).all(), "a refused call wrote into the output"
        short = torch.full((63, 8), 9.0, dtype=own[storage], device="cuda")
        with pytest.raises(OutputBufferError):
            hps.lookup_fromdlpack(tk, short, "m", 0)
        assert (short == 9.0).all()
