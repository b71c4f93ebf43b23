// Torch glue for the FP8 quantization CUDA kernels: schema, CUDA and Meta implementations.
//
//   torch.ops.primus_turbo_cpp_extension.quantize_fp8_rowwise(x, out_dtype, pow2) -> (q, scale_inv)
//   torch.ops.primus_turbo_cpp_extension.quantize_fp8_rowwise_transpose(x, out_dtype, pow2)
//       -> (q, scale_inv, qt, scale_inv_t)
//   torch.ops.primus_turbo_cpp_extension.quantize_fp8_tensorwise(x, out_dtype, pow2, with_t) -> (q, scale_inv, qt)
//
// x: contiguous 2-D fp32/fp16/bf16 [rows, cols]; q: [rows, cols] in out_dtype (float8_e4m3fn or
// float8_e5m2); scale_inv: fp32 [rows, 1]; qt: [cols, rows] scaled per column of x, scale_inv_t: fp32 [cols, 1].
// Tensor-wise: x contiguous of any shape (2-D with with_t), one scale: scale_inv fp32 [] (0-dim), qt [cols,
// rows] with the same scale, or an empty [0] tensor without with_t. The Python layer (primus_turbo/pytorch/
// kernels/quantization/quantization_impl.py) validates and reshapes; the checks here only guard against
// misuse of the raw op.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "torch_dtype.h"
#include "primus_turbo/quantization.h"

namespace {

using at::Tensor;

void check_out_dtype(at::ScalarType out_dtype, const char* op = "quantize_fp8_rowwise") {
    TORCH_CHECK(out_dtype == at::kFloat8_e4m3fn || out_dtype == at::kFloat8_e5m2, op, ": out_dtype ", out_dtype,
                " is not supported; accepted: float8_e4m3fn, float8_e5m2");
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

std::tuple<Tensor, Tensor> quantize_fp8_rowwise_cuda(const Tensor& x, at::ScalarType out_dtype, bool pow2) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(),
                "quantize_fp8_rowwise: x must be a contiguous 2-D CUDA tensor, got ", x.sizes());
    check_out_dtype(out_dtype);
    const auto dtype = primus_turbo::to_dtype(x.scalar_type(), "quantize_fp8_rowwise: x");
    const c10::cuda::CUDAGuard guard(x.device());
    Tensor q = at::empty(x.sizes(), x.options().dtype(out_dtype));
    Tensor scale_inv = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
    const bool aligned = aligned16(x) && aligned16(q);
    C10_CUDA_CHECK(primus_turbo::quantize_rowwise_fp8_launch(
        x.data_ptr(), q.data_ptr(), scale_inv.data_ptr<float>(), x.size(0), x.size(1), dtype,
        out_dtype == at::kFloat8_e5m2, pow2, aligned, c10::cuda::getCurrentCUDAStream()));
    return {q, scale_inv};
}

std::tuple<Tensor, Tensor> quantize_fp8_rowwise_meta(const Tensor& x, at::ScalarType out_dtype, bool) {
    check_out_dtype(out_dtype);
    return {at::empty_like(x, x.options().dtype(out_dtype)),
            at::empty_symint({x.sym_size(0), 1}, x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_fp8_rowwise_transpose_cuda(const Tensor& x,
                                                                             at::ScalarType out_dtype, bool pow2) {
    constexpr const char* op = "quantize_fp8_rowwise_transpose";
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous 2-D CUDA tensor, got ",
                x.sizes());
    check_out_dtype(out_dtype, op);
    TORCH_CHECK(x.size(1) <= 4194240, op, ": x has ", x.size(1), " columns; at most 4194240 are supported");
    const auto dtype = primus_turbo::to_dtype(x.scalar_type(), "quantize_fp8_rowwise_transpose: x");
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0), cols = x.size(1);
    Tensor q = at::empty({rows, cols}, x.options().dtype(out_dtype));
    Tensor qt = at::empty({cols, rows}, x.options().dtype(out_dtype));
    Tensor scale_inv = at::empty({rows, 1}, x.options().dtype(at::kFloat));
    Tensor scale_inv_t = at::empty({cols, 1}, x.options().dtype(at::kFloat));
    if (rows == 0 || cols == 0) {  // an empty dim has scale 1 (amax 0), as the torch reference says
        scale_inv.fill_(1.0f);
        scale_inv_t.fill_(1.0f);
        return {q, scale_inv, qt, scale_inv_t};
    }
    Tensor workspace = at::empty({rows + cols}, x.options().dtype(at::kInt));
    C10_CUDA_CHECK(primus_turbo::quantize_rowwise_transpose_fp8_launch(
        x.data_ptr(), q.data_ptr(), qt.data_ptr(), scale_inv.data_ptr<float>(), scale_inv_t.data_ptr<float>(),
        workspace.data_ptr(), rows, cols, dtype, out_dtype == at::kFloat8_e5m2, pow2,
        aligned16(x) && aligned16(q) && aligned16(qt), c10::cuda::getCurrentCUDAStream()));
    return {q, scale_inv, qt, scale_inv_t};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_fp8_rowwise_transpose_meta(const Tensor& x,
                                                                             at::ScalarType out_dtype, bool) {
    check_out_dtype(out_dtype, "quantize_fp8_rowwise_transpose");
    const auto opts = x.options().dtype(out_dtype);
    const auto fopts = x.options().dtype(at::kFloat);
    return {at::empty_symint({x.sym_size(0), x.sym_size(1)}, opts), at::empty_symint({x.sym_size(0), 1}, fopts),
            at::empty_symint({x.sym_size(1), x.sym_size(0)}, opts), at::empty_symint({x.sym_size(1), 1}, fopts)};
}

std::tuple<Tensor, Tensor, Tensor> quantize_fp8_tensorwise_cuda(const Tensor& x, at::ScalarType out_dtype, bool pow2,
                                                                bool with_t) {
    constexpr const char* op = "quantize_fp8_tensorwise";
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && (!with_t || x.dim() == 2), op,
                ": x must be a contiguous CUDA tensor (2-D with with_t), got ", x.sizes());
    check_out_dtype(out_dtype, op);
    const auto dtype = primus_turbo::to_dtype(x.scalar_type(), "quantize_fp8_tensorwise: x");
    const c10::cuda::CUDAGuard guard(x.device());
    Tensor q = at::empty(x.sizes(), x.options().dtype(out_dtype));
    Tensor qt = with_t ? at::empty({x.size(1), x.size(0)}, x.options().dtype(out_dtype))
                       : at::empty({0}, x.options().dtype(out_dtype));
    Tensor scale_inv = at::empty({}, x.options().dtype(at::kFloat));
    Tensor workspace = at::empty({1}, x.options().dtype(at::kInt));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (with_t) {
        TORCH_CHECK(x.size(1) <= 4194240, op, ": x has ", x.size(1), " columns; at most 4194240 are supported");
        if (x.numel() == 0) {  // amax 0: scale 1, as the torch reference says
            scale_inv.fill_(1.0f);
            return {q, scale_inv, qt};
        }
        C10_CUDA_CHECK(primus_turbo::quantize_tensorwise_transpose_fp8_launch(
            x.data_ptr(), q.data_ptr(), qt.data_ptr(), scale_inv.data_ptr<float>(), workspace.data_ptr(), x.size(0),
            x.size(1), dtype, out_dtype == at::kFloat8_e5m2, pow2, aligned16(x) && aligned16(q) && aligned16(qt),
            stream));
    } else {
        C10_CUDA_CHECK(primus_turbo::quantize_tensorwise_fp8_launch(
            x.data_ptr(), q.data_ptr(), scale_inv.data_ptr<float>(), workspace.data_ptr(), x.numel(), dtype,
            out_dtype == at::kFloat8_e5m2, pow2, aligned16(x) && aligned16(q), stream));
    }
    return {q, scale_inv, qt};
}

std::tuple<Tensor, Tensor, Tensor> quantize_fp8_tensorwise_meta(const Tensor& x, at::ScalarType out_dtype, bool,
                                                                bool with_t) {
    check_out_dtype(out_dtype, "quantize_fp8_tensorwise");
    const auto opts = x.options().dtype(out_dtype);
    Tensor qt = with_t ? at::empty_symint({x.sym_size(1), x.sym_size(0)}, opts) : at::empty({0}, opts);
    return {at::empty_like(x, opts), at::empty({}, x.options().dtype(at::kFloat)), qt};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(primus_turbo_cpp_extension, m) {
    m.def("quantize_fp8_rowwise(Tensor x, ScalarType out_dtype, bool pow2) -> (Tensor, Tensor)");
    m.def(
        "quantize_fp8_rowwise_transpose(Tensor x, ScalarType out_dtype, bool pow2) -> (Tensor, Tensor, Tensor, "
        "Tensor)");
    m.def("quantize_fp8_tensorwise(Tensor x, ScalarType out_dtype, bool pow2, bool with_t) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) {
    m.impl("quantize_fp8_rowwise", &quantize_fp8_rowwise_cuda);
    m.impl("quantize_fp8_rowwise_transpose", &quantize_fp8_rowwise_transpose_cuda);
    m.impl("quantize_fp8_tensorwise", &quantize_fp8_tensorwise_cuda);
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m) {
    m.impl("quantize_fp8_rowwise", &quantize_fp8_rowwise_meta);
    m.impl("quantize_fp8_rowwise_transpose", &quantize_fp8_rowwise_transpose_meta);
    m.impl("quantize_fp8_tensorwise", &quantize_fp8_tensorwise_meta);
}
