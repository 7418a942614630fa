// Thin torch binding of the router GEMM launchers (router_gemm.cu) and of the experts step's glue kernels
// (moe_glue.cu). Built by backends/cuda/build.py with torch.utils.cpp_extension.load; the Python wrappers in
// backends/cuda/gate.py and backends/cuda/experts.py validate arguments first and raise ValueError with the limits,
// so the TORCH_CHECKs here are a second line of defence.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moe_glue.h"
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

// ---- experts glue (moe_glue.h) ----------------------------------------------------------------------------------

namespace {

void check_cuda_contig(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ", like.device());
}

const float* opt_f32(const c10::optional<torch::Tensor>& t, const char* name, const torch::Tensor& like) {
  if (!t.has_value()) return nullptr;
  check_cuda_contig(*t, name, like);
  TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be fp32");
  return t->data_ptr<float>();
}

// What moe_scatter_rows / moe_route_plan_scatter write must fit the buffers they are given.
void check_scatter_buffers(const torch::Tensor& x, int64_t topk, int64_t mode, bool x_fp8,
                           const c10::optional<torch::Tensor>& scale_in, bool scale_per_token,
                           const torch::Tensor& out, const c10::optional<torch::Tensor>& scale_out) {
  const int64_t M = x.size(0), R = M * topk;
  TORCH_CHECK(mode >= moe_glue::kCopy && mode <= moe_glue::kQuantStaticTensor, "unknown scatter mode ", mode);
  TORCH_CHECK(!x_fp8 || mode == moe_glue::kCopy, "FP8 codes are copied (mode kCopy), not quantized again");
  const bool out_bf16 = !x_fp8 && mode == moe_glue::kCopy;
  TORCH_CHECK(out.scalar_type() == (out_bf16 ? at::kBFloat16 : at::kFloat8_e4m3fn), "out must be ",
              out_bf16 ? "bf16" : "float8_e4m3fn", " for this mode, got ", out.scalar_type());
  TORCH_CHECK(out.size(0) >= R, "out must have at least M * topk = ", R, " rows, got ", out.size(0));
  if (x_fp8 || mode != moe_glue::kCopy) {
    TORCH_CHECK(scale_out.has_value() && scale_out->numel() >= R, "scale_out must have at least M * topk = ", R,
                " elements");
  }
  if (x_fp8 || mode == moe_glue::kQuantStaticTensor) {
    const int64_t want = x_fp8 && scale_per_token ? M : 1;
    TORCH_CHECK(scale_in.has_value() && scale_in->numel() == want, "scale_in must have ", want, " element(s)");
  }
}

// The route plan's checked inputs and its freshly allocated outputs (offs, inv, sorted_token: int32).
struct PlanArgs {
  const int32_t* map = nullptr;
  int64_t n_ids = 0, M = 0, topk = 0;
  torch::Tensor offs, inv, token;
};

PlanArgs plan_args(const torch::Tensor& topk_ids, const c10::optional<torch::Tensor>& expert_map,
                   int64_t num_local_experts) {
  check_cuda_contig(topk_ids, "topk_ids", topk_ids);
  TORCH_CHECK(topk_ids.dim() == 2, "topk_ids must be (M, topk)");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "topk_ids must be int32 or int64");
  PlanArgs a;
  a.n_ids = num_local_experts;
  if (expert_map.has_value()) {
    check_cuda_contig(*expert_map, "expert_map", topk_ids);
    TORCH_CHECK(expert_map->scalar_type() == at::kInt && expert_map->dim() == 1, "expert_map must be (E,) int32");
    a.map = expert_map->data_ptr<int32_t>();
    a.n_ids = expert_map->numel();
  }
  a.M = topk_ids.size(0);
  a.topk = topk_ids.size(1);
  auto opts = topk_ids.options().dtype(at::kInt);
  a.offs = torch::empty({num_local_experts}, opts);
  a.inv = torch::empty({a.M * a.topk}, opts);
  a.token = torch::empty({a.M * a.topk}, opts);
  return a;
}

}  // namespace

// (offs (E_local,), inv (M * topk,), sorted_token (M * topk,)), all int32.
std::vector<torch::Tensor> moe_route_plan(const torch::Tensor& topk_ids, const c10::optional<torch::Tensor>& expert_map,
                                          int64_t num_local_experts) {
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  PlanArgs a = plan_args(topk_ids, expert_map, num_local_experts);
  check_launch(moe_glue::launch_route_plan(topk_ids.data_ptr(), topk_ids.scalar_type() == at::kLong,
                                           static_cast<int>(a.M), static_cast<int>(a.topk), a.map,
                                           static_cast<int>(a.n_ids), static_cast<int>(num_local_experts),
                                           a.offs.data_ptr<int32_t>(), a.inv.data_ptr<int32_t>(),
                                           a.token.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream().stream()),
               "moe_route_plan");
  return {a.offs, a.inv, a.token};
}

// moe_route_plan, then moe_scatter_rows of x into out with that plan; one launch at decode (moe_glue.h).
std::vector<torch::Tensor> moe_route_plan_scatter(const torch::Tensor& topk_ids,
                                                  const c10::optional<torch::Tensor>& expert_map,
                                                  int64_t num_local_experts, const torch::Tensor& x, int64_t mode,
                                                  const c10::optional<torch::Tensor>& scale_in, bool scale_per_token,
                                                  torch::Tensor& out, const c10::optional<torch::Tensor>& scale_out) {
  check_cuda_contig(x, "x", topk_ids);
  check_cuda_contig(out, "out", topk_ids);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(1) == x.size(1), "x (M, K) and out (R, K) disagree");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0), "topk_ids must be (M, topk) for x (M, K)");
  const bool x_fp8 = x.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(x_fp8 || x.scalar_type() == at::kBFloat16, "x must be bf16 or float8_e4m3fn");
  check_scatter_buffers(x, topk_ids.size(1), mode, x_fp8, scale_in, scale_per_token, out, scale_out);
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  PlanArgs a = plan_args(topk_ids, expert_map, num_local_experts);
  check_launch(moe_glue::launch_route_plan_scatter(
                   topk_ids.data_ptr(), topk_ids.scalar_type() == at::kLong, static_cast<int>(a.M),
                   static_cast<int>(a.topk), a.map, static_cast<int>(a.n_ids), static_cast<int>(num_local_experts),
                   a.offs.data_ptr<int32_t>(), a.inv.data_ptr<int32_t>(), a.token.data_ptr<int32_t>(), x.data_ptr(), x_fp8,
                   static_cast<int>(x.size(1)), static_cast<int>(mode), opt_f32(scale_in, "scale_in", x),
                   scale_per_token, out.data_ptr(), const_cast<float*>(opt_f32(scale_out, "scale_out", x)),
                   c10::cuda::getCurrentCUDAStream().stream()),
               "moe_route_plan_scatter");
  return {a.offs, a.inv, a.token};
}

void moe_scatter_rows(const torch::Tensor& x, const torch::Tensor& inv, int64_t topk, int64_t mode,
                      const c10::optional<torch::Tensor>& scale_in, bool scale_per_token, torch::Tensor& out,
                      const c10::optional<torch::Tensor>& scale_out) {
  check_cuda_contig(x, "x", x);
  check_cuda_contig(inv, "inv", x);
  check_cuda_contig(out, "out", x);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(1) == x.size(1), "x (M, K) and out (R, K) disagree");
  TORCH_CHECK(inv.scalar_type() == at::kInt && inv.numel() == x.size(0) * topk, "inv must be (M * topk,) int32");
  const bool x_fp8 = x.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(x_fp8 || x.scalar_type() == at::kBFloat16, "x must be bf16 or float8_e4m3fn");
  check_scatter_buffers(x, topk, mode, x_fp8, scale_in, scale_per_token, out, scale_out);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(moe_glue::launch_scatter_rows(x.data_ptr(), x_fp8, static_cast<int>(x.size(0)),
                                             static_cast<int>(x.size(1)), static_cast<int>(topk),
                                             inv.data_ptr<int32_t>(), static_cast<int>(mode),
                                             opt_f32(scale_in, "scale_in", x), scale_per_token, out.data_ptr(),
                                             const_cast<float*>(opt_f32(scale_out, "scale_out", x)),
                                             c10::cuda::getCurrentCUDAStream().stream()),
               "moe_scatter_rows");
}

void moe_act_quant(const torch::Tensor& h, int64_t act, double alpha, double beta, double limit,
                   const torch::Tensor& offs, int64_t out_kind, torch::Tensor& out,
                   const c10::optional<torch::Tensor>& scale_out, const c10::optional<torch::Tensor>& static_scale,
                   const c10::optional<torch::Tensor>& amax_out) {
  check_cuda_contig(h, "h", h);
  check_cuda_contig(offs, "offs", h);
  check_cuda_contig(out, "out", h);
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kBFloat16, "h must be (R, N) bf16");
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.numel() >= 1, "offs must be (E_local,) int32");
  TORCH_CHECK(act >= moe_glue::kSilu && act <= moe_glue::kRelu2NoMul, "unknown activation code ", act);
  const int64_t I = act <= moe_glue::kSwigluStep ? h.size(1) / 2 : h.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == h.size(0) && out.size(1) == I, "out must be (R, I) = (", h.size(0),
              ", ", I, ")");
  TORCH_CHECK(out_kind >= moe_glue::kActBf16 && out_kind <= moe_glue::kActFp8StaticTensor, "unknown out_kind ",
              out_kind);
  TORCH_CHECK(out.scalar_type() == (out_kind == moe_glue::kActBf16 ? at::kBFloat16 : at::kFloat8_e4m3fn),
              "out's dtype does not match out_kind ", out_kind);
  TORCH_CHECK(out_kind != moe_glue::kActFp8PerToken || (scale_out.has_value() && scale_out->numel() >= h.size(0)),
              "scale_out must have R = ", h.size(0), " elements");
  TORCH_CHECK(out_kind != moe_glue::kActFp8StaticTensor || (static_scale.has_value() && static_scale->numel() == 1),
              "static_scale must have one element");
  TORCH_CHECK(!amax_out.has_value() || amax_out->numel() == 1, "amax_out must have one element");
  const c10::cuda::CUDAGuard guard(h.device());
  int sms = 0;
  check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, h.get_device()), "moe_act_quant (SM count)");
  check_launch(moe_glue::launch_act_quant(h.data_ptr(), static_cast<int>(h.size(0)), static_cast<int>(h.size(1)),
                                          static_cast<int>(act), static_cast<float>(alpha), static_cast<float>(beta),
                                          static_cast<float>(limit), offs.data_ptr<int32_t>(),
                                          static_cast<int>(offs.numel()), static_cast<int>(out_kind), out.data_ptr(),
                                          const_cast<float*>(opt_f32(scale_out, "scale_out", h)),
                                          opt_f32(static_scale, "static_scale", h),
                                          const_cast<float*>(opt_f32(amax_out, "amax_out", h)), sms,
                                          c10::cuda::getCurrentCUDAStream().stream()),
               "moe_act_quant");
}

void moe_weight_reduce(const torch::Tensor& y, const torch::Tensor& inv, int64_t topk,
                       const c10::optional<torch::Tensor>& weights, torch::Tensor& out) {
  check_cuda_contig(y, "y", y);
  check_cuda_contig(inv, "inv", y);
  check_cuda_contig(out, "out", y);
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "y and out must be bf16");
  TORCH_CHECK(out.dim() == 2 && y.dim() == 2 && out.size(1) == y.size(1), "y (R, K) and out (M, K) disagree");
  TORCH_CHECK(inv.scalar_type() == at::kInt && inv.numel() == out.size(0) * topk, "inv must be (M * topk,) int32");
  TORCH_CHECK(!weights.has_value() || weights->numel() == out.size(0) * topk, "weights must be (M, topk)");
  const c10::cuda::CUDAGuard guard(y.device());
  check_launch(moe_glue::launch_weight_reduce(y.data_ptr(), static_cast<int>(y.size(1)),
                                              static_cast<int>(out.size(0)), static_cast<int>(topk),
                                              inv.data_ptr<int32_t>(), opt_f32(weights, "weights", y), out.data_ptr(),
                                              c10::cuda::getCurrentCUDAStream().stream()),
               "moe_weight_reduce");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe-conformance cuda backend: DSV3 and fp32 router GEMMs, experts glue kernels (SM90)";
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
  m.def("moe_route_plan", &moe_route_plan, "routes sorted by local expert: (offs, inv, sorted_token)",
        py::arg("topk_ids"), py::arg("expert_map"), py::arg("num_local_experts"));
  m.def("moe_route_plan_scatter", &moe_route_plan_scatter,
        "moe_route_plan then moe_scatter_rows (one launch at decode): (offs, inv, sorted_token)", py::arg("topk_ids"),
        py::arg("expert_map"), py::arg("num_local_experts"), py::arg("x"), py::arg("mode"), py::arg("scale_in"),
        py::arg("scale_per_token"), py::arg("out"), py::arg("scale_out"));
  m.def("moe_scatter_rows", &moe_scatter_rows, "token rows (quantized) to their routes' rows", py::arg("x"),
        py::arg("inv"), py::arg("topk"), py::arg("mode"), py::arg("scale_in"), py::arg("scale_per_token"),
        py::arg("out"), py::arg("scale_out"));
  m.def("moe_act_quant", &moe_act_quant, "activation (+ FP8 requantization) of the expert rows", py::arg("h"),
        py::arg("act"), py::arg("alpha"), py::arg("beta"), py::arg("limit"), py::arg("offs"), py::arg("out_kind"),
        py::arg("out"), py::arg("scale_out"), py::arg("static_scale"), py::arg("amax_out"));
  m.def("moe_weight_reduce", &moe_weight_reduce, "weighted top-k sum", py::arg("y"), py::arg("inv"),
        py::arg("topk"), py::arg("weights"), py::arg("out"));
}
