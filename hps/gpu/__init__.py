"""The GPU tier: embedding caches in CUDA kernels (cuda/*.cu) loaded through CuPy.

- kernels.py       the one loader of the CUDA sources (RawModules, -D constants, launches)
- cache.py         EmbeddingCache: set-associative LRU cache on one device
- static_table.py  StaticEmbeddingTable: the whole table on one device, read-only
- reference.py     a NumPy model of EmbeddingCache, for the GPU tests
- lookup.py        GpuEmbeddingTable: the lookup path the server uses; cuda_available()

Nothing here imports CuPy at import time: without it, `hps.gpu.lookup.cuda_available()`
is False and building a cache raises MissingExtraError naming the 'gpu' extra.
"""
