"""The GPU tier: embedding tables in CUDA kernels (cuda/*.cu) loaded through CuPy.

One table concept, three kinds picked by the model's `embedding_cache_type`:

- open.py          which table a model's table gets (dynamic, static, uvm) and its sizing
- table.py         GpuEmbeddingTable: the lookup path the server uses (hits, misses,
                   scatter, inserts); cuda_available()
- fill.py          what fills a table besides misses: the warm-up and the refresh
- device_table.py  DeviceTable: what the kinds share: device memory, streams, ordering,
                   the query launch
- dynamic_cache.py EmbeddingCache: set-associative LRU (murmur3_fmix64 set hash, set codes)
- static_table.py  StaticEmbeddingTable: the whole table on one device, read-only
- uvm_table.py     UvmEmbeddingTable: every key's index on the device, hot rows in GPU
                   memory, the others in mapped host memory (host_memory.py)
- workspace.py     one thread's query buffers: where a query's misses land
- fast_query.py    a query in one compiled call (launch, event, wait), behind a gate that
                   writers close; write_order.py: how writes are ordered after queries
- launch_shape.py  block size, lanes per key, keys in flight, cache hints, as measured
- device_arrays.py keys and rows brought to a table's device for its checked calls
- kernels.py       the one loader of the CUDA sources (RawModules, launches) and the one
                   place compile-time constants are set (-D options: SET_SIZE, EMPTY_KEY, …)
- key_sample.py    samples of looked-up keys copied off the device for the hot-key sketch
- staging.py, host_loops.py, threshold.py, overlap.py, streams.py: the lookup path's
  pinned staging, compiled host loops, hit-rate threshold, host work during the wait,
  and stream identity

Keys and outputs are checked by hps/intake/keys.py, not here. cache_model.py is the NumPy
model of the dynamic cache (`hps plan` replays key logs through it; the GPU tests compare
with it); the uvm table's model is test support (tests/support/uvm_reference.py).

Nothing here imports CuPy at import time: without it, `hps.gpu.table.cuda_available()`
is False and building a table raises MissingExtraError naming the 'gpu' extra.
"""
