// The experts step's glue kernels (route plan, gather + input quantization, activation + requantization, weighted
// top-k reduction) of the ``cuda`` backend. Contracts: moe_glue.h. The torch-op functions of experts.py define
// what each kernel computes (bit for bit where torch's ops are correctly rounded); vLLM counterparts:
// csrc/moe/moe_align_sum_kernels.cu (moe_align_block_size), csrc/moe/moe_permute_unpermute_op.cu,
// csrc/quantization/w8a8/fp8/common.cu (dynamic_per_token_scaled_fp8_quant), csrc/activation_kernels.cu.
//
// Rounding: every fp32 operation below is one IEEE operation (nvcc's default -prec-div=true; no --use_fast_math);
// where torch rounds a product before a sum, __fmul_rn / __fadd_rn stop nvcc from contracting them into an FMA.

#include "moe_glue.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace moe_glue {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxTopk = 64;
// vLLM's dynamic per-token floor, 1 / (448 * 512) rounded once to fp32 (the reference's _MIN_PER_TOKEN_SCALE).
constexpr float kMinTokenScale = 1.0f / (448.0f * 512.0f);

// max that lets NaN win (torch's amax / max propagate NaN; fmaxf would drop it)
__device__ __forceinline__ float nanmax(float a, float b) { return (a != a || a > b) ? a : b; }

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  // RNE with saturation to +-448 (torch: clamp(-448, 448) then .to(float8_e4m3fn)); NaN stays NaN
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

__device__ __forceinline__ uint2 pack_e4m3x8(const float (&f)[8]) {
  uint2 v;
  uint8_t* p = reinterpret_cast<uint8_t*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) p[i] = to_e4m3(f[i]);
  return v;
}

// NaN-propagating max over the block; ``red`` holds 32 floats of shared memory. Every thread gets the result.
__device__ float block_nanmax(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o; o >>= 1) v = nanmax(v, __shfl_xor_sync(kFull, v, o));
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? red[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o; o >>= 1) w = nanmax(w, __shfl_xor_sync(kFull, w, o));
    if (lane == 0) red[0] = w;
  }
  __syncthreads();
  const float out = red[0];
  __syncthreads();  // red may be reused right after
  return out;
}

// The reference's dynamic per-token scale: max(amax / 448, 1 / (448 * 512)); a non-finite amax poisons the row.
__device__ __forceinline__ float token_scale(float amax) {
  return isfinite(amax) ? fmaxf(amax / kFp8Max, kMinTokenScale) : __int_as_float(0x7fc00000);
}

// ---------------------------------------------------------------------------------------------------------------
// Route plan: one block of 32 warps; warp w owns the routes [w * per_warp, (w + 1) * per_warp) so that rows are
// handed out in route order within each expert (the torch plan's stable sort), without a global sort.
// ---------------------------------------------------------------------------------------------------------------

constexpr int kPlanWarps = 32;
constexpr int kPlanBatch = 4;  // warp-steps of ids loaded together

template <typename IdT>
__device__ __forceinline__ int local_expert(IdT id, const int32_t* __restrict__ map, int n_ids, int E) {
  if (id < -1 || id >= n_ids) return -2;  // outside the id space: the token is poisoned
  if (id == -1) return -1;                // no route
  const int l = map ? map[id] : static_cast<int>(id);
  return (l >= 0 && l < E) ? l : -1;      // not held here (expert_map -1, or past E_local)
}

// The local experts of routes b0 + 32 j + lane (j < kPlanBatch): the loads issued together, -3 past r1.
template <typename IdT>
__device__ __forceinline__ void load_batch(int (&eb)[kPlanBatch], const IdT* __restrict__ ids, int b0, int r1,
                                           int lane, const int32_t* __restrict__ map, int n_ids, int E) {
#pragma unroll
  for (int j = 0; j < kPlanBatch; ++j) {
    const int r = b0 + 32 * j + lane;
    eb[j] = r < r1 ? local_expert(ids[r], map, n_ids, E) : -3;
  }
}

template <typename IdT>
__device__ __forceinline__ void plan_body(const IdT* __restrict__ ids, int R, int topk,
                                          const int32_t* __restrict__ map, int n_ids, int E,
                                          int32_t* __restrict__ offs, int32_t* __restrict__ inv,
                                          int32_t* __restrict__ token) {
  extern __shared__ int32_t smem[];  // [kPlanWarps][E] counts, then bases; [32] warp sums
  int32_t* warp_sums = smem + kPlanWarps * E;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // At least 32 routes per warp: at decode one warp holds them all, and the per-expert column sums below run over
  // the busy warps only (over all 32 they cost ~2 us of shared-memory latency at M = 1).
  const int nw = min(kPlanWarps, (R + 31) / 32);
  for (int i = tid; i < nw * E; i += blockDim.x) smem[i] = 0;
  __syncthreads();

  const int per_warp = (R + nw - 1) / nw;
  const int r0 = warp < nw ? min(R, warp * per_warp) : R, r1 = min(R, r0 + per_warp);
  int32_t* cnt = smem + warp * E;
  // The ids are read kPlanBatch warp-steps at a time (independent loads in flight: one block streams every route,
  // so latency, not bandwidth, bounds this kernel).
  for (int b0 = r0; b0 < r1; b0 += 32 * kPlanBatch) {
    int eb[kPlanBatch];
    load_batch(eb, ids, b0, r1, lane, map, n_ids, E);
#pragma unroll
    for (int j = 0; j < kPlanBatch; ++j)
      if (eb[j] >= 0) atomicAdd(&cnt[eb[j]], 1);
  }
  __syncthreads();

  // Thread e: the warps' counts of expert e become exclusive prefixes; total = rows of expert e.
  int total = 0;
  if (tid < E) {
    for (int w = 0; w < nw; ++w) {
      const int c = smem[w * E + tid];
      smem[w * E + tid] = total;
      total += c;
    }
  }
  // Exclusive scan of the totals over e (one per thread).
  int incl = total;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int s = warp_sums[lane];
    int si = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kFull, si, o);
      if (lane >= o) si += v;
    }
    warp_sums[lane] = si - s;
  }
  __syncthreads();
  if (tid < E) {
    const int start = warp_sums[warp] + incl - total;
    offs[tid] = start + total;
    for (int w = 0; w < nw; ++w) smem[w * E + tid] += start;
  }
  __syncthreads();

  // Hand out rows: lanes with the same expert are ranked by lane (= route order); the lowest lane advances.
  const unsigned lower = (1u << lane) - 1u;
  for (int b0 = r0; b0 < r1; b0 += 32 * kPlanBatch) {  // warp-uniform bounds: every lane takes part in the match
    int eb[kPlanBatch];
    load_batch(eb, ids, b0, r1, lane, map, n_ids, E);
#pragma unroll
    for (int j = 0; j < kPlanBatch; ++j) {
      const int r = b0 + 32 * j + lane, e = eb[j];
      const unsigned peers = __match_any_sync(kFull, e);
      if (e >= 0) {
        const int pos = cnt[e] + __popc(peers & lower);
        inv[r] = pos;
        token[pos] = r / topk;
      } else if (r < r1) {
        inv[r] = e;
      }
      __syncwarp();
      if (e >= 0 && (peers & lower) == 0) cnt[e] += __popc(peers);
      __syncwarp();
    }
  }
}

template <typename IdT>
__global__ void __launch_bounds__(kPlanWarps * 32)
    route_plan_kernel(const IdT* __restrict__ ids, int R, int topk, const int32_t* __restrict__ map, int n_ids,
                      int E, int32_t* __restrict__ offs, int32_t* __restrict__ inv, int32_t* __restrict__ token) {
  plan_body(ids, R, topk, map, n_ids, E, offs, inv, token);
}

// ---------------------------------------------------------------------------------------------------------------
// Scatter rows: one block per token; its row is read (and quantized) once and written to each local route's row.
// ---------------------------------------------------------------------------------------------------------------

constexpr int kScatterThreads = 128;

template <bool X_FP8, int MODE>
__global__ void __launch_bounds__(kScatterThreads)
    scatter_rows_kernel(const uint8_t* __restrict__ x, int K, int topk, const int32_t* __restrict__ inv,
                        const float* __restrict__ scale_in, bool per_token, uint8_t* __restrict__ out,
                        float* __restrict__ scale_out) {
  __shared__ int dst[kMaxTopk];
  __shared__ float red[32];
  const int t = blockIdx.x;
  int n_dst = 0;
  for (int k = 0; k < topk; ++k) {  // every thread walks the same list; thread 0 stores it
    const int pos = inv[static_cast<int64_t>(t) * topk + k];
    if (pos >= 0) {
      if (threadIdx.x == 0) dst[n_dst] = pos;
      ++n_dst;
    }
  }
  __syncthreads();
  if (n_dst == 0) return;

  if constexpr (MODE == kCopy) {
    const int elem = X_FP8 ? 1 : 2;
    const int nvec = K * elem / 16;
    const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * K * elem);
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      const uint4 val = src[v];
      for (int i = 0; i < n_dst; ++i)
        reinterpret_cast<uint4*>(out + static_cast<int64_t>(dst[i]) * K * elem)[v] = val;
    }
    if (X_FP8 && threadIdx.x < n_dst) scale_out[dst[threadIdx.x]] = scale_in[per_token ? t : 0];
  } else {
    static_assert(!X_FP8, "quantizing modes read bf16 rows");
    const int nvec = K / 8;
    const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * K * 2);
    float s, mult = 0.0f;
    if constexpr (MODE == kQuantPerToken) {
      float amax = 0.0f;
      for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
        float f[8];
        unpack_bf16x8(src[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = nanmax(amax, fabsf(f[i]));
      }
      s = token_scale(block_nanmax(amax, red));
    } else {  // kQuantStaticTensor: the kernel inverts the scale once and multiplies (vLLM's static recipe)
      s = scale_in[0];
      mult = s == 0.0f ? 0.0f : 1.0f / s;
    }
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      float f[8];
      unpack_bf16x8(src[v], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = MODE == kQuantPerToken ? f[i] / s : f[i] * mult;
      const uint2 q = pack_e4m3x8(f);
      for (int i = 0; i < n_dst; ++i) reinterpret_cast<uint2*>(out + static_cast<int64_t>(dst[i]) * K)[v] = q;
    }
    if (threadIdx.x < n_dst) scale_out[dst[threadIdx.x]] = s;
  }
}

// The same for a few tokens in the plan's own block (one launch instead of two at decode): the block's warps split
// into groups of 32 / M warps (at least one), a group per token, so every row is read with the whole block's
// parallelism; the routes' rows are read back from ``inv`` (written by this block before the barrier).
template <bool X_FP8, int MODE>
__device__ void scatter_tokens_block(int M, const uint8_t* __restrict__ x, int K, int topk,
                                     const int32_t* __restrict__ inv, const float* __restrict__ scale_in,
                                     bool per_token, uint8_t* __restrict__ out, float* __restrict__ scale_out) {
  __shared__ float red[kPlanWarps];
  __shared__ int rows[kPlanWarps][kMaxTopk];  // each group's token's rows, read once from inv
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wpt = max(1, kPlanWarps / M);  // warps per token
  const int groups = kPlanWarps / wpt;     // tokens per round
  const int g = warp / wpt, gthreads = wpt * 32, gt = (warp % wpt) * 32 + lane;
  const int elem = (X_FP8 || MODE != kCopy) ? 1 : 2;  // output bytes per element
  const int nvec = MODE == kCopy ? K * elem / 16 : K / 8;
  for (int t0 = 0; t0 < M; t0 += groups) {  // block-uniform rounds: the barriers below are reached by all
    const int t = t0 + g;
    const bool active = g < groups && t < M;
    int* dst = rows[active ? g : 0];
    if (active)
      for (int k = gt; k < topk; k += gthreads) dst[k] = inv[static_cast<int64_t>(t) * topk + k];
    __syncthreads();
    float s = 0.0f, mult = 0.0f;
    uint4 first = make_uint4(0, 0, 0, 0);  // this thread's first vector, kept for the second pass (decode: the only)
    if constexpr (MODE == kQuantPerToken) {
      float amax = 0.0f;
      if (active) {
        const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * K * 2);
        for (int v = gt; v < nvec; v += gthreads) {
          const uint4 raw = src[v];
          if (v == gt) first = raw;
          float f[8];
          unpack_bf16x8(raw, f);
#pragma unroll
          for (int i = 0; i < 8; ++i) amax = nanmax(amax, fabsf(f[i]));
        }
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) amax = nanmax(amax, __shfl_xor_sync(kFull, amax, o));
      if (lane == 0) red[warp] = amax;
      __syncthreads();
      // the group's warps' maxima, combined by shuffles (g, hence ``active``, is the same on all lanes of a warp)
      float a = lane < wpt && g < groups ? red[g * wpt + lane] : 0.0f;
#pragma unroll
      for (int o = 16; o; o >>= 1) a = nanmax(a, __shfl_xor_sync(kFull, a, o));
      s = token_scale(a);
    } else if constexpr (MODE == kQuantStaticTensor) {
      s = scale_in[0];
      mult = s == 0.0f ? 0.0f : 1.0f / s;
    } else if (X_FP8) {
      s = scale_in[per_token ? (active ? t : 0) : 0];
    }
    if (active) {
      if constexpr (MODE == kCopy) {
        const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * K * elem);
        for (int v = gt; v < nvec; v += gthreads) {
          const uint4 val = src[v];
          for (int k = 0; k < topk; ++k) {
            const int pos = dst[k];
            if (pos >= 0) reinterpret_cast<uint4*>(out + static_cast<int64_t>(pos) * K * elem)[v] = val;
          }
        }
      } else {
        const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * K * 2);
        for (int v = gt; v < nvec; v += gthreads) {  // the row is in L1 / L2 now (per token: read above)
          float f[8];
          unpack_bf16x8(MODE == kQuantPerToken && v == gt ? first : src[v], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) f[i] = MODE == kQuantPerToken ? f[i] / s : f[i] * mult;
          const uint2 q = pack_e4m3x8(f);
          for (int k = 0; k < topk; ++k) {
            const int pos = dst[k];
            if (pos >= 0) reinterpret_cast<uint2*>(out + static_cast<int64_t>(pos) * K)[v] = q;
          }
        }
      }
      if (X_FP8 || MODE != kCopy) {
        for (int k = gt; k < topk; k += gthreads)
          if (dst[k] >= 0) scale_out[dst[k]] = s;
      }
    }
    __syncthreads();  // red is rewritten by the next round
  }
}

template <typename IdT, bool X_FP8, int MODE>
__global__ void __launch_bounds__(kPlanWarps * 32)
    route_plan_scatter_kernel(const IdT* __restrict__ ids, int M, int topk, const int32_t* __restrict__ map,
                              int n_ids, int E, int32_t* __restrict__ offs, int32_t* __restrict__ inv,
                              int32_t* __restrict__ token, const uint8_t* __restrict__ x, int K,
                              const float* __restrict__ scale_in, bool per_token, uint8_t* __restrict__ out,
                              float* __restrict__ scale_out) {
  plan_body(ids, M * topk, topk, map, n_ids, E, offs, inv, token);
  __syncthreads();  // inv, written above by this block, is read back below
  scatter_tokens_block<X_FP8, MODE>(M, x, K, topk, inv, scale_in, per_token, out, scale_out);
}

// ---------------------------------------------------------------------------------------------------------------
// Activation (+ requantization): a grid-stride loop over the rows that belong to an expert (offs[E - 1] of them,
// read on the device, so no host synchronisation).
// ---------------------------------------------------------------------------------------------------------------

struct ActParams {
  float alpha, beta, limit;  // limit < 0: no clamp where the clamp is optional
};

// torch.clamp semantics: NaN passes through.
__device__ __forceinline__ float clamp_max(float x, float hi) { return x > hi ? hi : x; }
__device__ __forceinline__ float clamp_both(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

// torch's CUDA formulas (ATen/native/cuda/ActivationSiluKernel.cu, ActivationGeluKernel.cu, UnarySpecialOpsKernel.cu)
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_erf(float x) {
  constexpr float kAlpha = static_cast<float>(M_SQRT1_2);
  return 0.5f * x * (1.0f + erff(x * kAlpha));
}
__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  const float x_cube = x * x * x;
  const float inner = kBeta * (x + kKappa * x_cube);
  return 0.5f * x * (1.0f + tanhf(inner));
}

template <int ACT>
__device__ __forceinline__ float activate(float gate, float up, const ActParams& p) {
  if constexpr (ACT == kSilu) {
    if (p.limit >= 0.0f) {
      gate = clamp_max(gate, p.limit);
      up = clamp_both(up, -p.limit, p.limit);
    }
    return __fmul_rn(silu(gate), up);
  } else if constexpr (ACT == kGelu) {
    return __fmul_rn(gelu_erf(gate), up);
  } else if constexpr (ACT == kGeluTanh) {
    return __fmul_rn(gelu_tanh(gate), up);
  } else if constexpr (ACT == kSwigluOai) {
    gate = clamp_max(gate, p.limit);
    up = clamp_both(up, -p.limit, p.limit);
    return __fmul_rn(__fmul_rn(__fadd_rn(up, 1.0f), gate), sigmoid(__fmul_rn(p.alpha, gate)));
  } else if constexpr (ACT == kSwigluOaiUninterleave) {
    if (p.limit >= 0.0f) {
      gate = clamp_max(gate, p.limit);
      up = clamp_both(up, -p.limit, p.limit);
    }
    return __fmul_rn(__fmul_rn(gate, sigmoid(__fmul_rn(p.alpha, gate))), __fadd_rn(up, p.beta));
  } else if constexpr (ACT == kSwigluStep) {
    return __fmul_rn(clamp_max(silu(gate), p.limit), clamp_both(up, -p.limit, p.limit));
  } else if constexpr (ACT == kSiluNoMul) {
    return silu(gate);
  } else if constexpr (ACT == kGeluNoMul) {
    return gelu_erf(gate);
  } else {  // kRelu2NoMul
    const float r = gate > 0.0f ? gate : (gate != gate ? gate : 0.0f);
    return __fmul_rn(r, r);
  }
}

constexpr bool is_gated(int act) { return act <= kSwigluStep; }

template <int ACT, int OUT>
__global__ void __launch_bounds__(256)
    act_quant_kernel(const __nv_bfloat16* __restrict__ h, int N, int I, ActParams p, const int32_t* __restrict__ offs,
                     int E, uint8_t* __restrict__ out, float* __restrict__ scale_out,
                     const float* __restrict__ static_scale, float* __restrict__ amax_out) {
  extern __shared__ __align__(16) __nv_bfloat16 staged[];  // kActFp8PerToken: the activated row, I bf16 (uint4 access)
  __shared__ float red[32];
  const int rows = offs[E - 1];
  float mult = 0.0f;
  if constexpr (OUT == kActFp8StaticTensor) {
    const float s = static_scale[0];
    mult = s == 0.0f ? 0.0f : 1.0f / s;
  }
  float amax_all = 0.0f;  // kActBf16 with amax_out
  const int nvec = I / 8;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {  // block-uniform bound
    const __nv_bfloat16* hr = h + static_cast<int64_t>(row) * N;
    float amax = 0.0f;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      float g[8], u[8], y[8];
      if constexpr (ACT == kSwigluOai) {  // interleaved: gate = even columns, up = odd columns
        float a[8], b[8];
        unpack_bf16x8(reinterpret_cast<const uint4*>(hr)[2 * v], a);
        unpack_bf16x8(reinterpret_cast<const uint4*>(hr)[2 * v + 1], b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          g[i] = a[2 * i];
          u[i] = a[2 * i + 1];
          g[4 + i] = b[2 * i];
          u[4 + i] = b[2 * i + 1];
        }
      } else {
        unpack_bf16x8(reinterpret_cast<const uint4*>(hr)[v], g);
        if constexpr (is_gated(ACT)) unpack_bf16x8(reinterpret_cast<const uint4*>(hr + I)[v], u);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        y[i] = bf16_round(activate<ACT>(g[i], is_gated(ACT) ? u[i] : 0.0f, p));
        amax = nanmax(amax, fabsf(y[i]));
      }
      if constexpr (OUT == kActBf16) {
        reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * I * 2)[v] = pack_bf16x8(y);
      } else if constexpr (OUT == kActFp8PerToken) {
        reinterpret_cast<uint4*>(staged)[v] = pack_bf16x8(y);  // exact: y is already bf16
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] *= mult;
        reinterpret_cast<uint2*>(out + static_cast<int64_t>(row) * I)[v] = pack_e4m3x8(y);
      }
    }
    if constexpr (OUT == kActFp8PerToken) {
      const float s = token_scale(block_nanmax(amax, red));  // its barriers also publish ``staged``
      for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
        float y[8];
        unpack_bf16x8(reinterpret_cast<const uint4*>(staged)[v], y);
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = y[i] / s;
        reinterpret_cast<uint2*>(out + static_cast<int64_t>(row) * I)[v] = pack_e4m3x8(y);
      }
      if (threadIdx.x == 0) scale_out[row] = s;
      __syncthreads();  // ``staged`` is rewritten by the next row
    } else {
      amax_all = nanmax(amax_all, amax);
    }
  }
  if (OUT == kActBf16 && amax_out != nullptr) {
    const float m = block_nanmax(amax_all, red);
    // |v| >= 0, so its bits order as integers; NaN's bits (0x7fc00000) exceed +inf's: NaN wins, as in torch.amax
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax_out), __float_as_int(m));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Weighted top-k reduction: block (token, column chunk); products rounded, summed in k order (the reference's
// (y * w).sum over k), one rounding to bf16.
// ---------------------------------------------------------------------------------------------------------------

constexpr int kReduceThreads = 128;
constexpr int kReduceChunk = 8;  // routes whose rows are loaded together

__global__ void __launch_bounds__(kReduceThreads)
    weight_reduce_kernel(const __nv_bfloat16* __restrict__ y, int K, int topk, const int32_t* __restrict__ inv,
                         const float* __restrict__ w, __nv_bfloat16* __restrict__ out) {
  const int t = blockIdx.x;
  const int col = (blockIdx.y * kReduceThreads + threadIdx.x) * 8;
  if (col >= K) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  bool poisoned = false;
  const int32_t* rows = inv + static_cast<int64_t>(t) * topk;
  for (int k0 = 0; k0 < topk; k0 += kReduceChunk) {
    // all loads of the chunk first (independent), then the sums in k order
    uint4 v[kReduceChunk];
    int pos[kReduceChunk];
#pragma unroll
    for (int j = 0; j < kReduceChunk; ++j) {
      pos[j] = k0 + j < topk ? rows[k0 + j] : -1;
      if (pos[j] >= 0) v[j] = *reinterpret_cast<const uint4*>(y + static_cast<int64_t>(pos[j]) * K + col);
    }
#pragma unroll
    for (int j = 0; j < kReduceChunk; ++j) {
      poisoned |= pos[j] == -2;
      if (pos[j] < 0) continue;
      const float wk = w ? w[static_cast<int64_t>(t) * topk + k0 + j] : 1.0f;
      float f[8];
      unpack_bf16x8(v[j], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wk, f[i]));
    }
  }
  if (poisoned) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = __int_as_float(0x7fc00000);
  }
  *reinterpret_cast<uint4*>(out + static_cast<int64_t>(t) * K + col) = pack_bf16x8(acc);
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// The contracts of moe_glue.h, shared by the separate launchers and the fused one.
bool plan_args_ok(const void* topk_ids, int M, int topk, int n_ids, int E_local, const int32_t* offs,
                  const int32_t* inv, const int32_t* sorted_token) {
  return M >= 1 && topk >= 1 && E_local >= 1 && E_local <= kMaxLocalExperts && n_ids >= 1 && topk_ids && offs &&
         inv && sorted_token && static_cast<int64_t>(M) * topk <= (1ll << 30);
}

bool scatter_args_ok(const void* x, bool x_fp8, int K, int topk, int mode, const float* scale_in, const void* out,
                     const float* scale_out) {
  if (K < 8 || K % (x_fp8 ? 16 : 8) || topk < 1 || topk > kMaxTopk || !x || !out || !aligned16(x) ||
      !aligned16(out) || mode < kCopy || mode > kQuantStaticTensor || (x_fp8 && mode != kCopy))
    return false;
  if ((x_fp8 || mode != kCopy) && !scale_out) return false;  // the rows' scales
  return !((x_fp8 || mode == kQuantStaticTensor) && !scale_in);
}

template <int ACT>
cudaError_t launch_act(int out_kind, dim3 grid, int threads, size_t smem, cudaStream_t stream,
                       const __nv_bfloat16* h, int N, int I, ActParams p, const int32_t* offs, int E, uint8_t* out,
                       float* scale_out, const float* static_scale, float* amax_out) {
  switch (out_kind) {
    case kActBf16:
      act_quant_kernel<ACT, kActBf16><<<grid, threads, 0, stream>>>(h, N, I, p, offs, E, out, scale_out,
                                                                    static_scale, amax_out);
      break;
    case kActFp8PerToken:
      act_quant_kernel<ACT, kActFp8PerToken><<<grid, threads, smem, stream>>>(h, N, I, p, offs, E, out, scale_out,
                                                                              static_scale, amax_out);
      break;
    case kActFp8StaticTensor:
      act_quant_kernel<ACT, kActFp8StaticTensor><<<grid, threads, 0, stream>>>(h, N, I, p, offs, E, out,
                                                                               scale_out, static_scale, amax_out);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_route_plan(const void* topk_ids, bool ids_int64, int M, int topk, const int32_t* expert_map,
                              int n_ids, int E_local, int32_t* offs, int32_t* inv, int32_t* sorted_token,
                              cudaStream_t stream) {
  if (!plan_args_ok(topk_ids, M, topk, n_ids, E_local, offs, inv, sorted_token)) return cudaErrorInvalidValue;
  const int R = M * topk;
  const size_t smem = (static_cast<size_t>(kPlanWarps) * E_local + 32) * sizeof(int32_t);
  if (smem > 48 * 1024) {  // past the default limit (E_local > 383): opt in, per call (per device, cheap)
    const cudaError_t err = ids_int64 ? cudaFuncSetAttribute(route_plan_kernel<int64_t>,
                                                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem)
                                      : cudaFuncSetAttribute(route_plan_kernel<int32_t>,
                                                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  if (ids_int64) {
    route_plan_kernel<int64_t><<<1, kPlanWarps * 32, smem, stream>>>(
        static_cast<const int64_t*>(topk_ids), R, topk, expert_map, n_ids, E_local, offs, inv, sorted_token);
  } else {
    route_plan_kernel<int32_t><<<1, kPlanWarps * 32, smem, stream>>>(
        static_cast<const int32_t*>(topk_ids), R, topk, expert_map, n_ids, E_local, offs, inv, sorted_token);
  }
  return cudaGetLastError();
}

cudaError_t launch_scatter_rows(const void* x, bool x_fp8, int M, int K, int topk, const int32_t* inv, int mode,
                                const float* scale_in, bool scale_per_token, void* out, float* scale_out,
                                cudaStream_t stream) {
  if (M < 1 || !inv || !scatter_args_ok(x, x_fp8, K, topk, mode, scale_in, out, scale_out))
    return cudaErrorInvalidValue;
  const auto* xb = static_cast<const uint8_t*>(x);
  auto* ob = static_cast<uint8_t*>(out);
  const dim3 grid(M);
  if (x_fp8) {
    if (mode != kCopy) return cudaErrorInvalidValue;
    scatter_rows_kernel<true, kCopy><<<grid, kScatterThreads, 0, stream>>>(xb, K, topk, inv, scale_in,
                                                                          scale_per_token, ob, scale_out);
  } else if (mode == kCopy) {
    scatter_rows_kernel<false, kCopy><<<grid, kScatterThreads, 0, stream>>>(xb, K, topk, inv, scale_in, false, ob,
                                                                           nullptr);
  } else if (mode == kQuantPerToken) {
    scatter_rows_kernel<false, kQuantPerToken><<<grid, kScatterThreads, 0, stream>>>(xb, K, topk, inv, scale_in,
                                                                                    false, ob, scale_out);
  } else if (mode == kQuantStaticTensor) {
    scatter_rows_kernel<false, kQuantStaticTensor><<<grid, kScatterThreads, 0, stream>>>(xb, K, topk, inv, scale_in,
                                                                                        false, ob, scale_out);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

namespace {

template <typename IdT, bool X_FP8, int MODE>
cudaError_t launch_fused(const void* ids, int M, int topk, const int32_t* map, int n_ids, int E, int32_t* offs,
                         int32_t* inv, int32_t* token, const void* x, int K, const float* scale_in, bool per_token,
                         void* out, float* scale_out, size_t smem, cudaStream_t stream) {
  auto* kernel = route_plan_scatter_kernel<IdT, X_FP8, MODE>;
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  if (smem + attr.sharedSizeBytes > 48 * 1024) {  // static (staged rows) + dynamic past the default: opt in
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<1, kPlanWarps * 32, smem, stream>>>(static_cast<const IdT*>(ids), M, topk, map, n_ids, E, offs, inv, token,
                                               static_cast<const uint8_t*>(x), K, scale_in, per_token,
                                               static_cast<uint8_t*>(out), scale_out);
  return cudaGetLastError();
}

template <typename IdT>
cudaError_t launch_fused_modes(bool x_fp8, int mode, const void* ids, int M, int topk, const int32_t* map, int n_ids,
                               int E, int32_t* offs, int32_t* inv, int32_t* token, const void* x, int K,
                               const float* scale_in, bool per_token, void* out, float* scale_out, size_t smem,
                               cudaStream_t stream) {
  if (x_fp8)
    return launch_fused<IdT, true, kCopy>(ids, M, topk, map, n_ids, E, offs, inv, token, x, K, scale_in, per_token,
                                          out, scale_out, smem, stream);
  if (mode == kCopy)
    return launch_fused<IdT, false, kCopy>(ids, M, topk, map, n_ids, E, offs, inv, token, x, K, scale_in, false, out,
                                           scale_out, smem, stream);
  if (mode == kQuantPerToken)
    return launch_fused<IdT, false, kQuantPerToken>(ids, M, topk, map, n_ids, E, offs, inv, token, x, K, scale_in,
                                                    false, out, scale_out, smem, stream);
  return launch_fused<IdT, false, kQuantStaticTensor>(ids, M, topk, map, n_ids, E, offs, inv, token, x, K, scale_in,
                                                      false, out, scale_out, smem, stream);
}

}  // namespace

cudaError_t launch_route_plan_scatter(const void* topk_ids, bool ids_int64, int M, int topk, const int32_t* expert_map,
                                      int n_ids, int E_local, int32_t* offs, int32_t* inv, int32_t* sorted_token,
                                      const void* x, bool x_fp8, int K, int mode, const float* scale_in,
                                      bool scale_per_token, void* out, float* scale_out, cudaStream_t stream) {
  const int64_t out_bytes = static_cast<int64_t>(M) * topk * K * ((x_fp8 || mode != kCopy) ? 1 : 2);
  if (out_bytes > kFusedScatterMaxBytes) {
    const cudaError_t err = launch_route_plan(topk_ids, ids_int64, M, topk, expert_map, n_ids, E_local, offs, inv,
                                              sorted_token, stream);
    if (err != cudaSuccess) return err;
    return launch_scatter_rows(x, x_fp8, M, K, topk, inv, mode, scale_in, scale_per_token, out, scale_out, stream);
  }
  // the two launchers' checks, for the one fused launch
  if (!plan_args_ok(topk_ids, M, topk, n_ids, E_local, offs, inv, sorted_token) ||
      !scatter_args_ok(x, x_fp8, K, topk, mode, scale_in, out, scale_out))
    return cudaErrorInvalidValue;
  const size_t smem = (static_cast<size_t>(kPlanWarps) * E_local + 32) * sizeof(int32_t);
  return ids_int64 ? launch_fused_modes<int64_t>(x_fp8, mode, topk_ids, M, topk, expert_map, n_ids, E_local, offs,
                                                 inv, sorted_token, x, K, scale_in, scale_per_token, out, scale_out,
                                                 smem, stream)
                   : launch_fused_modes<int32_t>(x_fp8, mode, topk_ids, M, topk, expert_map, n_ids, E_local, offs,
                                                 inv, sorted_token, x, K, scale_in, scale_per_token, out, scale_out,
                                                 smem, stream);
}

cudaError_t launch_act_quant(const void* h, int R, int N, int act, float alpha, float beta, float limit,
                             const int32_t* offs, int E_local, int out_kind, void* out, float* scale_out,
                             const float* static_scale, float* amax_out, int num_sms, cudaStream_t stream) {
  if (act < kSilu || act > kRelu2NoMul || R < 1 || E_local < 1 || !h || !offs || !out || !aligned16(h) ||
      !aligned16(out))
    return cudaErrorInvalidValue;
  const int I = is_gated(act) ? N / 2 : N;
  if ((is_gated(act) && N % 2) || I < 8 || I % 8 || I > kMaxActWidth) return cudaErrorInvalidValue;
  if ((out_kind == kActFp8PerToken && !scale_out) || (out_kind == kActFp8StaticTensor && !static_scale))
    return cudaErrorInvalidValue;
  const int threads = I <= 1024 ? 128 : 256;
  const int blocks_per_sm = 2048 / threads;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(R, static_cast<int64_t>(std::max(num_sms, 1)) *
                                                                 blocks_per_sm)));
  const size_t smem = out_kind == kActFp8PerToken ? static_cast<size_t>(I) * 2 : 0;
  const ActParams p{alpha, beta, limit};
  const auto* hb = static_cast<const __nv_bfloat16*>(h);
  auto* ob = static_cast<uint8_t*>(out);
  switch (act) {
    case kSilu: return launch_act<kSilu>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs, E_local, ob,
                                         scale_out, static_scale, amax_out);
    case kGelu: return launch_act<kGelu>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs, E_local, ob,
                                         scale_out, static_scale, amax_out);
    case kGeluTanh: return launch_act<kGeluTanh>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs, E_local,
                                                 ob, scale_out, static_scale, amax_out);
    case kSwigluOai: return launch_act<kSwigluOai>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs,
                                                   E_local, ob, scale_out, static_scale, amax_out);
    case kSwigluOaiUninterleave:
      return launch_act<kSwigluOaiUninterleave>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs, E_local, ob,
                                                scale_out, static_scale, amax_out);
    case kSwigluStep: return launch_act<kSwigluStep>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs,
                                                     E_local, ob, scale_out, static_scale, amax_out);
    case kSiluNoMul: return launch_act<kSiluNoMul>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs,
                                                   E_local, ob, scale_out, static_scale, amax_out);
    case kGeluNoMul: return launch_act<kGeluNoMul>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs,
                                                   E_local, ob, scale_out, static_scale, amax_out);
    default: return launch_act<kRelu2NoMul>(out_kind, grid, threads, smem, stream, hb, N, I, p, offs, E_local, ob,
                                            scale_out, static_scale, amax_out);
  }
}

cudaError_t launch_weight_reduce(const void* y, int K, int M, int topk, const int32_t* inv, const float* weights,
                                 void* out, cudaStream_t stream) {
  if (M < 1 || topk < 1 || K < 8 || K % 8 || !y || !inv || !out || !aligned16(y) || !aligned16(out))
    return cudaErrorInvalidValue;
  const dim3 grid(M, (K / 8 + kReduceThreads - 1) / kReduceThreads);
  weight_reduce_kernel<<<grid, kReduceThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(y), K, topk, inv,
                                                            weights, static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

}  // namespace moe_glue
