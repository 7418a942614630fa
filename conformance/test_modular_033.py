"""The vLLM 0.33 modular-kernel contract, per backend experts class (``reference.modular`` under 0.33 semantics).

- M == 0: the kernel returns ``(0, output_hidden_dim(K))`` before calling the experts (the class is never asked);
- deferred finalize: a class that claims it (``SupportRecord.deferred_finalize``) hands ``post_gemm2_hook`` a valid
  route-major ``UnfinalizedMoEOutput`` whose finalize (``reference.moe_output``) matches the reference within the
  error model's bound, and writes nothing itself;
- hidden padding: a class that claims it (``SupportRecord.hidden_padding``) run at a zero-padded K returns the
  unpadded ``(M, K)`` output, matching the reference on the unpadded inputs;
- shared experts: in each of the three orders they run exactly once, at the order's site, and the routed output is
  bitwise the one without shared experts;
- async prepare/finalize: the class run behind ``AsyncMoEPrepareAndFinalizeNoEP`` (hook + receiver, or receiver
  only) gives bitwise the synchronous kernel's output; under DBO (two ubatches, each hook run by the other ubatch)
  each ubatch's output is bitwise the synchronous kernel's on its tokens, and every hook ran before its receiver;
- ``moe_fused_mul_sum`` (a backend op): the reference's rows within the activation ulps, untouched rows untouched;
- ``consumes_expert_mask``: each class is a bool and, handed the map form it declares (``layer_expert_map``) on an
  EP rank, matches the reference.

Skipped under ``--vllm-semantics 0.17`` (none of this exists there). Small: Qwen3-30B-A3B at its CPU EP size, 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from conformance.cases import ExpertsCase, seed_of
from conformance.inputs import make_experts_inputs
from conformance.metrics import ConformanceFailure, assert_close, assert_ulps
from conformance.experts_case import case_error_bound, claims_config, moe_config_for
from reference.experts import fused_experts_with_heavy
from reference.modular import (
    AsyncMoEPrepareAndFinalizeNoEP,
    FusedMoEActivationFormat,
    FusedMoEKernel,
    MoEPrepareAndFinalizeNoEP,
    layer_expert_map,
)
from reference.modular.ubatching import run_ubatches
from reference.moe_output import UnfinalizedMoEOutput, moe_fused_mul_sum
from reference.routing import determine_expert_map
from reference.semantics import SemanticsVersion, current_semantics
from reference.shared_experts import SharedExperts, SharedExpertsOrder
from specs import load_models

MODEL = "qwen3_30b_a3b"


@pytest.fixture(autouse=True)
def _needs_033():
    if current_semantics() < SemanticsVersion.V0_33:
        pytest.skip("the 0.33 modular-kernel contract does not exist under --vllm-semantics 0.17")


def _case(tokens: int = 16, rank: str = "last") -> ExpertsCase:
    m = load_models()[MODEL]
    return ExpertsCase(m, "bf16", tokens, m.cpu_ep_size, m.cpu_ep_size - 1 if rank == "last" else 0)


def _standard_classes(config):
    return [c for c in config._moe_backend.experts if c.activation_format() == FusedMoEActivationFormat.Standard]


def pytest_generate_tests(metafunc):
    if "experts_cls" in metafunc.fixturenames and metafunc.module.__name__.endswith("test_modular_033"):
        classes = _standard_classes(metafunc.config)
        metafunc.parametrize("experts_cls", classes or [None], ids=lambda c: getattr(c, "__name__", "no-experts"))


def _setup(backend, experts_cls, case):
    if experts_cls is None:
        pytest.skip(f"backend {backend.name} offers no Standard-format experts")
    inputs = make_experts_inputs(case, backend.device)
    qc = inputs.quant_config
    cfg = moe_config_for(case)
    ok, reason = claims_config(experts_cls, cfg, qc)
    if not ok:
        pytest.skip(f"{experts_cls.__name__} does not claim {case.id}: {reason}")
    kw = dict(activation=case.activation, global_num_experts=inputs.global_num_experts, expert_map=inputs.expert_map)
    return inputs, qc, cfg, kw


def test_empty_batch_returns_before_the_experts(backend, experts_cls, record):
    case = _case(0)
    inputs, qc, cfg, kw = _setup(backend, experts_cls, case)
    calls = []

    class Spy(experts_cls):
        def apply(self, *a, **k):
            calls.append(1)
            return super().apply(*a, **k)

    record(component="modular-0.33", scheme="empty-batch", model=case.model.name, tokens=0,
           experts_class=experts_cls.__name__)
    ex = Spy(cfg, qc)
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ex, poison=float("nan")).apply(
        inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids, **kw)
    K = inputs.hidden_states.shape[1]
    if calls or tuple(out.shape) != (0, ex.output_hidden_dim(K)) or out.dtype != inputs.hidden_states.dtype:
        raise ConformanceFailure(f"M == 0: the 0.33 kernel must return (0, {ex.output_hidden_dim(K)}) "
                                 f"{inputs.hidden_states.dtype} without calling the experts; got "
                                 f"{tuple(out.shape)} {out.dtype}, experts called {len(calls)} times")


def test_deferred_finalize_through_post_gemm2_hook(backend, experts_cls, repro, record):
    rec = getattr(experts_cls, "support", None)
    if rec is None or not rec.deferred_finalize:
        pytest.skip(f"{getattr(experts_cls, '__name__', None)} does not claim deferred finalize")
    case = _case()
    inputs, qc, cfg, kw = _setup(backend, experts_cls, case)
    record(component="modular-0.33", scheme="deferred-finalize", model=case.model.name, tokens=case.tokens,
           experts_class=experts_cls.__name__)
    seen = []

    def hook(unfinalized, output):
        if not isinstance(unfinalized, UnfinalizedMoEOutput):
            raise ConformanceFailure(f"post_gemm2_hook got {type(unfinalized).__name__}, not UnfinalizedMoEOutput")
        unfinalized.validate()  # raises ValueError naming the broken field
        seen.append(unfinalized)
        unfinalized.finalize(output)  # the reference's reduction stands in for the fused consumer

    ex = experts_cls(cfg, qc)
    ex.post_gemm2_hook = hook
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ex, poison=float("nan")).apply(
        inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids, **kw)
    if len(seen) != 1:
        raise ConformanceFailure(f"post_gemm2_hook called {len(seen)} times (expected once)\n  reproduce: {repro}")
    expected, heavy = fused_experts_with_heavy(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights,
                                           inputs.topk_ids, quant_config=qc, **kw)
    assert_close(out, expected, case_error_bound(case, qc, experts_cls, heavy=heavy).as_tolerance(), case=case.id + "-deferred",
                 what=f"{experts_cls.__name__} deferred-finalize output", repro=repro)


def test_hidden_padding_is_dropped(backend, experts_cls, repro, record):
    rec = getattr(experts_cls, "support", None)
    if rec is None or not rec.hidden_padding:
        pytest.skip(f"{getattr(experts_cls, '__name__', None)} does not claim output_hidden_dim (hidden padding)")
    case = _case()
    inputs, qc, cfg, kw = _setup(backend, experts_cls, case)
    record(component="modular-0.33", scheme="hidden-padding", model=case.model.name, tokens=case.tokens,
           experts_class=experts_cls.__name__)
    pad = 64  # zero columns of x / w1 and zero rows of w2: they change nothing but the K the kernel runs at
    x = torch.nn.functional.pad(inputs.hidden_states, (0, pad))
    w1 = torch.nn.functional.pad(inputs.w1, (0, pad))
    w2 = torch.nn.functional.pad(inputs.w2, (0, 0, 0, pad))
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts_cls(cfg, qc), poison=float("nan")).apply(
        x, w1, w2, inputs.topk_weights, inputs.topk_ids, **kw)
    expected, heavy = fused_experts_with_heavy(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights,
                                           inputs.topk_ids, quant_config=qc, **kw)
    assert_close(out, expected, case_error_bound(case, qc, experts_cls, heavy=heavy).as_tolerance(), case=case.id + "-hpad",
                 what=f"{experts_cls.__name__} output with the hidden padding dropped", repro=repro)


class _AsyncNoEP(AsyncMoEPrepareAndFinalizeNoEP):
    """The reference's async prepare/finalize: the kernel then runs shared experts itself."""


@pytest.mark.parametrize("order", ["hook_receiver", "receiver_only", "dbo", "dbo_receiver_only"])
def test_async_prepare_finalize_hooks(backend, experts_cls, order, repro, record):
    case = _case()
    inputs, qc, cfg, kw = _setup(backend, experts_cls, case)
    record(component="modular-0.33", scheme=f"async-{order}", model=case.model.name, tokens=case.tokens,
           experts_class=experts_cls.__name__)
    events = []
    pf = AsyncMoEPrepareAndFinalizeNoEP(return_hook=not order.endswith("receiver_only"), events=events)
    x, w1, w2, w, ids = inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids
    sync = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts_cls(cfg, qc))
    k = FusedMoEKernel(pf, experts_cls(cfg, qc), poison=float("nan"))
    if order.startswith("dbo"):
        h = x.size(0) // 2
        parts = [slice(0, h), slice(h, None)]
        outs = run_ubatches([lambda s=s: k.apply(x[s], w1, w2, w[s], ids[s], **kw) for s in parts])
        wants = [sync.apply(x[s], w1, w2, w[s], ids[s], **kw) for s in parts]
    else:
        outs, wants = [k.apply(x, w1, w2, w, ids, **kw)], [sync.apply(x, w1, w2, w, ids, **kw)]
    for i, (out, want) in enumerate(zip(outs, wants)):
        if not torch.equal(out.cpu(), want.cpu()):
            raise ConformanceFailure(f"{experts_cls.__name__} behind an async prepare/finalize ({order}), ubatch "
                                     f"{i}: the output differs from the synchronous kernel's\n  reproduce: {repro}")
    hooks = [e for e in events if e[0].endswith("_hook")]
    if order == "dbo" and (len(hooks) != 4 or any(u == owner for (_, u), owner in zip(hooks, (0, 1, 0, 1)))):
        raise ConformanceFailure(f"under DBO each hook must run in the other ubatch; ran {events}")


@pytest.mark.parametrize("order", [SharedExpertsOrder.NO_OVERLAP, SharedExpertsOrder.MULTI_STREAM_OVERLAPPED,
                                   SharedExpertsOrder.MK_INTERNAL_OVERLAPPED], ids=lambda o: o.name)
def test_shared_experts_run_once_in_their_order(backend, experts_cls, order, record):
    case = _case()
    inputs, qc, cfg, kw = _setup(backend, experts_cls, case)
    record(component="modular-0.33", scheme=f"shared-{order.name}", model=case.model.name, tokens=case.tokens,
           experts_class=experts_cls.__name__)
    pf = _AsyncNoEP() if order == SharedExpertsOrder.MK_INTERNAL_OVERLAPPED else MoEPrepareAndFinalizeNoEP()
    kernel = FusedMoEKernel(pf, experts_cls(cfg, qc))
    layer = lambda h: h * 2  # noqa: E731
    se = SharedExperts(layer, mk_can_overlap_shared_experts=lambda: kernel.can_overlap_shared_experts,
                       aux_stream=order == SharedExpertsOrder.MULTI_STREAM_OVERLAPPED,
                       is_cuda_alike=order == SharedExpertsOrder.MULTI_STREAM_OVERLAPPED)
    args = (inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids)
    shared, routed = kernel.forward_with_shared_experts(se, *args, **kw)
    plain = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts_cls(cfg, qc)).apply(*args, **kw)
    if se.calls != [order]:
        raise ConformanceFailure(f"shared experts ran at {[o.name for o in se.calls]}, expected once at {order.name}")
    if not torch.equal(shared, layer(inputs.hidden_states)) or not torch.equal(routed, plain):
        raise ConformanceFailure(f"{order.name}: the shared or routed output changed with the ordering")


def test_moe_fused_mul_sum(backend, tolerances, repro, record):
    op = backend.ops.get("moe_fused_mul_sum")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement moe_fused_mul_sum")
    record(component="modular-0.33", scheme="moe_fused_mul_sum", tokens=24)
    g = torch.Generator().manual_seed(seed_of("moe_fused_mul_sum"))
    T, k, H, E = 24, 4, 256, 16
    inputs = torch.randn(T, k, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, k, generator=g)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    ids[::5] = -1  # all-padding rows: left untouched
    ids[1::3, 0] = -1  # one skipped slot
    emap = torch.where(torch.arange(E) % 2 == 0, torch.arange(E) // 2, -1).to(torch.int32)  # odd experts remote
    sentinel = torch.full((T, H), 7.0, dtype=torch.bfloat16)
    for kwargs in (dict(), dict(topk_ids=ids), dict(topk_ids=ids, expert_map=emap),
                   dict(topk_ids=ids, expert_map=emap, num_valid_tokens=torch.tensor([T - 4], dtype=torch.int32))):
        dev = {n: v.to(backend.device) for n, v in kwargs.items()}
        out = op(inputs.to(backend.device), w.to(backend.device), sentinel.clone().to(backend.device), **dev).cpu()
        ref = moe_fused_mul_sum(inputs, w, sentinel.clone(), **kwargs)
        untouched = (ref == sentinel).all(dim=1)
        what = f"moe_fused_mul_sum({', '.join(kwargs) or 'no ids'})"
        if not torch.equal(out[untouched], ref[untouched]):
            raise ConformanceFailure(f"{what}: a row that must stay untouched was written\n  reproduce: {repro}")
        assert_ulps(out, ref, tolerances["activation"]["ulps"]["bfloat16"], case="moe_fused_mul_sum", what=what,
                    repro=repro)


def test_experts_get_the_expert_map_form_they_consume(backend, experts_cls, repro, record):
    """``consumes_expert_mask`` (0.33): the layer hands each experts class the map form it declares (the AITER
    0/1 mask, or the canonical -1/local-slot map, ``reference.modular.layer_expert_map``); run on an EP rank with
    that tensor, the class matches the reference within the error model's bound."""
    case = _case()
    inputs, qc, cfg, kw = _setup(backend, experts_cls, case)
    if inputs.expert_map is None:
        pytest.skip("the case has no expert map")
    if not isinstance(getattr(experts_cls, "consumes_expert_mask", None), bool):
        raise ConformanceFailure(f"{experts_cls.__name__}.consumes_expert_mask must be a bool (vLLM 0.33 "
                                 "FusedMoEExperts.consumes_expert_mask)")
    record(component="modular-0.33", scheme="expert-map-form", model=case.model.name, tokens=case.tokens,
           experts_class=experts_cls.__name__)
    m = case.model
    _, emap, mask = determine_expert_map(case.ep_size, case.ep_rank, m.num_experts, return_expert_mask=True)
    handed = layer_expert_map(experts_cls, emap.to(inputs.expert_map.device), mask.to(inputs.expert_map.device))
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts_cls(cfg, qc), poison=float("nan")).apply(
        inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids,
        **{**kw, "expert_map": handed})
    expected, heavy = fused_experts_with_heavy(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights,
                                           inputs.topk_ids, quant_config=qc, **kw)
    assert_close(out, expected, case_error_bound(case, qc, experts_cls, heavy=heavy).as_tolerance(),
                 case=case.id + "-emapform",
                 what=f"{experts_cls.__name__} with the expert map form it consumes", repro=repro)


def test_expert_substitution_routes_reach_the_experts(backend, experts_cls, repro, record):
    """MoNE constant expert substitution (vLLM 0.33 ``expert_substitution.py``; no EP): after
    ``transform_routes`` the experts see compact ids with every substituted / invalid route turned into a zero-weight
    route to expert 0 (a token may hold expert 0 twice); the class on the compact weights, plus the constant output,
    matches the reference on the same routes within the error model's bound."""
    from reference.expert_substitution import add_constant_output, expert_substitution_routes, transform_routes

    m = load_models()[MODEL]
    case = ExpertsCase(m, "bf16", 16, 1, 0)
    inputs, qc, cfg, kw = _setup(backend, experts_cls, case)
    record(component="modular-0.33", scheme="expert-substitution", model=m.name, tokens=case.tokens,
           experts_class=experts_cls.__name__)
    E = inputs.w1.size(0)
    subs = tuple(range(0, E, 3))  # every third expert becomes a constant
    routes = expert_substitution_routes(E, subs)
    keep = [e for e in range(E) if e not in subs]
    w1, w2 = inputs.w1[keep], inputs.w2[keep]
    g = torch.Generator().manual_seed(seed_of("expert-substitution"))
    values = torch.randn(len(subs), inputs.hidden_states.size(1), generator=g).to(inputs.hidden_states.dtype)
    ids, w = inputs.topk_ids.clone(), inputs.topk_weights.clone()
    const = transform_routes(inputs.hidden_states, w, ids, routes.to(ids.device), values.to(ids.device))
    kw = {**kw, "global_num_experts": len(keep), "expert_map": None}
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts_cls(cfg, qc), poison=float("nan")).apply(
        inputs.hidden_states, w1, w2, w, ids, **kw)
    expected, heavy = fused_experts_with_heavy(inputs.hidden_states, w1, w2, w, ids, quant_config=qc, **kw)
    assert_close(add_constant_output(out, const), add_constant_output(expected, const),
                 case_error_bound(case, qc, experts_cls, topk_ids=ids, heavy=heavy).as_tolerance(),
                 case=case.id + "-substitution",
                 what=f"{experts_cls.__name__} on substituted routes (+ constant)", repro=repro)
