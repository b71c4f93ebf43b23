// at::ScalarType -> primus_turbo::DType for the torch glue (csrc/pytorch/*_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

#include "primus_turbo/dtype.h"

namespace primus_turbo {

// The element types the csrc kernels are instantiated for; anything else is a clear error naming `op`.
inline DType to_dtype(at::ScalarType t, const char* op) {
    switch (t) {
        case at::kFloat:
            return DType::kFloat32;
        case at::kHalf:
            return DType::kFloat16;
        case at::kBFloat16:
            return DType::kBFloat16;
        default:
            TORCH_CHECK(false, op, ": dtype ", t, " is not supported; accepted: float32, float16, bfloat16");
    }
}

}  // namespace primus_turbo
