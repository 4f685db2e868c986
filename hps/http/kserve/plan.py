"""Planning an inference: the split of KEYS by NUMKEYS over a model's tables, every count
checked before any lookup, and the lookups that write OUTPUT0 in place.

    inputs: KEYS [k0 … | k1 … | …]   NUMKEYS [n0, n1, …]   (fewer entries than tables:
            the tables left out get no keys)
    OUTPUT0: [n0 × width0 floats | n1 × width1 floats | …]

Bad counts (LookupInputError, BatchTooLargeError) are refused before anything is looked
up, so bad input changes nothing. A plan depends only on the model version and NUMKEYS:
each version keeps the plans it has made.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hps.errors import BatchTooLargeError, LookupInputError

if TYPE_CHECKING:
    from hps.server import HierarchicalParameterServer, LoadedModel


@dataclass(frozen=True)
class InferPlan:
    """Where each table's keys and vectors lie in KEYS and OUTPUT0, counts checked."""

    counts: list[int]  # keys per table, in table order
    starts: list[int]  # each table's first key in KEYS (and the end)
    offsets: list[int]  # each table's first float in OUTPUT0 (and its size)
    dims: list[int]  # each table's width

    @property
    def size(self) -> int:
        """OUTPUT0's number of floats."""
        return self.offsets[-1]


#: the plans of each served model version by NUMKEYS: clients send the same counts with
#: every request of a shape, and a plan depends on nothing else. Weak: a retired version's
#: plans go with it. Bounded per version as parse.py's `_LAYOUTS` is.
_PLANS: weakref.WeakKeyDictionary[LoadedModel, dict[tuple[int, ...], InferPlan]] = (
    weakref.WeakKeyDictionary())
_PLANS_MAX = 256


def plan_infer(server: HierarchicalParameterServer, model: str, keys: np.ndarray,
               numkeys: np.ndarray) -> InferPlan:
    """The split of `keys` by `numkeys` over the model's tables in order. Checks every
    count before any lookup (LookupInputError, BatchTooLargeError), so bad input changes
    nothing."""
    loaded = server.model(model)
    counts = tuple(numkeys.tolist())  # one entry per table: plain ints beat ufuncs here
    plans = _PLANS.get(loaded)
    plan = plans.get(counts) if plans is not None else None
    if plan is None:
        plan = _plan(loaded, model, counts)
        if plans is None:
            plans = _PLANS.setdefault(loaded, {})
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[counts] = plan
    if plan.starts[-1] != keys.size:
        raise LookupInputError(f"NUMKEYS adds up to {plan.starts[-1]} keys but KEYS has "
                               f"{keys.size}")
    return plan


def _plan(loaded: LoadedModel, model: str, counts: tuple[int, ...]) -> InferPlan:
    """The plan of `counts` keys per table, each count checked against its table."""
    tables = loaded.tables
    if len(counts) > len(tables):
        raise LookupInputError(f"NUMKEYS has {len(counts)} entries but model {model!r} has "
                               f"{len(tables)} tables")
    if any(c < 0 for c in counts):
        raise LookupInputError("NUMKEYS must not be negative")
    used = tables[:len(counts)]
    for table, count in zip(used, counts, strict=True):
        if count > table.max_keys:
            raise BatchTooLargeError(
                f"{count} keys exceed the limit of {table.max_keys} for table "
                f"{table.name!r} (max_batch_size × maxnum_catfeature_query_per_table_per_sample)")
    dims = [t.dim for t in used]
    return InferPlan(list(counts), list(itertools.accumulate(counts, initial=0)),
                     list(itertools.accumulate(map(operator.mul, counts, dims), initial=0)),
                     dims)


def fill_output(server: HierarchicalParameterServer, model: str, plan: InferPlan,
                keys: np.ndarray, out: np.ndarray) -> None:
    """Write OUTPUT0 into `out` (float32 [plan.size], C-contiguous): each table's vectors
    looked up in place, a lookup per table over an array of keys."""
    if len(plan.counts) == 1:  # one table (the common case): no slices to make
        server.lookup_http(model, 0, keys, out.reshape(plan.counts[0], plan.dims[0]))
        return
    for i, count in enumerate(plan.counts):
        if count:
            rows = out[plan.offsets[i]:plan.offsets[i + 1]].reshape(count, plan.dims[i])
            server.lookup_http(model, i, keys[plan.starts[i]:plan.starts[i + 1]], rows)

