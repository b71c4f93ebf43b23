// Torch glue for the RMSNorm CUDA kernels: schema, CUDA and Meta implementations.
//
//   torch.ops.primus_turbo_cpp_extension.rmsnorm_fwd(x, weight, eps, zero_centered_gamma) -> (y, rstd)
//   torch.ops.primus_turbo_cpp_extension.rmsnorm_residual_fwd(x, residual, weight, eps, zcg) -> (y, sum, rstd)
//   torch.ops.primus_turbo_cpp_extension.rmsnorm_bwd(dy, x, weight, rstd, dsum?, zcg) -> (dx, dweight)
//
// x / residual / dy / dsum: contiguous [rows, hidden]; weight: [hidden]; rstd: fp32 [rows]; one dtype
// (fp32, fp16 or bf16) for all but rstd. The Python layer (primus_turbo/pytorch/ops/normalization.py)
// validates and reshapes; the checks here only guard against misuse of the raw op.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "torch_dtype.h"
#include "primus_turbo/rmsnorm.h"

namespace {

using at::Tensor;

bool aligned16(std::initializer_list<const void*> ptrs) {
    for (const void* p : ptrs)
        if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    return true;
}

void check_row_tensor(const Tensor& t, const Tensor& x, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "rmsnorm: ", name, " must be on ", x.device());
    TORCH_CHECK(t.scalar_type() == x.scalar_type(), "rmsnorm: ", name, " dtype ", t.scalar_type(), " != x dtype ",
                x.scalar_type());
    TORCH_CHECK(t.sizes() == x.sizes() && t.is_contiguous(), "rmsnorm: ", name,
                " must be contiguous with the shape of x ", x.sizes(), ", got ", t.sizes());
}

void check_inputs(const Tensor& x, const Tensor& weight) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "rmsnorm: x must be a contiguous 2-D CUDA tensor");
    TORCH_CHECK(weight.is_cuda() && weight.device() == x.device() && weight.is_contiguous(),
                "rmsnorm: weight must be a contiguous CUDA tensor on ", x.device());
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rmsnorm: weight dtype ", weight.scalar_type(),
                " != x dtype ", x.scalar_type());
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "rmsnorm: weight must be [", x.size(1), "], got ",
                weight.sizes());
}

std::tuple<Tensor, Tensor, Tensor> fwd_impl(const Tensor& x, const std::optional<Tensor>& residual,
                                            const Tensor& weight, double eps, bool zero_centered_gamma) {
    check_inputs(x, weight);
    if (residual) check_row_tensor(*residual, x, "residual");
    const c10::cuda::CUDAGuard guard(x.device());
    Tensor y = at::empty_like(x);
    Tensor sum = residual ? at::empty_like(x) : Tensor();
    Tensor rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
    const void* res_ptr = residual ? residual->data_ptr() : nullptr;
    void* sum_ptr = residual ? sum.data_ptr() : nullptr;
    const bool aligned = aligned16({x.data_ptr(), res_ptr, weight.data_ptr(), y.data_ptr(), sum_ptr});
    const auto dtype = primus_turbo::to_dtype(x.scalar_type(), "primus_turbo rmsnorm");
    TORCH_CHECK(x.size(1) <= primus_turbo::rmsnorm_max_hidden(x.size(1), dtype, aligned),
                "rmsnorm (TURBO): hidden size ", x.size(1), " exceeds the register-resident maximum ",
                primus_turbo::rmsnorm_max_hidden(x.size(1), dtype, aligned), "; use the TRITON backend");
    C10_CUDA_CHECK(primus_turbo::rmsnorm_fwd_launch(x.data_ptr(), res_ptr, weight.data_ptr(), y.data_ptr(), sum_ptr,
                                                    rstd.data_ptr<float>(), x.size(0), x.size(1),
                                                    static_cast<float>(eps), zero_centered_gamma, dtype, aligned,
                                                    c10::cuda::getCurrentCUDAStream()));
    return {y, sum, rstd};
}

std::tuple<Tensor, Tensor> rmsnorm_fwd_cuda(const Tensor& x, const Tensor& weight, double eps,
                                            bool zero_centered_gamma) {
    auto [y, sum, rstd] = fwd_impl(x, std::nullopt, weight, eps, zero_centered_gamma);
    return {y, rstd};
}

std::tuple<Tensor, Tensor, Tensor> rmsnorm_residual_fwd_cuda(const Tensor& x, const Tensor& residual,
                                                             const Tensor& weight, double eps,
                                                             bool zero_centered_gamma) {
    return fwd_impl(x, residual, weight, eps, zero_centered_gamma);
}

std::tuple<Tensor, Tensor> rmsnorm_bwd_cuda(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                            const Tensor& rstd, const std::optional<Tensor>& dsum,
                                            bool zero_centered_gamma) {
    check_inputs(x, weight);
    check_row_tensor(dy, x, "dy");
    if (dsum) check_row_tensor(*dsum, x, "dsum");
    TORCH_CHECK(rstd.is_cuda() && rstd.scalar_type() == at::kFloat && rstd.numel() == x.size(0) &&
                    rstd.is_contiguous(),
                "rmsnorm: rstd must be a contiguous fp32 CUDA tensor of ", x.size(0), " elements");
    const c10::cuda::CUDAGuard guard(x.device());
    Tensor dx = at::empty_like(x);
    const void* ds_ptr = dsum ? dsum->data_ptr() : nullptr;
    const bool aligned = aligned16({dy.data_ptr(), x.data_ptr(), weight.data_ptr(), ds_ptr, dx.data_ptr()});
    const auto dtype = primus_turbo::to_dtype(x.scalar_type(), "primus_turbo rmsnorm");
    TORCH_CHECK(x.size(1) <= primus_turbo::rmsnorm_max_hidden(x.size(1), dtype, aligned),
                "rmsnorm (TURBO): hidden size ", x.size(1), " too large; use the TRITON backend");
    if (x.size(0) == 0) return {dx, at::zeros_like(weight)};
    Tensor dweight = at::empty_like(weight);
    const int64_t ws_rows = primus_turbo::rmsnorm_bwd_workspace_rows(x.size(0), x.size(1), dtype, aligned);
    Tensor workspace = at::empty({ws_rows, x.size(1)}, x.options().dtype(at::kFloat));
    C10_CUDA_CHECK(primus_turbo::rmsnorm_bwd_launch(
        dy.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr<float>(), ds_ptr, dx.data_ptr(),
        dweight.data_ptr(), workspace.data_ptr<float>(), x.size(0), x.size(1), zero_centered_gamma, dtype, aligned,
        c10::cuda::getCurrentCUDAStream()));
    return {dx, dweight};
}

// Meta: shapes and dtypes only (torch.compile / FakeTensor tracing); SymInt-safe for dynamic shapes.
std::tuple<Tensor, Tensor> rmsnorm_fwd_meta(const Tensor& x, const Tensor& weight, double, bool) {
    return {at::empty_like(x), at::empty_symint({x.sym_size(0)}, x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor, Tensor> rmsnorm_residual_fwd_meta(const Tensor& x, const Tensor&, const Tensor& weight,
                                                             double, bool) {
    return {at::empty_like(x), at::empty_like(x),
            at::empty_symint({x.sym_size(0)}, x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor> rmsnorm_bwd_meta(const Tensor&, const Tensor& x, const Tensor& weight, const Tensor&,
                                            const std::optional<Tensor>&, bool) {
    return {at::empty_like(x), at::empty_like(weight)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(primus_turbo_cpp_extension, m) {
    m.def("rmsnorm_fwd(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> (Tensor, Tensor)");
    m.def(
        "rmsnorm_residual_fwd(Tensor x, Tensor residual, Tensor weight, float eps, bool zero_centered_gamma)"
        " -> (Tensor, Tensor, Tensor)");
    m.def(
        "rmsnorm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd, Tensor? dsum, bool zero_centered_gamma)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) {
    m.impl("rmsnorm_fwd", &rmsnorm_fwd_cuda);
    m.impl("rmsnorm_residual_fwd", &rmsnorm_residual_fwd_cuda);
    m.impl("rmsnorm_bwd", &rmsnorm_bwd_cuda);
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m) {
    m.impl("rmsnorm_fwd", &rmsnorm_fwd_meta);
    m.impl("rmsnorm_residual_fwd", &rmsnorm_residual_fwd_meta);
    m.impl("rmsnorm_bwd", &rmsnorm_bwd_meta);
}
