"""Routing conformance: the backend's routing ops against the reference router, with each real model's settings.

Ids compare as per-token sets (ties accepted either way), weights with fp32 tolerances.

The reference routes under the vLLM semantics version chosen by ``--vllm-semantics`` (else ``$MOE_VLLM_SEMANTICS``,
else the newest); ``_vllm_semantics`` applies it to every test of this module. Under 0.33 the non-finite rule of
``fused_topk`` / ``fused_topk_bias`` is vLLM 0.33.0's clamp (``csrc/moe/topk_softmax_kernels.cu``), under 0.17 the
seed-era raise (``reference.routing`` module doc)."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import RoutingCase, routing_cases
from conformance.inputs import _gen, route, router_logits, routing_bias
from conformance.metrics import assert_routing
from reference import routing as reference_routing
from reference.routing import valid_grouping
from reference.semantics import SemanticsVersion, resolve_semantics, use_semantics


@pytest.fixture(autouse=True)
def _vllm_semantics(request):
    """Route the reference under ``--vllm-semantics`` (the conftest's option; ``None``: env var or newest)."""
    try:
        chosen = request.config.getoption("--vllm-semantics")
    except ValueError:  # the option is not registered (module run outside the conformance conftest)
        chosen = None
    with use_semantics(resolve_semantics(chosen)) as v:
        yield v


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


CLAMPED_033 = ("fused_topk", "fused_topk_bias")  # vLLM 0.33.0's topk_softmax / topk_sigmoid kernels clamp


@pytest.mark.parametrize("op_name", ["fused_topk", "grouped_topk", "fused_topk_bias", "topk_softmax",
                                     "llama4_routing"])
@pytest.mark.parametrize("bad", list(NONFINITE))
def test_routing_nonfinite_logits_never_give_out_of_range_ids(backend, op_name, bad, repro, record, tolerances,
                                                              _vllm_semantics):
    """vLLM #39391: NaN/inf router logits (CUDA-graph padding rows) must not yield ids outside [0, E).

    0.17 semantics (and, under 0.33, the ops vLLM does not clamp): by default the op raises ValueError (the
    reference's definition); with ``check_finite=False`` it returns in-range ids.
    0.33 semantics, ``fused_topk`` / ``fused_topk_bias``: the scores are clamped (NaN/inf -> 0): with
    ``check_finite=False`` every token has unique in-range ids and finite weights, as vLLM 0.33.0's
    ``tests/kernels/moe/test_fused_topk.py::test_fused_topk*_nan_inf_clamp`` require, and the finite rows route as
    the reference does."""
    op = backend.ops.get(op_name)
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement {op_name}")
    v = _vllm_semantics
    record(component="routing", scheme=f"{op_name}-nonfinite", vllm_semantics=v.value)
    E, k = 64, 4 if op_name != "llama4_routing" else 1
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(7))
    logits[1, 5] = NONFINITE[bad]
    logits[3] = NONFINITE[bad]  # a whole padding row
    args = {"fused_topk": (None, logits, k, True), "grouped_topk": (None, logits, k, True, 8, 4),
            "fused_topk_bias": (None, logits, torch.zeros(E), k, True), "topk_softmax": (None, logits, k, True),
            "llama4_routing": (None, logits, k, False)}[op_name]
    dev = backend.device
    dev_args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    clamped = v >= SemanticsVersion.V0_33 and op_name in CLAMPED_033
    if not clamped:
        with pytest.raises(ValueError):
            op(*dev_args)
    w, ids = op(*dev_args, check_finite=False)
    w, ids = w.cpu(), ids.cpu()
    if not bool(((ids >= 0) & (ids < E)).all()):
        raise AssertionError(f"{op_name} with {bad} logits returned ids {ids.tolist()} outside [0, {E})"
                             f"\n  reproduce: {repro}")
    if clamped:
        dup = [t for t in range(ids.shape[0]) if ids[t].unique().numel() != k]
        nonfinite = [t for t in range(w.shape[0]) if not bool(torch.isfinite(w[t]).all())]
        if dup or nonfinite:
            raise AssertionError(
                f"{op_name} with {bad} logits under vLLM 0.33 semantics (clamp NaN/inf scores to 0): tokens {dup} "
                f"have duplicate ids, tokens {nonfinite} non-finite weights {w[nonfinite].tolist()}"
                f"\n  reproduce: {repro} --vllm-semantics {v.value}")
        ref_w, ref_ids = getattr(reference_routing, op_name)(*args)  # the reference under the same semantics
        finite = torch.isfinite(logits).all(dim=1)
        key = logits.float().softmax(-1) if op_name == "fused_topk" else logits.float().sigmoid()
        assert_routing(w[finite], ids[finite], ref_w[finite], ref_ids[finite], key[finite], tolerances["routing"],
                       case=f"routing-nonfinite[{op_name}-{bad}] finite rows", repro=repro)
