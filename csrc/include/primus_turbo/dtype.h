// Element types of csrc kernels; host-safe (no device code), shared by kernels and torch glue.
#pragma once

namespace primus_turbo {

// The torch glue maps at::ScalarType onto this; kernels instantiate one template per member.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace primus_turbo
