"""Probe: why the uvm table's random reads of host rows slow down as the host rows grow.

    python scripts/uvm_host_reads_probe.py [--dim 64] [--keys 20000000] [--small 2000000]

One process, CuPy RawKernels only. Reads `--reads` uniform random rows (1M) of `dim`
float32 from pinned, device-mapped host memory holding a uvm table's host rows (keys / 0.9
rows, the index's load factor) and from a tenth of that, beside the pinned host-to-device
copy of the same run, and prints a table: per variant the median time of one call (CUDA
events), G rows/s and the row bytes as a fraction of the copy's bandwidth. Variants:

    memory   one cudaHostAlloc (mapped) as the uvm table has it; 128 MiB cudaHostAlloc
             slices (HierarchicalKV's slice size for tables of 2-16 GB, core_kernels.cuh
             get_slice_size); an anonymous mapping advised as transparent huge pages and
             registered (hps/gpu/host_memory.py); hugetlbfs pages where the host has them
    order    random (the query kernel's order); sorted by row (HierarchicalKV's hybrid
             find sorts the value addresses before its read kernel) with the sort timed
             in the call; "first tenth" (random rows of the first tenth of the big
             allocation: footprint, not allocation size)
    kernel   g16: 16 lanes per row, 16-byte loads (our query kernel); g16x4: each group
             issues 4 rows' loads before storing (more reads in flight); t4: one thread
             per float (HierarchicalKV's read_kernel); 16B: one 16-byte load per row (the
             per-row cost, whatever the row's bytes)

It also prints the facts that decide address translation: transparent huge pages mode,
hugetlbfs pages, IOMMU groups, virtualisation, driver and PCIe link.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import subprocess
import time

import cupy as cp
import numpy as np

from hps.tools.bench.gpu_uvm import h2d_bandwidth

_MAPPED_PORTABLE = 3  # cudaHostAllocPortable | cudaHostAllocMapped (same bits for Register)
_SLICE = 128 << 20
_HUGE = 2 << 20

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

// Row r's first float4: slices of 2^shift rows each (one slice: shift 31).
__device__ __forceinline__ const float4* row_at(const u64* __restrict__ slices, int shift,
                                                u32 r, int r4) {
    const float4* base = reinterpret_cast<const float4*>(slices[r >> shift]);
    return base + (u64)(r & ((1u << shift) - 1u)) * r4;
}

// 16 lanes per row, 16-byte loads; each group loads U rows before it stores them.
template <int U>
__device__ void gather_g16(const u64* slices, int shift, const u32* rows, const u32* pos,
                           float4* out, long long n, int r4) {
    const int gl = threadIdx.x & 15;
    const long long g = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 4;
    const long long ng = ((long long)gridDim.x * blockDim.x) >> 4;
    for (long long base = g * U; base < n; base += ng * U) {
        float4 v[U][4];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long i = base + u;
            if (i < n) {
                const float4* src = row_at(slices, shift, rows[i], r4);
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    if (gl + 16 * c < r4) v[u][c] = src[gl + 16 * c];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long i = base + u;
            if (i < n) {
                const long long p = pos ? pos[i] : i;
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    if (gl + 16 * c < r4) out[p * r4 + gl + 16 * c] = v[u][c];
            }
        }
    }
}

extern "C" __global__ void g16(const u64* slices, int shift, const u32* rows, const u32* pos,
                               float4* out, long long n, int r4) {
    gather_g16<1>(slices, shift, rows, pos, out, n, r4);
}

extern "C" __global__ void g16x4(const u64* slices, int shift, const u32* rows,
                                 const u32* pos, float4* out, long long n, int r4) {
    gather_g16<4>(slices, shift, rows, pos, out, n, r4);
}

// One thread per float (read_kernel's shape).
extern "C" __global__ void t4(const u64* slices, int shift, const u32* rows, const u32* pos,
                              float* out, long long n, int r4) {
    const int dim = r4 * 4;
    const long long total = n * dim;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const long long i = t / dim;
        const int d = (int)(t - i * dim);
        const float* src = reinterpret_cast<const float*>(row_at(slices, shift, rows[i], r4));
        const long long p = pos ? pos[i] : i;
        out[p * dim + d] = src[d];
    }
}

// One 16-byte load per row (lane 0 of a 16-lane group reads the row's first float4).
extern "C" __global__ void one16(const u64* slices, int shift, const u32* rows,
                                 const u32* pos, float4* out, long long n, int r4) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nt = (long long)gridDim.x * blockDim.x;
    for (long long i = t; i < n; i += nt) out[i * r4] = row_at(slices, shift, rows[i], r4)[0];
}
"""


class Host:
    """Pinned, mapped host memory for `rows` rows of `row_bytes`, in slices of 2^shift
    rows (one slice when slice_bytes is None)."""

    def __init__(self, kind: str, rows: int, row_bytes: int, slice_bytes: int | None = None):
        self.kind, self.rows = kind, rows
        self._freed: list = []
        per = rows if slice_bytes is None else slice_bytes // row_bytes
        self.shift = 31 if slice_bytes is None else int(per).bit_length() - 1
        per = rows if slice_bytes is None else 1 << self.shift
        ptrs = []
        t0 = time.perf_counter()
        self.note = ""
        for start in range(0, rows, per):
            nbytes = min(per, rows - start) * row_bytes
            ptrs.append(self._alloc(kind, nbytes))
        self.alloc_s = time.perf_counter() - t0
        self.slices = cp.asarray(np.array(ptrs, dtype=np.uint64))

    def _alloc(self, kind: str, nbytes: int) -> int:
        rt = cp.cuda.runtime
        if kind == "hostalloc":
            ptr = rt.hostAlloc(nbytes, _MAPPED_PORTABLE)
            self._freed.append(lambda: rt.freeHost(ptr))
            return int(ptr)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if kind == "hugetlb":
            free = _meminfo("HugePages_Free") // 1024 * _meminfo("Hugepagesize")
            if free < nbytes + _HUGE:
                raise MemoryError(f"{free >> 20} MiB of hugetlbfs pages free")
            flags |= getattr(mmap, "MAP_HUGETLB", 0x40000)
        m = mmap.mmap(-1, nbytes + _HUGE, flags=flags)
        anchor = ctypes.c_char.from_buffer(m)
        base = ctypes.addressof(anchor)
        del anchor
        offset = (-base) % _HUGE
        if kind == "thp":
            m.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
        before = _meminfo("AnonHugePages")
        np.frombuffer(m, np.uint8, count=nbytes, offset=offset).fill(1)
        if kind == "thp":
            self.note = f"AnonHugePages +{(_meminfo('AnonHugePages') - before) / 2**30:.2f} GiB"
        rt.hostRegister(base + offset, nbytes, _MAPPED_PORTABLE)
        self._freed.append(lambda: (rt.hostUnregister(base + offset), m.close()))
        attrs = rt.pointerGetAttributes(base + offset)
        return int(attrs.devicePointer) or base + offset

    def close(self) -> None:
        for free in self._freed:
            free()
        self._freed = []


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except Exception as exc:  # a fact we could not read is printed as such
        return f"({exc})"


def facts() -> None:
    print("== host and device facts")
    for label, cmd in (
        ("THP enabled", "cat /sys/kernel/mm/transparent_hugepage/enabled"),
        ("THP defrag", "cat /sys/kernel/mm/transparent_hugepage/defrag"),
        ("hugetlb", "grep -E 'HugePages_(Total|Free)|Hugepagesize' /proc/meminfo | tr -s ' '"),
        ("iommu groups", "ls /sys/kernel/iommu_groups 2>/dev/null | wc -l"),
        ("iommu class", "ls /sys/class/iommu 2>/dev/null"),
        ("cmdline", "cat /proc/cmdline"),
        ("virt", "systemd-detect-virt 2>/dev/null || cat /sys/class/dmi/id/product_name"),
        ("cpu", "grep -m1 'model name' /proc/cpuinfo"),
        ("numa", "ls -d /sys/devices/system/node/node* | wc -l"),
        ("gpu", "nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,"
                "pcie.link.width.current --format=csv,noheader 2>&1 | head -2"),
        ("gpu mem", "nvidia-smi -q 2>/dev/null | grep -iE 'addressing|bar1|iommu|virtuali' "
                    "| tr -s ' ' | head -8 | tr '\\n' ';'"),
    ):
        print(f"  {label:14s} {_sh(cmd)}")
    dev = cp.cuda.Device()
    for name in ("CanUseHostPointerForRegisteredMem", "PageableMemoryAccess",
                 "PageableMemoryAccessUsesHostPageTables", "DirectManagedMemAccessFromHost"):
        try:
            attr = getattr(cp.cuda.runtime, "cudaDevAttr" + name)
            print(f"  {name:40s} {cp.cuda.runtime.deviceGetAttribute(attr, dev.id)}")
        except AttributeError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000_000)
    ap.add_argument("--small", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reads", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--memory", default="hostalloc,slices,thp,hugetlb")
    args = ap.parse_args()
    facts()
    mod = cp.RawModule(code=_SOURCE, options=("-std=c++17",))
    kern = {k: mod.get_function(k) for k in ("g16", "g16x4", "t4", "one16")}
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    dim, r4, row_bytes = args.dim, args.dim // 4, args.dim * 4
    n = args.reads
    out = cp.empty((n, dim), cp.float32)
    bw = h2d_bandwidth()
    print(f"\n== pinned H2D copy (256 MiB): {bw / 1e9:.1f} GB/s")
    print(f"   rows {row_bytes} B, reads {n} per call, median of {args.repeats} calls\n")
    cp.random.seed(0)
    results: list[tuple[str, ...]] = []

    def time_call(fn) -> float:
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        fn()
        times = []
        for _ in range(args.repeats):
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        return statistics.median(times)

    def measure(label: str, host: Host, span: int, order: str, kname: str) -> None:
        rows = cp.random.randint(0, span, n).astype(cp.uint32)
        slices, shift = host.slices, np.int32(host.shift)
        grid = sms * 32
        region_shift = (_HUGE // row_bytes).bit_length() - 1
        block = 256

        def launch(r, p):
            kern[kname]((grid,), (block,),
                        (slices, shift, r, p, out, np.int64(n), np.int32(r4)))

        def fn():
            if order == "random" or order == "first tenth":
                launch(rows, np.uint64(0))  # pos: none, row i goes to out[i]
            else:  # sorted by row, or only by its 2 MiB region of host memory
                perm = cp.argsort(rows if order == "sorted" else rows >> region_shift)
                perm = perm.astype(cp.uint32)
                launch(rows[perm], perm)
        sec = time_call(fn)
        grows = n / sec / 1e9
        frac = n * row_bytes / sec / bw
        results.append((label, order, kname, f"{sec * 1e3:8.3f}", f"{grows:6.3f}",
                        f"{frac:5.2f}"))
        print(f"  {label:34s} {order:11s} {kname:6s} {sec * 1e3:8.3f} ms {grows:6.3f} G rows/s"
              f" {frac:5.2f} of copy", flush=True)

    big_rows = int(np.ceil(args.keys / 0.9)) + 1
    small_rows = int(np.ceil(args.small / 0.9)) + 1
    gib = big_rows * row_bytes / 2**30
    print(f"== {args.keys} keys: {big_rows} rows, {gib:.2f} GiB; {args.small} keys: "
          f"{small_rows} rows, {small_rows * row_bytes / 2**20:.0f} MiB")
    print(f"  {'memory':34s} {'order':11s} {'kernel':6s} {'ms/call':>8s}    G rows/s   fraction")
    # The small table as the uvm table has it (one allocation): the fast case.
    small = Host("hostalloc", small_rows, row_bytes)
    for order, k in (("random", "g16"), ("random", "one16"), ("sorted", "g16")):
        measure(f"one hostAlloc {small_rows * row_bytes >> 20} MiB", small, small_rows, order, k)
    small.close()
    for kind in args.memory.split(","):
        try:
            host = Host("hostalloc" if kind == "slices" else kind, big_rows, row_bytes,
                        _SLICE if kind == "slices" else None)
        except Exception as exc:
            print(f"  {kind}: not available ({type(exc).__name__}: {exc})", flush=True)
            continue
        label = {"hostalloc": "one hostAlloc", "slices": "128 MiB hostAlloc slices",
                 "thp": "THP mmap + hostRegister", "hugetlb": "hugetlb mmap + hostRegister"}[kind]
        label = f"{label} {gib:.1f} GiB"
        print(f"  -- {label}: allocated in {host.alloc_s:.1f} s {host.note}", flush=True)
        plan = [("random", "g16"), ("sorted", "g16")]
        if kind == "hostalloc":
            plan += [("random", "g16x4"), ("random", "t4"), ("random", "one16"),
                     ("sorted", "t4"), ("sorted", "g16x4")]
            measure(label, host, small_rows, "first tenth", "g16")
            measure(label, host, big_rows, "2MiB region", "g16")
        for order, k in plan:
            measure(label, host, big_rows, order, k)
        host.close()
    print("\n== sort alone (cupy.argsort of 1M uint32 + gather)")
    rows = cp.random.randint(0, big_rows, n).astype(cp.uint32)

    def sort_only():
        perm = cp.argsort(rows).astype(cp.uint32)
        rows[perm]
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    sort_only()
    e0.record()
    for _ in range(5):
        sort_only()
    e1.record()
    e1.synchronize()
    print(f"  {cp.cuda.get_elapsed_time(e0, e1) / 5:.3f} ms per 1M")
    os.environ.get("OUT") and print(f"(log under {os.environ['OUT']})")


if __name__ == "__main__":
    main()
