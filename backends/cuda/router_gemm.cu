// Router (gate) GEMMs for small token counts: out (M, E) = x (M, H) @ w (E, H)^T with fp32 accumulation.
//
// Two instances of one kernel template (see router_gemm.h for the launch contracts):
//   dsv3_router_gemm  bf16 x, bf16 w, fp32 or bf16 out, H = 7168, E in {256, 384}, M <= 16
//                     (DeepSeek-V3 / Kimi-K2 gates; vLLM csrc/moe/dsv3_router_gemm_*.cu, from TensorRT-LLM)
//   fp32_router_gemm  bf16 or fp32 x, fp32 w, fp32 out, H = 3072, E = 256, M <= 32
//                     (MiniMax-M2 gate; vLLM csrc/moe/fp32_router_gemm_*.cu)
//
// Both are GEMVs in disguise: with M <= 32 the arithmetic intensity is at most 32 FMA per weight element, so the
// time floor is reading the weight once (DSV3: 7168 x 256 x 2 B = 3.67 MB, ~1.2 us at 3 TB/s). Design:
//
// * Grid (S, E / EPB), thread-block clusters of (S, 1, 1) blocks on SM90. Block (s, g) owns experts
//   [g * EPB, (g + 1) * EPB) and the K slice [s * H / S, (s + 1) * H / S). Splitting K shortens each thread's
//   serial chain (one 16-byte weight vector per expert instead of H / (8 * 128) = 7), keeps the activation bytes
//   each block pulls from L2 small (x is re-read by every expert group; at M = 16 all of x is 229 KB), and gives
//   several blocks per SM. Measured (docs/notes/cuda-results.md): the unsplit S = 1 variant is 1.3-2.3x slower for M >= 4.
// * Every thread issues all of its weight loads first (16-byte ld.global.nc.L1::no_allocate: each weight element
//   is read exactly once, for all M tokens, and bypasses L1), then loads its x vectors (16 or 8 bytes, __ldg,
//   L1-cached, several rows in flight at once) and accumulates acc[m][e] in fp32 registers; each x vector is
//   reused for the EPB experts of the block, each weight vector for the M tokens.
// * Reduction, all in a fixed order (bitwise deterministic): a warp-level butterfly reduce-scatter (each of the
//   V = M*EPB partial sums ends up on one lane after V-1 + 5 shuffles instead of 5V), a cross-warp sum through
//   shared memory, then the S blocks of the cluster add their partials through distributed shared memory
//   (block s finishes outputs s, s + S, ...). No global workspace, no atomics, one launch.
// * M is a run-time argument bounded by a compile-time bucket (1, 2, 4, 8, 16, 32): rows m >= M are skipped by a
//   block-uniform branch and never stored.
//
// At these sizes the kernel is latency-bound (H200: 3.7 us at M = 1 against a 0.9 us weight-read floor and a 1.2 us
// launch), 2x faster than cuBLAS at M = 1 and at parity at M = 16 (docs/notes/cuda-results.md).
//
// Compile: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a (clusters need sm_90 or newer).

#include "router_gemm.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace cg = cooperative_groups;

namespace moe_router {
namespace {

__host__ __device__ constexpr int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// 16-byte streaming load of weights: read-only path, no L1 allocation (each element is used once per block).
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits. Element 2i is the low half of word i.
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

template <typename TW>
struct WeightTraits;

template <>
struct WeightTraits<__nv_bfloat16> {
  static constexpr int kVec = 8;  // elements per 16-byte vector
  __device__ __forceinline__ static void unpack(const uint4& v, float (&f)[8]) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
    f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
    f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
  }
};

template <>
struct WeightTraits<float> {
  static constexpr int kVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
};

// Activation vectors: kVec elements (aligned to kVec), loaded raw through the read-only path (L1-cached: every
// expert of the block reuses them) and unpacked to fp32 later, so that all rows' loads can be in flight at once.
template <typename TX, int kVec>
struct XTraits;

template <>
struct XTraits<__nv_bfloat16, 8> {
  using Raw = uint4;
  __device__ __forceinline__ static Raw load(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ static void unpack(const Raw& v, float (&f)[8]) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
    f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
    f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
  }
};

template <>
struct XTraits<__nv_bfloat16, 4> {
  using Raw = uint2;
  __device__ __forceinline__ static Raw load(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
  __device__ __forceinline__ static void unpack(const Raw& v, float (&f)[4]) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
    f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
  }
};

template <>
struct XTraits<float, 4> {
  using Raw = uint4;
  __device__ __forceinline__ static Raw load(const float* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ static void unpack(const Raw& v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
};

// Butterfly reduce-scatter over the 32 lanes of a warp. On entry every lane holds N partial values r[0..N) (N a
// power of two); at offset O the lanes whose bit O is set keep the upper half of the values and the others the
// lower half, each adding its partner's copy. Once one value is left, the remaining offsets reduce it plainly.
// On exit lane l holds the warp sums of values [scatter_base(l), scatter_base(l) + max(1, N/32)).
template <int O, int N, int VP>
__device__ __forceinline__ void warp_reduce_scatter(float (&r)[VP], int lane) {
  if constexpr (O >= 1) {
    if constexpr (N > 1) {
      constexpr int kHalf = N / 2;
      const bool upper = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float send = upper ? r[i] : r[i + kHalf];
        const float keep = upper ? r[i + kHalf] : r[i];
        r[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      warp_reduce_scatter<O / 2, kHalf, VP>(r, lane);
    } else {
      r[0] += __shfl_xor_sync(0xffffffffu, r[0], O);
      warp_reduce_scatter<O / 2, 1, VP>(r, lane);
    }
  }
}

template <int O, int N>
__device__ __forceinline__ int scatter_base(int lane) {
  if constexpr (O >= 1 && N > 1) {
    return ((lane & O) ? N / 2 : 0) + scatter_base<O / 2, N / 2>(lane);
  } else {
    return 0;
  }
}

__device__ __forceinline__ void store_out(void* out, size_t i, float v, bool out_bf16) {
  if (out_bf16) {
    reinterpret_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  } else {
    reinterpret_cast<float*>(out)[i] = v;
  }
}

// acc[m][j] += sum_v x[m, v] * wf[j][v] over the kVec activations at xk + m * kH, for every row m < M. The rows are
// loaded kXRows at a time with no branch between the loads (rows >= M re-read row M - 1, an L1 hit, and are
// skipped by the FMAs), so their L2 round trips overlap instead of serializing behind block-uniform branches
// (per-row branches around the loads made them serial: 16 L2 round trips at M = 16).
template <typename TX, int kVec, int kMaxM, int kE, int kH>
__device__ __forceinline__ void accumulate_rows(const TX* xk, int M, const float (&wf)[kE][kVec],
                                                float (&acc)[kMaxM][kE]) {
  using XT = XTraits<TX, kVec>;
  constexpr int kXRaw = static_cast<int>(sizeof(typename XT::Raw) / 4);  // registers per row
  constexpr int kXRowsWanted = (64 / kXRaw) / (kE > 2 ? kE / 2 : 1);
  constexpr int kXRows = kMaxM < kXRowsWanted ? kMaxM : (kXRowsWanted < 1 ? 1 : kXRowsWanted);
  static_assert(kMaxM % kXRows == 0, "x row chunk must divide the M bucket");
#pragma unroll
  for (int m0 = 0; m0 < kMaxM; m0 += kXRows) {
    if (m0 < M) {  // block-uniform; measured faster than hoisting every chunk's loads (fewer live registers)
      typename XT::Raw xr[kXRows];
#pragma unroll
      for (int r = 0; r < kXRows; ++r) {
        const int m = min(m0 + r, M - 1);
        xr[r] = XT::load(xk + static_cast<size_t>(m) * kH);
      }
#pragma unroll
      for (int r = 0; r < kXRows; ++r) {
        if (m0 + r < M) {  // block-uniform
          float xf[kVec];
          XT::unpack(xr[r], xf);
#pragma unroll
          for (int j = 0; j < kE; ++j) {
#pragma unroll
            for (int v = 0; v < kVec; ++v) acc[m0 + r][j] = fmaf(xf[v], wf[j][v], acc[m0 + r][j]);
          }
        }
      }
    }
  }
}

// The body shared by the clustered (kS > 1) and plain (kS == 1) kernels.
template <typename TW, typename TX, int kMaxM, int kH, int kS, int kEPB, int kThreads>
__device__ __forceinline__ void router_gemm_body(const TX* __restrict__ x, const TW* __restrict__ w,
                                                 void* __restrict__ out, int M, int E, bool out_bf16) {
  constexpr int kVec = WeightTraits<TW>::kVec;
  constexpr int kKS = kH / kS;  // K elements per split
  static_assert(kH % kS == 0 && kKS % kVec == 0, "K split must be a multiple of the vector width");
  static_assert(kThreads % 32 == 0, "whole warps only");
  constexpr int kChunk = kVec * kThreads;
  constexpr int kIters = (kKS + kChunk - 1) / kChunk;
  constexpr bool kExact = kKS % kChunk == 0;
  constexpr int kWarps = kThreads / 32;
  constexpr int V = kMaxM * kEPB;     // partial sums per thread
  constexpr int VP = next_pow2(V);    // padded to a power of two for the butterfly
  constexpr int NV = VP > 32 ? VP / 32 : 1;
  constexpr int kPlainMask = VP >= 32 ? 0 : (32 / VP) - 1;  // lanes that only differ here hold equal sums

  __shared__ float red_warp[kWarps][VP];
  __shared__ float red_block[VP];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int split = blockIdx.x;  // == rank in the (kS, 1, 1) cluster: gridDim.x == kS
  const int e0 = blockIdx.y * kEPB;
  const int kbase = split * kKS;

  // 1. Issue every weight load of this thread before any use (kIters * kEPB 16-byte loads in flight).
  uint4 wv[kIters][kEPB];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int kk = (i * kThreads + tid) * kVec;
#pragma unroll
    for (int j = 0; j < kEPB; ++j) {
      if (kExact || kk < kKS) {
        wv[i][j] = ld_stream_v4(w + static_cast<size_t>(e0 + j) * kH + kbase + kk);
      } else {
        wv[i][j] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }

  // 2. acc[m][j] = sum over this thread's k of x[m, k] * w[e0 + j, k], fp32 FMAs in k order.
  float acc[kMaxM][kEPB];
#pragma unroll
  for (int m = 0; m < kMaxM; ++m) {
#pragma unroll
    for (int j = 0; j < kEPB; ++j) acc[m][j] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int kk = (i * kThreads + tid) * kVec;
    if (kExact || kk < kKS) {
      float wf[kEPB][kVec];
#pragma unroll
      for (int j = 0; j < kEPB; ++j) WeightTraits<TW>::unpack(wv[i][j], wf[j]);
      accumulate_rows<TX, kVec, kMaxM, kEPB, kH>(x + kbase + kk, M, wf, acc);
    }
  }

  // 3. Warp reduce-scatter, then the cross-warp sum in warp order.
  float r[VP];
#pragma unroll
  for (int i = 0; i < VP; ++i) r[i] = i < V ? acc[i / kEPB][i % kEPB] : 0.f;
  warp_reduce_scatter<16, VP, VP>(r, lane);
  if ((lane & kPlainMask) == 0) {
    const int base = scatter_base<16, VP>(lane);
#pragma unroll
    for (int t = 0; t < NV; ++t) red_warp[warp][base + t] = r[t];
  }
  __syncthreads();

  for (int idx = tid; idx < V; idx += kThreads) {
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) s += red_warp[wi][idx];
    if constexpr (kS == 1) {
      const int m = idx / kEPB;
      if (m < M) store_out(out, static_cast<size_t>(m) * E + e0 + idx % kEPB, s, out_bf16);
    } else {
      red_block[idx] = s;
    }
  }

  // 4. Sum the kS K-split partials of the cluster through distributed shared memory, in rank order.
  if constexpr (kS > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's partials are in its shared memory (and visible cluster-wide)
    for (int idx = split + kS * tid; idx < V; idx += kS * kThreads) {
      const int m = idx / kEPB;
      if (m < M) {
        float s = 0.f;
#pragma unroll
        for (int p = 0; p < kS; ++p) s += cluster.map_shared_rank(red_block, p)[idx];
        store_out(out, static_cast<size_t>(m) * E + e0 + idx % kEPB, s, out_bf16);
      }
    }
    cluster.sync();  // no block leaves while a peer may still read its shared memory
  }
}

template <typename TW, typename TX, int kMaxM, int kH, int kS, int kEPB, int kThreads>
__global__ void __cluster_dims__(kS, 1, 1) __launch_bounds__(kThreads)
    router_gemm_cluster_kernel(const TX* __restrict__ x, const TW* __restrict__ w, void* __restrict__ out, int M,
                               int E, bool out_bf16) {
  router_gemm_body<TW, TX, kMaxM, kH, kS, kEPB, kThreads>(x, w, out, M, E, out_bf16);
}

template <typename TW, typename TX, int kMaxM, int kH, int kEPB, int kThreads>
__global__ void __launch_bounds__(kThreads)
    router_gemm_plain_kernel(const TX* __restrict__ x, const TW* __restrict__ w, void* __restrict__ out, int M,
                             int E, bool out_bf16) {
  router_gemm_body<TW, TX, kMaxM, kH, 1, kEPB, kThreads>(x, w, out, M, E, out_bf16);
}

template <typename TW, typename TX, int kMaxM, int kH, int kS, int kEPB, int kThreads>
void launch_bucket(const void* x, const void* w, void* out, int M, int E, bool out_bf16, cudaStream_t stream) {
  const dim3 grid(kS, E / kEPB);
  const dim3 block(kThreads);
  const TX* xp = static_cast<const TX*>(x);
  const TW* wp = static_cast<const TW*>(w);
  if constexpr (kS > 1) {
    router_gemm_cluster_kernel<TW, TX, kMaxM, kH, kS, kEPB, kThreads>
        <<<grid, block, 0, stream>>>(xp, wp, out, M, E, out_bf16);
  } else {
    router_gemm_plain_kernel<TW, TX, kMaxM, kH, kEPB, kThreads>
        <<<grid, block, 0, stream>>>(xp, wp, out, M, E, out_bf16);
  }
}

// Picks the smallest M bucket >= M (buckets 1, 2, 4, 8, 16 and, when kMaxTokens >= 32, 32).
template <typename TW, typename TX, int kMaxTokens, int kH, int kS, int kEPB, int kThreads>
cudaError_t launch_variant(const void* x, const void* w, void* out, int M, int E, bool out_bf16,
                           cudaStream_t stream) {
  if (E % kEPB != 0) return cudaErrorInvalidValue;
  if (M <= 1) {
    launch_bucket<TW, TX, 1, kH, kS, kEPB, kThreads>(x, w, out, M, E, out_bf16, stream);
  } else if (M <= 2) {
    launch_bucket<TW, TX, 2, kH, kS, kEPB, kThreads>(x, w, out, M, E, out_bf16, stream);
  } else if (M <= 4) {
    launch_bucket<TW, TX, 4, kH, kS, kEPB, kThreads>(x, w, out, M, E, out_bf16, stream);
  } else if (M <= 8) {
    launch_bucket<TW, TX, 8, kH, kS, kEPB, kThreads>(x, w, out, M, E, out_bf16, stream);
  } else if (M <= 16) {
    launch_bucket<TW, TX, 16, kH, kS, kEPB, kThreads>(x, w, out, M, E, out_bf16, stream);
  } else {
    if constexpr (kMaxTokens >= 32) {
      launch_bucket<TW, TX, 32, kH, kS, kEPB, kThreads>(x, w, out, M, E, out_bf16, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  return cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Variant tables.
struct VariantDesc {
  const char* name;
};

// Measured on H200 (the old bench.py), us per call at M = 1 / 4 / 8 / 16, E = 256: v0 3.9 / 4.1 / 5.1 / 7.0,
// v1 4.8 / 4.2 / 5.5 / 7.4, v2 3.7 / 4.1 / 5.1 / 8.4, v3 (no cluster) 4.7 / 6.3 / 7.4 / 11.3 (cuBLAS 7.3-7.5).
// A variant spreading the experts over the warps (each lane 4 K vectors x 2 experts) was 1.5-3x slower.
constexpr VariantDesc kDsv3Variants[] = {
    {"S=7 EPB=4 T=128"},
    {"S=7 EPB=8 T=128"},
    {"S=7 EPB=2 T=128"},
    {"S=1 EPB=2 T=128"},
};
constexpr int kDsv3NumVariants = sizeof(kDsv3Variants) / sizeof(kDsv3Variants[0]);

// H200, M = 1 / 4 / 8 / 16 / 32: v0 3.3 / 3.6 / 3.9 / 4.9 / 9.2, v1 3.4 / 3.7 / 4.1 / 4.8 / 8.2,
// v2 3.5 / 4.1 / 4.9 / 6.9 / 7.1, v3 3.7 / 5.2 / 6.4 / 8.5 / 9.0 (F.linear fp32: 6.5 / 14 / 18 / 19 / 16).
constexpr VariantDesc kFp32Variants[] = {
    {"S=6 EPB=4 T=128"},
    {"S=6 EPB=2 T=128"},
    {"S=3 EPB=4 T=128"},
    {"S=1 EPB=2 T=128"},
};
constexpr int kFp32NumVariants = sizeof(kFp32Variants) / sizeof(kFp32Variants[0]);

}  // namespace

int dsv3_num_variants() { return kDsv3NumVariants; }
int fp32_num_variants() { return kFp32NumVariants; }
// The variant used when none is requested, by token count (fastest measured on H200 by the old backends/cuda/bench.py; now python -m benchmarks --backend cuda).
int dsv3_auto_variant(int M, int E) { return (E == 256 && M <= 4) ? 2 : 0; }
int fp32_auto_variant(int M) { return M <= 8 ? 0 : (M <= 16 ? 1 : 2); }

const char* dsv3_variant_name(int variant) {
  return (variant >= 0 && variant < kDsv3NumVariants) ? kDsv3Variants[variant].name : "invalid";
}
const char* fp32_variant_name(int variant) {
  return (variant >= 0 && variant < kFp32NumVariants) ? kFp32Variants[variant].name : "invalid";
}

cudaError_t launch_dsv3_router_gemm(const void* x, const void* w, void* out, int M, int E, bool out_bf16,
                                    int variant, cudaStream_t stream) {
  if (M < 1 || M > kDsv3MaxTokens || (E != 256 && E != 384)) return cudaErrorInvalidValue;
  if (!aligned16(x) || !aligned16(w) || !aligned16(out)) return cudaErrorInvalidValue;
  if (variant < 0) variant = dsv3_auto_variant(M, E);
  using B = __nv_bfloat16;
  constexpr int H = kDsv3Hidden;
  constexpr int MT = kDsv3MaxTokens;
  switch (variant) {
    case 0: return launch_variant<B, B, MT, H, 7, 4, 128>(x, w, out, M, E, out_bf16, stream);
    case 1: return launch_variant<B, B, MT, H, 7, 8, 128>(x, w, out, M, E, out_bf16, stream);
    case 2: return launch_variant<B, B, MT, H, 7, 2, 128>(x, w, out, M, E, out_bf16, stream);
    case 3: return launch_variant<B, B, MT, H, 1, 2, 128>(x, w, out, M, E, out_bf16, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename TX>
static cudaError_t launch_fp32_typed(const void* x, const float* w, float* out, int M, int E, int variant,
                                     cudaStream_t stream) {
  constexpr int H = kFp32Hidden;
  constexpr int MT = kFp32MaxTokens;
  switch (variant) {
    case 0: return launch_variant<float, TX, MT, H, 6, 4, 128>(x, w, out, M, E, false, stream);
    case 1: return launch_variant<float, TX, MT, H, 6, 2, 128>(x, w, out, M, E, false, stream);
    case 2: return launch_variant<float, TX, MT, H, 3, 4, 128>(x, w, out, M, E, false, stream);
    case 3: return launch_variant<float, TX, MT, H, 1, 2, 128>(x, w, out, M, E, false, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_fp32_router_gemm(const void* x, const float* w, float* out, int M, int E, bool x_bf16,
                                    int variant, cudaStream_t stream) {
  if (M < 1 || M > kFp32MaxTokens || E != 256) return cudaErrorInvalidValue;
  if (!aligned16(x) || !aligned16(w) || !aligned16(out)) return cudaErrorInvalidValue;
  if (variant < 0) variant = fp32_auto_variant(M);
  return x_bf16 ? launch_fp32_typed<__nv_bfloat16>(x, w, out, M, E, variant, stream)
                : launch_fp32_typed<float>(x, w, out, M, E, variant, stream);
}

}  // namespace moe_router
