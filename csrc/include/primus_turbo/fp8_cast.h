// Device helpers of the FP8 quantization kernels (include from .cu files only): the numerics contract
// of primus_turbo/quantization.h in one place, shared by every csrc quantization kernel.
#pragma once

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

namespace primus_turbo {

__device__ __forceinline__ float finite_abs(float v) {
    const float a = fabsf(v);
    return a < INFINITY ? a : 0.0f;  // false for inf and NaN
}

// scale = fp8_max / amax (IEEE division), 1 when amax == 0, capped at FLT_MAX; pow2: exponent bits only.
__device__ __forceinline__ float fp8_scale_from_amax(float amax, float fp8_max, bool pow2) {
    float scale = amax > 0.0f ? __fdiv_rn(fp8_max, amax) : 1.0f;
    scale = fminf(scale, FLT_MAX);
    if (pow2) scale = __int_as_float(__float_as_int(scale) & 0x7F800000);
    return scale;
}

template <bool E5M2>
__device__ __forceinline__ uint8_t to_fp8(float x, float scale, float fp8_max) {
    float y = fminf(fmaxf(x * scale, -fp8_max), fp8_max);
    if (x != x) y = x;  // fminf/fmaxf drop NaN: put it back
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3));
}

// Four floats scaled and rounded to FP8 in two paired conversions, packed in memory order (element 0 in
// the low byte). SATFINITE saturates +-inf and finite overflow to +-max and keeps NaN: the same bytes as
// to_fp8's explicit clamp.
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
    constexpr __nv_fp8_interpretation_t kFmt = E5M2 ? __NV_E5M2 : __NV_E4M3;
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFmt);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kFmt);
    return lo | (hi << 16);
}

template <bool E5M2>
__host__ __device__ constexpr float fp8_max_of() {
    return E5M2 ? 57344.0f : 448.0f;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

}  // namespace primus_turbo
