// Device helpers of the FP8 quantization kernels (include from .cu files only): the numerics contract
// of primus_turbo/quantization.h in one place, shared by every csrc quantization kernel, and the block
// reduction / vector cast the row-wise and tensor-wise kernels share.
#pragma once

#include <cuda_fp8.h>

#include "primus_turbo/common.h"

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

// Max over the block (blockDim.x a multiple of 32, at most 1024 threads); smem: blockDim.x / 32 floats.
// Every thread gets the result.
__device__ __forceinline__ float block_max(float v, float* smem) {
    v = warp_max(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : 0.0f;
        v = warp_max(v);
        if (lane == 0) smem[0] = v;
    }
    __syncthreads();
    return smem[0];
}

// One vector scaled and cast: four elements per pair of paired conversions where VEC allows.
template <bool E5M2, typename T, int VEC>
__device__ __forceinline__ Vec<uint8_t, VEC> cast_vec(const Vec<T, VEC>& v, float scale, float fp8_max) {
    Vec<uint8_t, VEC> out;
    if constexpr (VEC % 4 == 0) {
        uint32_t* words = reinterpret_cast<uint32_t*>(out.v);
#pragma unroll
        for (int j = 0; j < VEC; j += 4)
            words[j / 4] = fp8x4<E5M2>(to_float(v.v[j]) * scale, to_float(v.v[j + 1]) * scale,
                                       to_float(v.v[j + 2]) * scale, to_float(v.v[j + 3]) * scale);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = to_fp8<E5M2>(to_float(v.v[j]), scale, fp8_max);
    }
    return out;
}

}  // namespace primus_turbo
