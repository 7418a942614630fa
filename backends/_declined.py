"""Why the GPU backends (``triton``, ``cuda``, ``deep_gemm``) do not claim vLLM 0.33's microscaling cross pairs
(issue 41 item 5; the schemes of ``specs/schemes.toml``'s microscaling block), as ``SupportRecord.declined`` data:
``is_supported_config`` adds the reason to its refusal, so the conformance matrix says why each is skipped.

Every pair is specified bit-exactly in the reference and run by the ``torch`` backend. The kernels that run them in
vLLM 0.33 are, per pair (``vllm/model_executor/layers/fused_moe/``):

- Humming (``experts/fused_humming_moe.py``, ``_supports_current_device``: the external ``humming`` package on CUDA
  SM75+): MXFP4 x FP8 per-token / 1x128, MXFP8 W8A16 and x FP8 per-token, NVFP4 W4A16 and x FP8 per-token;
- b12x (``b12x.py``, ``experts/flashinfer_b12x_moe.py``: SM120 only): NVFP4 x MXFP8, NVFP4 W4A16 (NVFP4 activation
  quantization inside FlashInfer's kernel);
- DeepGEMM ``m_grouped_fp8_fp4_gemm_nt_contiguous`` (``experts/deep_gemm_moe.py``: SM100 / SM120): MXFP4 x FP8 1x128;
- AITER (``experts/aiter_mxfp4_w4a8_moe.py``: ROCm gfx950 / gfx1250): MXFP4 x static FP8;
- XPU (``experts/xpu_moe.py``: Intel GPUs): MXFP8 W8A16;
- the OCP MX emulation (``experts/ocp_mx_emulation_moe.py``, needs ``amd-quark``): MXFP6 W6A6, MXFP4 x MXFP6 and
  MXFP4 x static FP8 (weights dequantized to bf16, activations fake-quantized, then ``TritonExperts``).
"""

from __future__ import annotations

from reference.quant import keys as K

__all__ = ["MICROSCALING_DECLINED"]

_HUMMING = ("vLLM 0.33 runs it with the Humming kernels (experts/fused_humming_moe.py, the external `humming` "
            "package, SM75+), which this backend does not implement")
_SM90_NO_FP4 = "SM90 has no FP4 / MX block-scaled MMA"
_OCP = ("vLLM 0.33 runs it only through the OCP MX emulation (experts/ocp_mx_emulation_moe.py: amd-quark, weights "
        "dequantized to bf16 before TritonExperts); no GPU has an MXFP6 MMA this backend could use on SM90, and it "
        "does not implement the emulation")

#: ``(weight_key, activation_key) -> reason`` for ``SupportRecord.declined``.
MICROSCALING_DECLINED = {
    (K.kMxfp4Static, K.kFp8StaticTensorSym): (
        "vLLM 0.33 runs it with AITER's W4A8 kernel (experts/aiter_mxfp4_w4a8_moe.py: ROCm gfx950 / gfx1250) or the "
        "OCP MX emulation (experts/ocp_mx_emulation_moe.py, amd-quark); " + _SM90_NO_FP4),
    (K.kMxfp4Static, K.kFp8Dynamic128Sym): (
        "DeepGEMM's m_grouped_fp8_fp4_gemm_nt_contiguous is SM100 / SM120 only (experts/deep_gemm_moe.py, "
        "DeepGemmFP4Experts); " + _HUMMING),
    (K.kMxfp4Static, K.kFp8DynamicTokenSym): _HUMMING,
    (K.kMxfp8Static, None): "experts/xpu_moe.py is Intel XPU only; " + _HUMMING,
    (K.kMxfp8Static, K.kFp8DynamicTokenSym): _HUMMING,
    (K.kNvfp4Static, None): ("b12x.py / experts/flashinfer_b12x_moe.py are SM120 only (NVFP4 activations quantized "
                             "inside FlashInfer's kernel); " + _HUMMING),
    (K.kNvfp4Static, K.kMxfp8Dynamic): "b12x.py (B12xExperts) is SM120 only; " + _SM90_NO_FP4,
    (K.kNvfp4Static, K.kFp8DynamicTokenSym): _HUMMING,
    (K.kMxfp6E3M2Static, K.kMxfp6E3M2Dynamic): _OCP,
    (K.kMxfp6E2M3Static, K.kMxfp6E2M3Dynamic): _OCP,
    (K.kMxfp4Static, K.kMxfp6E3M2Dynamic): _OCP,
    (K.kMxfp4Static, K.kMxfp6E2M3Dynamic): _OCP,
}
