"""Declared signatures compiled at their first use: only what is called is compiled, in
the declared types only, from Python and from other compiled functions, and each compile
is reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hps.runtime.compile_on_use import CompileEvent, compile_events
from hps.runtime.compiled import array, holding_gil, kernel, types

_INTS = array(np.int64)
_FLOATS = array(np.float64)


@kernel([types.int64(_INTS, types.uint32), types.float64(_FLOATS, types.uint32)])
def total_of_first(values: np.ndarray, count: int) -> float:
    total = values[0] - values[0]
    for i in range(min(count, values.size)):
        total += values[i]
    return total


@kernel([types.int64(_INTS)])
def first_of(values: np.ndarray) -> int:
    return values[0]  # type: ignore[no-any-return]


@holding_gil([types.int64(_INTS)])
def first_of_held(values: np.ndarray) -> int:
    return first_of(values)  # type: ignore[no-any-return]


@kernel([types.int64(_INTS)])
def size_of(values: np.ndarray) -> int:
    return values.size


@kernel([types.int64(_INTS)])
def last_of(values: np.ndarray) -> int:
    return values[-1]  # type: ignore[no-any-return]


def test_nothing_is_compiled_before_a_call() -> None:
    assert len(last_of.declared) == 1 and not last_of.signatures
    assert last_of(np.arange(5)) == 4
    assert len(last_of.signatures) == 1


def test_each_declared_signature_is_compiled_at_its_own_first_use() -> None:
    """Integers compile the int64 version only; floats then the float64 one; a Python
    int for the uint32 count is cast as njit casts it, with nothing more compiled."""
    assert total_of_first(np.arange(10), 4) == 6
    assert [str(s[0].dtype) for s in total_of_first.signatures] == ["int64"]
    assert total_of_first(np.arange(10, dtype=np.float64) / 2, 3) == 1.5
    assert len(total_of_first.signatures) == 2
    for _ in range(3):
        assert total_of_first(np.arange(10), np.int64(2)) == 1
    assert len(total_of_first.signatures) == 2


def test_undeclared_types_raise_type_error_and_compile_nothing() -> None:
    with pytest.raises(TypeError, match="No matching definition"):
        size_of(np.arange(4, dtype=np.int32))
    with pytest.raises(TypeError):
        size_of(np.arange(8)[::2])  # not C-contiguous: the declared arrays are
    assert all(str(s[0].dtype) == "int64" for s in size_of.signatures)
    with pytest.raises(TypeError, match="compiled for .* only"):
        size_of.compile((types.float32[::1],))


def test_a_compiled_caller_compiles_the_callee_it_calls(tmp_path: Path) -> None:
    """In a fresh cache folder (a cached caller holds its callee's code: nothing to
    compile then), compiling the GIL-holding twin compiles the kernel it calls."""
    code = ("import numpy as np; from tests.runtime.test_compile_on_use import first_of, "
            "first_of_held as held; assert not first_of.signatures; "
            "print(held(np.arange(6) + 3), len(first_of.signatures), len(held.signatures))")
    assert _run(code, tmp_path) == "3 1 1"


def test_compiles_are_reported_with_their_cache_state(tmp_path: Path) -> None:
    """In a fresh cache folder the first call's compile is reported as compiled; a second
    process reads it from the cache and says so, from the compile's start on (a listener
    never takes a slow read for a compile)."""
    code = ("import numpy as np; from hps.runtime.compile_on_use import compile_events; "
            "from tests.runtime.test_compile_on_use import size_of; events = []; "
            "with_ = compile_events(events.append); with_.__enter__(); "
            "size_of(np.arange(3)); size_of(np.arange(4)); "
            "print([(e.function.rpartition('.')[2], e.seconds is None, e.from_cache) "
            "for e in events])")
    runs = [_run(code, tmp_path) for _ in range(2)]
    assert runs == ["[('size_of', True, False), ('size_of', False, False)]",
                    "[('size_of', True, True), ('size_of', False, True)]"]


def _run(code: str, cache: Path) -> str:
    """What `code` prints, run in a fresh process caching into `cache`."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300,
                          capture_output=True, text=True, cwd=Path(__file__).parents[2]
                          ).stdout.strip()


def test_listeners_hear_only_while_installed() -> None:
    events: list[CompileEvent] = []

    @kernel([types.int64(types.int64)])
    def plus_one(x: int) -> int:
        return x + 1

    with compile_events(events.append):
        assert plus_one(1) == 2
    assert [e.seconds is None for e in events] == [True, False]
    assert events[1].function.endswith("plus_one") and events[1].seconds is not None
    assert events[1].seconds >= 0 and "int64" in events[1].signature
