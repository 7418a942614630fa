"""``DeepGemmExperts`` and ``DeepGemmFP4Experts`` (seed 001, ``vllm/model_executor/layers/fused_moe/experts/
deep_gemm_moe.py``) as ``reference.modular.FusedMoEExpertsModular`` subclasses.

``DeepGemmExperts.apply`` runs, for one chunk of tokens (seed 001's order):

1. the layout plan (:func:`plan_layout`): for ``M >= masked_below_m`` (128) DeepGEMM's contiguous layout,
   ``M_sum, alignment = compute_aligned_M_and_alignment(M, topk, E_local, block_m=128, expert_tokens_meta)``; below it
   the masked layout (slots of 128 rows per local expert, ``m_grouped_fp8_gemm_nt_masked``: vLLM's
   ``BatchedDeepGemmExperts`` GEMMs inside the standard activation format, so a decode batch pays 64-row blocks
   for the experts it touches instead of 128-row blocks);
2. build the layout (Triton on CUDA, torch ops elsewhere: :mod:`backends.deep_gemm.layout`); the routes are
   checked on the host only when ``validate_routes`` (the conformance suite turns it on: ``MOE_VALIDATE_ROUTES=1``)
   - otherwise a bad id poisons its token's output with NaN on the device, and nothing in ``apply`` synchronises;
3. the input quantization (the experts take unquantized inputs, ``expects_unquantized_inputs``): each token's
   1x128 groups are quantized once (``per_token_group_quant_fp8``, the prepare step's rule) and written straight to
   the rows of its routes with MN-major TMA-aligned fp32 scales (``triton_kernels.quantize_scatter``; the torch path
   quantizes every token, then gathers the layout's rows; FP8 inputs with ``a1q_scale``, from a prepare step that
   quantized them, are gathered instead);
4. ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a1q, sfa), (w1, w1_scale), mm1_out bf16, m_indices)`` (or
   ``_masked(..., masked_m, expected_m)``);
5. gated activation + 1x128 requantization of the routes' rows (no padding row), FLOAT32_CEIL_UE8M0 scales when
   ``quant_config.use_ue8m0`` (:mod:`backends.deep_gemm.act_quant`);
6. GEMM2 the same way into bf16;
7. unpermute + top-k weighted fp32 reduction into the ``(M, K)`` output (``TopKWeightAndReduceNoOP`` follows).

Buffers: ``workspace13`` (act dtype) holds the permuted FP8 activations, then the FP8 requantized activations;
``workspace2`` the bf16 GEMM1 output, then the bf16 GEMM2 output (seed 001). Scales and index tensors are
allocated per call (small).

Steps 2, 3, 5 and 7 have two implementations with the same results: torch ops (:mod:`~backends.deep_gemm.layout`,
:mod:`~backends.deep_gemm.act_quant`; the definition, and the CPU path) and Triton kernels
(:mod:`~backends.deep_gemm.triton_kernels`, used on CUDA when ``use_triton``; checked equal - codes, scales, layout
and reduction bit for bit - on an H200 by ``tools/probe.py``'s "kernels" section).

The grouped GEMM is a class attribute (``grouped_gemm``) so a test can run the whole pipeline on CPU with an
emulated GEMM; the platform probes live in :mod:`backends.deep_gemm.platform` for the same reason.
"""

from __future__ import annotations

import dataclasses
from math import prod

import torch

from backends._declined import MICROSCALING_DECLINED
from backends._validation import validate_routes_requested
from backends.deep_gemm import platform, triton_kernels
from backends.deep_gemm.act_quant import SUPPORTED_ACTIVATIONS, act_mul_quant, per_token_group_quant_fp8_mn_major
from backends.deep_gemm.layout import POISON_ROW, build_contiguous_layout, gather_rows, gather_scales_mn_major, \
    sf_empty, unpermute_and_reduce
from reference.activation import MoEActivation
from reference.align import DEEP_GEMM_M_ALIGNMENT, compute_aligned_M_and_alignment
from reference.config import FusedMoEConfig, FusedMoEParallelConfig, FusedMoEQuantConfig
from reference.modular import ACTIVATION_PARAMS, FusedMoEActivationFormat, FusedMoEExpertsModular, SupportRecord, \
    TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOP
from reference.quant import (
    DeepGemmQuantScaleFMT,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
    kMxfp4Static,
    kMxfp8Dynamic,
    kMxfp8Static,
)

__all__ = [
    "BatchedDeepGemmExperts",
    "DeepGemmExperts",
    "DeepGemmFP4Experts",
    "deep_gemm_m_grouped_fp8_gemm_nt_contiguous",
    "deep_gemm_m_grouped_fp8_gemm_nt_masked",
    "plan_layout",
    "get_mk_alignment_for_contiguous_layout",
    "valid_deep_gemm",
    "scale_fmt_for",
    "device_unsupported_reason",
]

BLOCK = 128
#: Rows of each local expert's slot in the masked layout: DeepGEMM's SM90 masked kernels use BLOCK_M 64 or 128
#: (``csrc/jit_kernels/heuristics/sm90.hpp``), and a block must not run into the next slot.
MASKED_SLOT_ROWS = 128


# ------------------------------------------------------------------------------------------------------------
# DeepGEMM entry points
# ------------------------------------------------------------------------------------------------------------


def get_mk_alignment_for_contiguous_layout() -> int:
    """DeepGEMM's per-expert M (and K) alignment of the contiguous layout: 128 on SM90 (``deep_gemm`` is asked when
    it is importable on a GPU machine; otherwise the documented constant ``reference.align.DEEP_GEMM_M_ALIGNMENT``).
    vLLM's wrapper returns ``[128, 128]``; seed 001 indexes ``[0]``."""
    if platform.current_capability() is not None and platform.deep_gemm_installed():
        try:
            return int(platform.import_deep_gemm().get_mk_alignment_for_contiguous_layout())
        except RuntimeError:
            pass
    return DEEP_GEMM_M_ALIGNMENT


def deep_gemm_m_grouped_fp8_gemm_nt_contiguous(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor,
                                                sfb: torch.Tensor, d: torch.Tensor, m_indices: torch.Tensor,
                                                *, disable_ue8m0_cast: bool = False) -> None:
    """``d[r] = (a[r] * sfa[r]) @ (b[m_indices[r]] * sfb[m_indices[r]]).T`` for rows with ``m_indices[r] >= 0``.

    The call and argument layout DeepGEMM (2.5, SM90) accepts, checked on an H200 (see the package docstring):
    ``a`` fp8 e4m3 ``(M_sum, K)`` K-major; ``sfa`` fp32 ``(M_sum, K/128)`` (any strides; MN-major TMA-aligned is
    used as is, anything else is transposed by DeepGEMM); ``b`` fp8 ``(G, N, K)`` contiguous; ``sfb`` fp32
    ``(G, ceil(N/128), ceil(K/128))`` contiguous; ``d`` bf16 ``(M_sum, N)`` row-major; ``m_indices`` int32
    ``(M_sum,)`` contiguous. Rows of a block that starts with -1 are not written; padding rows inside a valid block
    are (garbage in, garbage out).

    Raises:
        RuntimeError: deep_gemm missing / unusable, or DeepGEMM's own assertion (its message is kept).
    """
    dg = platform.import_deep_gemm()
    dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, m_indices, disable_ue8m0_cast=disable_ue8m0_cast)


def deep_gemm_m_grouped_fp8_gemm_nt_masked(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
                                            d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, *,
                                            disable_ue8m0_cast: bool = False) -> None:
    """``d[g, r] = (a[g, r] * sfa[g, r]) @ (b[g] * sfb[g]).T`` for ``r < masked_m[g]`` (other rows not written).

    ``a`` fp8 e4m3 ``(G, max_m, K)`` contiguous; ``sfa`` fp32 ``(G, max_m, K/128)`` with strides
    ``(K/128 * max_m, 1, max_m)`` (``layout.sf_empty(..., slot_rows=max_m)``: used as is); ``b`` fp8 ``(G, N, K)``
    contiguous; ``sfb`` fp32 ``(G, ceil(N/128), ceil(K/128))``; ``d`` bf16 ``(G, max_m, N)``; ``masked_m`` int32
    ``(G,)`` contiguous; ``expected_m`` > 0, the rows per group DeepGEMM's heuristics plan for
    (``csrc/apis/gemm.hpp::m_grouped_fp8_fp4_gemm_nt_masked``).

    Raises:
        RuntimeError: deep_gemm missing / unusable, or DeepGEMM's own assertion (its message is kept).
    """
    dg = platform.import_deep_gemm()
    dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, int(expected_m),
                                    disable_ue8m0_cast=disable_ue8m0_cast)


def plan_layout(M: int, topk: int, local_num_experts: int, expert_tokens_meta=None,
                masked_below_m: int = 128) -> tuple[int, int, int | None]:
    """``(rows, alignment, slot_rows)`` of the layout :class:`DeepGemmExperts` uses for ``M`` tokens.

    ``M < masked_below_m``: the masked layout, ``(E_local * 128, 128, 128)``; otherwise the contiguous layout,
    ``(*compute_aligned_M_and_alignment(M, topk, E_local, 128, expert_tokens_meta), None)``.
    """
    if 0 < M < masked_below_m:
        return local_num_experts * MASKED_SLOT_ROWS, MASKED_SLOT_ROWS, MASKED_SLOT_ROWS
    M_sum, align_used = compute_aligned_M_and_alignment(
        M, topk, local_num_experts, get_mk_alignment_for_contiguous_layout(), expert_tokens_meta)
    return M_sum, align_used, None


def expected_m_for(M: int, topk: int, local_num_experts: int) -> int:
    """DeepGEMM's ``expected_m`` hint for the masked GEMMs: the mean routes per local expert if every route is
    local, at least 1 and at most ``MASKED_SLOT_ROWS``."""
    return max(1, min(MASKED_SLOT_ROWS, -(-M * topk // local_num_experts)))


def valid_deep_gemm(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[bool, str | None]:
    """Seed 001's ``_valid_deep_gemm``: ``(ok, reason)``.

    The package check (``has_deep_gemm()``) first, then ``reference.align.valid_deep_gemm`` with DeepGEMM's
    alignment: ``M >= 128``, ``N = w2.size(2)`` and ``K`` multiples of 128, ``N > 512``, fp8 e4m3 weights,
    contiguous operands. (vLLM uses it to choose DeepGEMM over Triton; ``apply`` itself needs only the hard
    requirements checked in ``DeepGemmExperts._check_operands``.)
    """
    from reference.align import valid_deep_gemm as _reference_rule

    if not platform.deep_gemm_installed():
        return False, f"DeepGemm disabled: {platform.PACKAGE} is not installed"
    return _reference_rule(hidden_states, w1, w2, alignment=get_mk_alignment_for_contiguous_layout())


def scale_fmt_for(capability: tuple[int, int], use_ue8m0: bool) -> DeepGemmQuantScaleFMT:
    """``DeepGemmQuantScaleFMT.from_oracle()`` with the platform and ``VLLM_USE_DEEP_GEMM_E8M0`` as parameters:
    ``use_ue8m0`` of the quant config stands for the environment switch (FLOAT32 when off; FLOAT32_CEIL_UE8M0 on
    SM90, UE8M0 on SM100/SM120 when on)."""
    return DeepGemmQuantScaleFMT.from_capability(capability, use_e8m0=use_ue8m0)


def device_unsupported_reason() -> str | None:
    """None when this backend's FP8 path can run here (CUDA SM90 + a working deep_gemm), else why not."""
    cap = platform.current_capability()
    if cap is None:
        return "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    if not platform.is_sm90(cap):
        return (f"{platform.device_name()} is sm_{cap[0]}{cap[1]}; the deep_gemm backend implements and verified the "
                "SM90 FP8 path only (SM100/SM120 need packed UE8M0 scales and were not available to test)")
    if not platform.deep_gemm_installed():
        return f"{platform.PACKAGE} is not installed ({platform.PIP_HINT})"
    return platform.deep_gemm_abi_error()


def _resize(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    n = prod(shape)
    if n > x.numel():
        raise ValueError(f"workspace of {x.numel()} elements is too small for {shape}")
    return x.flatten()[:n].view(*shape)


def _workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
    """Seed 001's ``workspace_shapes`` with the rows of the layout :func:`plan_layout` picks (the masked layout's
    ``E_local * 128`` rows below ``masked_below_m``)."""
    rows, _, _ = plan_layout(M, topk, local_num_experts, expert_tokens_meta, self.masked_below_m)
    activation_out_dim = self.adjust_N_for_activation(N, activation)
    return (rows, max(activation_out_dim, K)), (rows, max(N, K)), (M, K)


def _seed_workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                           activation):
    """Seed 001's ``workspace_shapes`` (the FP4 class, declared only)."""
    block_m = get_mk_alignment_for_contiguous_layout()
    M_sum, align_used = compute_aligned_M_and_alignment(M, topk, local_num_experts, block_m, expert_tokens_meta)
    assert M_sum % align_used == 0
    activation_out_dim = self.adjust_N_for_activation(N, activation)
    workspace1 = (M_sum, max(activation_out_dim, K))
    workspace2 = (M_sum, max(N, K))
    output = (M, K)
    return (workspace1, workspace2, output)


def _no_fi_nvl(moe_parallel_config: FusedMoEParallelConfig) -> bool:
    # Seed 001: "discovered an IMA with this combination. Needs investigation."
    return not (moe_parallel_config.use_fi_nvl_two_sided_kernels or moe_parallel_config.use_fi_nvl_one_sided_kernels)


def _device_reason() -> str | None:
    # Looked up at call time, so that tests replacing the probes (``platform``) or this module's function are seen.
    return device_unsupported_reason()


def _fp4_device_reason() -> str:
    return DeepGemmFP4Experts.unsupported_reason()


# ------------------------------------------------------------------------------------------------------------
# DeepGemmExperts
# ------------------------------------------------------------------------------------------------------------


class DeepGemmExperts(FusedMoEExpertsModular):
    """DeepGEMM-based fused MoE experts (seed 001): FP8 e4m3 weights with 128x128 block scales
    (``kFp8Static128BlockSym``), activations quantized dynamically per 1x128 group (``kFp8Dynamic128Sym``), two
    ``m_grouped_fp8_gemm_nt_contiguous`` calls on the contiguous layout (from M = 128; below it two
    ``m_grouped_fp8_gemm_nt_masked`` calls on 128-row slots: :func:`plan_layout`), SM90.

    Inputs of ``apply`` (from ``MoEPrepareAndFinalizeNoEP``, which defers the input quantization to the experts:
    ``expects_unquantized_inputs``): ``hidden_states`` bf16 ``(M, K)`` and ``a1q_scale`` None (or fp8 ``(M, K)`` with
    fp32 ``(M, K/128)`` scales from a prepare step that quantized them); ``w1`` fp8 ``(E_local, N=2I, K)``, ``w2`` fp8
    ``(E_local, K, I)``, ``quant_config.w1_scale`` / ``w2_scale`` fp32 ``(E_local, N/128, K/128)`` / ``(E_local, K/128,
    I/128)``; ``topk_ids`` ``(M, topk)`` int (global ids with ``expert_map``), ``topk_weights`` ``(M, topk)`` fp32.
    Output: ``(M, K)`` in the activation dtype, weighted and reduced.

    Quant config: ``fp8_w8a8_moe_quant_config(w1_scale, w2_scale, block_shape=[128, 128], use_ue8m0=True,
    recipe="vllm")`` reproduces the seed on SM90 (FLOAT32_CEIL_UE8M0); ``use_ue8m0=False`` is the seed's FLOAT32
    path (``VLLM_USE_DEEP_GEMM_E8M0=0``). The requantization between the GEMMs uses ``quant_config.recipe`` and
    ``use_ue8m0``, the same rule the reference applies to a2.

    Support (``is_supported_config``): device = CUDA SM90 with a working deep_gemm (see
    :func:`device_unsupported_reason`); activations SILU, SWIGLUSTEP, SWIGLUOAI_UNINTERLEAVE (gated only); quant
    scheme (kFp8Static128BlockSym, kFp8Dynamic128Sym); (kMxfp8Static, kMxfp8Dynamic) only on SM100 as in the seed
    (never reached here, since the device predicate is SM90-only; constructing the MXFP8 variant raises); parallel
    configs without FlashInfer NVL kernels; hidden size a multiple of 128 (``_supports_shape``, a backend
    addition: the kernel cannot run otherwise).

    Raises (``__init__``): ValueError for a quant config that is not FP8 block [128, 128] with dynamic 1x128
    activations (seed 001's asserts); NotImplementedError for the MXFP8 [1, 32] variant.
    """

    #: The grouped GEMMs (replaceable for CPU tests of the pipeline).
    grouped_gemm = staticmethod(deep_gemm_m_grouped_fp8_gemm_nt_contiguous)
    grouped_gemm_masked = staticmethod(deep_gemm_m_grouped_fp8_gemm_nt_masked)
    #: Check ids / counts on the host (one small device->host copy per call: out-of-range ids, stale
    #: expert_tokens_meta, an expert overflowing its masked slot) and raise a ValueError that names the problem.
    #: None (default): on when the environment sets ``MOE_VALIDATE_ROUTES=1`` (the conformance suite does), else off:
    #: the hot path then never synchronises, and a bad route poisons its token's output with NaN instead. Skipped
    #: during CUDA-graph capture.
    validate_routes: bool | None = None
    #: Use the Triton kernels of :mod:`backends.deep_gemm.triton_kernels` on CUDA (else the torch-op paths).
    use_triton: bool = True
    #: Chunks of fewer tokens run the masked layout (:func:`plan_layout`); 0 turns it off.
    masked_below_m: int = 128

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig, max_num_tokens=None,
                 num_dispatchers=None):
        super().__init__(moe_config=moe_config, quant_config=quant_config, max_num_tokens=max_num_tokens,
                         num_dispatchers=num_dispatchers)
        self.mxfp8 = quant_config.block_shape == [1, 32]
        if self.mxfp8:
            raise NotImplementedError(
                "DeepGemmExperts MXFP8 (block_shape [1, 32], recipe (1, 32)) runs only on SM100 (seed 001) and is not "
                "implemented by this backend")
        if quant_config.block_shape != [BLOCK, BLOCK]:
            raise ValueError(f"DeepGemmExperts needs 128x128 block-quantized FP8 weights (block_shape [128, 128] = "
                             f"get_mk_alignment_for_contiguous_layout()), got block_shape {quant_config.block_shape}")
        if quant_config.quant_dtype != torch.float8_e4m3fn or quant_config.weight_quant_dtype != torch.float8_e4m3fn:
            raise ValueError(f"DeepGemmExperts needs float8_e4m3fn activations and weights, got "
                             f"{quant_config.quant_dtype} / {quant_config.weight_quant_dtype}")
        if quant_config.a1.shape != (1, BLOCK) or quant_config.a1.scale is not None:
            raise ValueError(f"DeepGemmExperts needs dynamic 1x128 activation quantization, got a1 shape "
                             f"{quant_config.a1.shape}, static scale {quant_config.a1.scale is not None}")
        if quant_config.per_act_token_quant or quant_config.per_out_ch_quant:
            raise ValueError("DeepGemmExperts does not support per-token / per-channel quantization (seed 001)")
        if quant_config.w1_bias is not None or quant_config.w2_bias is not None:
            raise ValueError("DeepGemmExperts has no expert bias epilogue (seed 001)")
        self.gemm1_clamp_limit = quant_config.gemm1_clamp_limit
        self.gemm1_alpha = quant_config.gemm1_alpha if quant_config.gemm1_alpha is not None else 1.0
        self.gemm1_beta = quant_config.gemm1_beta if quant_config.gemm1_beta is not None else 0.0

    # --- support oracle (seed 001) ---------------------------------------------------------------------------
    @staticmethod
    def activation_format() -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        declined=MICROSCALING_DECLINED,  # vLLM 0.33's microscaling cross pairs: why not here (backends/_declined.py)
        # Seed 001's pairs. The MXFP8 pair is the seed's SM100-only claim: _supports_quant_scheme adds the device
        # condition (and the device probe is SM90-only, so it is never claimed here; __init__ raises for it).
        quant_schemes=frozenset({(kFp8Static128BlockSym, kFp8Dynamic128Sym), (kMxfp8Static, kMxfp8Dynamic)}),
        activations=frozenset(SUPPORTED_ACTIVATIONS),  # SILU, SWIGLUSTEP, SWIGLUOAI_UNINTERLEAVE (apply raises else)
        no_act_and_mul=False,
        # DeepGEMM's grouped GEMM writes bf16 into the act-dtype workspaces: apply raises for another act dtype.
        act_dtypes=frozenset({torch.bfloat16}),
        device=_device_reason,
        parallel_config=_no_fi_nvl,  # no FlashInfer NVL kernels (seed 001: an IMA)
        # K multiple of 128 (1x128 / 128x128 scale blocks; apply checks K, N and I): a backend addition.
        hidden_dim_multiple=BLOCK,
        finalize="(M, K) weighted and reduced: TopKWeightAndReduceNoOP",
        activation_params=ACTIVATION_PARAMS, ue8m0_scales=True,  # every variant, as before the claims had them
        notes="m_grouped_fp8_gemm_nt_contiguous on the contiguous layout, _masked on 128-row slots below M = 128 "
              "(SM90); N, I multiples of 128; a2 quantized dynamically (no static a2_scale); no expert biases; any M "
              "(vLLM only picks DeepGEMM for M >= 128)",
    )

    @classmethod
    def _supports_quant_scheme(cls, weight_key, activation_key) -> bool:
        # The record lists both seed pairs; the MXFP8 one holds only on the SM100 family (seed 001), a device
        # condition a frozen record cannot carry.
        if not cls.support.claims_quant(weight_key, activation_key):
            return False
        if (weight_key, activation_key) == (kMxfp8Static, kMxfp8Dynamic):
            return platform.capability_family(platform.current_capability()) == 100
        return True

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    workspace_shapes = _workspace_shapes

    @property
    def expects_unquantized_inputs(self) -> bool:
        """True: ``apply`` quantizes the hidden states itself, fused with the permutation (step 3 of the module
        docstring; same codes and scales as the prepare step's ``per_token_group_quant_fp8``)."""
        return True

    # --- compute ---------------------------------------------------------------------------------------------
    def scale_fmt(self) -> DeepGemmQuantScaleFMT:
        """The activation scale format used between the GEMMs (SM90: FLOAT32_CEIL_UE8M0 or FLOAT32)."""
        return scale_fmt_for((9, 0), self.quant_config.use_ue8m0)

    def _check_operands(self, hidden_states, a1q_scale, a2_scale, w1, w2) -> None:
        fp8 = torch.float8_e4m3fn
        if a2_scale is not None:
            raise ValueError("DeepGemmExperts quantizes a2 dynamically; a static a2_scale is not supported")
        if w1.dtype != fp8 or w2.dtype != fp8:
            raise ValueError(f"w1, w2 must be float8_e4m3fn, got {w1.dtype}, {w2.dtype}")
        if hidden_states.dtype == fp8:
            if a1q_scale is None:
                raise ValueError("FP8 hidden_states need a1q_scale (their 1x128 group scales)")
        elif hidden_states.dtype != torch.bfloat16 or a1q_scale is not None:
            raise ValueError(f"hidden_states must be bfloat16 (quantized here) or float8_e4m3fn with a1q_scale, got "
                             f"{hidden_states.dtype} with a1q_scale {'given' if a1q_scale is not None else 'None'}")
        E, N, K = w1.shape
        I = self.adjust_N_for_activation(N, MoEActivation.SILU)
        if w2.shape != (E, K, I):
            raise ValueError(f"w2 must be (E, K, N/2) = ({E}, {K}, {I}), got {tuple(w2.shape)}")
        if K % BLOCK or N % BLOCK or I % BLOCK:
            raise ValueError(f"DeepGEMM needs K, N=2I and I multiples of 128 (1x128 / 128x128 scale blocks), got "
                             f"K={K}, N={N}, I={I}")
        if hidden_states.dim() != 2 or hidden_states.size(1) != K or (
                a1q_scale is not None and tuple(a1q_scale.shape) != (hidden_states.size(0), K // BLOCK)):
            raise ValueError(f"hidden_states / a1q_scale must be (M, {K}) / (M, {K // BLOCK}), got "
                             f"{tuple(hidden_states.shape)} / "
                             f"{None if a1q_scale is None else tuple(a1q_scale.shape)}")
        for name, s, want in (("w1_scale", self.w1_scale, (E, N // BLOCK, K // BLOCK)),
                              ("w2_scale", self.w2_scale, (E, K // BLOCK, I // BLOCK))):
            if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
                raise ValueError(f"quant_config.{name} must be fp32 {want}, got "
                                 f"{None if s is None else (tuple(s.shape), s.dtype)}")

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        """One chunk of the experts step (module docstring); writes ``output (M, K)``.

        Raises:
            ValueError: operands of the wrong dtype/shape, ids outside the id space (other than -1),
                ``expert_tokens_meta`` counts that disagree with ``topk_ids``; NotImplementedError: an activation
                outside SILU / SWIGLUSTEP / SWIGLUOAI_UNINTERLEAVE; RuntimeError: deep_gemm missing or failing.
        """
        if activation not in SUPPORTED_ACTIVATIONS:
            raise NotImplementedError(f"DeepGemmExperts does not support {activation}")
        self._check_operands(hidden_states, a1q_scale, a2_scale, w1, w2)
        M, K = hidden_states.shape
        E_local, N, _ = w1.shape
        topk = topk_ids.size(1)
        if workspace2.dtype != torch.bfloat16 or output.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"DeepGEMM's grouped GEMM writes bf16: the activation dtype (workspaces) must be "
                             f"bfloat16, got {workspace2.dtype}")
        if M == 0:
            return

        rows, align_used, slot = plan_layout(M, topk, E_local, expert_tokens_meta, self.masked_below_m)
        if slot is not None and (rows * max(K, N // 2) > workspace13.numel() * workspace13.element_size()
                                 or rows * max(N, K) > workspace2.numel()):
            # workspaces sized for a larger chunk's contiguous layout (0.17's chunking: a short tail chunk) cannot hold
            # E_local slots: the contiguous layout for this chunk fits them (its rows grow with M)
            rows, align_used, slot = plan_layout(M, topk, E_local, expert_tokens_meta, 0)
        triton_ok = self.use_triton and triton_kernels.available(topk_ids)
        if triton_ok:
            layout, counts_all = triton_kernels.build_contiguous_layout(
                topk_ids, E_local, rows, align_used, expert_map, slot_rows=slot,
                with_row_token=hidden_states.dtype == torch.float8_e4m3fn)
            n_out_of_range = counts_all[E_local]
        else:
            layout, out_of_range = build_contiguous_layout(topk_ids, E_local, rows, align_used, expert_map,
                                                           slot_rows=slot)
            n_out_of_range = out_of_range.sum()
        if self._validating(topk_ids):
            self._validate(layout, n_out_of_range, topk_ids, expert_map, expert_tokens_meta)
        expected_m = expected_m_for(M, topk, E_local)
        disable_cast = not self.quant_config.use_ue8m0
        device = hidden_states.device

        # Input: FP8 codes of each route's token (workspace13) + fp32 1x128 scales in DeepGEMM's layout.
        a1q = _resize(workspace13.view(torch.float8_e4m3fn), (rows, K))
        if hidden_states.dtype == torch.float8_e4m3fn:
            gather_rows(hidden_states, layout.row_token, out=a1q)
            sfa1 = gather_scales_mn_major(a1q_scale, layout.row_token, slot)
        else:
            qkw = dict(group_size=BLOCK, use_ue8m0=self.quant_config.use_ue8m0, recipe=self.quant_config.recipe)
            if triton_ok:  # (bf16 rows, checked above; contiguous rows are all the kernel asks for)
                sfa1 = sf_empty(rows, K // BLOCK, device, slot)
                triton_kernels.quantize_scatter(hidden_states.contiguous(), layout.inv_perm, a1q, sfa1, **qkw)
            else:  # torch ops without a host sync: quantize every token, then gather the layout's rows and scales
                xq, xs = per_token_group_quant_fp8_mn_major(hidden_states, **qkw)
                gather_rows(xq, layout.row_token, out=a1q)
                sfa1 = gather_scales_mn_major(xs, layout.row_token, slot)

        # GEMM1 -> bf16 (workspace2).
        mm1_out = _resize(workspace2, (rows, N))
        self._gemm(layout, a1q, sfa1, w1, self.w1_scale, mm1_out, expected_m, disable_cast)

        # Activation + requantization -> FP8 (workspace13) + fp32 scales, the routes' rows only.
        I = self.adjust_N_for_activation(N, activation)
        quant_out = _resize(workspace13.view(torch.float8_e4m3fn), (rows, I))
        sfa2 = sf_empty(rows, I // BLOCK, device, slot)
        qkw = dict(alpha=self.quant_config.gemm1_alpha, beta=self.quant_config.gemm1_beta,
                   limit=self.gemm1_clamp_limit, group_size=BLOCK, use_ue8m0=self.quant_config.use_ue8m0,
                   recipe=self.quant_config.recipe, out_q=quant_out, out_s=sfa2)
        a2q = None
        if self.use_triton and triton_kernels.available(mm1_out):
            try:
                a2q, sfa2 = triton_kernels.act_mul_quant(mm1_out, activation, routes=layout.inv_perm, **qkw)
            except NotImplementedError:
                a2q = None
        if a2q is None:
            a2q, sfa2 = act_mul_quant(mm1_out, activation, **qkw)

        # GEMM2 -> bf16 (workspace2), then unpermute + weighted top-k reduction into the output.
        mm2_out = _resize(workspace2, (rows, K))
        self._gemm(layout, a2q, sfa2, w2, self.w2_scale, mm2_out, expected_m, disable_cast)
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        if self.use_triton and triton_kernels.available(mm2_out):
            triton_kernels.unpermute_and_reduce(mm2_out, layout.inv_perm, weights, output)
        else:
            unpermute_and_reduce(mm2_out, layout.inv_perm, weights, output)

    def _gemm(self, layout, a, sfa, w, w_scale, out, expected_m: int, disable_cast: bool) -> None:
        """One grouped GEMM on the layout: contiguous (``m_indices``) or masked (``masked_m``, 3-D views)."""
        w_scale = w_scale.contiguous()
        if layout.masked:
            E, slot = w.size(0), layout.slot_rows
            self.grouped_gemm_masked(a.view(E, slot, a.size(1)), sfa, w, w_scale, out.view(E, slot, out.size(1)),
                                     layout.masked_m, expected_m, disable_ue8m0_cast=disable_cast)
        else:
            self.grouped_gemm(a, sfa, w, w_scale, out, layout.m_indices, disable_ue8m0_cast=disable_cast)

    def _validating(self, topk_ids: torch.Tensor) -> bool:
        return validate_routes_requested(self.validate_routes, topk_ids)

    def _validate(self, layout, n_out_of_range, topk_ids, expert_map, expert_tokens_meta) -> None:
        """One device->host copy: out-of-range ids, routes left without a row (M_sum or a masked slot too small),
        stale expert_tokens_meta counts."""
        E = layout.counts.numel()
        n_poisoned = (layout.inv_perm == POISON_ROW).sum()
        parts = [n_out_of_range.reshape(1).to(torch.int64), n_poisoned.reshape(1).to(torch.int64)]
        given = None
        if expert_tokens_meta is not None:
            given = expert_tokens_meta.expert_num_tokens_cpu
            if given is None:
                given = expert_tokens_meta.expert_num_tokens
        if given is not None:
            parts.append(layout.counts.to(torch.int64))
        host = torch.cat(parts).tolist()
        if host[0]:
            n_ids = expert_map.numel() if expert_map is not None else E
            flat = topk_ids.reshape(-1)
            bad = flat[((flat < -1) | (flat >= n_ids)).nonzero()[0]].item()
            raise ValueError(f"topk_ids holds {bad}, outside the expert id space [0, {n_ids}) and not the -1 sentinel "
                             "(NaN router logits? vLLM #39391); DeepGemmExperts refuses it")
        if host[1] > host[0]:
            if layout.masked:
                raise ValueError(f"a local expert receives more than {layout.slot_rows} routes in the masked layout "
                                 f"(max {int(layout.counts.max())}; duplicate expert ids within a token?)")
            raise ValueError(f"{host[1]} routes found no row in M_sum={layout.M_sum} (expert_tokens_meta counts "
                             "smaller than the real ones: vLLM #20392)")
        if given is not None:
            counts = host[2:2 + E]
            given_list = [int(c) for c in (given.tolist() if isinstance(given, torch.Tensor) else given)]
            if given_list != counts:
                raise ValueError(f"expert_tokens_meta counts {given_list} disagree with topk_ids {counts}; "
                                 "recompute them for this chunk (vLLM #20392)")


# ------------------------------------------------------------------------------------------------------------
# BatchedDeepGemmExperts
# ------------------------------------------------------------------------------------------------------------


class BatchedDeepGemmExperts(DeepGemmExperts):
    """vLLM's ``BatchedDeepGemmExperts`` (``fused_moe/batched_deep_gemm_moe.py``; the batched activation format of
    seed 002): the experts of :class:`DeepGemmExperts` on ``(E_local, T, K)`` slots, two
    ``m_grouped_fp8_gemm_nt_masked`` calls with ``masked_m = expert_num_tokens``.

    Inputs of ``apply`` (from ``reference.batched.BatchedPrepareAndFinalize`` or a DeepEP low-latency dispatch):
    ``hidden_states`` fp8 ``(E_local, T, K)`` with ``a1q_scale`` fp32 ``(E_local, T, K/128)`` (or bf16 slots,
    quantized here per 1x128 group), ``expert_tokens_meta.expert_num_tokens`` ``(E_local,)``; rows past an expert's
    count are ignored. Output: ``(E_local, T, K)`` in the activation dtype, unweighted, padding rows zero (the
    prepare/finalize weights and reduces: ``TopKWeightAndReduceDelegate``). Slots are padded to a multiple of 128
    rows for the GEMMs when ``T`` is not one (a 64- or 128-row GEMM block must not run into the next slot).

    Same support as :class:`DeepGemmExperts` (quant schemes, activations, device, parallel configs, K % 128) in the
    batched format, without chunking (the format has no token dimension to chunk).

    Raises (``apply``): ValueError without ``expert_tokens_meta``, for operands of the wrong dtype / shape, or (when
    validating, ``validate_routes``) counts above ``T``. Without validation a count above ``T`` is capped at ``T``
    (a slot holds no more rows: the prepare step that produced it is at fault, and raises where it validates).
    """

    support = dataclasses.replace(
        DeepGemmExperts.support, activation_format=FusedMoEActivationFormat.BatchedExperts, chunking=False,
        finalize="(E_local, T, K) unweighted: TopKWeightAndReduceDelegate",
        notes="m_grouped_fp8_gemm_nt_masked on (E_local, T, K) slots (SM90), masked_m = expert_num_tokens; N, I "
              "multiples of 128; a2 quantized dynamically; no expert biases")

    @staticmethod
    def activation_format() -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.BatchedExperts

    @property
    def expects_unquantized_inputs(self) -> bool:
        return False  # the batched prepare quantizes each slot's rows (per 1x128 group: row-local, the same codes)

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceDelegate()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        # Each slot receives up to max_num_tokens rows from every dispatcher (seed 002 BatchedExperts); the GEMM
        # buffers (padded slots) are allocated in apply.
        E, T = local_num_experts, self.max_num_tokens * self.num_dispatchers
        return (E, T, max(N, K)), (E, T, self.adjust_N_for_activation(N, activation)), (E, T, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        if activation not in SUPPORTED_ACTIVATIONS:
            raise NotImplementedError(f"BatchedDeepGemmExperts does not support {activation}")
        if expert_tokens_meta is None:
            raise ValueError("BatchedDeepGemmExperts needs expert_tokens_meta (expert_num_tokens) from the prepare "
                             "step")
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be (E_local, T, K) slots, got {tuple(hidden_states.shape)}")
        E, T, K = hidden_states.shape
        self._check_operands(hidden_states.reshape(E * T, K),
                             None if a1q_scale is None else a1q_scale.reshape(E * T, -1), a2_scale, w1, w2)
        if w1.size(0) != E:
            raise ValueError(f"hidden_states has {E} expert slots but w1 holds {w1.size(0)} experts")
        if tuple(output.shape) != (E, T, K):
            raise ValueError(f"output must be ({E}, {T}, {K}), got {tuple(output.shape)}")
        N = w1.size(1)
        I = self.adjust_N_for_activation(N, activation)
        device = hidden_states.device
        counts = expert_tokens_meta.expert_num_tokens.to(device=device)
        if self._validating(counts):
            bad = [int(c) for c in counts.tolist() if int(c) > T or int(c) < 0]
            if bad:
                raise ValueError(f"expert_num_tokens {counts.tolist()} exceed the {T} rows of a slot")
        masked_m = counts.to(torch.int32).clamp(0, T).contiguous()
        if T == 0:
            return
        slot = -(-T // MASKED_SLOT_ROWS) * MASKED_SLOT_ROWS
        rows = E * slot
        row_ids = torch.arange(rows, device=device)
        # the rows the GEMMs compute (row t < masked_m[e] of slot e), as "routes" for the act+quant kernel
        routes = torch.where(row_ids % slot < masked_m.repeat_interleave(slot), row_ids, torch.full_like(row_ids, -1))

        # input codes and scales in padded slots
        qkw = dict(group_size=BLOCK, use_ue8m0=self.quant_config.use_ue8m0, recipe=self.quant_config.recipe)
        if hidden_states.dtype != torch.float8_e4m3fn:
            xq, xs = per_token_group_quant_fp8_mn_major(hidden_states.reshape(E * T, K), **qkw)
            x3, s3 = xq.view(E, T, K), xs.reshape(E, T, K // BLOCK)
        else:
            x3, s3 = hidden_states, a1q_scale.reshape(E, T, K // BLOCK)
        if slot == T and x3.is_contiguous():
            a1 = x3
        else:
            a1 = torch.empty((E, slot, K), dtype=torch.float8_e4m3fn, device=device)
            a1.view(torch.uint8)[:, :T].copy_(x3.view(torch.uint8))
        sfa1 = sf_empty(rows, K // BLOCK, device, slot)
        sfa1[:, :T].copy_(s3)
        expected_m = max(1, min(T, MASKED_SLOT_ROWS))
        disable_cast = not self.quant_config.use_ue8m0
        mm1 = torch.empty((E, slot, N), dtype=torch.bfloat16, device=device)
        self.grouped_gemm_masked(a1, sfa1, w1, self.w1_scale.contiguous(), mm1, masked_m, expected_m,
                                 disable_ue8m0_cast=disable_cast)

        a2q = torch.empty((rows, I), dtype=torch.float8_e4m3fn, device=device)
        sfa2 = sf_empty(rows, I // BLOCK, device, slot)
        akw = dict(alpha=self.quant_config.gemm1_alpha, beta=self.quant_config.gemm1_beta,
                   limit=self.gemm1_clamp_limit, out_q=a2q, out_s=sfa2, **qkw)
        done = False
        if self.use_triton and triton_kernels.available(mm1):
            try:
                triton_kernels.act_mul_quant(mm1.view(rows, N), activation, routes=routes, **akw)
                done = True
            except NotImplementedError:
                pass
        if not done:
            act_mul_quant(mm1.view(rows, N), activation, **akw)
        y = torch.empty((E, slot, K), dtype=torch.bfloat16, device=device)
        self.grouped_gemm_masked(a2q.view(E, slot, I), sfa2, w2, self.w2_scale.contiguous(), y, masked_m,
                                 expected_m, disable_ue8m0_cast=disable_cast)
        valid = (torch.arange(T, device=device)[None, :] < masked_m[:, None].long())[:, :, None]
        output.copy_(torch.where(valid, y[:, :T], torch.zeros((), dtype=y.dtype, device=device)))


# ------------------------------------------------------------------------------------------------------------
# DeepGemmFP4Experts
# ------------------------------------------------------------------------------------------------------------


class DeepGemmFP4Experts(FusedMoEExpertsModular):
    """Seed 001's FP4-weight DeepGEMM experts, declared with the seed's support rules and not implemented.

    The seed runs ``m_grouped_fp8_fp4_gemm_nt_contiguous`` with FP8 activations (recipe_a (1, 128)) and MXFP4 E2M1
    weights packed as int8 with UE8M0 1x32 scales (recipe_b (1, 32)) - a Blackwell-only kernel: the seed's device
    rule is ``is_deep_gemm_supported() and (SM100 family or SM120 family)`` (:meth:`seed_supports_capability`).
    This project's GPU is SM90, where the kernel does not exist, so ``_supports_current_device`` is False
    (:meth:`unsupported_reason` says why) and construction raises ``NotImplementedError``: a support claim that
    nothing here could verify is not made.

    Seed predicates kept as data: quant scheme (kMxfp4Static, kFp8Dynamic128Sym); activations SILU, SWIGLUSTEP;
    no act-and-mul-less MLPs; no FlashInfer NVL parallel configs; ``workspace_shapes`` as the seed's.
    """

    _ACT_BLOCK_K = 128
    _WEIGHT_BLOCK_K = 32

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        raise NotImplementedError(f"DeepGemmFP4Experts is not implemented: {self.unsupported_reason()}")

    @staticmethod
    def seed_supports_capability(capability: tuple[int, int] | None) -> bool:
        """Seed 001's device rule without the package check: SM100 family or SM120 family."""
        return platform.capability_family(capability) in (100, 120)

    @staticmethod
    def unsupported_reason() -> str:
        cap = platform.current_capability()
        where = "no CUDA GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
        return (f"DeepGemmFP4Experts (MXFP4 weights x FP8 activations, m_grouped_fp8_fp4_gemm_nt_contiguous) needs "
                f"an SM100/SM120 GPU (seed 001); this machine has {where}, and the backend has no SM100 "
                "implementation to claim")

    @staticmethod
    def activation_format() -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        declined=MICROSCALING_DECLINED,  # vLLM 0.33's microscaling cross pairs: why not here (backends/_declined.py)
        quant_schemes=frozenset({(kMxfp4Static, kFp8Dynamic128Sym)}),
        activations=frozenset({MoEActivation.SILU, MoEActivation.SWIGLUSTEP}),
        no_act_and_mul=False,
        device=_fp4_device_reason,  # never None: no SM100 implementation to claim
        parallel_config=_no_fi_nvl,
        finalize="(M, K) weighted and reduced: TopKWeightAndReduceNoOP",
        activation_params=ACTIVATION_PARAMS, ue8m0_scales=True,  # every variant, as before the claims had them
        notes="declared only (seed 001's claims kept as data): SM100/SM120 m_grouped_fp8_fp4_gemm_nt_contiguous; "
              "construction and apply raise NotImplementedError",
    )

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    workspace_shapes = _seed_workspace_shapes

    def apply(self, *args, **kwargs):
        raise NotImplementedError(self.unsupported_reason())
