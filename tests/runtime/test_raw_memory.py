"""hps/runtime/raw_memory.py: the compiled capsule reader agrees with the ctypes reader on every
capsule shape it takes, and hands the rest back; the spin wait returns what it reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.dlpack as tdl

from hps.intake import array_ref as producers
from hps.runtime import raw_memory

CASES = [
    ((2000,), np.int64), ((7,), np.uint32), ((), np.int64), ((0,), np.int64),
    ((3, 5), np.float32), ((1, 64), np.float16), ((4, 1), np.int32), ((0, 16), np.float32),
    ((2, 3, 4), np.float32),
]


def _ctypes_ref(capsule):
    saved = producers._fast_capsules
    producers._fast_capsules = False
    try:
        return producers.array_ref(capsule, "keys")
    finally:
        producers._fast_capsules = saved


def _same(a, b):
    assert (a.ptr, tuple(a.shape), a.size, a.dtype, a.device, a.contiguous, a.strides,
            a.writable) == (b.ptr, tuple(b.shape), b.size, b.dtype, b.device, b.contiguous,
                            b.strides, b.writable)


def test_the_layout_is_confirmed_on_this_interpreter():
    assert raw_memory.capsules_readable()


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_compiled_reader_agrees_with_ctypes(shape, dtype):
    array = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    for make in (lambda: array.__dlpack__(), lambda: tdl.to_dlpack(torch.from_numpy(array))):
        capsule = make()
        _same(producers.array_ref(capsule, "keys"), _ctypes_ref(make()))


@pytest.mark.parametrize("view", [
    lambda t: t[:, ::2], lambda t: t.t(), lambda t: t[1:, 3:], lambda t: t[::3],
])
def test_strided_and_offset_capsules(view):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensor = view(base)
    ref = producers.array_ref(tdl.to_dlpack(tensor), "output")
    _same(ref, _ctypes_ref(tdl.to_dlpack(tensor)))
    assert ref.ptr == tensor.data_ptr()
    np.testing.assert_array_equal(ref.host_array(), tensor.numpy())


def test_consumed_and_foreign_capsules_keep_their_errors():
    capsule = tdl.to_dlpack(torch.arange(3))
    torch.utils.dlpack.from_dlpack(capsule)
    with pytest.raises(Exception, match="already consumed"):
        producers.array_ref(capsule, "keys")
    versioned = np.arange(3).__dlpack__(max_version=(1, 0))
    ref = producers.array_ref(versioned, "keys")
    np.testing.assert_array_equal(ref.host_array(), np.arange(3))


def test_wait_while_returns_the_first_other_value():
    cell = np.array([-1], dtype=np.int32)
    assert raw_memory.wait_while(cell.ctypes.data, -1, 1000) == -1
    cell[0] = 0
    assert raw_memory.wait_while(cell.ctypes.data, -1, 1000) == 0
    cell[0] = 123
    assert raw_memory.wait_while(cell.ctypes.data, -1, 1) == 123


def test_capsule_pair_takes_only_the_cuda_common_case():
    # host capsules of the right dtypes, and any pair with another dtype, layout or a
    # consumed capsule: device -1 (the GPU tests check the CUDA pairs it accepts)
    keys, out = torch.arange(6), torch.zeros((6, 4))
    pairs = [
        (tdl.to_dlpack(keys), tdl.to_dlpack(out)),
        (tdl.to_dlpack(keys.int()), tdl.to_dlpack(out)),
        (tdl.to_dlpack(keys), tdl.to_dlpack(out.double())),
        (tdl.to_dlpack(keys), tdl.to_dlpack(out.half())),
        (tdl.to_dlpack(keys), tdl.to_dlpack(out.bfloat16())),
        (tdl.to_dlpack(torch.arange(12)[::2]), tdl.to_dlpack(out)),
    ]
    consumed = tdl.to_dlpack(keys)
    torch.from_dlpack(consumed)
    pairs.append((consumed, tdl.to_dlpack(out)))
    for k, o in pairs:
        assert raw_memory.capsule_pair(id(k), id(o), raw_memory.DLTENSOR_NAME)[4] == -1


def test_capsule_pair_knows_torch_dtype_words_of_each_output_type():
    # the words capsule_pair maps to output types 0, 1, 2 are those torch's capsules carry
    out = torch.zeros((2, 4))
    for tensor, word in ((out, raw_memory._DL_FLOAT32), (out.half(), raw_memory._DL_FLOAT16),
                         (out.bfloat16(), raw_memory._DL_BFLOAT16),
                         (torch.arange(3), raw_memory._DL_INT64)):
        capsule = tdl.to_dlpack(tensor)
        assert raw_memory.capsule_fields(id(capsule), raw_memory.DLTENSOR_NAME)[4] == word
