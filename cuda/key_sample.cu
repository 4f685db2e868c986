// The hot-key sampler's copy (hps/gpu/key_sample.py): m <= blockDim.x keys of `itemsize`
// bytes (4 or 8), one every `step` bytes from `src`, packed into a slot of mapped pinned
// host memory, then `ticket` written to the slot's ticket word. The host finds a finished
// sample by reading that word: no event to record or query, and the launch goes through
// the driver with the GIL held (a runtime copy and event record cost ~17 µs of host time
// a sampled call on the H100, each releasing the GIL).

extern "C" __global__ void sample_keys(const char* __restrict__ src, const long long step,
                                       const int itemsize, const int m,
                                       char* __restrict__ dst,
                                       unsigned long long* __restrict__ ticket_at,
                                       const unsigned long long ticket) {
    const int i = threadIdx.x;
    if (i < m) {
        if (itemsize == 8) {
            reinterpret_cast<unsigned long long*>(dst)[i] =
                *reinterpret_cast<const unsigned long long*>(src + i * step);
        } else {
            reinterpret_cast<unsigned int*>(dst)[i] =
                *reinterpret_cast<const unsigned int*>(src + i * step);
        }
        __threadfence_system();  // this thread's key reaches the host before the ticket
    }
    __syncthreads();
    if (i == 0) {
        *reinterpret_cast<volatile unsigned long long*>(ticket_at) = ticket;
    }
}
