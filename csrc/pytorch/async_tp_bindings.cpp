// The TURBO GEMM + reduce-scatter push pipeline (bf16/fp16/fp32), enqueued from C++.
//
//   torch.ops.primus_turbo_cpp_extension.async_tp_rs_fused(a, b, out, stage, remote, local, bounds,
//       signal_pads, rank, world, side_stream_id, side_device_index, side_device_type, scale, fuse_own) -> ()
//
// The same schedule as pipelined_produce_reduce_scatter(accumulate=...) in
// primus_turbo/pytorch/kernels/async_tp/symm_mem_pipeline.py, which prepares every argument:
//   a [world * m, K], b [K, N], out [m, N] (this rank's result), stage [world - 1, m, N] (scratch),
//   remote[i] / local[i]: [m, N] views of peer i's slot for this rank / this rank's slot for peer i
//   (peer i = (rank + 1 + i) % world), bounds: row-block starts plus m, signal_pads: the handle's
//   signal_pad_ptrs_dev, side stream: torch.cuda.Stream's (stream_id, device_index, device_type),
//   scale: 1 (sum) or 1 / world (avg).
// compute: ev0, GEMM of every peer block per row block (event each), then
//          fuse_own: per row block wait(arrived_j), own block j computed onto the peers' partials
//                    (addmm epilogue: no extra pass, but 2 x P GEMM launches)
//          else:     the own block as one GEMM into out (not waiting for any push), wait(done), out += the
//                    peers' partials (one elementwise pass; P + 1 GEMM launches: for host-bound calls)
// side:    wait(ev0), barrier(0), per row block: wait(produced_j), push to every peer, barrier(j + 1)
// At ~0.3 ms of GEMM per call the Python version of this schedule is bound by its ~60 launches.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace primus_turbo {
cudaError_t symm_barrier_launch(const uint64_t* pads, int channel, int rank, int world, cudaStream_t stream);
}  // namespace primus_turbo

namespace {

using at::Tensor;

constexpr int kMaxWorld = 32;     // one barrier thread per rank
constexpr int kMaxChannels = 16;  // channel 0 opens the call, 1..P signal row blocks

// Reusable events per device: a wait captures the event's latest record when it is enqueued, and every
// use within a call is enqueued before the next call records the event again. Calls on one device are
// assumed to come from one host thread at a time (the pool may grow between calls, as the Python
// schedule's pool assumes too).
cudaEvent_t* event_pool(int device, size_t n) {
    static std::mutex mu;
    static std::unordered_map<int, std::vector<cudaEvent_t>> pools;
    std::lock_guard<std::mutex> lock(mu);
    auto& pool = pools[device];
    while (pool.size() < n) {
        cudaEvent_t ev;
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        pool.push_back(ev);
    }
    return pool.data();
}

void async_tp_rs_fused_cuda(const Tensor& a, const Tensor& b, Tensor out, Tensor stage, at::TensorList remote,
                            at::TensorList local, at::IntArrayRef bounds, int64_t signal_pads, int64_t rank,
                            int64_t world, int64_t side_stream_id, int64_t side_device_index,
                            int64_t side_device_type, double scale, bool fuse_own) {
    const int64_t npeers = world - 1;
    const int64_t nparts = static_cast<int64_t>(bounds.size()) - 1;
    const int64_t m = out.size(0);
    TORCH_CHECK(world >= 2 && world <= kMaxWorld && rank >= 0 && rank < world, "async_tp_rs_fused: world=", world,
                " rank=", rank, " (2 <= world <= ", kMaxWorld, ")");
    TORCH_CHECK(nparts >= 1 && nparts < kMaxChannels, "async_tp_rs_fused: 1..", kMaxChannels - 1,
                " row blocks, got ", nparts);
    TORCH_CHECK(bounds.front() == 0 && bounds.back() == m, "async_tp_rs_fused: bounds must run from 0 to ", m);
    TORCH_CHECK(static_cast<int64_t>(remote.size()) == npeers && static_cast<int64_t>(local.size()) == npeers,
                "async_tp_rs_fused: one remote and one local slot per peer");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == world * m && a.size(1) == b.size(0) &&
                    out.dim() == 2 && out.size(1) == b.size(1) && out.is_contiguous(),
                "async_tp_rs_fused: a [world * m, K], b [K, N], contiguous out [m, N]; got ", a.sizes(), " ",
                b.sizes(), " ", out.sizes());
    TORCH_CHECK(stage.is_contiguous() && stage.dim() == 3 && stage.size(0) == npeers && stage.size(1) == m &&
                    stage.size(2) == out.size(1) && stage.scalar_type() == out.scalar_type(),
                "async_tp_rs_fused: stage must be contiguous [world - 1, m, N] of out's dtype");
    for (int64_t i = 0; i < npeers; ++i) {
        TORCH_CHECK(remote[i].is_contiguous() && local[i].is_contiguous() && remote[i].sizes() == out.sizes() &&
                        local[i].sizes() == out.sizes() && remote[i].scalar_type() == out.scalar_type() &&
                        local[i].scalar_type() == out.scalar_type(),
                    "async_tp_rs_fused: slot views must be contiguous with out's shape and dtype");
    }
    const c10::cuda::CUDAGuard guard(out.device());
    const auto compute = c10::cuda::getCurrentCUDAStream();
    const auto side = c10::cuda::CUDAStream::unpack3(side_stream_id, static_cast<c10::DeviceIndex>(side_device_index),
                                                     static_cast<c10::DeviceType>(side_device_type));
    cudaEvent_t* ev = event_pool(out.get_device(), 2 * nparts + 2);  // start, produced_j, arrived_j, done
    const auto* pads = reinterpret_cast<const uint64_t*>(signal_pads);
    const int r = static_cast<int>(rank), w = static_cast<int>(world);
    const int64_t row_bytes = out.size(1) * out.element_size();

    C10_CUDA_CHECK(cudaEventRecord(ev[0], compute.stream()));
    for (int64_t j = 0; j < nparts; ++j) {  // every peer block first, so the pushes start early
        const int64_t r0 = bounds[j], r1 = bounds[j + 1];
        for (int64_t i = 0; i < npeers; ++i) {
            const int64_t peer = (rank + 1 + i) % world;
            Tensor dst = stage.select(0, i).slice(0, r0, r1);
            at::mm_out(dst, a.slice(0, peer * m + r0, peer * m + r1), b);
        }
        C10_CUDA_CHECK(cudaEventRecord(ev[1 + j], compute.stream()));
    }
    C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), ev[0], 0));
    C10_CUDA_CHECK(primus_turbo::symm_barrier_launch(pads, 0, r, w, side.stream()));  // peers done reading
    for (int64_t j = 0; j < nparts; ++j) {
        const int64_t r0 = bounds[j], r1 = bounds[j + 1];
        C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), ev[1 + j], 0));
        for (int64_t i = 0; i < npeers; ++i) {
            auto* src = static_cast<char*>(stage.select(0, i).data_ptr()) + r0 * row_bytes;
            auto* dst = static_cast<char*>(remote[i].data_ptr()) + r0 * row_bytes;
            C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, (r1 - r0) * row_bytes, cudaMemcpyDeviceToDevice, side.stream()));
        }
        C10_CUDA_CHECK(primus_turbo::symm_barrier_launch(pads, static_cast<int>(j + 1), r, w, side.stream()));
        C10_CUDA_CHECK(cudaEventRecord(ev[1 + nparts + j], side.stream()));
    }
    C10_CUDA_CHECK(cudaEventRecord(ev[1 + 2 * nparts], side.stream()));
    if (!fuse_own) {
        at::mm_out(out, a.slice(0, rank * m, (rank + 1) * m), b);
        C10_CUDA_CHECK(cudaStreamWaitEvent(compute.stream(), ev[1 + 2 * nparts], 0));
        for (int64_t i = 0; i < npeers; ++i) out.add_(local[i]);
        if (scale != 1.0) out.mul_(scale);
        return;
    }
    for (int64_t j = 0; j < nparts; ++j) {
        const int64_t r0 = bounds[j], r1 = bounds[j + 1];
        C10_CUDA_CHECK(cudaStreamWaitEvent(compute.stream(), ev[1 + nparts + j], 0));
        Tensor dst = out.slice(0, r0, r1);
        Tensor c = local[0].slice(0, r0, r1);
        if (npeers > 1) {
            at::add_out(dst, c, local[1].slice(0, r0, r1));
            for (int64_t i = 2; i < npeers; ++i) dst.add_(local[i].slice(0, r0, r1));
            c = dst;
        }
        at::addmm_out(dst, c, a.slice(0, rank * m + r0, rank * m + r1), b, scale, scale);
    }
    C10_CUDA_CHECK(cudaStreamWaitEvent(compute.stream(), ev[1 + 2 * nparts], 0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(primus_turbo_cpp_extension, m) {
    m.def(
        "async_tp_rs_fused(Tensor a, Tensor b, Tensor(a!) out, Tensor(b!) stage, Tensor[] remote, Tensor[] local, "
        "int[] bounds, int signal_pads, int rank, int world, int side_stream_id, int side_device_index, "
        "int side_device_type, float scale, bool fuse_own) -> ()");
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) { m.impl("async_tp_rs_fused", &async_tp_rs_fused_cuda); }
