// FP8 GEMM through cuBLASLt with a plan cache (see primus_turbo/gemm_fp8.h for the contract).
//
// Layout: cuBLASLt is column-major and Hopper's FP8 kernels take only the "TN" form, so the row-major
// problem C[m, n] = A[m, k] @ B[n, k]^T is passed as C^T[n, m] = op_T(B) @ op_N(A): cuBLAS's "A" is our
// B (a k x n column-major matrix, ld k, transposed), its "B" is our A (k x m, ld k), its output C^T is
// n x m column-major with ld n, which is our row-major C. Row-wise scales follow the swap: cuBLAS's A
// scale vector (length = its m = our n) is b_scale, its B scale vector (our m) is a_scale.
//
// Cache key: the problem plus the 16..256-byte alignment class of each pointer (the heuristic's answer
// is only valid for pointers at least as aligned as it was told). One descriptor per plan: a call sets
// the two scale pointers on it and enqueues under the cache mutex, so concurrent callers never see each
// other's pointers (cublasLtMatmul reads the descriptor while it enqueues, not later).
#include <cublasLt.h>

#include <functional>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "primus_turbo/gemm_fp8.h"

namespace primus_turbo {
namespace {

// 32 MiB: what cuBLASLt's Hopper kernels ask for at most (torch uses the same on sm_90); a smaller
// workspace makes the heuristic drop split-K and stream-K algorithms for skinny problems.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr size_t kMaxPlans = 4096;  // distinct shapes of a training run are a few hundred

struct PlanKey {
    int device;
    int64_t m, n, k;
    bool a_e5m2, b_e5m2;
    int out_dtype, scale_mode;
    bool fast_accum;
    int align_a, align_b, align_c;
    auto fields() const {
        return std::tie(device, m, n, k, a_e5m2, b_e5m2, out_dtype, scale_mode, fast_accum, align_a, align_b,
                        align_c);
    }
    bool operator==(const PlanKey& o) const { return fields() == o.fields(); }
};

struct PlanKeyHash {
    size_t operator()(const PlanKey& key) const {
        size_t h = 1469598103934665603ull;
        const int64_t parts[] = {key.device,     key.m,          key.n,          key.k,
                                 key.a_e5m2,     key.b_e5m2,     key.out_dtype,  key.scale_mode,
                                 key.fast_accum, key.align_a,    key.align_b,    key.align_c};
        for (const int64_t v : parts) h = (h ^ std::hash<int64_t>{}(v)) * 1099511628211ull;
        return h;
    }
};

struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool supported = false;
};

std::mutex g_mutex;
std::unordered_map<PlanKey, Plan, PlanKeyHash> g_plans;
std::unordered_map<int, cublasLtHandle_t> g_handles;

int alignment_class(const void* p) {
    const auto v = reinterpret_cast<uintptr_t>(p);
    int align = 256;
    while (align > 1 && v % align) align >>= 1;
    return align;
}

cudaDataType_t cuda_out_type(DType t) {
    switch (t) {
        case DType::kFloat32:
            return CUDA_R_32F;
        case DType::kFloat16:
            return CUDA_R_16F;
        default:
            return CUDA_R_16BF;
    }
}

void destroy(Plan& plan) {
    if (plan.layout_c) cublasLtMatrixLayoutDestroy(plan.layout_c);
    if (plan.layout_b) cublasLtMatrixLayoutDestroy(plan.layout_b);
    if (plan.layout_a) cublasLtMatrixLayoutDestroy(plan.layout_a);
    if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
    plan = Plan{};
}

#define PT_LT_TRY(call, what)                                                                      \
    do {                                                                                           \
        const cublasStatus_t status_ = (call);                                                     \
        if (status_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            if (error) *error = std::string(what) + " failed: " + cublasLtGetStatusString(status_); \
            return Fp8GemmStatus::kError;                                                          \
        }                                                                                          \
    } while (0)

// Descriptor, layouts and the heuristic's first algorithm for `key`. kUnsupported (plan.supported stays
// false and is cached) when the heuristic offers nothing.
Fp8GemmStatus build_plan(const PlanKey& key, cublasLtHandle_t handle, Plan& plan, std::string* error) {
    const cudaDataType_t type_a = key.a_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    const cudaDataType_t type_b = key.b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    const cudaDataType_t type_c = cuda_out_type(static_cast<DType>(key.out_dtype));
    PT_LT_TRY(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
    PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)),
              "set TRANSA");
    PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)),
              "set TRANSB");
    const int8_t fast = key.fast_accum ? 1 : 0;
    PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
              "set FAST_ACCUM");
    if (key.scale_mode == 1) {
        const cublasLtMatmulMatrixScale_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof(outer)),
                  "set A_SCALE_MODE");
        PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof(outer)),
                  "set B_SCALE_MODE");
    }
    // The heuristic must see scale pointers of the right kind; any valid address does (reset per call).
    static const float dummy_scale = 1.0f;
    const void* dummy = &dummy_scale;
    PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy, sizeof(dummy)),
              "set A_SCALE_POINTER");
    PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy, sizeof(dummy)),
              "set B_SCALE_POINTER");
    // cuBLAS A = our B (k x n, ld k, transposed); cuBLAS B = our A (k x m, ld k); C^T = n x m, ld n.
    PT_LT_TRY(cublasLtMatrixLayoutCreate(&plan.layout_a, type_b, key.k, key.n, key.k), "layout A");
    PT_LT_TRY(cublasLtMatrixLayoutCreate(&plan.layout_b, type_a, key.k, key.m, key.k), "layout B");
    PT_LT_TRY(cublasLtMatrixLayoutCreate(&plan.layout_c, type_c, key.n, key.m, key.n), "layout C");

    cublasLtMatmulPreference_t pref = nullptr;
    PT_LT_TRY(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t ws = kWorkspaceBytes;
    const uint32_t align_a = key.align_b, align_b = key.align_a, align_c = key.align_c;  // swapped roles
    cublasStatus_t status =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                      sizeof(align_a));
    if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                      sizeof(align_b));
    if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                      sizeof(align_c));
    if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                      sizeof(align_c));
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.layout_a, plan.layout_b, plan.layout_c,
                                                plan.layout_c, pref, 1, &result, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && returned == 0))
        return Fp8GemmStatus::kUnsupported;
    PT_LT_TRY(status, "cublasLtMatmulAlgoGetHeuristic");
    plan.algo = result.algo;
    plan.supported = true;
    return Fp8GemmStatus::kOk;
}

}  // namespace

size_t gemm_fp8_cublaslt_workspace_bytes() { return kWorkspaceBytes; }

size_t gemm_fp8_cublaslt_plan_count() {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_plans.size();
}

Fp8GemmStatus gemm_fp8_cublaslt(const Fp8GemmProblem& problem, const void* a, const void* b, void* c,
                                const float* a_scale, const float* b_scale, void* workspace, int device,
                                cudaStream_t stream, std::string* error) {
    PlanKey key;
    key.device = device;
    key.m = problem.m;
    key.n = problem.n;
    key.k = problem.k;
    key.a_e5m2 = problem.a_e5m2;
    key.b_e5m2 = problem.b_e5m2;
    key.out_dtype = static_cast<int>(problem.out_dtype);
    key.scale_mode = problem.scale_mode;
    key.fast_accum = problem.fast_accum;
    key.align_a = alignment_class(a);
    key.align_b = alignment_class(b);
    key.align_c = alignment_class(c);

    std::lock_guard<std::mutex> lock(g_mutex);
    auto handle_it = g_handles.find(device);
    if (handle_it == g_handles.end()) {
        cublasLtHandle_t handle = nullptr;
        PT_LT_TRY(cublasLtCreate(&handle), "cublasLtCreate");
        handle_it = g_handles.emplace(device, handle).first;
    }
    const cublasLtHandle_t handle = handle_it->second;
    auto it = g_plans.find(key);
    if (it == g_plans.end()) {
        if (g_plans.size() >= kMaxPlans) {
            for (auto& entry : g_plans) destroy(entry.second);
            g_plans.clear();
        }
        Plan plan;
        const Fp8GemmStatus status = build_plan(key, handle, plan, error);
        if (status == Fp8GemmStatus::kError) {
            destroy(plan);
            return status;
        }
        it = g_plans.emplace(key, plan).first;  // unsupported plans are cached too: asked once
    }
    Plan& plan = it->second;
    if (!plan.supported) return Fp8GemmStatus::kUnsupported;
    PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale,
                                             sizeof(b_scale)),
              "set A_SCALE_POINTER");
    PT_LT_TRY(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale,
                                             sizeof(a_scale)),
              "set B_SCALE_POINTER");
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t status = cublasLtMatmul(handle, plan.desc, &alpha, b, plan.layout_a, a, plan.layout_b, &beta,
                                                 c, plan.layout_c, c, plan.layout_c, &plan.algo, workspace,
                                                 kWorkspaceBytes, stream);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED) {  // the heuristic's algorithm declined at run time: ask no more
        plan.supported = false;
        return Fp8GemmStatus::kUnsupported;
    }
    PT_LT_TRY(status, "cublasLtMatmul");
    return Fp8GemmStatus::kOk;
}

}  // namespace primus_turbo
