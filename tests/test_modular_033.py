"""The 0.33 modular-kernel contract of the reference, against oracles written here (float64 loops over tokens and
slots) and against the 0.17 kernel where the versions must agree."""

from __future__ import annotations

import pytest
import torch

from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, fp8_w8a8_moe_quant_config
from reference.experts import ReferenceExperts, fused_experts
from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP, TopKWeightAndReduceNoOP
from reference.moe_output import UnfinalizedMoEOutput, moe_fused_mul_sum, route_major_moe_output
from reference.semantics import SemanticsError, point
from reference.shared_experts import SharedExperts, SharedExpertsOrder, combine_shared_and_routed

CFG = FusedMoEConfig(8, 3, 64, 48, 8)


def make(M=23, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 64, generator=g).to(dtype)
    w1 = (torch.randn(8, 96, 64, generator=g) / 8).to(dtype)
    w2 = (torch.randn(8, 64, 48, generator=g) / 7).to(dtype)
    w = torch.rand(M, 3, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(M)] or [torch.zeros(0, 3, dtype=torch.int64)])
    ids = ids.reshape(M, 3).to(torch.int32)
    return x, w1, w2, w, ids


def _mul_sum_f64(inputs, weights, out, ids=None, emap=None, n_valid=None):
    """Slot by slot, token by token, in float64 (the oracle of moe_fused_mul_sum)."""
    res = out.double().clone()
    T, k, _ = inputs.shape
    for t in range(T):
        if n_valid is not None and t >= n_valid:
            continue
        if ids is not None and all(int(ids[t, s]) < 0 for s in range(k)):
            continue
        acc = torch.zeros(inputs.shape[2], dtype=torch.float64)
        for s in range(k):
            if ids is not None and (int(ids[t, s]) < 0 or (emap is not None and int(emap[int(ids[t, s])]) < 0)):
                continue
            acc += inputs[t, s].double() * float(weights[t, s])
        res[t] = acc
    return res


@pytest.mark.parametrize("variant", ["plain", "ids", "map", "valid"])
def test_moe_fused_mul_sum_against_a_float64_loop(variant):
    g = torch.Generator().manual_seed(1)
    T, k, H = 13, 4, 32
    x = torch.randn(T, k, H, generator=g)
    w = torch.rand(T, k, generator=g)
    ids = torch.randint(0, 8, (T, k), generator=g, dtype=torch.int32)
    ids[::4] = -1
    ids[2, 1] = -1
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)
    kw = {"plain": {}, "ids": dict(topk_ids=ids), "map": dict(topk_ids=ids, expert_map=emap),
          "valid": dict(topk_ids=ids, num_valid_tokens=torch.tensor([9]))}[variant]
    out = torch.full((T, H), 5.0)
    got = moe_fused_mul_sum(x, w, out.clone(), **kw)
    exp = _mul_sum_f64(x, w, out, kw.get("topk_ids"), kw.get("expert_map"),
                       None if "num_valid_tokens" not in kw else 9)
    torch.testing.assert_close(got.double(), exp)  # fp32 sums of 4 terms: default fp32 tolerances
    if variant != "plain":
        assert bool((got[0] == 5.0).all()), "an all-padding row must stay untouched"
    with pytest.raises(ValueError, match="topk_ids is required"):
        moe_fused_mul_sum(x, w, expert_map=emap)
    with pytest.raises(ValueError, match="num_tokens, top_k"):
        moe_fused_mul_sum(x[0], w)


def test_unfinalized_finalize_and_route_major_layout():
    g = torch.Generator().manual_seed(2)
    T, k, H = 6, 2, 16
    routes = torch.randn(T, k, H, generator=g)
    w = torch.rand(T, k, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [-1, 1], [3, 0], [-1, -1], [2, 2]], dtype=torch.int32)
    emap = torch.tensor([0, -1, 1, -1], dtype=torch.int32)
    u = route_major_moe_output(routes, w, ids, emap)
    u.validate()
    assert u.route_major and u.expanded_idx_to_permuted_idx.dtype == torch.int32
    exp_idx = [[0, -1], [2, -1], [-1, -1], [-1, 7], [-1, -1], [10, 11]]
    assert u.expanded_idx_to_permuted_idx.tolist() == exp_idx
    out = u.finalize()
    for t in range(T):  # float64 oracle
        ref = sum((routes[t, s].double() * float(w[t, s]) for s in range(k) if exp_idx[t][s] >= 0),
                  torch.zeros(H, dtype=torch.float64))
        torch.testing.assert_close(out[t].double(), ref)
    bad = UnfinalizedMoEOutput(routes.reshape(T * k, H), w, u.expanded_idx_to_permuted_idx.long())
    with pytest.raises(ValueError, match="int32"):
        bad.finalize()
    with pytest.raises(ValueError, match="identity"):
        UnfinalizedMoEOutput(routes.reshape(T * k, H), w, u.expanded_idx_to_permuted_idx.flip(0),
                             route_major=True).validate()


def test_033_kernel_equals_017_unchunked_and_refuses_017_options():
    x, w1, w2, w, ids = make()
    ref = fused_experts(x, w1, w2, w, ids)
    k33 = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG),
                         poison=float("nan"), semantics="0.33")
    assert torch.equal(k33.apply(x, w1, w2, w, ids), ref)
    assert k33.chunk_size is None and k33._chunk_info(23) == (1, 23)
    for kw in (dict(chunk_size=4), dict(inplace=True), dict(shared_experts=lambda h: h)):
        with pytest.raises(SemanticsError, match="0.17"):
            FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG),
                           semantics="0.33", **kw)
    k17 = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG),
                         semantics="0.17")
    with pytest.raises(SemanticsError):
        k17.apply(x, w1, w2, w, ids, shared_experts=SharedExperts(lambda h: h))
    assert {p.name for p in [point("modular.activation_chunking"), point("modular.deferred_finalize")]}


def test_033_a2_per_tensor_scale_spans_the_call_where_017_chunks_it(monkeypatch):
    """Dynamic per-tensor FP8 a2: 0.33 (one call) == fused_experts; 0.17 with chunks of 4 has a scale per chunk."""
    from reference.quant import scaled_fp8_quant

    x, w1, w2, w, ids = make(M=16, dtype=torch.bfloat16)
    w1q, s1 = zip(*(scaled_fp8_quant(w1[e].float()) for e in range(8)))
    w2q, s2 = zip(*(scaled_fp8_quant(w2[e].float()) for e in range(8)))
    qc = fp8_w8a8_moe_quant_config(w1_scale=torch.stack(s1).reshape(8), w2_scale=torch.stack(s2).reshape(8))
    w1q, w2q = torch.stack(w1q), torch.stack(w2q)
    ref = fused_experts(x, w1q, w2q, w, ids, quant_config=qc)
    cfg = FusedMoEConfig(8, 3, 64, 48, 8, in_dtype=torch.bfloat16)
    out33 = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(cfg, qc), semantics="0.33").apply(
        x, w1q, w2q, w, ids)
    out17 = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(cfg, qc), chunk_size=4,
                           semantics="0.17").apply(x, w1q, w2q, w, ids)
    assert torch.equal(out33, ref)
    assert not torch.equal(out17, ref)  # four a2 scales instead of one


class _Deferring(ReferenceExperts):
    """Returns the route-major unfinalized output instead of reducing (the 0.33 return form)."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs):
        rows = torch.empty(topk_ids.shape[0], topk_ids.shape[1], output.shape[-1], dtype=output.dtype)
        super().apply(rows, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs)
        return route_major_moe_output(rows, topk_weights, topk_ids, kwargs.get("expert_map"))


class _NoDefer(MoEPrepareAndFinalizeNoEP):
    def supports_deferred_moe_finalize(self) -> bool:
        return False


def test_deferred_finalize_passes_through_or_raises():
    x, w1, w2, w, ids = make()
    k = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), _Deferring(CFG, FUSED_MOE_UNQUANTIZED_CONFIG), semantics="0.33")
    u = k.apply(x, w1, w2, w, ids)
    assert isinstance(u, UnfinalizedMoEOutput) and k.supports_deferred_moe_finalize()
    torch.testing.assert_close(u.finalize(), fused_experts(x, w1, w2, w, ids))
    with pytest.raises(ValueError, match="cannot pass through"):
        FusedMoEKernel(_NoDefer(), _Deferring(CFG, FUSED_MOE_UNQUANTIZED_CONFIG), semantics="0.33").apply(
            x, w1, w2, w, ids)
    with pytest.raises(SemanticsError, match="deferred finalize"):
        FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), _Deferring(CFG, FUSED_MOE_UNQUANTIZED_CONFIG),
                       semantics="0.17").apply(x, w1, w2, w, ids)


class _Spy(ReferenceExperts):
    calls = 0

    def apply(self, *a, **k):
        type(self).calls += 1
        return super().apply(*a, **k)

    def output_hidden_dim(self, hidden_dim):
        return hidden_dim - 8


def test_empty_batch_returns_early_with_output_hidden_dim():
    x, w1, w2, w, ids = make(M=0)
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), _Spy(CFG, FUSED_MOE_UNQUANTIZED_CONFIG),
                         semantics="0.33").apply(x, w1, w2, w, ids)
    assert out.shape == (0, 56) and _Spy.calls == 0


class _Supplies(MoEPrepareAndFinalizeNoEP):
    def __init__(self, bad=False):
        self.bad, self.given = bad, None

    def allocate_fused_expert_output(self, shape, dtype, device, weight_and_reduce_impl):
        self.given = torch.empty((shape[0] + int(self.bad), *shape[1:]), dtype=dtype, device=device)
        return self.given


def test_allocate_fused_expert_output_is_the_experts_buffer():
    x, w1, w2, w, ids = make()
    pf = _Supplies()
    out = FusedMoEKernel(pf, ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG), semantics="0.33").apply(
        x, w1, w2, w, ids)
    assert torch.equal(out, fused_experts(x, w1, w2, w, ids))
    # the experts wrote (M, topk, K) unweighted rows into the supplied buffer
    assert pf.given.shape == (23, 3, 64) and bool(torch.isfinite(pf.given).all())
    with pytest.raises(ValueError, match="allocate_fused_expert_output"):
        FusedMoEKernel(_Supplies(bad=True), ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG),
                       semantics="0.33").apply(x, w1, w2, w, ids)
    assert isinstance(ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG).finalize_weight_and_reduce_impl(),
                      object) and TopKWeightAndReduceNoOP


def test_shared_experts_orders_and_combine():
    x = torch.randn(300, 8)
    se = SharedExperts(lambda h: h + 1, aux_stream=True, is_cuda_alike=True)
    assert se.determine_order(x[:256]) == SharedExpertsOrder.MULTI_STREAM_OVERLAPPED
    assert se.determine_order(x) == SharedExpertsOrder.NO_OVERLAP  # above the 256-token threshold
    assert SharedExperts(lambda h: h, mk_can_overlap_shared_experts=lambda: True).determine_order(x) == \
        SharedExpertsOrder.MK_INTERNAL_OVERLAPPED
    assert SharedExperts(lambda h: h, mk_can_overlap_shared_experts=lambda: True, enable_eplb=True,
                         all2all_backend="deepep_low_latency").determine_order(x) == SharedExpertsOrder.NO_OVERLAP
    se(x, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)  # not this call's order: does nothing
    with pytest.raises(ValueError, match="before they ran"):
        se.output
    se(x, SharedExpertsOrder.NO_OVERLAP)
    with pytest.raises(ValueError, match="twice"):
        se(x, SharedExpertsOrder.NO_OVERLAP)
    assert torch.equal(se.output, x + 1)
    s, r = torch.ones(2, 4, dtype=torch.float16), torch.full((2, 4), 3.0, dtype=torch.float16)
    assert torch.equal(combine_shared_and_routed(s, r, 2.0), s * 0.5 + r)  # fp16: the shared output is divided
    s32, r32 = s.float(), r.float()
    assert torch.equal(combine_shared_and_routed(s32, r32, 2.0), s32 + r32 * 2.0)
    assert torch.equal(combine_shared_and_routed(None, r, 2.0), r * 2.0)
