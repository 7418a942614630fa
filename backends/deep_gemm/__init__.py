"""The ``deep_gemm`` backend: seed 001's ``DeepGemmExperts`` on DeepGEMM's grouped FP8 GEMMs (SM90).

Contents
--------
- :class:`~backends.deep_gemm.experts.DeepGemmExperts`: FP8 block-128 experts (permute -> grouped GEMM1 ->
  activation + 1x128 requantization -> grouped GEMM2 -> unpermute/reduce; the masked GEMMs below M = 128);
  :class:`~backends.deep_gemm.experts.BatchedDeepGemmExperts`: the same experts in the batched activation format
  (``m_grouped_fp8_gemm_nt_masked`` on ``(E_local, T, K)`` slots); :class:`DeepGemmFP4Experts` declared with the
  seed's SM100/SM120-only rules (unsupported here).
- :mod:`~backends.deep_gemm.layout`: the contiguous layout built on the device with torch ops.
- :mod:`~backends.deep_gemm.act_quant`: the activation + requantization (torch ops).
- :mod:`~backends.deep_gemm.triton_kernels`: the same three steps as Triton kernels (used on CUDA; bit-identical
  to the torch paths on the H200).
- :mod:`~backends.deep_gemm.platform`: package / GPU / capability probes (replaceable in tests).
- ``python -m benchmarks --backend deep_gemm``: the timings (step and GEMMs alone against vLLM's figures);
  ``python3 -m tools.deep_gemm.probe``: layout probe, kernels against the torch ops, published GEMM rates.

Availability (``backend.unavailable_reason()``), in this order so that a CPU machine never installs the package:
no CUDA GPU; a GPU that is not SM90; ``deep_gemm is not installed (...)``; a deep_gemm whose compiled ``_C`` does
not work with this torch (the probe runs one tiny layout call).

DeepGEMM argument layout for ``m_grouped_fp8_gemm_nt_contiguous`` (findings, 2026-11-21)
-----------------------------------------------------------------------------------------
Sources: the sgl-deep-gemm 0.2.0 wheel (``deep_gemm/__init__.py``, ``utils/``, ``testing/``, the JIT headers
``include/deep_gemm/scheduler/gemm.cuh`` and ``impls/sm90_fp8_gemm_1d2d.cuh``, strings of ``_C.so``), the
sgl-project/DeepGEMM sources (``csrc/apis/gemm.hpp``, ``csrc/apis/layout.hpp``, ``csrc/utils/layout.hpp``,
``csrc/tvm_ffi_api.cpp``, ``csrc/utils/torch_compat.hpp``, ``tests/test_fp8.py``, ``tests/generators.py``), the
tokenspeed-deepgemm wheels, and two runs on the project's H200 (torch 2.11.0+cu130).

1. **The "dim == 2 or dim == 3" failure is not a layout problem.** sgl-deep-gemm 0.2.0 fails that assertion
   (``csrc/utils/layout.hpp:16``, ``major_check`` in ``get_major_type_ab``) for *every* argument layout tried -
   canonical inputs, MN-major SFA, explicit ``recipe=(1, 128, 128)``, ``recipe_a/recipe_b``, psum layout, lists -
   and ``deep_gemm.get_mn_major_tma_aligned_tensor`` fails the same check (``smxx_layout.hpp:52``) on a plain
   ``(130, 4)`` fp32 tensor. tvm-ffi sees the right shape (``tvm_ffi.from_dlpack(t).shape == (8, 4)``) and
   ``TVM_FFI_DISABLE_TORCH_C_DLPACK=1`` changes nothing: the wheel's ``_C.so`` was compiled against newer torch
   headers (its embedded ``TensorImpl.h`` assertion lines, 1799/1338, are those of torch >= 2.12), so the inline
   ``at::Tensor::dim()`` in it misreads torch 2.11's ``TensorImpl``. No argument layout can fix it.
2. **A DeepGEMM that works on torch 2.11:** ``tokenspeed-deepgemm==2.5.0.post20260604`` (DeepGEMM 2.5, pybind
   ``_C`` built against an older torch; no dependencies; cp312 manylinux_2_28 wheel; also
   2.5.0.post20260424). Its 2.5.0.post20260810 and 2.8.2 (and sgl-deep-gemm >= 0.2.2) do not load on torch 2.11
   (undefined ``c10::ValueError`` / ``c10::cuda::CUDAErrorLogCapture``). It provides the same ``deep_gemm`` module
   (do not install it next to sgl-deep-gemm).
3. **The layout that works (checked on the H200, calc_diff 1.4e-6 vs an fp32 dequantized reference):**
   ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, m_indices, disable_ue8m0_cast=...)`` with

   - ``a``: float8_e4m3fn ``(M_sum, K)``, K-major (contiguous rows). SM90 requires K-major A and B.
   - ``sfa``: float32 ``(M_sum, ceil(K/128))`` per-token 1x128 scales. Any strides are accepted: on SM90
     ``transform_sf_into_required_layout`` turns (FP32, gran 1x128) into MN-major TMA-aligned storage
     (``get_mn_major_tma_aligned_tensor``: strides ``(1, align(M_sum, 4))``); passing that layout already skips
     the copy (this backend writes it directly). UE8M0-rounded fp32 scales (FLOAT32_CEIL_UE8M0) are ordinary fp32
     scales to the SM90 kernel.
   - ``b``: float8_e4m3fn ``(G, N, K)`` contiguous (3-D ``major_check``: ``stride(0) == N * K``).
   - ``sfb``: float32 ``(G, ceil(N/128), ceil(K/128))`` **contiguous** (128x128 blocks; the SM90 path checks
     ``contiguous_check`` and does not transform them).
   - ``d``: bfloat16 ``(M_sum, N)`` row-major (``check_major_type_cd``; the contiguous GEMM asserts bf16).
   - ``m_indices`` (``grouped_layout``): **int32, 1-D ``(M_sum,)``, contiguous**: expert id per row, -1 on
     padding rows. The psum alternative is ``use_psum_layout=True`` with an int32 ``(G,)`` grouped_layout
     (cumulative row ends); this backend does not use it.
   - ``recipe``: leave None: the SM90 default with fp32 SFA/SFB is ``(1, 128, 128)`` (``get_default_recipe``).
     ``recipe_a``/``recipe_b`` ((1, 32)) are the SM100 MXFP8 form. ``disable_ue8m0_cast`` only matters on SM100
     (it forbids packing fp32 scales to UE8M0); vLLM passes ``not use_ue8m0``, and so does this backend.
   - Alignment: ``get_mk_alignment_for_contiguous_layout()`` = 128. The kernel takes an M block's group from the
     block's first row (``grouped_layout[m_block_idx * BLOCK_M]``) and skips blocks / 64-row WGMMA halves whose
     first row is -1, so each expert's rows must start at a multiple of 128 (= BLOCK_M on SM90 for this layout).
     Padding rows that share a block with real rows *are* computed and written (observed: no NaN left there), so
     their inputs should be finite and their outputs must be ignored.
   - N and K multiples of 128 (block scales, TMA); seed 001's ``_valid_deep_gemm`` also wants M >= 128 and
     N (= I of w2) > 512 to prefer DeepGEMM over Triton.

Measured on the H200 (the old ``bench.py``, 2026-11-22): the grouped GEMM alone reaches 1391-1423 TFLOP/s at 4x8192 rows,
n=4096, k=7168 (1.03-1.06x DeepGEMM's published 1346 on H800) and 1244-1312 TFLOP/s at n=7168, k=2048 (1.02-1.08x
of 1214). DeepSeek-V3 EP8-local (E=32, topk 8): the two GEMMs take 0.49 / 0.82 / 2.30 ms at M = 64 / 1024 / 4096
(vLLM's Triton GEMMs: 0.37 / 1.42 / 4.99 ms; floor 0.33 / 0.57 / 2.29 ms); the whole step 1.34 / 1.72 / 3.40 ms
(host-bound launch overhead of ~0.85 ms at decode; 3.4 / 4.2 / 10.0 ms with the torch-op paths). Every model
shape (DeepSeek-V3, Kimi-K2, MiniMax-M2, Qwen3-30B-A3B; SILU, SWIGLUSTEP, SWIGLUOAI_UNINTERLEAVE, chunking, both
recipes, FLOAT32 and FLOAT32_CEIL_UE8M0) agrees with the reference within the fp8 tolerance (max_norm <= 8.3e-3,
calc_diff <= 1.6e-5).

Conformance (``pytest conformance --backend deep_gemm`` on the H200, 2026-11-22): 11 passed (DeepSeek-V3,
Kimi-K2, Qwen3-30B-A3B, Qwen3-235B-A22B, MiniMax-M2 fp8_block128 / fp8_block128_ue8m0 cases, repeated runs bitwise
equal, CUDA-graph replay == eager), 3 failed on ``rms_norm`` only (6.2e-3, 6.2e-3, 8.6e-3 against the bound 6e-3;
max_norm <= 1.4e-2, calc_diff <= 4.2e-5): the spread a tensor-core FP8 GEMM adds (see below), not a layout error.

Numerics of ``DeepGemmExperts`` vs ``reference.experts.fused_experts``: same rounding points (GEMM outputs bf16;
activation fp32 rounded to bf16; a2 quantized per 1x128 with ``quant_config.recipe`` / ``use_ue8m0``, bit-exact
with the reference quantizer for the same input; fp32 top-k reduction). DeepGEMM accumulates FP8 products in fp32
with per-128-K scale promotion (Hopper's FP8 WGMMA accumulates with reduced precision inside a 128-K block), so a
GEMM1 output can round to the neighbouring bf16 value (single-GEMM calc_diff 1.4e-6, i.e. ~1.7e-3 relative RMS,
about one bf16 rounding); its a2 code then moves one FP8 step (~6 %) in a few percent of the elements, which GEMM2
turns into an output RMS error of ~4e-3 to 9e-3. The same pipeline with an exact fp32 GEMM is bitwise equal to the
reference on CPU (tests/test_deep_gemm_backend.py), and the Triton and torch-op paths are bit-identical on the GPU.
"""

from __future__ import annotations

from backends import Backend
from backends.deep_gemm import platform
from backends.deep_gemm.experts import BatchedDeepGemmExperts, DeepGemmExperts, DeepGemmFP4Experts, \
    device_unsupported_reason

__all__ = ["backend", "BatchedDeepGemmExperts", "DeepGemmExperts", "DeepGemmFP4Experts"]


def _availability() -> str | None:
    return device_unsupported_reason()


def _version() -> str:
    try:
        return platform.deep_gemm_version()
    except Exception as exc:  # never let a version probe break the registry
        return f"unknown ({type(exc).__name__})"


backend = Backend(
    name="deep_gemm",
    version=_version(),
    experts=[DeepGemmExperts, BatchedDeepGemmExperts, DeepGemmFP4Experts],
    # The a2 requantization follows quant_config.recipe (vllm or deepgemm, bit-exact with the reference for
    # either); the seed's SM90 kernels (silu_mul_per_token_group_quant_fp8_colmajor) use vLLM's rule.
    recipes={"per_token_group_quant_fp8": "vllm"},
    availability=_availability,
    device="cuda",
    deterministic=True,
    description="DeepGEMM m_grouped_fp8_gemm_nt_contiguous (seed 001 DeepGemmExperts, SM90 FP8 block 128)",
)
