"""Compiled functions with declared signatures, each signature compiled at its first use.

numba's `njit([signatures])` compiles every signature when the module is imported: a
process that serves float32 rows from the hash map also compiled the float16, bfloat16
and int8 decodes, the GPU staging loops and the kernels of tiers it never opens (28 s of
the first `hps demo`'s 31 s on a 2-core machine, most of it for functions the demo never
calls). `OnUseDispatcher` keeps njit's contract and moves the work to the first call:

- only the declared signatures are ever compiled: a call (from Python or from another
  compiled function) is matched against them by numba's own overload resolution, the
  one it matches is compiled (or read from numba's disk cache) once, and a call that
  matches none raises TypeError, as njit's dispatcher with compilation disabled does;
- later calls are resolved by numba's C dispatcher alone, with unsafe scalar casts
  allowed as after njit (compilation stays disabled between first uses: the C
  dispatcher asks `_search_new_conversions` when nothing compiled matches, which is
  where the next declared signature is compiled).

`compile_events(listener)` reports each compile (start and end, and whether it came from
numba's cache) to a listener while it is installed: what the command line shows as
progress. The start already says whether numba's cache lists the signature (a read of
milliseconds, or a second on a loaded machine, not a compile of seconds), so that a
listener never calls a slow read a compile. `loading()` marks a block as a model load's:
the events of compiles made while one runs say so (`during_load`; any thread's: a load's
helpers compile on pools of their own), which tells a load's compiles (its warm-up runs
each lookup path once: hps/server/warm_paths.py) from those of lookups served after
ready, which the HTTP server counts apart (`hps_compiles_total`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# isort: split
import hps.runtime.numba_cache  # noqa: F401  (numba's cache folder is set before numba loads)

# isort: split
from numba.core import sigutils, typing
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import CPUDispatcher


@dataclass(frozen=True)
class CompileEvent:
    """One compile of one signature: `seconds` None while it runs; `from_cache` whether
    numba's disk cache held it (then it took milliseconds): at the end, whether the
    compile read it from there; at the start, whether the cache's index lists it (the
    read that follows fails over to a compile only for a cache file gone meanwhile)."""

    function: str  # module.qualname
    signature: str
    seconds: float | None = None
    from_cache: bool = False
    #: compiled while a `loading()` block ran (a model load, its warm-up among it)
    during_load: bool = False


#: the listeners `compile_events` installed, called under numba's compiler lock
_listeners: list[Callable[[CompileEvent], None]] = []
_listeners_lock = threading.Lock()
#: the `loading()` blocks running now, in any thread
_loads = [0]


@contextlib.contextmanager
def compile_events(listener: Callable[[CompileEvent], None]) -> Iterator[None]:
    """Call `listener` with a CompileEvent when a compile starts and when it ends, for
    as long as the block runs (any thread's compiles)."""
    with _listeners_lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _listeners_lock:
            _listeners.remove(listener)


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Mark the compiles made while the block runs as a model load's (see the module)."""
    with _listeners_lock:
        _loads[0] += 1
    try:
        yield
    finally:
        with _listeners_lock:
            _loads[0] -= 1


def _tell(event: CompileEvent) -> None:
    for listener in list(_listeners):
        listener(event)


class OnUseDispatcher(CPUDispatcher):
    """numba's CPU dispatcher, compiling each of `declared` at its first use (see the
    module's docstring). Made by `on_use`."""

    declared: tuple[Any, ...] = ()

    def compile(self, sig: Any) -> Any:
        """The entry point of the declared signature `sig`'s argument types match
        (compiled or read from the cache now if needed); TypeError when none does."""
        args, _ = sigutils.normalize_signature(sig)
        name = f"{self.py_func.__module__}.{self.py_func.__qualname__}"
        chosen = self.typingctx.resolve_overload(name, self.declared, tuple(args), {})
        if chosen is None:
            declared = "; ".join(str(s) for s in self.declared)
            raise TypeError(f"{name} is compiled for ({declared}) only, not for "
                            f"({', '.join(map(str, args))})")
        existing = self.overloads.get(tuple(chosen.args))
        if existing is not None:
            return existing.entry_point
        with global_compiler_lock:  # one flip of the flag at a time (it is reentrant)
            existing = self.overloads.get(tuple(chosen.args))
            if existing is not None:  # another thread compiled it while this one waited
                return existing.entry_point
            started, misses = time.perf_counter(), sum(self._cache_misses.values())
            during_load = _loads[0] > 0
            _tell(CompileEvent(name, str(chosen), from_cache=self._listed(chosen),
                               during_load=during_load))
            was = self._can_compile
            self._can_compile = True
            try:
                entry = super().compile(chosen)
            finally:
                self._can_compile = was
            _tell(CompileEvent(name, str(chosen), time.perf_counter() - started,
                               from_cache=sum(self._cache_misses.values()) == misses,
                               during_load=during_load))
        return entry

    def _listed(self, sig: Any) -> bool:
        """Whether numba's disk cache lists `sig` for this code (its index file, read
        the way numba's own load reads it); False when it cannot tell."""
        cache = self._cache
        try:
            key = cache._index_key(sig, self.targetctx.codegen())
            return key in cache._cache_file._load_index()
        except Exception:  # noqa: BLE001 - numba's private API: a guess, never a failure
            return False

    def _search_new_conversions(self, *args: Any, **kws: Any) -> bool:
        # numba's C dispatcher calls this when no compiled signature takes `args`, and
        # tries again when it returns True: compile the declared one they match first
        types = tuple(self.typeof_pyval(a) for a in args)
        with contextlib.suppress(TypeError):  # matches none: numba's own error follows
            self.compile(types)
        return bool(super()._search_new_conversions(*args, **kws))

    def get_call_template(self, args: Any, kws: Any) -> Any:
        # another compiled function calls this one: compile what its argument types
        # match before numba types the call from the compiled signatures
        _, folded = self._compiler.fold_argument_types(args, kws)
        with contextlib.suppress(TypeError):
            self.compile(tuple(folded))
        return super().get_call_template(args, kws)


def _signature(declared: Any) -> Any:
    """A declared signature (a numba Signature or its text) as a typing Signature."""
    args, return_type = sigutils.normalize_signature(declared)
    return typing.signature(return_type, *args)


def on_use(fn: Callable[..., Any], signatures: Sequence[Any], **options: Any) -> Any:
    """`fn` compiled for `signatures` at their first use, with numba's disk cache and
    `options` (njit's: nogil, ...); nothing is compiled now."""
    dispatcher = OnUseDispatcher(py_func=fn, locals={},
                                 targetoptions={"nopython": True, "boundscheck": None,
                                                **options})
    dispatcher.declared = tuple(_signature(s) for s in signatures)
    dispatcher.enable_caching()
    dispatcher._can_compile = False  # (disable_compile asserts a compiled signature)
    return dispatcher
