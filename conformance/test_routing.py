"""Routing conformance: the backend's routing ops against the reference router, with each real model's settings.

Ids compare as per-token sets (ties accepted either way), weights with fp32 tolerances."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import RoutingCase, routing_cases
from conformance.inputs import _gen, route, router_logits, routing_bias
from conformance.metrics import assert_routing
from reference.routing import valid_grouping


def _op_and_call(model, logits, bias):
    """(op name, callable(op) -> (w, ids)) for the model's routing method."""
    k = model.top_k
    if model.scoring_func == "topk_softmax":
        return "topk_softmax", lambda op: op(None, logits, k, True)
    if model.scoring_func == "llama4":
        return "llama4_routing", lambda op: op(None, logits, k, False)
    if model.use_grouped_topk and valid_grouping(model.num_experts, model.num_expert_group):
        return "grouped_topk", lambda op: op(
            None, logits, k, model.renormalize, model.num_expert_group, model.topk_group,
            scoring_func=model.scoring_func, routed_scaling_factor=model.routed_scaling_factor,
            e_score_correction_bias=bias)
    if bias is not None:
        return "fused_topk_bias", lambda op: op(
            None, logits, bias, k, model.renormalize, scoring_func=model.scoring_func,
            routed_scaling_factor=model.routed_scaling_factor)
    return "fused_topk", lambda op: op(None, logits, k, model.renormalize, scoring_func=model.scoring_func)


def _selection_key(model, logits, bias):
    x = logits.float()
    if model.scoring_func in ("topk_softmax", "llama4"):
        return x
    s = x.softmax(-1) if model.scoring_func == "softmax" else x.sigmoid()
    return s if bias is None else s + bias


@pytest.mark.parametrize("case", routing_cases(), ids=lambda c: c.id)
def test_routing(backend, case: RoutingCase, tolerances, repro, record):
    g = _gen(case.seed)
    m = case.model
    logits = router_logits(m, case.tokens, g)
    bias = routing_bias(m, g)
    name, call = _op_and_call(m, logits, bias)
    op = backend.ops.get(name)
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement {name}")
    record(model=m.name, component="routing", scheme=name, tokens=case.tokens)
    ref_w, ref_ids = route(m, logits, bias)
    dev = backend.device
    out_w, out_ids = call_on_device(call, op, dev)
    assert_routing(out_w, out_ids, ref_w, ref_ids, _selection_key(m, logits, bias), tolerances["routing"],
                   case=f"routing[{case.id}] via {name}", repro=repro)


def call_on_device(call, op, device):
    """Run ``call(op)`` on inputs moved to ``device`` by wrapping the op (inputs are built on the CPU)."""
    if device == "cpu":
        return call(op)

    def moved(*args, **kwargs):
        mv = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return op(*[mv(a) for a in args], **{k: mv(v) for k, v in kwargs.items()})

    return call(moved)


NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


@pytest.mark.parametrize("op_name", ["fused_topk", "grouped_topk", "fused_topk_bias", "topk_softmax",
                                     "llama4_routing"])
@pytest.mark.parametrize("bad", list(NONFINITE))
def test_routing_nonfinite_logits_never_give_out_of_range_ids(backend, op_name, bad, repro, record):
    """vLLM #39391: NaN/inf router logits (CUDA-graph padding rows) must not yield ids outside [0, E). By default the
    op raises ValueError (the reference's definition); with ``check_finite=False`` it returns in-range ids."""
    op = backend.ops.get(op_name)
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement {op_name}")
    record(component="routing", scheme=f"{op_name}-nonfinite")
    E, k = 64, 4 if op_name != "llama4_routing" else 1
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(7))
    logits[1, 5] = NONFINITE[bad]
    logits[3] = NONFINITE[bad]  # a whole padding row
    args = {"fused_topk": (None, logits, k, True), "grouped_topk": (None, logits, k, True, 8, 4),
            "fused_topk_bias": (None, logits, torch.zeros(E), k, True), "topk_softmax": (None, logits, k, True),
            "llama4_routing": (None, logits, k, False)}[op_name]
    dev = backend.device
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(ValueError):
        op(*args)
    _, ids = op(*args, check_finite=False)
    ids = ids.cpu()
    if not bool(((ids >= 0) & (ids < E)).all()):
        raise AssertionError(f"{op_name} with {bad} logits returned ids {ids.tolist()} outside [0, {E})"
                             f"\n  reproduce: {repro}")
