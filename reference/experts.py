"""The experts computation, written as the readable per-expert loop that every kernel must reproduce.

For each local expert ``e`` and the tokens routed to it (mirrors vLLM's ``fused_experts_impl`` in
``fused_moe/fused_moe.py`` and the test oracle ``torch_experts`` in ``tests/kernels/utils.py``)::

    a   = dequant(quant_a1(x))                       fp32 (M_e, K)        [prepare: a1 quantized per the config]
    h   = a @ dequant(w1[e]).T  (+ w1_bias[e])       fp32 accumulate -> ROUND to act dtype   (intermediate_cache1)
    g   = activation(h)                              fp32 math         -> ROUND to act dtype   (intermediate_cache2)
    g'  = dequant(quant_a2(g))                       fp32 (if a2 is quantized: dynamic per token/group)
    y   = g' @ dequant(w2[e]).T (+ w2_bias[e])       fp32 accumulate -> ROUND to act dtype   (intermediate_cache3)
    out[t] = sum_k  w[t, k] * y[t, k]               fp32 accumulate -> ROUND to act dtype once

Rounding points are exactly the four ROUND/quantize steps above; every other step is fp32. A *per-tensor* dynamic
a2 scale is taken over all routed rows of the call (vLLM quantizes ``intermediate_cache2`` at once), so under the
modular kernel's chunking each chunk has its own a2 scale; per-token and per-group scales see only their row. ``act dtype`` is the
hidden_states dtype (bf16/fp16/fp32). A kernel's fp32 accumulation order differs from ``torch.matmul``'s, so GEMM
results are compared with tolerances derived from the format (``specs/tolerances.toml``), quantizers bit-exactly.

Routes to experts not held by this rank (``expert_map[id] == -1``) contribute nothing. With
``apply_router_weight_on_input`` (topk == 1) the input is multiplied by the weight in the act dtype before
quantization, and the output sum uses weight 1.

Dequantization (``dequant`` above) multiplies each code by the scale of its group: per tensor (one scale per expert),
per token / per output channel, per 1xG group along K, or per 128x128 block; it is exact in fp32 for FP8/INT8 codes.
Where a weight format's kernels quantize the GEMM's input rows themselves (CPU INT4 W4A8: asymmetric INT8 per row,
``reference.quant.moe.gemm_input_quantizer``), ``a`` and ``g'`` are those rows' quantize-dequantize values.
"""

from __future__ import annotations

import torch

from reference.activation import MoEActivation, adjust_N_for_activation, apply_moe_activation
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
from reference.modular import (
    ACTIVATION_PARAMS,
    ExpertTokensMetadata,
    FusedMoEActivationFormat,
    FusedMoEExpertsModular,
    SupportRecord,
    TopKWeightAndReduceContiguous,
)
from reference.quant.moe import _per_expert, dequant_activation, dequant_groups, dequant_weight, moe_kernel_quantize_input, \
    weight_pack_factor
from reference.quant.moe import gemm_input_quantizer

__all__ = ["fused_experts", "fused_experts_with_heavy", "experts_unreduced", "ReferenceExperts", "reference_support", "dequant_groups", "local_expert_ids", "check_moe_inputs"]


def local_expert_ids(topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Local expert index of every route, -1 where the expert is not held (or the id is out of range / -1)."""
    ids = topk_ids.long()
    if expert_map is None:
        valid = (ids >= 0) & (ids < num_local_experts)
        return torch.where(valid, ids, torch.full_like(ids, -1))
    E = expert_map.numel()
    valid = (ids >= 0) & (ids < E)
    # Never index expert_map with -1 or an out-of-range id (vLLM #48371 read expert_map[-1]).
    mapped = expert_map.long()[ids.clamp(0, E - 1)]
    return torch.where(valid, mapped, torch.full_like(ids, -1))


def check_moe_inputs(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map=None,
                     global_num_experts=-1, quant_config: FusedMoEQuantConfig | None = None) -> None:
    """Validate the experts' operands with clear messages (shapes, dtypes, devices, id ranges).

    Raises:
        ValueError: any mismatch; the message names the tensor, what it has and what it needs.
    """
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be (M, K), got {tuple(hidden_states.shape)}")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1/w2 must be (E, N, K) / (E, K, I), got {tuple(w1.shape)} / {tuple(w2.shape)}")
    M, K = hidden_states.shape
    qc = quant_config or FUSED_MOE_UNQUANTIZED_CONFIG
    pack1, pack2 = weight_pack_factor(qc.w1), weight_pack_factor(qc.w2)
    E_local, N, K1 = w1.shape
    K1 *= pack1
    if w2.size(0) != E_local:
        raise ValueError(f"w1 has {E_local} experts but w2 has {w2.size(0)}")
    if K1 != K or w2.size(1) != K:
        raise ValueError(f"hidden size mismatch: hidden_states K={K}, w1 K={K1}, w2 K={w2.size(1)}")
    I = adjust_N_for_activation(N, activation)
    if w2.size(2) * pack2 != I:
        raise ValueError(f"w2 must be (E, K, {I // pack2}) for {activation.name} with w1 N={N}, got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.size(0) != M:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be (M={M}, topk)"
        )
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if hidden_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden_states must be bf16, fp16 or fp32 (quantization happens inside), got "
                         f"{hidden_states.dtype}")
    if qc.w1.dtype is None and (w1.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype):
        raise ValueError(f"unquantized weights must have the activations' dtype {hidden_states.dtype}, got "
                         f"w1 {w1.dtype} and w2 {w2.dtype}")
    n_ids = (global_num_experts if global_num_experts != -1 else
             expert_map.numel() if expert_map is not None else E_local)
    if topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= n_ids):
        raise ValueError(f"topk_ids must lie in [0, {n_ids}) (or be -1 for no route); got values in "
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]. Non-finite router logits produce such ids "
                         "(vLLM #39391): check the routing.")
    devices = {t.device for t in (hidden_states, w1, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    if expert_map is not None:
        E = global_num_experts if global_num_experts != -1 else expert_map.numel()
        if expert_map.numel() != E:
            raise ValueError(f"expert_map has {expert_map.numel()} entries, expected global_num_experts={E}")


class _TapFilter(dict):
    """A ``stages`` dict that forwards only the named taps (``experts_unreduced(stage_names=...)``): the others are
    not stored (a tap of every stage is a copy of each intermediate)."""

    def __init__(self, target: dict, names):
        super().__init__()
        self.target, self.names = target, frozenset(names)

    def __setitem__(self, key, value):
        if key in self.names:
            self.target[key] = value

    def setdefault(self, key, default=None):
        if key in self.names:
            return self.target.setdefault(key, default)
        return default


def experts_unreduced(a1q, a1q_scale, w1, w2, topk_ids, expert_map, qc, activation, act_dtype,
                       acc_dtype: torch.dtype = torch.float32, gemm=None, *, situ_beta=None,
                       situ_linear_beta=None, stages: dict | None = None, profile=None,
                       substitute: dict | None = None, stage_names=None) -> torch.Tensor:
    """Every route's expert output, unweighted and unreduced: the reference loop up to GEMM2 (see the module
    docstring), ``(M, topk, K)`` in ``act_dtype``, zeros for routes to experts not held here (``expert_map``).

    Args:
        a1q, a1q_scale: the quantized activations ``(M, K')`` and their scales, as ``moe_kernel_quantize_input``
            returns them for ``qc.a1`` (``K'`` = K, or K / 2 for packed FP4).
        w1: ``(E_local, N, K / pack)``; w2: ``(E_local, K, N' / pack)`` (``N'`` = N / 2 for gated activations).
        topk_ids: ``(M, topk)`` integer global expert ids (-1: no route). expert_map: int32 ``(E,)`` or None.
        qc: the ``FusedMoEQuantConfig`` (weight scales, a2 quantization, biases, gemm1 alpha/beta/limit).
        activation: the ``MoEActivation`` between the GEMMs. act_dtype: the rounding dtype of each GEMM's output.
        acc_dtype: the GEMMs' accumulation dtype: fp32 defines the reference; float64 gives the (nearly) exact
            products of the dequantized operands that ``reference.error_model`` measures accumulation errors
            against.
        gemm: ``gemm(a (R, K), w (N, K)) -> (R, N)`` replaces the matmul of both GEMMs (dequantized fp32 operands
            in, the accumulated product out): a hook for emulating a kernel's accumulator (tests/emulated_backends.py).
        situ_beta, situ_linear_beta: SITU's parameters.
        stages: a dict that receives GEMM1's rounded output (``"gemm1"``, ``(M, topk, N)``) and the activation's
            (``"activation"``, ``(M, topk, N')``) per route, zeros for routes not held here (``conformance/diagnose.py``).
        stage_names: the taps ``stages`` receives (a set of the names below; None: all of them).

    Three passes, because the requantization of a2 may need every routed row at once: a *per-tensor* dynamic a2
    scale is the amax over all routed rows of the call (one chunk of the modular kernel), as vLLM's Triton path
    quantizes ``intermediate_cache2`` in one go. Per-token and per-group scales only see their own row.

    Raises:
        NotImplementedError / ValueError: as ``moe_kernel_quantize_input`` and the dequantizers for a format the
            reference does not define or a missing scale. Operands are not validated here (``check_moe_inputs``).

    ``profile``: a ``reference.profiles.NumericsProfile`` (None: the default, ``vllm``): its ``activation``,
    ``gemm_bias`` and ``fp8_accumulation`` rounding points apply here (the router weight and top-k sum in
    ``fused_experts``). ``stages`` then also receives ``"input"`` (the dequantized a1, fp32 ``(M, K)``), ``"a2"``
    (the dequantized requantized activation per route, fp32 ``(M, topk, N')``) and ``"gemm2"`` (as returned).
    ``substitute``: taps of the same names (``input``, ``gemm1``, ``activation``, ``a2``, ``gemm2``) that replace
    the reference's own values at that stage (held routes only), so each later stage runs on them: the diagnosis
    compares each stage of a kernel on its own inputs (``conformance/diagnose.py``).
    """
    sub = substitute or {}
    from reference.profiles import DEFAULT_PROFILE, apply_activation_per_op, inplace_fp8_gemm, uses_inplace_fp8

    profile = DEFAULT_PROFILE if profile is None else profile
    M, topk = topk_ids.shape
    inplace = profile.fp8_accumulation == "inplace" and gemm is None and uses_inplace_fp8(qc)
    if gemm is None:
        def gemm(x, w):
            return x.to(acc_dtype) @ w.to(acc_dtype).T

    def gemm_codes(xq, xs, wq, desc, e):
        """The profile's in-place FP8 GEMM on the codes, scales in the epilogue (reference.profiles)."""
        return inplace_fp8_gemm(xq.float(), xs, wq[e].float(), _per_expert(desc.scale, e),
                                mantissa_bits=profile.fp8_mma_bits, k_step=profile.fp8_mma_k)

    def add_bias(h, bias):
        if bias is None:
            return h.to(act_dtype)
        if profile.gemm_bias == "after_store":  # R(R(acc) + b): the bias added to the stored GEMM output
            return (h.to(act_dtype).float() + bias.float()).to(act_dtype)
        return (h + bias.to(acc_dtype)).to(act_dtype)

    act_fn = apply_activation_per_op if profile.activation == "per_op" else apply_moe_activation
    # Weight formats whose GEMMs quantize their own input rows (CPU INT4 W4A8: asymmetric INT8 per row; issue 41).
    lhs1 = gemm_input_quantizer(qc.w1) or (lambda rows: rows)
    lhs2 = gemm_input_quantizer(qc.w2) or (lambda rows: rows)
    a = dequant_activation(a1q, a1q_scale, qc.a1)
    if "input" in sub:
        a, inplace = sub["input"].float(), False  # a substituted input has no codes: the fp32 product of its values
    if stages is not None and stage_names is not None:
        stages = _TapFilter(stages, stage_names)
    if stages is not None:
        stages["input"] = a
    K = a.size(1)  # packed activations (NVFP4) hold K // 2 bytes
    local = local_expert_ids(topk_ids, w1.size(0), expert_map)
    routes = [(e, *(local == e).nonzero(as_tuple=True)) for e in range(w1.size(0))]
    routes = [(e, t, k) for e, t, k in routes if t.numel()]
    # Pass 1: GEMM1 (+ bias) rounded to the act dtype, then the activation (fp32 math, rounded once).
    g_rows = {}
    for e, t, k in routes:
        if inplace:
            a_s = a1q_scale if a1q_scale is None or a1q_scale.numel() == 1 else a1q_scale.reshape(M, -1)[t]
            h = gemm_codes(a1q[t], a_s, w1, qc.w1, e)
        else:
            h = gemm(lhs1(a[t]), dequant_weight(w1, qc.w1, e))
        h = add_bias(h, None if qc.w1_bias is None else qc.w1_bias[e])
        if "gemm1" in sub:
            h = sub["gemm1"][t, k].to(act_dtype)
        g_rows[e] = act_fn(activation, h, alpha=qc.gemm1_alpha, beta=qc.gemm1_beta,
                           limit=qc.gemm1_clamp_limit, situ_beta=situ_beta,
                           situ_linear_beta=situ_linear_beta)
        if "activation" in sub:
            g_rows[e] = sub["activation"][t, k].to(act_dtype)
        if stages is not None:
            for name, val in (("gemm1", h), ("activation", g_rows[e])):
                if stage_names is None or name in stage_names:
                    buf = stages.setdefault(name, torch.zeros(M, topk, val.shape[1], dtype=val.dtype,
                                                              device=val.device))
                    buf[t, k] = val
    out = torch.zeros(M, topk, K, dtype=act_dtype, device=a1q.device)
    if not routes:
        return out
    # Pass 2: requantize a2 over all routed rows of the call, back to fp32.
    g_all = torch.cat([g_rows[e] for e, _, _ in routes])
    gq, gs = moe_kernel_quantize_input(g_all, qc.a2_scale, qc, "a2")
    g_all = dequant_activation(gq, gs, qc.a2)
    if "a2" in sub or (stages is not None and (stage_names is None or "a2" in stage_names)):
        a2_rows = torch.cat([torch.stack([t, k], 1) for _, t, k in routes])
        if "a2" in sub:
            g_all, inplace = sub["a2"][a2_rows[:, 0], a2_rows[:, 1]].float(), False
        if stages is not None and (stage_names is None or "a2" in stage_names):
            buf = torch.zeros(M, topk, g_all.shape[1], dtype=torch.float32, device=g_all.device)
            buf[a2_rows[:, 0], a2_rows[:, 1]] = g_all
            stages["a2"] = buf
    # Pass 3: GEMM2 (+ bias) rounded to the act dtype.
    start = 0
    for e, t, k in routes:
        rows = slice(start, start + t.numel())
        start += t.numel()
        if inplace:
            g_s = gs if gs is None or gs.numel() == 1 else gs.reshape(g_all.size(0), -1)[rows]
            y = gemm_codes(gq[rows], g_s, w2, qc.w2, e)
        else:
            y = gemm(lhs2(g_all[rows]), dequant_weight(w2, qc.w2, e))
        out[t, k] = add_bias(y, None if qc.w2_bias is None else qc.w2_bias[e])
        if "gemm2" in sub:
            out[t, k] = sub["gemm2"][t, k].to(act_dtype)
    if stages is not None:
        stages["gemm2"] = out
    return out


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: MoEActivation = MoEActivation.SILU,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    quant_config: FusedMoEQuantConfig | None = None,
    accumulate_dtype: torch.dtype = torch.float32,
    activation_situ_beta: float | None = None,
    activation_situ_linear_beta: float | None = None,
    profile=None,
    substitute: dict | None = None,
    stages: dict | None = None,
    stage_names=None,
) -> torch.Tensor:
    """The reference MoE experts: ``(M, K)`` output in ``hidden_states.dtype``.

    Args:
        hidden_states: ``(M, K)`` bf16/fp16/fp32 (unquantized; quantized here per ``quant_config.a1``).
        w1: ``(E_local, N, K)``, w2: ``(E_local, K, N // 2)`` (gated) or ``(E_local, K, N)``; unquantized or codes
            whose scales are in ``quant_config``.
        topk_weights: ``(M, topk)`` fp32; topk_ids: ``(M, topk)`` integer global expert ids.
        activation: the ``MoEActivation`` between the GEMMs (gemm1 alpha/beta/limit from the quant config).
        global_num_experts: E (-1: E_local). expert_map: int32 ``(E,)`` global -> local, -1 not held.
        apply_router_weight_on_input: multiply the input by the weight (topk must be 1).
        quant_config: ``FusedMoEQuantConfig`` (default unquantized).
        accumulate_dtype: the GEMMs' accumulation dtype. fp32 (default) *is* the reference; float64 computes the
            exact products of the dequantized operands, for measuring accumulation error
            (``reference.error_model``, ``conformance/test_accumulation.py``).
        activation_situ_beta, activation_situ_linear_beta: SITU's parameters (vLLM 0.33 ``FusedMoEConfig``).
        profile: the numerics profile (``reference.profiles``: a ``NumericsProfile`` or its name; None: the current
            one, ``$MOE_NUMERICS_PROFILE`` / ``use_profile``, default ``vllm``, which is the loop described above).
        substitute: per-stage taps replacing the reference's values (``experts_unreduced``), for the diagnosis.
        stages, stage_names: receive the loop's intermediates (``experts_unreduced``): the conformance tests take the
            activation's output for the error model's heavy event (``reference.error_model.heavy_values``).

    Raises:
        ValueError: bad shapes/dtypes/devices (``check_moe_inputs``), apply_router_weight_on_input with topk > 1.
    """
    qc = quant_config or FUSED_MOE_UNQUANTIZED_CONFIG
    check_moe_inputs(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, global_num_experts, qc)
    act_dtype = hidden_states.dtype
    x = hidden_states
    if apply_router_weight_on_input:
        if topk_ids.size(1) != 1:
            raise ValueError(f"apply_router_weight_on_input is only supported for topk == 1, got {topk_ids.size(1)}")
        x = x * topk_weights.to(x.dtype)
    if qc.a1.dtype is not None and not x.is_contiguous():  # as the prepare step: quantizers read contiguous rows
        x = x.contiguous()
    a1q, a1q_scale = moe_kernel_quantize_input(x, qc.a1_scale, qc, "a1")
    from reference.profiles import reduce_topk, resolve_profile

    prof = resolve_profile(profile)
    y = experts_unreduced(a1q, a1q_scale, w1, w2, topk_ids, expert_map, qc, activation, act_dtype,
                           accumulate_dtype, situ_beta=activation_situ_beta,
                           situ_linear_beta=activation_situ_linear_beta, profile=prof, substitute=substitute,
                           stages=stages, stage_names=stage_names)
    w = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
    if prof.router_weight == "fp32" and prof.topk_sum == "fp32":
        return (y.float() * w.float().unsqueeze(-1)).sum(dim=1).to(act_dtype)
    return reduce_topk(y, w, local_expert_ids(topk_ids, w1.size(0), expert_map), prof, act_dtype)


def fused_experts_with_heavy(hidden_states, w1, w2, topk_weights, topk_ids, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fused_experts(...), heavy)`` from one run of the reference: ``heavy`` is the call's own weighted values at
    GEMM2's input (``reference.error_model.heavy_values``), which the error model's heavy event (step 7b) is
    evaluated on (``experts_error_bound(heavy=...)``; ``conformance.experts_case.case_error_bound``). Arguments and
    errors as ``fused_experts``; ``heavy`` is float64 on the CPU, empty when no route is held here."""
    stages: dict = {}
    out = fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, stages=stages, stage_names={"activation"},
                        **kwargs)
    local = local_expert_ids(topk_ids, w1.size(0), kwargs.get("expert_map")) >= 0
    if "activation" not in stages:  # no route held here: nothing to flip
        return out, torch.zeros(0, dtype=torch.float64)
    from reference.error_model import heavy_values

    return out, heavy_values(stages["activation"], topk_weights, local,
                             apply_router_weight_on_input=kwargs.get("apply_router_weight_on_input", False))


def reference_support(activation_format: FusedMoEActivationFormat, **overrides) -> SupportRecord:
    """The claims of every reference experts class: any device, every activation vLLM can apply (not the
    unprojected RELU2), every quantization scheme the loop dequantizes, every parallel config."""
    return SupportRecord(activation_format, activations=frozenset(a for a in MoEActivation if a is not MoEActivation.RELU2),
                         activation_params=ACTIVATION_PARAMS, ue8m0_scales=True,
                         notes="the reference loop (reference.experts)", **overrides)


class ReferenceExperts(FusedMoEExpertsModular):
    """The reference loop as a ``FusedMoEExpertsModular`` (Standard format), so the modular kernel itself (chunking,
    prepare/finalize, shared experts) can be tested against ``fused_experts``. Supports every activation, expert_map,
    chunking, and the quant schemes the loop dequantizes. Output: ``(M, topk, K)`` unweighted, reduced by
    ``TopKWeightAndReduceContiguous``.
    """

    support = reference_support(FusedMoEActivationFormat.Standard,
                                finalize="(M, topk, K) unweighted: TopKWeightAndReduceContiguous")

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceContiguous()

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        E, M, N, K, topk = super().moe_problem_size(a1, w1, w2, topk_ids)
        if self.quant_config.a1.dtype in ("nvfp4", "mxfp4"):
            K *= 2  # packed E2M1 activations: two elements per byte
        return E, M, N, K, topk

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        # The loop allocates its own temporaries; workspaces are unused but sized like vLLM's Triton experts.
        return (M * topk, max(N, K)), (M * topk, adjust_N_for_activation(N, activation)), (M, topk, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        act_dtype = output.dtype
        y = experts_unreduced(hidden_states, a1q_scale, w1, w2, topk_ids, expert_map, self.quant_config,
                               activation, act_dtype, situ_beta=getattr(self.moe_config, "activation_situ_beta", None),
                               situ_linear_beta=getattr(self.moe_config, "activation_situ_linear_beta", None))
        output.copy_(y.view(output.shape))
