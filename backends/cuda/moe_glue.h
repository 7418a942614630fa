// The experts step's glue kernels of the ``cuda`` backend (everything around the two CUTLASS grouped GEMMs): plain
// CUDA C++, no torch headers, so nvcc alone can compile-check them (tests/test_cuda_backend.py).
//
// The step (backends/cuda/experts.py): route_plan -> scatter_rows (gather + input quantization) -> GEMM1 ->
// act_quant -> GEMM2 -> weight_reduce: four glue launches (three at decode, where the plan's block scatters too), none
// of them a host synchronisation. The torch-op
// functions of experts.py (route_plan, quant_fp8_per_token, cuda_moe_activation, _weight_and_reduce) define what
// each kernel computes; the GPU probe checks every kernel against them (python -m tools.cuda.glue_check).
//
// Layout: routes are ``r = token * topk + k``. The plan gives every local route a row ``inv[r]`` of the sorted
// operand, grouped by local expert in ascending route order (the torch plan's stable sort); rows past
// ``offs[E_local - 1]`` belong to no expert and are never read. ``inv[r]`` is -1 for a route to no local expert and
// -2 for an id outside the id space (its token's output row is NaN, never a plausible number).
//
// Contracts (checked again by each launcher; a violation returns cudaErrorInvalidValue without launching):
//   route_plan:    topk_ids (M, topk) int32 or int64 contiguous; expert_map (n_ids,) int32 or null (ids are local,
//                  n_ids = E_local); 1 <= E_local <= kMaxLocalExperts. One thread block (1024 threads).
//   scatter_rows:  x (M, K) bf16 (K a multiple of 8) or e4m3 codes (of 16); out (>= R, K) e4m3 or bf16; 16-byte
//                  aligned; topk <= 64.
//   act_quant:     h (R, N) bf16, N = 2 * I (gated) or I; I a multiple of 8 and <= kMaxActWidth.
//   weight_reduce: y (R, K) bf16, K a multiple of 8; out (M, K) bf16; weights (M, topk) fp32 or null (all 1).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe_glue {

constexpr int kMaxLocalExperts = 1023;  // torch's CUTLASS grouped GEMMs take fewer than 1024 groups
constexpr int kMaxActWidth = 16384;     // I: the activated row is staged in shared memory as bf16
constexpr float kFp8Max = 448.0f;
// launch_route_plan_scatter runs one fused launch (the plan's block scatters too) when it writes at most this much
constexpr long long kFusedScatterMaxBytes = 256 << 10;

// Activations, in the order of reference.activation.MoEActivation's gated / no-mul members that the backend claims.
enum Act : int {
  kSilu = 0,
  kGelu = 1,
  kGeluTanh = 2,
  kSwigluOai = 3,             // interleaved: gate = even columns, up = odd columns
  kSwigluOaiUninterleave = 4,
  kSwigluStep = 5,
  kSiluNoMul = 6,
  kGeluNoMul = 7,
  kRelu2NoMul = 8,
};

// What scatter_rows writes for each local route's row.
enum ScatterMode : int {
  kCopy = 0,             // the token row as it is (bf16 -> bf16, or e4m3 codes -> codes with their scale)
  kQuantPerToken = 1,    // bf16 -> e4m3, s = max(amax / 448, 1 / (448 * 512)), q = sat(x / s)
  kQuantStaticTensor = 2 // bf16 -> e4m3 with a given scale s: q = sat(x * (s == 0 ? 0 : 1 / s))
};

// What act_quant writes: bf16 (optionally the amax of the local rows, for a dynamic per-tensor scale), e4m3 codes
// with one dynamic scale per row, or e4m3 codes with a given per-tensor scale.
enum ActOut : int { kActBf16 = 0, kActFp8PerToken = 1, kActFp8StaticTensor = 2 };

// inv (M * topk,) int32, sorted_token (M * topk,) int32 (token of each sorted row; rows past offs[E_local - 1]
// untouched), offs (E_local,) int32 cumulative row counts.
cudaError_t launch_route_plan(const void* topk_ids, bool ids_int64, int M, int topk, const int32_t* expert_map,
                              int n_ids, int E_local, int32_t* offs, int32_t* inv, int32_t* sorted_token,
                              cudaStream_t stream);

// x (M, K) bf16 (x_fp8 false) or e4m3 codes; out rows inv[r] of (R, K) (e4m3 unless mode == kCopy with bf16 x);
// scale_in: kCopy of codes: per-token (M,) or per-tensor (1,) (scale_per_token says which); kQuantStaticTensor: (1,);
// scale_out (R,) fp32 (null for bf16 copies): each row's activation scale.
cudaError_t launch_scatter_rows(const void* x, bool x_fp8, int M, int K, int topk, const int32_t* inv, int mode,
                                const float* scale_in, bool scale_per_token, void* out, float* scale_out,
                                cudaStream_t stream);

// launch_route_plan, then launch_scatter_rows with that inv; one launch (the plan's block, a warp per token) when
// the rows written total at most kFusedScatterMaxBytes (decode: M * topk * K bytes).
cudaError_t launch_route_plan_scatter(const void* topk_ids, bool ids_int64, int M, int topk, const int32_t* expert_map,
                                      int n_ids, int E_local, int32_t* offs, int32_t* inv, int32_t* sorted_token,
                                      const void* x, bool x_fp8, int K, int mode, const float* scale_in,
                                      bool scale_per_token, void* out, float* scale_out, cudaStream_t stream);

// h (R, N) bf16 -> out (R, I) bf16 or e4m3 over the rows r < offs[E_local - 1]; scale_out (R,) for
// kActFp8PerToken; static_scale (1,) for kActFp8StaticTensor; amax_out (1,) fp32 (zeroed by the caller), or null,
// receives max |bf16 activation| over those rows for kActBf16. limit < 0: no clamp where the activation's clamp is
// optional (SILU, SWIGLUOAI_UNINTERLEAVE).
cudaError_t launch_act_quant(const void* h, int R, int N, int act, float alpha, float beta, float limit,
                             const int32_t* offs, int E_local, int out_kind, void* out, float* scale_out,
                             const float* static_scale, float* amax_out, int num_sms, cudaStream_t stream);

// out[t, :] = bf16(sum_k w[t, k] * y[inv[t * topk + k], :]) in fp32 (products rounded, summed in k order);
// routes with inv < 0 add nothing; a token with inv == -2 gets NaN.
cudaError_t launch_weight_reduce(const void* y, int K, int M, int topk, const int32_t* inv, const float* weights,
                                 void* out, cudaStream_t stream);

}  // namespace moe_glue
