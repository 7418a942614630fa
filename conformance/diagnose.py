"""Diagnosis by attribution: which pipeline stages of a failing experts case diverge, each compared on its *own*
inputs, and each divergent stage's share of the output error. A stage that matches is never blamed.

Stages (reference.experts' rounding points, in order)::

    input_quant     a1 dequantized (M, K) fp32                  tap "input"; or the backend's quantizer op, bit-exact
    gemm1           (M, topk, N) act dtype                      tap "gemm1"
    activation      (M, topk, N') act dtype                     tap "activation"; or the backend's activation op
    requant         a2 dequantized (M, topk, N') fp32           tap "a2"
    gemm2           (M, topk, K) act dtype, per route            tap "gemm2"; black box: the per-route taps below
    router_weight   the weights applied to the routes
    topk_reduction  the sum over a token's routes
    finalize        the output written (unwritten elements keep the harness's NaN poison)

Taps. An experts class may implement ``stages(hidden_states, w1, w2, topk_weights, topk_ids, activation,
global_num_experts, expert_map) -> dict`` returning any of the taps above as ``(M, topk, ...)`` tensors (``input``:
``(M, K)``), zeros for routes it does not compute. Without ``gemm2`` the per-route outputs are *derived* from the
black box: the kernel is run once per top-k slot with every other slot made padding (-1) and unit weights, so its
output is that route's GEMM2 output as the kernel rounds it.

Each stage is checked by running the reference's stage on the kernel's tap of the stage before it (the reference loop
with the kernel's taps substituted, ``reference.experts.fused_experts(substitute=...)``) and comparing with the
kernel's tap of the stage itself, under the case's bound. The router weight and the reduction are told apart by a
second black-box run with unit weights: right with unit weights and wrong with the real ones blames the router
weight; wrong with unit weights blames the reduction (the router weight is then not separable and not blamed).
Shares: the reference output is moved to the kernel's output one stage at a time (substituting the taps in pipeline
order); a stage's share is its step's squared norm over the sum of the steps'.
"""

from __future__ import annotations

import dataclasses

import torch

from conformance.metrics import ConformanceFailure, assert_close, assert_exact
from reference import quant as rq
from reference.experts import fused_experts
from reference.modular import moe_kernel_quantize_input

__all__ = ["STAGES", "Attribution", "attribute", "diagnose", "reference_stages"]

STAGES = ("input_quant", "gemm1", "activation", "requant", "gemm2", "router_weight", "topk_reduction", "finalize")
_TAP = {"input_quant": "input", "gemm1": "gemm1", "activation": "activation", "requant": "a2", "gemm2": "gemm2"}


def reference_stages(inputs, activation, profile=None) -> dict[str, torch.Tensor]:
    """The reference's taps (``input``, ``gemm1``, ``activation``, ``a2``, ``gemm2``) for every route."""
    from reference.experts import experts_unreduced
    from reference.profiles import resolve_profile

    qc, x = inputs.quant_config, inputs.hidden_states
    out: dict[str, torch.Tensor] = {}
    a1q, a1s = moe_kernel_quantize_input(x, qc.a1_scale, qc, "a1")
    experts_unreduced(a1q, a1s, inputs.w1, inputs.w2, inputs.topk_ids, inputs.expert_map, qc, activation, x.dtype,
                      stages=out, profile=resolve_profile(profile))
    return out


def _ref(inputs, activation, profile, *, substitute=None, stages=None, weights=None, ids=None):
    qc = inputs.quant_config
    w = inputs.topk_weights if weights is None else weights
    ids = inputs.topk_ids if ids is None else ids
    if stages is not None:
        from reference.experts import experts_unreduced as loop
        from reference.profiles import resolve_profile

        a1q, a1s = moe_kernel_quantize_input(inputs.hidden_states, qc.a1_scale, qc, "a1")
        loop(a1q, a1s, inputs.w1, inputs.w2, ids, inputs.expert_map, qc, activation, inputs.hidden_states.dtype,
             stages=stages, profile=resolve_profile(profile), substitute=substitute)
    return fused_experts(inputs.hidden_states, inputs.w1, inputs.w2, w, ids, activation=activation,
                         global_num_experts=inputs.global_num_experts, expert_map=inputs.expert_map,
                         quant_config=qc, profile=profile, substitute=substitute)


@dataclasses.dataclass
class Attribution:
    """The verdict: ``divergent`` stages (pipeline order) with their ``shares`` of the output error (0..1), what was
    checked per stage (``checks``: "matches", "DIVERGES ...", "not observable ..."), and the report lines."""

    divergent: list[str]
    shares: dict[str, float]
    checks: dict[str, str]

    def headline(self) -> str:
        if not self.divergent:
            return "no stage localized (every observable stage matches on its own inputs)"
        return "divergent stage(s): " + ", ".join(f"{s} ({self.shares.get(s, 0.0):.0%} of the output error)"
                                                  for s in self.divergent)

    def __str__(self) -> str:
        return self.headline() + "\n" + "\n".join(f"  {s}: {self.checks[s]}" for s in STAGES if s in self.checks)


def _close(a, b, tol, what, mask=None) -> str | None:
    """None when ``a`` matches ``b`` within ``tol`` (on ``mask``'s elements), else the failure's first line."""
    if mask is not None:
        a, b = a[mask], b[mask]
    if a.numel() == 0:
        return None
    try:
        assert_close(a.float(), b.float(), tol, case="", what=what)
        return None
    except ConformanceFailure as exc:
        return str(exc).splitlines()[0]


def _held(inputs) -> torch.Tensor:
    """(M, topk) routes this rank computes."""
    from reference.experts import local_expert_ids

    return local_expert_ids(inputs.topk_ids, inputs.w1.size(0), inputs.expert_map) >= 0


def attribute(run, inputs, activation, tol, *, profile=None, stages_fn=None, ops=None, recipe=None,
              apply_router_weight_on_input=False) -> Attribution:
    """Attribute a kernel's output error to the stages (module docstring).

    run(topk_weights, topk_ids) -> (M, K): the kernel on ``inputs`` with those routes (a black box);
    stages_fn: the experts' ``stages`` bound to the inputs (``() -> dict``), or None; ops / recipe: the backend's ops
    and its quantizer recipe lookup, for the op checks of input_quant and activation.
    """
    qc = inputs.quant_config
    held = _held(inputs)
    checks: dict[str, str] = {}
    divergent: list[str] = []
    ref_taps = reference_stages(inputs, activation, profile)
    out = run(inputs.topk_weights, inputs.topk_ids)
    ref_out = _ref(inputs, activation, profile)
    taps: dict[str, torch.Tensor] = {}
    if stages_fn is not None:
        try:
            taps = {k: v for k, v in (stages_fn() or {}).items() if k in _TAP.values()}
        except Exception as exc:  # a kernel whose stages() crashes still gets the black-box checks
            checks["gemm1"] = f"stages() raised {type(exc).__name__}: {exc}"
    # finalize: elements left unwritten (the poison) where the reference is finite
    unwritten = ~torch.isfinite(out) & torch.isfinite(ref_out)
    cols = torch.isfinite(out).all(dim=0) if unwritten.any() else None  # compare the rest on the written columns
    if unwritten.any():
        divergent.append("finalize")
        checks["finalize"] = (f"DIVERGES: {int(unwritten.sum())} of {out.numel()} output elements unwritten "
                              f"(columns {_ranges(~cols)})")
    else:
        checks["finalize"] = "matches (every output element written)"
    # black-box per-route taps: one slot at a time, the others padding, unit weights
    ones = torch.ones_like(inputs.topk_weights)
    if "gemm2" not in taps and not apply_router_weight_on_input:
        try:
            y = torch.zeros_like(ref_taps["gemm2"])
            for k in range(inputs.topk_ids.size(1)):
                ids = torch.full_like(inputs.topk_ids, -1)
                ids[:, k] = inputs.topk_ids[:, k]
                y[:, k] = run(ones, ids).to(y.dtype)
            taps["gemm2"] = torch.where(held.unsqueeze(-1), y, torch.zeros_like(y))
            derived = " (derived: the kernel run one top-k slot at a time)"
        except Exception as exc:
            derived = f" (not derivable: the kernel raised {type(exc).__name__} on padding slots)"
    else:
        derived = ""
    mask3 = held.unsqueeze(-1)
    if cols is not None:
        mask3 = mask3 & cols.view(1, 1, -1) if taps.get("gemm2") is not None else mask3

    # input_quant: the tap, or the backend's quantizer op on the hidden states (bit-exact)
    if "input" in taps:
        err = _close(taps["input"], ref_taps["input"], tol, "dequantized input")
        checks["input_quant"] = "matches" if err is None else f"DIVERGES: {err}"
    else:
        checks["input_quant"] = _input_quant_op(inputs, ops or {}, recipe)
    if checks["input_quant"].startswith("DIVERGES"):
        divergent.append("input_quant")
    # gemm1 .. gemm2: the reference's stage on the kernel's tap before it
    chain = [("gemm1", "input"), ("activation", "gemm1"), ("requant", "activation"), ("gemm2", "a2")]
    for stage, before in chain:
        tap = _TAP[stage]
        if tap not in taps:
            if stage == "activation" and "gemm1" in ref_taps and "apply_moe_activation" in (ops or {}):
                checks[stage] = _activation_op(inputs, ops, ref_taps, held, tol, activation)
            else:
                checks[stage] = "not observable (no tap; the experts class has no stages() handing it out)"
            if checks[stage].startswith("DIVERGES"):
                divergent.append(stage)
            continue
        # the reference from the kernel's latest tap before this stage, run through this stage
        prior = {_TAP[s]: taps[_TAP[s]] for s, _ in [("input_quant", None)] + chain
                 if s != stage and _TAP[s] in taps and STAGES.index(s) < STAGES.index(stage)}
        sub_taps: dict[str, torch.Tensor] = {}
        _ref(inputs, activation, profile, substitute=prior, stages=sub_taps)
        expected = sub_taps[tap]
        m = held.unsqueeze(-1) if tap != "gemm2" else mask3
        err = _close(taps[tap], expected, tol, f"{stage} on its own inputs",
                     mask=m.expand_as(taps[tap]) if taps[tap].dim() == 3 else None)
        note = derived if stage == "gemm2" else ""
        if stage == "gemm2" and "a2" not in taps:
            note += (" (from the reference's a2: gemm1 .. gemm2 together)" if not any(t in taps for t in
                     ("gemm1", "activation")) else " (requant and gemm2 together)")
        checks[stage] = ("matches" if err is None else f"DIVERGES: {err}") + note
        if err is not None:
            divergent.append(stage)
    # router weight and top-k reduction: the reference's reduction of the kernel's per-route outputs
    if "gemm2" in taps:
        y = {"gemm2": taps["gemm2"]}
        w_ref = _ref(inputs, activation, profile, substitute=y)
        err_w = _close(out, w_ref, tol, "weighted top-k sum of the kernel's routes",
                       mask=None if cols is None else cols.expand_as(out))
        if err_w is None:
            checks["router_weight"] = checks["topk_reduction"] = "matches"
        else:
            unit_out = run(ones, inputs.topk_ids)
            unit_ref = _ref(inputs, activation, profile, substitute=y, weights=ones)
            err_u = _close(unit_out, unit_ref, tol, "unit-weight top-k sum of the kernel's routes",
                           mask=None if cols is None else cols.expand_as(out))
            if err_u is None:
                checks["router_weight"] = f"DIVERGES: right with unit weights, wrong with the real ones: {err_w}"
                checks["topk_reduction"] = "matches (with unit weights)"
                divergent.append("router_weight")
            else:
                checks["topk_reduction"] = f"DIVERGES (even with unit weights): {err_u}"
                checks["router_weight"] = "not separable (the reduction diverges)"
                divergent.append("topk_reduction")
    else:
        checks["router_weight"] = checks["topk_reduction"] = "not observable (no per-route outputs)"
    divergent = [s for s in STAGES if s in divergent]
    return Attribution(divergent, _shares(inputs, activation, profile, taps, out, ref_out, cols, divergent), checks)


def _shares(inputs, activation, profile, taps, out, ref_out, cols, divergent) -> dict[str, float]:
    """Each stage's step when the reference output is moved to the kernel's one stage at a time (squared norms)."""
    order = [s for s in ("input_quant", "gemm1", "activation", "requant", "gemm2") if _TAP[s] in taps]
    mask = torch.ones_like(out, dtype=torch.bool) if cols is None else cols.expand_as(out)
    prev, steps, sub = ref_out.float(), {}, {}
    for s in order:
        sub[_TAP[s]] = taps[_TAP[s]]
        cur = _ref(inputs, activation, profile, substitute=dict(sub)).float()
        steps[s] = float(((cur - prev)[mask] ** 2).sum())
        prev = cur
    rest = float(((out.float() - prev)[mask] ** 2).sum()) if mask.any() else 0.0
    after = [s for s in divergent if s in ("router_weight", "topk_reduction")]
    for s in after or ["router_weight/topk_reduction"]:
        steps[s] = rest / max(len(after), 1)
    if "finalize" in divergent:
        steps["finalize"] = float(max((~torch.isfinite(out)).sum().item(), 1))  # unwritten: not a norm; share 1
        return {s: (1.0 if s == "finalize" else 0.0) for s in steps}
    total = sum(steps.values())
    return {s: (v / total if total > 0 else 0.0) for s, v in steps.items()}


def _ranges(mask: torch.Tensor) -> str:
    idx = mask.nonzero().flatten().tolist()
    if not idx:
        return "-"
    return f"{idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) else f"{len(idx)} columns"


def _input_quant_op(inputs, ops, recipe) -> str:
    act = inputs.quant_config.a1
    qc = inputs.quant_config
    x = inputs.hidden_states
    if act.dtype == torch.float8_e4m3fn:
        name = "per_token_group_quant_fp8" if act.shape and act.shape[0] == 1 and act.shape[1] > 0 \
            else "scaled_fp8_quant"
    elif act.dtype == torch.int8:
        name = "int8_quant_per_token"
    else:
        return "not applicable (unquantized input)" if act.dtype is None else "not observable (no quantizer op)"
    if name not in ops:
        return f"not observable (no tap, no {name} op)"
    try:
        if name == "per_token_group_quant_fp8":
            rq_, rs = rq.per_token_group_quant_fp8(x, act.shape[1], use_ue8m0=qc.use_ue8m0,
                                                   recipe=recipe(name) if recipe else "vllm")
            bq, bs = ops[name](x, act.shape[1], use_ue8m0=qc.use_ue8m0)
        elif name == "scaled_fp8_quant":
            rq_, rs = rq.scaled_fp8_quant(x, act.scale, use_per_token_if_dynamic=act.shape == (1, -1))
            bq, bs = ops[name](x, act.scale, use_per_token_if_dynamic=act.shape == (1, -1))
        else:
            rq_, rs = rq.int8_quant_per_token(x)
            bq, bs = ops[name](x)
        assert_exact(bs, rs, case="", what="input scales")
        assert_exact(bq, rq_, case="", what="input codes")
        return f"matches ({name} op, bit-exact)"
    except ConformanceFailure as exc:
        return f"DIVERGES ({name} op): " + str(exc).splitlines()[0]
    except Exception as exc:
        return f"DIVERGES ({name} op raised {type(exc).__name__}: {exc})"


def _activation_op(inputs, ops, ref_taps, held, tol, activation) -> str:
    qc = inputs.quant_config
    try:
        got = ops["apply_moe_activation"](activation, ref_taps["gemm1"], alpha=qc.gemm1_alpha, beta=qc.gemm1_beta,
                                          limit=qc.gemm1_clamp_limit)
    except Exception as exc:
        return f"DIVERGES (the backend's activation op raised {type(exc).__name__}: {exc})"
    err = _close(got, ref_taps["activation"], tol, "activation op on the reference's GEMM1 output",
                 mask=held.unsqueeze(-1).expand_as(got))
    return ("matches (the backend's activation op on the reference's GEMM1 output)" if err is None
            else f"DIVERGES (the backend's activation op on the reference's GEMM1 output): {err}")


def diagnose(backend, experts_cls, kernel_factory, inputs, case, tol, profile=None,
             apply_router_weight_on_input=False) -> str:
    """The conformance suite's diagnosis of a failing experts case: ``attribute`` on the kernel the test built, as a
    multi-line report whose first line names every divergent stage with its share of the output error."""
    kw = dict(activation=case.activation, global_num_experts=inputs.global_num_experts, expert_map=inputs.expert_map,
              apply_router_weight_on_input=apply_router_weight_on_input)

    def run(weights, ids):
        return kernel_factory(experts_cls).apply(inputs.hidden_states, inputs.w1, inputs.w2, weights, ids, **kw)

    experts = kernel_factory(experts_cls).fused_experts
    stages = getattr(experts, "stages", None)
    stages_fn = None
    if stages is not None:
        def stages_fn():
            return stages(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids,
                          case.activation, inputs.global_num_experts, inputs.expert_map)
    return str(attribute(run, inputs, case.activation, tol, profile=profile, stages_fn=stages_fn, ops=backend.ops,
                         recipe=backend.recipe, apply_router_weight_on_input=apply_router_weight_on_input))
