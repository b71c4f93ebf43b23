// Torch glue for the cached-plan cuBLASLt FP8 GEMM (csrc/kernels/gemm/gemm_fp8_cublaslt.cu).
//
//   torch.ops.primus_turbo_cpp_extension.gemm_fp8_cublaslt(a, a_scale, b, b_scale, scale_mode, out_dtype,
//       fast_accum) -> (out, supported)
//   torch.ops.primus_turbo_cpp_extension.gemm_fp8_cublaslt_plan_count() -> int
//
// out[M, N] = a[M, K] @ b[N, K]^T with a, b contiguous FP8 (float8_e4m3fn / float8_e5m2); scale_mode 0:
// one fp32 scale each, 1: a_scale M values and b_scale N values (any shape with that many contiguous
// fp32). `supported` is False (and out an empty placeholder) when cuBLASLt has no algorithm for the
// problem: the Python backend (primus_turbo/pytorch/kernels/gemm/gemm_fp8_impl.py) then runs
// torch._scaled_mm. Built only when setup.py finds cublasLt.h (else PRIMUS_TURBO_NO_CUBLASLT).
#ifndef PRIMUS_TURBO_NO_CUBLASLT

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "primus_turbo/gemm_fp8.h"
#include "torch_dtype.h"

namespace {

using at::Tensor;
constexpr const char* kOp = "gemm_fp8_cublaslt";

bool is_fp8(const Tensor& t) {
    return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_inputs(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale,
                  int64_t scale_mode, at::ScalarType out_dtype) {
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2, kOp, ": a and b must be 2-D, got ", a.sizes(), " and ", b.sizes());
    TORCH_CHECK(is_fp8(a) && is_fp8(b), kOp, ": a and b must be float8_e4m3fn or float8_e5m2, got ",
                a.scalar_type(), " and ", b.scalar_type());
    TORCH_CHECK(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2), kOp,
                ": float8_e5m2 x float8_e5m2 has no cuBLAS kernel; accepted: e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3");
    TORCH_CHECK(a.size(1) == b.size(1), kOp, ": a is [M, K] and b is [N, K]; K differs: ", a.sizes(), " vs ",
                b.sizes());
    TORCH_CHECK(scale_mode == 0 || scale_mode == 1, kOp, ": scale_mode ", scale_mode,
                " is not supported; accepted: 0 (tensor-wise), 1 (row-wise)");
    TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat, kOp,
                ": out_dtype ", out_dtype, " is not supported; accepted: bfloat16, float16, float32");
    const int64_t want_a = scale_mode == 0 ? 1 : a.size(0), want_b = scale_mode == 0 ? 1 : b.size(0);
    TORCH_CHECK(a_scale.numel() == want_a && b_scale.numel() == want_b, kOp, ": scale_mode ", scale_mode,
                " needs ", want_a, " a_scale and ", want_b, " b_scale values, got ", a_scale.numel(), " and ",
                b_scale.numel());
}

std::tuple<Tensor, bool> gemm_fp8_cublaslt_cuda(const Tensor& a_in, const Tensor& a_scale_in, const Tensor& b_in,
                                                const Tensor& b_scale_in, int64_t scale_mode,
                                                at::ScalarType out_dtype, bool fast_accum) {
    check_inputs(a_in, a_scale_in, b_in, b_scale_in, scale_mode, out_dtype);
    TORCH_CHECK(a_in.is_cuda() && b_in.is_cuda() && a_in.device() == b_in.device() &&
                    a_scale_in.device() == a_in.device() && b_scale_in.device() == a_in.device(),
                kOp, ": a, b and their scales must be on one CUDA device");
    const c10::cuda::CUDAGuard guard(a_in.device());
    const Tensor a = a_in.contiguous(), b = b_in.contiguous();
    // cuBLASLt refuses scale vectors that are not 16-byte aligned (seen on H100 for a view at a 4-byte
    // offset): such a view is copied (m or n floats).
    const auto scale_operand = [](const Tensor& s) {
        Tensor t = s.to(at::kFloat).contiguous();
        return aligned16(t) ? t : t.clone();
    };
    const Tensor a_scale = scale_operand(a_scale_in), b_scale = scale_operand(b_scale_in);
    const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
    Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
    if (m == 0 || n == 0) return {out, true};
    if (k == 0) return {out.zero_(), true};
    // Hopper FP8 tensor-core layouts: K-major operands with 16-byte rows, and an output row of 16 bytes.
    if (k % 16 || n % 16 || !aligned16(a) || !aligned16(b) || !aligned16(out)) return {at::empty({0}, out.options()), false};
    const primus_turbo::Fp8GemmProblem problem{m,
                                               n,
                                               k,
                                               a.scalar_type() == at::kFloat8_e5m2,
                                               b.scalar_type() == at::kFloat8_e5m2,
                                               primus_turbo::to_dtype(out_dtype, kOp),
                                               static_cast<int>(scale_mode),
                                               fast_accum};
    Tensor workspace = at::empty({static_cast<int64_t>(primus_turbo::gemm_fp8_cublaslt_workspace_bytes())},
                                 a.options().dtype(at::kByte));
    std::string error;
    const auto status = primus_turbo::gemm_fp8_cublaslt(
        problem, a.data_ptr(), b.data_ptr(), out.data_ptr(), a_scale.data_ptr<float>(), b_scale.data_ptr<float>(),
        workspace.data_ptr(), a.get_device(), c10::cuda::getCurrentCUDAStream(), &error);
    TORCH_CHECK(status != primus_turbo::Fp8GemmStatus::kError, kOp, ": ", error, " (M=", m, ", N=", n, ", K=", k,
                ", ", a.scalar_type(), " x ", b.scalar_type(), " -> ", out_dtype, ", scale_mode ", scale_mode, ")");
    if (status == primus_turbo::Fp8GemmStatus::kUnsupported) return {at::empty({0}, out.options()), false};
    return {out, true};
}

std::tuple<Tensor, bool> gemm_fp8_cublaslt_meta(const Tensor& a, const Tensor& a_scale, const Tensor& b,
                                                const Tensor& b_scale, int64_t scale_mode, at::ScalarType out_dtype,
                                                bool) {
    check_inputs(a, a_scale, b, b_scale, scale_mode, out_dtype);
    return {at::empty_symint({a.sym_size(0), b.sym_size(0)}, a.options().dtype(out_dtype)), true};
}

int64_t gemm_fp8_cublaslt_plan_count() { return static_cast<int64_t>(primus_turbo::gemm_fp8_cublaslt_plan_count()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(primus_turbo_cpp_extension, m) {
    m.def(
        "gemm_fp8_cublaslt(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, int scale_mode, ScalarType out_dtype, "
        "bool fast_accum) -> (Tensor, bool)");
    m.def("gemm_fp8_cublaslt_plan_count() -> int", &gemm_fp8_cublaslt_plan_count);
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) { m.impl("gemm_fp8_cublaslt", &gemm_fp8_cublaslt_cuda); }

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m) { m.impl("gemm_fp8_cublaslt", &gemm_fp8_cublaslt_meta); }

#endif  // PRIMUS_TURBO_NO_CUBLASLT
