// Torch glue for the fused router's backward kernel (csrc/kernels/moe/router.cu).
//
//   torch.ops.primus_turbo_cpp_extension.router_bwd(grad_probs, logits, routing_map, score, norm, scaling)
//       -> grad_logits
//
// logits / grad_probs: contiguous [T, E] fp32 / fp16 / bf16 (one dtype), E <= 1024; routing_map: bool or int8
// [T, E]; score: 0 softmax over the selected logits, 1 softmax over all experts, 2 sigmoid; norm: the
// selected scores were renormalised. The Python layer (primus_turbo/pytorch/kernels/moe/router_impl.py)
// validates; the checks here only guard against misuse of the raw op.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "primus_turbo/dtype.h"
#include "torch_dtype.h"

namespace primus_turbo {
int router_bwd_max_experts();
cudaError_t router_bwd_launch(const void* grad_probs, const void* logits, const int8_t* routing_map,
                              void* grad_logits, int64_t rows, int E, int score, bool norm, float scaling,
                              DType dtype, cudaStream_t stream);
}  // namespace primus_turbo

namespace {

using at::Tensor;

Tensor router_bwd_cuda(const Tensor& grad_probs, const Tensor& logits, const Tensor& routing_map, int64_t score,
                       bool norm, double scaling) {
    TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
                "router_bwd: logits must be a contiguous 2-D CUDA tensor");
    TORCH_CHECK(logits.size(1) <= primus_turbo::router_bwd_max_experts(), "router_bwd: ", logits.size(1),
                " experts > ", primus_turbo::router_bwd_max_experts());
    TORCH_CHECK(grad_probs.device() == logits.device() && grad_probs.sizes() == logits.sizes() &&
                    grad_probs.scalar_type() == logits.scalar_type() && grad_probs.is_contiguous(),
                "router_bwd: grad_probs must be contiguous with the shape and dtype of logits");
    TORCH_CHECK(routing_map.device() == logits.device() && routing_map.sizes() == logits.sizes() &&
                    routing_map.is_contiguous() &&
                    (routing_map.scalar_type() == at::kBool || routing_map.scalar_type() == at::kChar),
                "router_bwd: routing_map must be a contiguous bool / int8 tensor with the shape of logits");
    TORCH_CHECK(score >= 0 && score <= 2, "router_bwd: score must be 0 (softmax), 1 (pre-softmax) or 2 (sigmoid)");
    const c10::cuda::CUDAGuard guard(logits.device());
    Tensor grad_logits = at::empty_like(logits);
    const auto dtype = primus_turbo::to_dtype(logits.scalar_type(), "router_bwd");
    C10_CUDA_CHECK(primus_turbo::router_bwd_launch(
        grad_probs.data_ptr(), logits.data_ptr(), static_cast<const int8_t*>(routing_map.data_ptr()),
        grad_logits.data_ptr(), logits.size(0), static_cast<int>(logits.size(1)), static_cast<int>(score), norm,
        static_cast<float>(scaling), dtype, c10::cuda::getCurrentCUDAStream()));
    return grad_logits;
}

Tensor router_bwd_meta(const Tensor&, const Tensor& logits, const Tensor&, int64_t, bool, double) {
    return at::empty_like(logits);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(primus_turbo_cpp_extension, m) {
    m.def("router_bwd(Tensor grad_probs, Tensor logits, Tensor routing_map, int score, bool norm, float scaling)"
          " -> Tensor");
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) { m.impl("router_bwd", &router_bwd_cuda); }

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m) { m.impl("router_bwd", &router_bwd_meta); }
