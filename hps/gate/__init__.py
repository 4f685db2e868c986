"""The load gate: what a model version must pass before it serves.

Every load and reload streams each table's rows through a `TableGate` (table_gate.py)
on their way to the tiers: finite values, width, repeated keys, its size (no keys, or
far fewer than the served version's), and for a reload the drift of row norms and keys
against the version served now (drift.py), each within the limits of the config's
`validation` section (settings.py). A version that fails raises
`LoadGateError` (verdict.py) and is not swapped in; its `GateVerdict` says which check,
with what figure, past which limit. `hps validate` runs the same gate on files offline.

    settings.py    ValidationConfig (the `validation` section), effective()
    table_gate.py  TableGate: the checks on a table's stream; width_refusal
    key_set.py     compiled: the set of keys seen, the hash that picks the drift sample
    drift.py       norms and churn against the served rows (ServedRows, TierRows, FileRows)
    verdict.py     Finding, GateVerdict, LoadGateError, GateLedger (counts for /metrics)
    digest.py      a version's digest: its rows at the sampled keys (rollbacks known by it)

The package imports nothing itself: hps.config reads settings.py without loading the
compiled kernels of key_set.py.
"""

