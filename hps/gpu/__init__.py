"""The GPU tier: embedding caches in CUDA kernels (cuda/*.cu) loaded through CuPy.

- kernels.py       the one loader of the CUDA sources (RawModules, launches) and the one
                   place compile-time constants are set (-D options: SET_SIZE, EMPTY_KEY, …)
- device_table.py  DeviceTable: device memory, streams, query workspaces, kernel launches
- cache.py         cache policy: EmbeddingCache (set-associative LRU, murmur3_fmix64 set
                   hash, set codes), which table a model gets (dynamic/static/uvm), warm-up
- static_table.py  StaticEmbeddingTable: the whole table on one device, read-only
- reference.py     a NumPy model of EmbeddingCache, for the GPU tests
- lookup.py        GpuEmbeddingTable: the lookup path the server uses; cuda_available()

Keys and outputs are checked by hps/intake/keys.py (key_view, output_view), not here.

Nothing here imports CuPy at import time: without it, `hps.gpu.table.cuda_available()`
is False and building a cache raises MissingExtraError naming the 'gpu' extra.
"""
