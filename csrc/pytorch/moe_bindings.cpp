// Torch glue for the MoE permute/unpermute CUDA kernels (csrc/kernels/moe/permute.cu).
//
//   torch.ops.primus_turbo_cpp_extension.moe_permute(x, row_id_map, probs?, num_rows, zero_fill, out_dtype?)
//       -> (out, out_probs)
//   torch.ops.primus_turbo_cpp_extension.moe_unpermute(y, row_id_map, probs?, num_tokens, out_dtype?) -> out
//   torch.ops.primus_turbo_cpp_extension.moe_row_id_map(indices, num_experts, num_rows, pad_multiple, capacity,
//                                                       chunk_tokens) -> (row_id_map, tokens_per_expert)
//     (csrc/kernels/moe/row_id_map.cu; indices int32/int64 [T, K], capacity < 0: none)
//
// x / y: contiguous [rows, hidden] (permute: any dtype with even row bytes; unpermute: fp32/fp16/bf16);
// out_dtype (None: the input's): fp32 <-> fp16/bf16 either way, rounded to nearest even;
// row_id_map: int32 [T, K] (K <= 1024); probs: fp32 [T, K]. The Python layer
// (primus_turbo/pytorch/kernels/moe/permute_impl.py) builds the map and validates.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

#include "primus_turbo/dtype.h"

namespace primus_turbo {
int moe_permute_max_k();
cudaError_t moe_permute_launch(const void* x, const int32_t* row_id_map, const float* probs, void* out,
                               float* out_probs, int64_t num_tokens, int64_t row_bytes, int K, bool aligned16,
                               cudaStream_t stream);
cudaError_t moe_permute_cast_launch(const void* x, const int32_t* row_id_map, const float* probs, void* out,
                                    float* out_probs, int64_t num_tokens, int64_t hidden, int K, DType in_dtype,
                                    DType out_dtype, bool aligned16, cudaStream_t stream);
cudaError_t moe_unpermute_launch(const void* y, const int32_t* row_id_map, const float* probs, void* out,
                                 int64_t num_tokens, int64_t hidden, int K, DType in_dtype, DType out_dtype,
                                 bool aligned16, cudaStream_t stream);
cudaError_t moe_row_id_map_launch(const void* idx, bool idx_is_int64, int32_t* tile_counts, int32_t* base,
                                  int32_t* counts, int32_t* offsets, int32_t* tokens_per_expert, int32_t* dest,
                                  int64_t T, int K, int E, int chunk_t, int64_t num_rows, int pad_multiple,
                                  int capacity, cudaStream_t stream);
}  // namespace primus_turbo

namespace {

using at::Tensor;

bool aligned16(std::initializer_list<const void*> ptrs) {
    for (const void* p : ptrs)
        if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    return true;
}

void check_map(const Tensor& x, const Tensor& map, const std::optional<Tensor>& probs, int64_t rows) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "moe_permute: input must be a contiguous 2-D CUDA tensor");
    TORCH_CHECK(map.is_cuda() && map.scalar_type() == at::kInt && map.dim() == 2 && map.is_contiguous() &&
                    map.size(0) == rows,
                "moe_permute: row_id_map must be a contiguous int32 [", rows, ", K] CUDA tensor, got ", map.sizes());
    TORCH_CHECK(map.size(1) <= primus_turbo::moe_permute_max_k(), "moe_permute: K=", map.size(1), " > ",
                primus_turbo::moe_permute_max_k());
    if (probs) {
        TORCH_CHECK(probs->is_cuda() && probs->scalar_type() == at::kFloat && probs->is_contiguous() &&
                        probs->sizes() == map.sizes(),
                    "moe_permute: probs must be contiguous fp32 with the shape of row_id_map ", map.sizes());
    }
}

std::optional<primus_turbo::DType> float_dtype(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return primus_turbo::DType::kFloat32;
        case at::kHalf: return primus_turbo::DType::kFloat16;
        case at::kBFloat16: return primus_turbo::DType::kBFloat16;
        default: return std::nullopt;
    }
}

// The (input, output) element types of a converting permute / unpermute: fp32 <-> fp16/bf16, or the same.
std::pair<primus_turbo::DType, primus_turbo::DType> cast_pair(const char* op, at::ScalarType in, at::ScalarType out) {
    const auto i = float_dtype(in), o = float_dtype(out);
    TORCH_CHECK(i && o && (in == out || in == at::kFloat || out == at::kFloat), op, " (TURBO): ", in, " -> ", out,
                " not supported; fp32/fp16/bf16 to the same type, or fp32 <-> fp16/bf16");
    return {*i, *o};
}

std::tuple<Tensor, Tensor> moe_permute_cuda(const Tensor& x, const Tensor& row_id_map,
                                            const std::optional<Tensor>& probs, int64_t num_rows, bool zero_fill,
                                            std::optional<at::ScalarType> out_dtype) {
    check_map(x, row_id_map, probs, x.size(0));
    const at::ScalarType odt = out_dtype.value_or(x.scalar_type());
    const int64_t row_bytes = x.size(1) * x.element_size();
    TORCH_CHECK(odt != x.scalar_type() || row_bytes % 2 == 0, "moe_permute (TURBO): row bytes must be even, got ",
                row_bytes);
    const c10::cuda::CUDAGuard guard(x.device());
    const auto opts = x.options().dtype(odt);
    Tensor out = zero_fill ? at::zeros({num_rows, x.size(1)}, opts) : at::empty({num_rows, x.size(1)}, opts);
    Tensor out_probs = probs ? (zero_fill ? at::zeros({num_rows}, probs->options()) : at::empty({num_rows}, probs->options()))
                             : at::empty({0}, x.options().dtype(at::kFloat));
    const float* p = probs ? probs->data_ptr<float>() : nullptr;
    float* op = probs ? out_probs.data_ptr<float>() : nullptr;
    const bool aligned = aligned16({x.data_ptr(), out.data_ptr()});
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (odt == x.scalar_type()) {
        C10_CUDA_CHECK(primus_turbo::moe_permute_launch(x.data_ptr(), row_id_map.data_ptr<int32_t>(), p,
                                                        out.data_ptr(), op, x.size(0), row_bytes,
                                                        static_cast<int>(row_id_map.size(1)), aligned, stream));
    } else {
        const auto [in_t, out_t] = cast_pair("moe_permute", x.scalar_type(), odt);
        C10_CUDA_CHECK(primus_turbo::moe_permute_cast_launch(
            x.data_ptr(), row_id_map.data_ptr<int32_t>(), p, out.data_ptr(), op, x.size(0), x.size(1),
            static_cast<int>(row_id_map.size(1)), in_t, out_t, aligned, stream));
    }
    return {out, out_probs};
}

Tensor moe_unpermute_cuda(const Tensor& y, const Tensor& row_id_map, const std::optional<Tensor>& probs,
                          int64_t num_tokens, std::optional<at::ScalarType> out_dtype) {
    check_map(y, row_id_map, probs, num_tokens);
    const at::ScalarType odt = out_dtype.value_or(y.scalar_type());
    const auto [in_t, out_t] = cast_pair("moe_unpermute", y.scalar_type(), odt);
    const c10::cuda::CUDAGuard guard(y.device());
    Tensor out = at::empty({num_tokens, y.size(1)}, y.options().dtype(odt));
    const float* p = probs ? probs->data_ptr<float>() : nullptr;
    C10_CUDA_CHECK(primus_turbo::moe_unpermute_launch(
        y.data_ptr(), row_id_map.data_ptr<int32_t>(), p, out.data_ptr(), num_tokens, y.size(1),
        static_cast<int>(row_id_map.size(1)), in_t, out_t, aligned16({y.data_ptr(), out.data_ptr()}),
        c10::cuda::getCurrentCUDAStream()));
    return out;
}

std::tuple<Tensor, Tensor> moe_row_id_map_cuda(const Tensor& indices, int64_t num_experts, int64_t num_rows,
                                               int64_t pad_multiple, int64_t capacity, int64_t chunk_tokens) {
    TORCH_CHECK(indices.is_cuda() && indices.dim() == 2 && indices.is_contiguous() &&
                    (indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt),
                "moe_row_id_map: indices must be a contiguous int32/int64 [T, K] CUDA tensor, got ",
                indices.scalar_type(), " ", indices.sizes());
    const int64_t T = indices.size(0), K = indices.size(1);
    TORCH_CHECK(num_experts >= 1 && num_experts < (1 << 30), "moe_row_id_map: num_experts=", num_experts);
    TORCH_CHECK(chunk_tokens >= 1 && chunk_tokens * K <= 1024, "moe_row_id_map: chunk_tokens * K must be in [1, 1024], got ",
                chunk_tokens, " * ", K);
    TORCH_CHECK(pad_multiple >= 1, "moe_row_id_map: pad_multiple must be >= 1, got ", pad_multiple);
    const c10::cuda::CUDAGuard guard(indices.device());
    const auto i32 = indices.options().dtype(at::kInt);
    const int64_t nc = (T + chunk_tokens - 1) / chunk_tokens;
    Tensor dest = at::empty({T, K}, i32);
    Tensor tokens_per_expert = at::zeros({num_experts}, i32);
    if (T == 0 || K == 0) return {dest, tokens_per_expert};
    Tensor tile_counts = at::zeros({num_experts, nc}, i32);
    Tensor base = at::empty({num_experts, nc}, i32);
    Tensor small = at::empty({2, num_experts}, i32);  // counts, offsets
    C10_CUDA_CHECK(primus_turbo::moe_row_id_map_launch(
        indices.data_ptr(), indices.scalar_type() == at::kLong, tile_counts.data_ptr<int32_t>(),
        base.data_ptr<int32_t>(), small.data_ptr<int32_t>(), small.data_ptr<int32_t>() + num_experts,
        tokens_per_expert.data_ptr<int32_t>(), dest.data_ptr<int32_t>(), T, static_cast<int>(K),
        static_cast<int>(num_experts), static_cast<int>(chunk_tokens), num_rows, static_cast<int>(pad_multiple),
        static_cast<int>(capacity < 0 ? -1 : capacity), c10::cuda::getCurrentCUDAStream()));
    return {dest, tokens_per_expert};
}

std::tuple<Tensor, Tensor> moe_row_id_map_meta(const Tensor& indices, int64_t num_experts, int64_t num_rows,
                                               int64_t pad_multiple, int64_t capacity, int64_t chunk_tokens) {
    const auto i32 = indices.options().dtype(at::kInt);
    return {at::empty(indices.sizes(), i32), at::empty({num_experts}, i32)};
}

std::tuple<Tensor, Tensor> moe_permute_meta(const Tensor& x, const Tensor& row_id_map,
                                            const std::optional<Tensor>& probs, int64_t num_rows, bool zero_fill,
                                            std::optional<at::ScalarType> out_dtype) {
    return {at::empty({num_rows, x.size(1)}, x.options().dtype(out_dtype.value_or(x.scalar_type()))),
            at::empty({probs ? num_rows : 0}, x.options().dtype(at::kFloat))};
}

Tensor moe_unpermute_meta(const Tensor& y, const Tensor& row_id_map, const std::optional<Tensor>& probs,
                          int64_t num_tokens, std::optional<at::ScalarType> out_dtype) {
    return at::empty({num_tokens, y.size(1)}, y.options().dtype(out_dtype.value_or(y.scalar_type())));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(primus_turbo_cpp_extension, m) {
    m.def("moe_permute(Tensor x, Tensor row_id_map, Tensor? probs, int num_rows, bool zero_fill, "
          "ScalarType? out_dtype=None) -> (Tensor, Tensor)");
    m.def("moe_unpermute(Tensor y, Tensor row_id_map, Tensor? probs, int num_tokens, ScalarType? out_dtype=None) -> Tensor");
    m.def("moe_row_id_map(Tensor indices, int num_experts, int num_rows, int pad_multiple, int capacity, "
          "int chunk_tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) {
    m.impl("moe_permute", &moe_permute_cuda);
    m.impl("moe_unpermute", &moe_unpermute_cuda);
    m.impl("moe_row_id_map", &moe_row_id_map_cuda);
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m) {
    m.impl("moe_permute", &moe_permute_meta);
    m.impl("moe_unpermute", &moe_unpermute_meta);
    m.impl("moe_row_id_map", &moe_row_id_map_meta);
}
