"""Localize a failing experts case: run the reference and the backend stage by stage and name the first stage
that diverges.

Stages, in pipeline order (reference.experts' rounding points):
    input_quant   a1 -> (codes, scales)         backend op for the scheme's activation quantizer, bit-exact
    gemm1         (M, topk, N) act dtype        experts ``stages()`` protocol (optional)
    activation    (M, topk, N') act dtype       backend ``apply_moe_activation`` op on the reference's GEMM1 output
    requant       a2 codes and scales           backend quantizer op on the reference's activation output
    gemm2         (M, topk, K) act dtype        experts ``stages()`` protocol (optional; with the requantization)
    weights       output with unit weights      the experts rerun with topk_weights = 1 (black box)
    reduction     (M, K)                        the full output

An experts class may implement ``stages(hidden_states, w1, w2, topk_weights, topk_ids, activation,
global_num_experts, expert_map) -> dict[str, Tensor]`` returning any of ``gemm1``, ``activation``, ``gemm2`` as
``(M, topk, ...)`` tensors (zeros for routes it does not compute); without it those stages are reported as "not
observable" and the black-box checks still run.
"""

from __future__ import annotations

import torch

from conformance.metrics import ConformanceFailure, assert_close, assert_exact
from reference import quant as rq
from reference.experts import experts_unreduced
from reference.modular import moe_kernel_quantize_input

__all__ = ["reference_stages", "diagnose"]


def reference_stages(inputs, activation) -> dict[str, torch.Tensor]:
    """The reference's intermediates for every route as (M, topk, ...) in the act dtype: gemm1, activation and gemm2
    (GEMM2's output before the router weights, the requantization of its input included)."""
    qc, x = inputs.quant_config, inputs.hidden_states
    a1q, a1s = moe_kernel_quantize_input(x, qc.a1_scale, qc, "a1")
    out = {}
    out["gemm2"] = experts_unreduced(a1q, a1s, inputs.w1, inputs.w2, inputs.topk_ids, inputs.expert_map, qc,
                                      activation, x.dtype, stages=out)
    return out


def _check(name, fn, report):
    try:
        fn()
        report.append(f"  {name}: matches")
        return True
    except ConformanceFailure as exc:
        report.append(f"  {name}: DIVERGES\n      " + str(exc).replace("\n", "\n      "))
        return False
    except Exception as exc:  # a stage op that cannot even run is a divergence too
        report.append(f"  {name}: DIVERGES (raised {type(exc).__name__}: {exc})")
        return False


def diagnose(backend, experts_cls, kernel_factory, inputs, case, tol) -> str:
    """A multi-line report; its first line names the first divergent stage (or says none was localized)."""
    qc = inputs.quant_config
    report: list[str] = []
    first = None
    cid = case.id
    ref = reference_stages(inputs, case.activation)
    act = qc.a1
    # 1. input quantization
    op_name = None
    if act.dtype == torch.float8_e4m3fn:
        op_name = "per_token_group_quant_fp8" if act.shape and act.shape[0] == 1 and act.shape[1] > 0 \
            else "scaled_fp8_quant"
    elif act.dtype == torch.int8:
        op_name = "int8_quant_per_token"
    if op_name and op_name in backend.ops:
        def input_quant():
            x = inputs.hidden_states
            if op_name == "per_token_group_quant_fp8":
                rq_, rs = rq.per_token_group_quant_fp8(x, act.shape[1], use_ue8m0=qc.use_ue8m0,
                                                       recipe=backend.recipe(op_name))
                bq, bs = backend.ops[op_name](x, act.shape[1], use_ue8m0=qc.use_ue8m0)
            elif op_name == "scaled_fp8_quant":
                rq_, rs = rq.scaled_fp8_quant(x, act.scale, use_per_token_if_dynamic=act.shape == (1, -1))
                bq, bs = backend.ops[op_name](x, act.scale, use_per_token_if_dynamic=act.shape == (1, -1))
            else:
                rq_, rs = rq.int8_quant_per_token(x)
                bq, bs = backend.ops[op_name](x)
            assert_exact(bs, rs, case=cid, what="input scales")
            assert_exact(bq, rq_, case=cid, what="input codes")
        if not _check(f"input_quant ({op_name})", input_quant, report):
            first = first or "input_quant"
    else:
        report.append("  input_quant: not applicable or no quantizer op")
    # 2-4. stages observable through the optional protocol and the backend's elementwise ops
    experts = kernel_factory(experts_cls).fused_experts
    stages = getattr(experts, "stages", None)
    got = {}
    if stages is not None:
        try:
            got = stages(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids,
                         case.activation, inputs.global_num_experts, inputs.expert_map)
        except Exception as exc:  # a kernel that crashes here still gets the black-box checks below
            report.append(f"  stages(): raised {type(exc).__name__}: {exc}")
    unseen = "not handed out by stages()" if stages is not None else "not observable (the experts class has no stages())"
    for name in ("gemm1", "activation"):
        if name in got and name in ref:
            if not _check(name, lambda n=name: assert_close(got[n], ref[n], tol, case=cid, what=n), report):
                first = first or name
        elif name == "activation" and "apply_moe_activation" in backend.ops and "gemm1" in ref:
            def act_op():
                out = backend.ops["apply_moe_activation"](case.activation, ref["gemm1"], alpha=qc.gemm1_alpha,
                                                          beta=qc.gemm1_beta, limit=qc.gemm1_clamp_limit)
                assert_close(out, ref["activation"], tol, case=cid, what="activation op on the reference GEMM1")
            if not _check("activation (backend op on the reference's GEMM1 output)", act_op, report):
                first = first or "activation"
        else:
            report.append(f"  {name}: {unseen}")
    if "gemm2" in got:  # per route, before the router weights: GEMM2 (and the requantization before it)
        if not _check("requant -> gemm2 (per route)",
                      lambda: assert_close(got["gemm2"], ref["gemm2"], tol, case=cid, what="gemm2"), report):
            # Only the kernel's own activation output clears what comes before GEMM2's input
            first = first or ("requant/gemm2" if "activation" in got else
                              "gemm1/activation/requant/gemm2 (the output per route, before the router weights)")
    else:
        report.append(f"  requant -> gemm2: {unseen}")
    # 5. weights: rerun with unit weights (black box)
    def unit_weights():
        from reference.experts import fused_experts

        ones = torch.ones_like(inputs.topk_weights)
        kw = dict(activation=case.activation, global_num_experts=inputs.global_num_experts,
                  expert_map=inputs.expert_map)
        out = kernel_factory(experts_cls).apply(inputs.hidden_states, inputs.w1, inputs.w2, ones, inputs.topk_ids, **kw)
        exp = fused_experts(inputs.hidden_states, inputs.w1, inputs.w2, ones, inputs.topk_ids, quant_config=qc, **kw)
        assert_close(out, exp, tol, case=cid, what="output with unit router weights")
    unit_ok = _check("gemm1 -> gemm2 with unit router weights", unit_weights, report)
    if unit_ok:
        first = first or "weights/reduction (correct with unit router weights, wrong with the real ones)"
    else:
        first = first or "gemm1/activation/requant/gemm2 (wrong even with unit router weights)"
    return f"first divergent stage: {first}\n" + "\n".join(report)
