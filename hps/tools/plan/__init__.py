"""`hps plan`'s planner: what a table needs in every tier, and the hit rate its GPU cache
would have on a key log, before anything is bought or loaded. No GPU needed.

- tables.py     the tables planned: from a config (sizes from the files) or the command line
- memory.py     every tier's bytes for a table, by storage type, from the tiers' own sizing
- estimates.py  Redis's used_memory and RocksDB's files, told from their layouts
- key_log.py    a key log (raw int64, .npy, the hot-set JSON) as one int64 array
- hit_rates.py  the key log replayed through the NumPy model of the dynamic cache
                (hps/gpu/cache_model.py) at several cache sizes
- curve.py      the hit-rate curve as a picture (the `plot` extra)

The command itself (options, output) is hps/tools/cli/plan.py.
"""
