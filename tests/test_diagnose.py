"""Diagnosis by attribution (conformance/diagnose.py): one planted fault per stage, each named exactly, and a
matching stage never blamed. A planted kernel is the reference loop with one stage's tap replaced
(``fused_experts(substitute=...)``), so everything before the fault is right and everything after it is the
reference's own computation on the faulty value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.diagnose import attribute, reference_stages
from conformance.inputs import ExpertsInputs
from reference.activation import MoEActivation
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG
from reference.experts import fused_experts
from reference.profiles import NumericsProfile
from reference.schemes import quantize_weights

SILU = MoEActivation.SILU
TOL = {"max_norm": 2e-2, "rms_norm": 4e-3, "calc_diff": 1e-5}


def _inputs(M=6, E=8, K=128, I=64, topk=2, scheme="bf16", seed=0, ep=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) * I**-0.5).bfloat16()
    w, ids = torch.topk(torch.randn(M, E, generator=g).softmax(-1), topk, dim=-1)
    qc = FUSED_MOE_UNQUANTIZED_CONFIG
    if scheme != "bf16":
        w1, w2, qc = quantize_weights(scheme, w1, w2)
    emap = None
    if ep:  # this rank holds the first half of the experts
        emap = torch.where(torch.arange(E) < E // 2, torch.arange(E), -1).int()
        w1, w2 = w1[: E // 2], w2[: E // 2]
        if qc.w1.scale is not None and qc.w1.scale.numel() > 1:
            qc = dataclasses.replace(qc, w1=dataclasses.replace(qc.w1, scale=qc.w1.scale[: E // 2]),
                                     w2=dataclasses.replace(qc.w2, scale=qc.w2.scale[: E // 2]))
    return ExpertsInputs(hidden_states=x, w1=w1, w2=w2, topk_weights=(w / w.sum(-1, keepdim=True)).float(),
                         topk_ids=ids.int(), expert_map=emap, global_num_experts=E, quant_config=qc)


def _planted(inputs, tap, perturb):
    """A kernel whose stage ``tap`` is wrong by ``perturb``; its stages() hands out every tap."""
    taps = reference_stages(inputs, SILU)
    bad = {tap: perturb(taps[tap])}

    def run(weights, ids):
        sub = bad if ids is inputs.topk_ids else {}
        if sub:
            return fused_experts(inputs.hidden_states, inputs.w1, inputs.w2, weights, ids, activation=SILU,
                                 global_num_experts=inputs.global_num_experts, expert_map=inputs.expert_map,
                                 quant_config=inputs.quant_config, substitute=sub)
        raise AssertionError("the stage taps make black-box runs unnecessary here")

    def stages():
        out = {}
        from conformance.diagnose import _ref

        _ref(inputs, SILU, None, substitute=bad, stages=out)
        return out

    return run, stages


def _scale(f):
    return lambda t: (t.float() * f).to(t.dtype)


@pytest.mark.parametrize("stage,tap,scheme", [
    ("input_quant", "input", "fp8_channel_token"),
    ("gemm1", "gemm1", "bf16"),
    ("activation", "activation", "bf16"),
    ("requant", "a2", "fp8_channel_token"),
    ("gemm2", "gemm2", "bf16"),
])
def test_a_fault_in_one_stage_is_named_and_only_it(stage, tap, scheme):
    inputs = _inputs(scheme=scheme, ep=True)
    run, stages = _planted(inputs, tap, _scale(1.05))
    verdict = attribute(run, inputs, SILU, TOL, stages_fn=stages)
    assert verdict.divergent == [stage], str(verdict)
    assert verdict.shares[stage] > 0.5, str(verdict)
    for other in ("gemm1", "activation", "requant", "gemm2", "router_weight", "topk_reduction", "finalize"):
        if other != stage:
            assert not verdict.checks[other].startswith("DIVERGES"), str(verdict)


def _black_box(inputs, **kw):
    def run(weights, ids):
        return fused_experts(inputs.hidden_states, inputs.w1, inputs.w2, weights, ids, activation=SILU,
                             global_num_experts=inputs.global_num_experts, expert_map=inputs.expert_map,
                             quant_config=inputs.quant_config, **kw)
    return run


def test_router_weight_fault_black_box():
    inputs = _inputs(ep=True)
    base = _black_box(inputs)
    verdict = attribute(lambda w, ids: base(torch.ones_like(w), ids), inputs, SILU, TOL)
    assert verdict.divergent == ["router_weight"], str(verdict)
    assert "derived" in verdict.checks["gemm2"] and verdict.checks["gemm2"].startswith("matches")


def test_reduction_only_fault_at_m1_bf16_topk_sum():
    """transformers' eager top-k sum (bf16, expert order) alone, at M = 1 (issue 39 item 4): every other stage
    matches, and only the reduction is named."""
    inputs = _inputs(M=1, E=64, K=256, I=64, topk=8, seed=4)
    bf16_sum = NumericsProfile("planted_bf16_sum", topk_sum="act_dtype_expert_order")
    run = _black_box(inputs, profile=bf16_sum)
    verdict = attribute(run, inputs, SILU, {"max_norm": 4e-3, "rms_norm": 1.5e-3, "calc_diff": 1e-6})
    assert verdict.divergent == ["topk_reduction"], str(verdict)
    assert verdict.checks["gemm2"].startswith("matches")
    assert verdict.shares["topk_reduction"] == pytest.approx(1.0)


def test_unwritten_output_blames_finalize_only():
    inputs = _inputs()
    base = _black_box(inputs)

    def run(w, ids):
        out = base(w, ids)
        out[:, out.shape[1] // 2:] = float("nan")
        return out

    verdict = attribute(run, inputs, SILU, TOL)
    assert verdict.divergent == ["finalize"], str(verdict)
    assert "unwritten" in verdict.checks["finalize"]


def test_a_correct_kernel_blames_nothing():
    inputs = _inputs(scheme="fp8_channel_token", ep=True)
    run, stages = _planted(inputs, "gemm2", lambda t: t)
    verdict = attribute(run, inputs, SILU, TOL, stages_fn=stages)
    assert verdict.divergent == [] and "no stage localized" in str(verdict)
