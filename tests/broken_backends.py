"""Deliberately broken backends: the conformance suite must go red for each (tests/test_harness.py).

Each one wraps the correct torch backend and breaks one thing a real kernel gets wrong.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from backends import Backend
from backends.torch import backend as _torch
from backends.torch.experts import TorchExperts
from reference.distributed import BatchedReferenceExpertsEP, DeepEPHTPrepareAndFinalize, DeepEPLLPrepareAndFinalize
from reference.experts import ReferenceExperts, experts_unreduced
from reference.modular import moe_kernel_quantize_input


def _fused_topk_no_renormalize(hidden_states, gating_output, topk, renormalize, **kw):
    return _torch.ops["fused_topk"](hidden_states, gating_output, topk, False, **kw)


no_renormalize = dataclasses.replace(_torch, name="broken_no_renormalize",
                                     ops={**_torch.ops, "fused_topk": _fused_topk_no_renormalize})


class _NoRouterWeights(TorchExperts):
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs):
        super().apply(output, hidden_states, w1, w2, torch.ones_like(topk_weights), topk_ids, *args, **kwargs)


no_router_weights = dataclasses.replace(_torch, name="broken_no_router_weights", experts=[_NoRouterWeights])


class _HalfOutput(TorchExperts):
    """Writes only the first half of the hidden dimension (the rest keeps the harness's NaN poison)."""

    def apply(self, output, *args, **kwargs):
        full = torch.empty_like(output)
        super().apply(full, *args, **kwargs)
        half = output.shape[-1] // 2
        output[..., :half] = full[..., :half]


half_output = dataclasses.replace(_torch, name="broken_half_output", experts=[_HalfOutput])


def _activation_off_by_rounding(act, x, **kw):
    # SILU evaluated in the input dtype: silu(g) is rounded to bf16 before the multiply by u (two roundings).
    g, u = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def not_a_backend():
    return 42


activation_double_rounding = dataclasses.replace(
    _torch, name="broken_activation", ops={**_torch.ops, "apply_moe_activation": _activation_off_by_rounding})


def _ue8m0_floor(x, group_size=128, *, column_major_scales=False, tma_aligned_scales=False, use_ue8m0=False):
    """A one-bit bug: UE8M0 scales rounded DOWN (floor) instead of up."""
    from backends.torch import quant

    q, s = quant.per_token_group_quant_fp8(x, group_size, column_major_scales=column_major_scales,
                                           tma_aligned_scales=tma_aligned_scales, use_ue8m0=False)
    if not use_ue8m0:
        return q, s
    s = torch.exp2(torch.floor(torch.log2(s)))
    G = x.shape[-1] // group_size
    q = (x.float().unflatten(-1, (G, group_size)) / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


ue8m0_floor = dataclasses.replace(_torch, name="broken_ue8m0_floor",
                                  ops={**_torch.ops, "per_token_group_quant_fp8": _ue8m0_floor})


class _ClaimsNothing(TorchExperts):
    """Computes what TorchExperts computes (bf16 and its quantized schemes, correctly) but claims no quantization
    scheme at all, not even unquantized: every case it runs is "works but not claimed"."""

    support = dataclasses.replace(TorchExperts.support, quant_schemes=frozenset(),
                                  notes="claims no quantization scheme, yet computes (planted fault)")

    def apply(self, output, *args, **kwargs):
        _unchecked_apply(self, output, *args, **kwargs)


def _unchecked_apply(self, output, *args, **kwargs):
    # Bypass TorchExperts' own claim check so the unclaimed configuration still computes: for the call, the class's
    # record claims every quantization scheme (quant_schemes None), then its own record is put back.
    cls = type(self)
    own = cls.__dict__.get("support")
    try:
        cls.support = dataclasses.replace(cls.support, quant_schemes=None)
        TorchExperts.apply(self, output, *args, **kwargs)
    finally:
        if own is None:
            del cls.support
        else:
            cls.support = own


claims_nothing = dataclasses.replace(_torch, name="broken_claims_nothing", experts=[_ClaimsNothing])


class _GarbageWhenUnsupported(TorchExperts):
    """Returns zeros instead of raising for configurations it does not claim."""

    def apply(self, output, *args, **kwargs):
        qc = self.quant_config
        ok, _ = self.is_supported_config(type(self), self.moe_config, qc.weight_key, qc.activation_key,
                                         self.activation_format())
        if not ok:
            output.zero_()
            return
        super().apply(output, *args, **kwargs)


garbage_when_unsupported = dataclasses.replace(_torch, name="broken_garbage", experts=[_GarbageWhenUnsupported])


class _CrashesOnM4(TorchExperts):
    """Kills its process on the 4-token cases, as an illegal memory access or a segfault would."""

    def apply(self, output, hidden_states, *args, **kwargs):
        if hidden_states.shape[0] == 4:
            os.abort()
        super().apply(output, hidden_states, *args, **kwargs)


crashes_on_m4 = dataclasses.replace(_torch, name="broken_crash", experts=[_CrashesOnM4])


# --- Padding routes (-1 ids) under an expert map: conformance/test_padding.py ------------------------------------


class _PaddingIdClamped(TorchExperts):
    """Looks -1 slots up as ``expert_map[max(id, 0)]``: under an expert map a padding slot becomes a route to global
    expert 0 (wrong on the rank that holds it). Without an expert map it behaves (as the bug did)."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs):
        if expert_map is not None:
            topk_ids = topk_ids.clamp(min=0)
        super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map, *args, **kwargs)


padding_id_clamped = dataclasses.replace(_torch, name="broken_padding_id_clamped", experts=[_PaddingIdClamped])


class _PaddingIdWraps(TorchExperts):
    """Looks -1 slots up as ``expert_map[id]`` with wrap-around indexing (vLLM #48371 read ``expert_map[-1]``): a
    padding slot becomes a route to the last global expert (wrong on the rank that holds it)."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs):
        if expert_map is not None:
            topk_ids = torch.where(topk_ids < 0, topk_ids + expert_map.numel(), topk_ids)
        super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map, *args, **kwargs)


padding_id_wraps = dataclasses.replace(_torch, name="broken_padding_id_wraps", experts=[_PaddingIdWraps])


# --- 32-bit row offsets: conformance/test_hygiene.py::test_offsets_past_int32 and tests/test_offsets_int32.py --------


def wrapped_offsets(rows: torch.Tensor, stride: int, limit: int = 2**31) -> torch.Tensor:
    """``rows * stride`` as a signed integer of ``2 * limit`` values would hold it: ``limit = 2**31`` is int32
    (``(row * stride).to(torch.int32)``, two's complement wrap), a smaller ``limit`` a deliberately tiny "int width"
    for CPU-sized analogues. Returned as int64."""
    off = rows.long() * stride
    if limit == 2**31:
        return off.to(torch.int32).long()
    return (off + limit) % (2 * limit) - limit


class _OffsetsWrap(TorchExperts):
    """GEMM1 writes its output rows into a flat intermediate buffer at offsets computed by ``wrapped_offsets``
    (``OFFSET_LIMIT`` 2**31: int32); the activation reads them back at the true (64-bit) offsets. Past the limit a
    row lands elsewhere (emulated: the wrapped offset modulo the buffer; on a GPU it would land outside it) and the
    rows it should have filled keep their NaN poison. Below the limit it is exactly the correct torch backend.
    Unquantized weights without biases only; anything else runs the correct path."""

    OFFSET_LIMIT = 2**31

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        qc = self.quant_config
        if qc.w1.dtype is not None or qc.a1.dtype is not None or qc.w1_bias is not None or qc.w2_bias is not None:
            return super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                 global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                                 expert_tokens_meta, apply_router_weight_on_input)
        from backends.torch.experts import padded_grouped_mm, torch_activation

        M, topk = topk_ids.shape
        ids = topk_ids.reshape(-1).long()
        local = expert_map.long()[ids.clamp(0, expert_map.numel() - 1)] if expert_map is not None else ids
        local = torch.where(ids >= 0, local, -1)
        acc = torch.zeros(M, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
        keep = (local >= 0).nonzero().squeeze(1)
        if keep.numel():
            order = keep[torch.argsort(local[keep], stable=True)]
            experts, counts = torch.unique_consecutive(local[order], return_counts=True)
            tokens = order // topk
            dev, dtype = hidden_states.device, output.dtype
            active = torch.arange(len(experts), device=dev)
            h = padded_grouped_mm(hidden_states[tokens], counts, active, w1.index_select(0, experts),
                                  torch.float32).to(dtype)
            R, N = h.shape
            buf = torch.full((R * N,), float("nan"), dtype=dtype, device=dev)
            # Element (r, n) at offset r * N + n, computed in the narrow integer type.
            idx = wrapped_offsets(torch.arange(R, device=dev)[:, None], N, self.OFFSET_LIMIT) \
                + torch.arange(N, device=dev)
            idx = wrapped_offsets(idx, 1, self.OFFSET_LIMIT) % buf.numel()
            buf[idx.reshape(-1)] = h.reshape(-1)  # GEMM1's store, at the wrapped offsets
            h = buf.view(R, N)  # the activation's load, at the true offsets
            g = torch_activation(activation, h, qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit)
            y = padded_grouped_mm(g, counts, active, w2.index_select(0, experts), torch.float32).to(dtype).float()
            if not apply_router_weight_on_input:
                y = y * topk_weights.reshape(-1)[order].float().unsqueeze(1)
            acc.index_add_(0, tokens, y)
        output.copy_(acc)


offsets_wrap = dataclasses.replace(_torch, name="broken_offsets_wrap", experts=[_OffsetsWrap])


class _OffsetsWrap16(_OffsetsWrap):
    """The same bug at a tiny width (offsets wrap at 2**15 elements, int16): a CPU-sized analogue of int32."""

    OFFSET_LIMIT = 2**15


offsets_wrap_16bit = dataclasses.replace(_torch, name="broken_offsets_wrap_16bit", experts=[_OffsetsWrap16])


# --- The router weight applied on the input: conformance/test_hygiene.py::test_router_weight_on_input ---------------


class _RouterWeightTwice(TorchExperts):
    """Ignores ``apply_router_weight_on_input``: weights its output although prepare already multiplied the input by
    the weight, so with topk == 1 every token is scaled by w^2 instead of w."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, False)


router_weight_twice = dataclasses.replace(_torch, name="broken_router_weight_twice", experts=[_RouterWeightTwice])


# --- The diagnosis locates a stage through the experts' stages() protocol (conformance/diagnose.py) ----------------


class _Gemm2WrongExpert(ReferenceExperts):
    """GEMM2 reads the neighbouring expert's ``w2`` (an off-by-one in the expert offset of the second GEMM only);
    its ``stages()`` hands out the activation (right) and GEMM2's output per route (wrong), so the diagnosis names
    requant/gemm2 as the first divergent stage."""

    def apply(self, output, hidden_states, w1, w2, *args, **kwargs):
        super().apply(output, hidden_states, w1, w2.roll(1, dims=0), *args, **kwargs)

    def stages(self, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map):
        qc = self.quant_config
        a1q, a1s = moe_kernel_quantize_input(hidden_states, qc.a1_scale, qc, "a1")
        out = {}
        out["gemm2"] = experts_unreduced(a1q, a1s, w1, w2.roll(1, dims=0), topk_ids, expert_map, qc, activation,
                                          hidden_states.dtype, stages=out)
        del out["gemm1"]  # hands out the activation (right) and GEMM2 (wrong), as a fused kernel would
        return out


gemm2_wrong_expert = dataclasses.replace(_torch, name="broken_gemm2_wrong_expert", experts=[_Gemm2WrongExpert])


# ------------------------------------------------------------------------------------------------------------
# Distributed: planted communication faults (tests/test_distributed.py runs conformance/test_distributed.py on them)
# ------------------------------------------------------------------------------------------------------------


class DropLastTokenDispatch(DeepEPHTPrepareAndFinalize):
    """Planted fault: the dispatch loses the last token of each rank (its routes are never sent)."""

    def prepare(self, a1, topk_weights, topk_ids, *args, **kwargs):
        if topk_ids.shape[0]:
            topk_ids = topk_ids.clone()
            topk_ids[-1] = -1
        return super().prepare(a1, topk_weights, topk_ids, *args, **kwargs)


class WeightsTwiceCombine(DeepEPLLPrepareAndFinalize):
    """Planted fault: the combine applies the router weights twice (w * w * y)."""

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        super().finalize(output, fused_expert_output, topk_weights * topk_weights, topk_ids,
                         apply_router_weight_on_input, weight_and_reduce_impl)


class SilentOverflowDispatch(DeepEPLLPrepareAndFinalize):
    """Planted fault: tokens past ``max_num_tokens`` are dropped silently instead of raising."""

    def _check_capacity(self, stats):
        return None

    def prepare(self, a1, topk_weights, topk_ids, *args, **kwargs):
        if topk_ids.shape[0] > self.max_num_tokens:
            topk_ids = topk_ids.clone()
            topk_ids[self.max_num_tokens :] = -1
        return super().prepare(a1, topk_weights, topk_ids, *args, **kwargs)


_REF_EXPERTS = [ReferenceExperts, BatchedReferenceExpertsEP]
dist_reference = Backend(name="dist_reference", version="reference", experts=_REF_EXPERTS,
                         description="the reference experts classes (checks the distributed suite itself)")
dist_planted = Backend(name="broken_dist_planted", version="test", experts=_REF_EXPERTS,
                       prepare_finalize=[DropLastTokenDispatch, WeightsTwiceCombine, SilentOverflowDispatch])


# ------------------------------------------------------------------------------------------------------------
# Variants: a correct backend that declines two variants the suite exercises (tests/test_variant_claims.py)
# ------------------------------------------------------------------------------------------------------------


def _activation_without_limit(act, x, *, limit=None, **kw):
    """The torch activation, refusing a clamp limit (``NotImplementedError``), as a kernel without it would."""
    if limit is not None:
        raise NotImplementedError("no clamp limit in this kernel")
    return _torch.ops["apply_moe_activation"](act, x, **kw)


class _DeclinesVariants(TorchExperts):
    """TorchExperts claiming no activation parameter and fp32 block scales only; UE8M0 raises NotImplementedError."""

    support = dataclasses.replace(TorchExperts.support, activation_params=frozenset(), ue8m0_scales=False,
                                  notes="declines every activation parameter and UE8M0 scales (tests)")

    def apply(self, output, *args, **kwargs):
        if self.quant_config.use_ue8m0:
            raise NotImplementedError("no UE8M0 scales in this kernel")
        return super().apply(output, *args, **kwargs)


declines_variants = dataclasses.replace(_torch, name="declines_variants", experts=[_DeclinesVariants],
                                        ops={**_torch.ops, "apply_moe_activation": _activation_without_limit})
# The same refusals, but the variants claimed: a NotImplementedError on a claimed variant is a failure.
class _ClaimsVariantsRaises(TorchExperts):
    """The refusals of ``_DeclinesVariants`` with every variant claimed."""

    support = dataclasses.replace(TorchExperts.support, notes="claims every variant, raises on two (tests)")
    apply = _DeclinesVariants.apply


claims_variants_raises = dataclasses.replace(declines_variants, name="claims_variants_raises",
                                             experts=[_ClaimsVariantsRaises])
