// Thin torch binding of the router GEMM launchers (router_gemm.cu). Built by backends/cuda/tools/build.py with
// torch.utils.cpp_extension.load; the Python wrappers in backends/cuda/gate.py validate arguments first and raise
// ValueError with the tier's limits, so the TORCH_CHECKs here are a second line of defence.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>
#include <vector>

#include "router_gemm.h"

namespace {

void check_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (row-major)");
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " launch failed: ", cudaGetErrorString(err));
}

}  // namespace

// out (M, E) = x (M, 7168) bf16 @ w (E, 7168)^T bf16, fp32 accumulation, stored as fp32 or bf16.
torch::Tensor dsv3_router_gemm(const torch::Tensor& x, const torch::Tensor& w, bool out_bf16, int64_t variant) {
  check_matrix(x, "hidden_states");
  check_matrix(w, "router_weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "dsv3_router_gemm: hidden_states must be bf16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "dsv3_router_gemm: router_weight must be bf16");
  TORCH_CHECK(x.device() == w.device(), "dsv3_router_gemm: operands on different devices");
  const int64_t M = x.size(0), H = x.size(1), E = w.size(0);
  TORCH_CHECK(M >= 1 && M <= moe_router::kDsv3MaxTokens, "dsv3_router_gemm: num_tokens must be in [1, 16]");
  TORCH_CHECK(H == moe_router::kDsv3Hidden && w.size(1) == H, "dsv3_router_gemm: hidden_dim must be 7168");
  TORCH_CHECK(E == 256 || E == 384, "dsv3_router_gemm: num_experts must be 256 or 384");
  TORCH_CHECK(variant >= -1 && variant < moe_router::dsv3_num_variants(), "dsv3_router_gemm: bad variant");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty({M, E}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  check_launch(moe_router::launch_dsv3_router_gemm(x.data_ptr(), w.data_ptr(), out.data_ptr(), static_cast<int>(M),
                                                   static_cast<int>(E), out_bf16, static_cast<int>(variant),
                                                   c10::cuda::getCurrentCUDAStream().stream()),
               "dsv3_router_gemm");
  return out;
}

// out (M, 256) fp32 = x (M, 3072) bf16/fp32 @ w (256, 3072)^T fp32, fp32 accumulation.
torch::Tensor fp32_router_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t variant) {
  check_matrix(x, "x");
  check_matrix(w, "weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "fp32_router_gemm: x must be bf16 or fp32");
  TORCH_CHECK(w.scalar_type() == at::kFloat, "fp32_router_gemm: weight must be fp32");
  TORCH_CHECK(x.device() == w.device(), "fp32_router_gemm: operands on different devices");
  const int64_t M = x.size(0), H = x.size(1), E = w.size(0);
  TORCH_CHECK(M >= 1 && M <= moe_router::kFp32MaxTokens, "fp32_router_gemm: num_tokens must be in [1, 32]");
  TORCH_CHECK(H == moe_router::kFp32Hidden && w.size(1) == H, "fp32_router_gemm: hidden_dim must be 3072");
  TORCH_CHECK(E == 256, "fp32_router_gemm: num_experts must be 256");
  TORCH_CHECK(variant >= -1 && variant < moe_router::fp32_num_variants(), "fp32_router_gemm: bad variant");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty({M, E}, x.options().dtype(at::kFloat));
  check_launch(moe_router::launch_fp32_router_gemm(x.data_ptr(), w.data_ptr<float>(), out.data_ptr<float>(),
                                                   static_cast<int>(M), static_cast<int>(E),
                                                   x.scalar_type() == at::kBFloat16, static_cast<int>(variant),
                                                   c10::cuda::getCurrentCUDAStream().stream()),
               "fp32_router_gemm");
  return out;
}

std::vector<std::string> dsv3_variants() {
  std::vector<std::string> names;
  for (int i = 0; i < moe_router::dsv3_num_variants(); ++i) names.emplace_back(moe_router::dsv3_variant_name(i));
  return names;
}

std::vector<std::string> fp32_variants() {
  std::vector<std::string> names;
  for (int i = 0; i < moe_router::fp32_num_variants(); ++i) names.emplace_back(moe_router::fp32_variant_name(i));
  return names;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe-conformance cuda backend: DSV3 and fp32 router GEMMs (SM90)";
  m.def("dsv3_router_gemm", &dsv3_router_gemm, "DSV3 router GEMM", py::arg("x"), py::arg("w"),
        py::arg("out_bf16"), py::arg("variant") = -1);
  m.def("fp32_router_gemm", &fp32_router_gemm, "fp32 router GEMM", py::arg("x"), py::arg("w"),
        py::arg("variant") = -1);
  m.def("dsv3_variants", &dsv3_variants, "variant names of the DSV3 router GEMM");
  m.def("fp32_variants", &fp32_variants, "variant names of the fp32 router GEMM");
  m.def("dsv3_auto_variant", &moe_router::dsv3_auto_variant, "variant picked for (M, E) when none is requested",
        py::arg("M"), py::arg("E"));
  m.def("fp32_auto_variant", &moe_router::fp32_auto_variant, "variant picked for M when none is requested",
        py::arg("M"));
}
