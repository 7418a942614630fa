// Router (gate) GEMM launchers of the ``cuda`` backend: plain CUDA C++, no torch headers.
//
// The kernels live in router_gemm.cu (compiled by nvcc); binding.cpp (compiled against torch) checks tensors and
// calls these launchers with raw pointers and the current stream. Keeping the kernels free of torch headers lets
// them be compile-checked with nvcc alone (tests/test_cuda_backend.py).
//
// Contracts (checked again by every launcher; a violation returns cudaErrorInvalidValue without launching):
//   dsv3:  x (M, 7168) bf16 row-major, w (E, 7168) bf16 row-major, out (M, E) fp32 or bf16 row-major,
//          1 <= M <= 16, E in {256, 384}.   Mirrors csrc/moe/dsv3_router_gemm_entry.cu (vLLM).
//   fp32:  x (M, 3072) bf16 or fp32 row-major, w (E, 3072) fp32 row-major, out (M, E) fp32, 1 <= M <= 32,
//          E == 256.                        Mirrors csrc/moe/fp32_router_gemm_entry.cu (vLLM).
//   Every pointer must be 16-byte aligned (the weight is streamed with 16-byte vector loads).
#pragma once

#include <cuda_runtime_api.h>

namespace moe_router {

constexpr int kDsv3Hidden = 7168;
constexpr int kDsv3MaxTokens = 16;
constexpr int kFp32Hidden = 3072;
constexpr int kFp32MaxTokens = 32;

// Number of kernel variants (tiling choices) of each GEMM; variant -1 picks the *_auto_variant for the shape.
int dsv3_num_variants();
int fp32_num_variants();
int dsv3_auto_variant(int M, int E);
int fp32_auto_variant(int M);
// "S=7 EPB=4 T=128": K splits (= cluster size), experts per block, threads per block.
const char* dsv3_variant_name(int variant);
const char* fp32_variant_name(int variant);

// out[m, e] = sum_k x[m, k] * w[e, k], fp32 accumulation; out_bf16 selects a bf16 (RNE) instead of fp32 store.
cudaError_t launch_dsv3_router_gemm(const void* x, const void* w, void* out, int M, int E, bool out_bf16,
                                    int variant, cudaStream_t stream);

// x_bf16 selects a bf16 instead of an fp32 activation; the output is always fp32.
cudaError_t launch_fp32_router_gemm(const void* x, const float* w, float* out, int M, int E, bool x_bf16,
                                    int variant, cudaStream_t stream);

}  // namespace moe_router
