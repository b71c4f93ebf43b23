// All-ranks barrier over torch symmetric-memory signal pads, the protocol of
// _SymmetricMemory.barrier (put: CAS 0 -> 1 on the peer's pad [channel * world + rank]; wait: CAS
// 1 -> 0 on the own pad [channel * world + peer]; no signal to itself), so it interoperates with
// torch's barrier on the same handle and channels. Launched from C++
// (csrc/pytorch/async_tp_bindings.cpp) to keep the async-TP pipeline's launches off the Python
// interpreter. A peer that never arrives (a rank died or took another code path) traps after
// kTimeoutNs instead of hanging the job.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace primus_turbo {
namespace {

constexpr uint64_t kTimeoutNs = 300ull * 1000 * 1000 * 1000;

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Spin until *addr == from, then CAS it to `to` (the read loop keeps the atomics off NVLink meanwhile).
__device__ __forceinline__ bool swap_when(unsigned int* addr, unsigned int from, unsigned int to, uint64_t t0) {
    volatile unsigned int* v = addr;
    while (*v != from || atomicCAS_system(addr, from, to) != from) {
        if (now_ns() - t0 > kTimeoutNs) return false;
    }
    return true;
}

__global__ void symm_barrier_kernel(const uint64_t* __restrict__ pads, int channel, int rank, int world) {
    const int peer = threadIdx.x;
    if (peer >= world || peer == rank) return;
    const uint64_t t0 = now_ns();
    // release: the stream's earlier work (copy-engine pushes into the peer) is complete when this
    // kernel starts; the fence orders this thread's view before the signal
    __threadfence_system();
    auto* remote = reinterpret_cast<unsigned int*>(pads[peer]) + channel * world + rank;
    auto* local = reinterpret_cast<unsigned int*>(pads[rank]) + channel * world + peer;
    if (!swap_when(remote, 0u, 1u, t0) || !swap_when(local, 1u, 0u, t0)) {
        printf("[FATAL] primus_turbo symm_barrier: rank %d got no signal from rank %d on channel %d in 300 s\n",
               rank, peer, channel);
        __trap();
    }
    __threadfence_system();  // acquire: the peer's pushes are visible to work after this kernel
}

}  // namespace

cudaError_t symm_barrier_launch(const uint64_t* pads, int channel, int rank, int world, cudaStream_t stream) {
    symm_barrier_kernel<<<1, 32, 0, stream>>>(pads, channel, rank, world);
    return cudaGetLastError();
}

}  // namespace primus_turbo
