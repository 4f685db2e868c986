"""A lookup bound to one thread's own keys and output buffers (`HPS.bind_lookup`).

    lookup = hps.bind_lookup("model", 0, keys, out)  # checked as lookup_fromdlpack checks,
                                                     # and a first lookup of `keys`
    keys.copy_(next_batch)                           # the thread's next keys, in place
    lookup()                                         # their vectors into `out`

Why: a model server's caller threads (Triton instances, TorchServe workers) each keep
their own key and output buffers and call the lookup from their own thread and stream.
`lookup_fromdlpack` resolves the model, its served version and the table, reads both
arrays and waits for its kernel's miss count with the GIL held, so N such threads get
about one thread's keys/s. A bound lookup resolves the model and the table once; each
call reads the two arrays (hps/intake/keys.py `device_pair`: addresses, sizes, dtypes,
device, the current stream), holds the served version, and runs the query's launch and
its wait with the GIL released (DeviceTable.fast_query), as torch's operators hold it only
to read their arguments. Misses, a closed gate (a write pending), arrays of another shape,
type or device, and tables without a GPU cache take `lookup_into`, which serves and
checks as `lookup_fromdlpack` does. A reload is followed: the next call binds the new
version.

A bound lookup belongs to the thread that made it (its workspace is that thread's);
another thread's call raises LookupInputError.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from hps.errors import LookupInputError
from hps.intake.keys import device_pair

if TYPE_CHECKING:
    from hps.server.parameter_server import HierarchicalParameterServer


class BoundLookup:
    """`lookup_fromdlpack(keys, out, model, table)` of one thread's own buffers, bound once
    (see the module docstring). Call it to look up the keys `keys` holds now."""

    def __init__(self, server: HierarchicalParameterServer, model: str, table: int | str,
                 keys: Any, out: Any) -> None:
        self._server, self._model, self._table = server, model, table
        self._keys, self._out = keys, out
        self._thread = threading.get_ident()
        self._gpu: Any = None
        self._rebind()

    def _rebind(self) -> None:
        """One lookup through `lookup_into` (every check; binds the fast launch of this
        thread's workspace), then what the calls need: the served version, its GPU table
        of the arrays' device, and the arrays' form."""
        self._server.lookup_into(self._model, self._table, self._keys, self._out)
        self._gpu = None
        pair = device_pair(self._keys, self._out)
        loaded = self._server.registry.acquire(self._model)
        try:
            table = loaded.table(self._table)
            gpu = table.gpu.get(pair[4]) if pair is not None and table.gpu else None
        finally:
            loaded.refs.release()
        if gpu is None or pair is None:
            return  # every call through lookup_into
        self._loaded, self._sample = loaded, table.hot_sample
        self._form = (pair[1], pair[3], pair[4], pair[6])  # keys, output size, device, type
        self._gpu = gpu

    def __call__(self) -> None:
        if threading.get_ident() != self._thread:
            raise LookupInputError(
                "a bound lookup serves the thread that made it (its buffers and workspace "
                "are that thread's); bind one per thread with HPS.bind_lookup")
        gpu = self._gpu
        if gpu is None:
            self._server.lookup_into(self._model, self._table, self._keys, self._out)
            return
        loaded = self._loaded
        if not loaded.refs.acquire():  # a reload retired the bound version
            self._rebind()
            return
        try:
            pair = device_pair(self._keys, self._out)
            if pair is None or (pair[1], pair[3], pair[4], pair[6]) != self._form:
                self._server.lookup_into(self._model, self._table, self._keys, self._out)
                return  # changed arrays: checked (and refused or served) as any call
            keys_ptr, n, out_ptr, _, _, stream, out_type = pair
            misses = gpu.fast_lookup(keys_ptr, n, out_ptr, stream, out_type)
            if misses != 0:  # misses to serve, or the locked path's turn
                gpu.lookup_contiguous(keys_ptr, n, out_ptr, stream, out_type,
                                      misses if misses > 0 else None)
            sample = self._sample
            if sample is not None and not next(sample.calls) & sample.mask:
                sample.device_keys(keys_ptr, n, pair[4], stream)
        finally:
            loaded.refs.release()
