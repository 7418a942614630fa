"""Hand-computed checks of the vLLM 0.33 routers added for issue 41 (items 3 and 4): Cohere2-MoE's
``token_choice_with_bias``, MuseSpark1x's router, ``CPURouter``'s dispatch, ``ZeroExpertRouter`` (also through the
factory order and ``route``) and ``CustomRoutingRouter``'s ``routing_method_type`` mapping. Parity with vLLM's own
code: ``tests/parity/test_parity_routing.py``."""

from __future__ import annotations

import math

import pytest
import torch

from reference import routing as r
from reference.semantics import SemanticsError

V017, V033 = "0.17", "0.33"


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_token_choice_with_bias_hand_values():
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    w, ids = r.token_choice_with_bias(None, logits, 2, True, semantics=V033)
    assert ids.tolist() == [[1, 3], [0, 1]] and ids.dtype == torch.int32  # ties: lower index first
    torch.testing.assert_close(w, torch.full((2, 2), 0.5))
    w, ids = r.token_choice_with_bias(None, logits, 2, False, semantics=V033)
    torch.testing.assert_close(w, torch.tensor([[_sig(3.0)] * 2, [0.5, 0.5]]))
    # no zero-sum guard: underflowed sigmoids give 0 / 0 = NaN, as upstream's plain division does
    w, _ = r.token_choice_with_bias(None, torch.full((1, 4), -200.0), 2, True, semantics=V033)
    assert torch.isnan(w).all()
    with pytest.raises(ValueError, match="not finite"):
        r.token_choice_with_bias(None, torch.tensor([[float("nan"), 0.0]]), 1, True, semantics=V033)
    w, ids = r.token_choice_with_bias(None, torch.tensor([[float("nan"), 0.0]]), 1, True, check_finite=False,
                                      semantics=V033)
    assert ids.tolist() == [[1]]
    with pytest.raises(SemanticsError):
        r.token_choice_with_bias(None, logits, 2, True, semantics=V017)


def test_musespark1x_routing_hand_values():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    w, ids = r.musespark1x_routing(logits, bias, 2, 2.0, None, "sigmoid", 1e-5, semantics=V033)
    assert ids.tolist() == [[2, 1]]  # the bias chooses ...
    s2, s1 = _sig(0.5), _sig(2.0)
    torch.testing.assert_close(w, torch.tensor([[s2, s1]]) * (2.0 / (s2 + s1 + 1e-5)))  # ... the scores weigh
    w, ids = r.musespark1x_routing(logits, torch.zeros(4), 2, 1.0, 0.5, "sigmoid", semantics=V033)
    a, b = _sig(1.0), _sig(0.5)  # the multiplier acts before the sigmoid
    torch.testing.assert_close(w, torch.tensor([[a / (a + b), b / (a + b)]]))
    w, ids = r.musespark1x_routing(logits, torch.zeros(4), 4, 1.5, None, "softmax", semantics=V033)
    torch.testing.assert_close(w.sum(), torch.tensor(1.5))
    with pytest.raises(SemanticsError):
        r.musespark1x_routing(logits, bias, 2, 1.0, semantics=V017)
    with pytest.raises(ValueError, match="bias"):
        r.musespark1x_routing(logits, bias[:3], 2, 1.0, semantics=V033)


def test_custom_routing_method_type_per_version():
    T = r.RoutingMethodType
    assert r.custom_routing_method_type(r.llama4_routing, False, semantics=V033) == T.Llama4
    assert r.custom_routing_method_type("Llama4MoE.custom_routing_function", semantics=V033) == T.Llama4
    assert r.custom_routing_method_type(r.token_choice_with_bias, True, semantics=V033) == T.SigmoidRenorm
    assert r.custom_routing_method_type("token_choice_with_bias", False, semantics=V033) == T.Sigmoid
    assert r.custom_routing_method_type(lambda *a: None, True, semantics=V033) == T.Custom
    T17 = r.RoutingMethodType017
    assert r.custom_routing_method_type(r.llama4_routing, semantics=V017) == T17.Llama4
    assert r.custom_routing_method_type(r.token_choice_with_bias, semantics=V017) == T17.Custom  # no Cohere2 in 0.17


@pytest.mark.parametrize("kw,path", [
    (dict(), "_softmax_topk"),
    (dict(has_e_score_correction_bias=True), "_softmax_topk"),  # the bias is ignored on this path
    (dict(custom_routing_function=True, scoring_func="sigmoid"), "custom_routing_function"),
    (dict(use_grouped_topk=True, num_expert_group=8, topk_group=4, custom_routing_function=True), "_grouped_topk"),
    (dict(scoring_func="sqrtsoftplus", has_e_score_correction_bias=True, custom_routing_function=True),
     "_sqrtsoftplus_bias_topk:bias"),
    (dict(scoring_func="sqrtsoftplus", has_e_score_correction_bias=True, has_hash_indices_table=True),
     "_sqrtsoftplus_bias_topk:hash"),
    (dict(scoring_func="sigmoid"), ValueError),
    (dict(use_grouped_topk=True), ValueError),
    (dict(use_grouped_topk=True, num_expert_group=8, topk_group=4, scoring_func="sqrtsoftplus"), ValueError),
    (dict(scoring_func="sqrtsoftplus"), ValueError),
    (dict(scoring_func="sqrtsoftplus", has_e_score_correction_bias=True, renormalize=False), ValueError),
    (dict(scoring_func="sqrtsoftplus", has_hash_indices_table=True, has_input_ids=False), ValueError),
])
def test_cpu_router_path(kw, path):
    if path is ValueError:
        with pytest.raises(ValueError):
            r.cpu_router_path(semantics=V033, **kw)
    else:
        assert r.cpu_router_path(semantics=V033, **kw) == path
    with pytest.raises(SemanticsError):
        r.cpu_router_path(semantics=V017)


def test_cpu_route_softmax_path_ignores_bias_and_scale():
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(0))
    w, ids = r.cpu_route(None, logits, 4, e_score_correction_bias=torch.full((16,), 9.0), routed_scaling_factor=3.0,
                         semantics=V033)
    w0, ids0 = r.fused_topk(None, logits, 4, True, semantics=V033)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)
    with pytest.raises(ValueError, match="not finite"):  # no clamp on the CPU torch paths
        r.cpu_route(None, torch.tensor([[float("nan"), 0.0, 1.0]]), 2, semantics=V033)
    w, ids = r.route(None, logits, 4, is_cpu=True, e_score_correction_bias=torch.zeros(16), semantics=V033)
    assert torch.equal(ids, ids0)


def test_zero_expert_router_hand_values():
    E, Z, K = 2, 2, 512
    h = torch.arange(2 * K, dtype=torch.float32).reshape(2, K) / K
    logits = torch.tensor([[0.0, 5.0, 6.0, -9.0], [4.0, 3.0, -9.0, -9.0]])
    bias = torch.zeros(E + Z)
    w, ids, out = r.zero_expert_router(h, logits, 2, bias, E, semantics=V033, routed_scaling_factor=2.0)
    p = logits.softmax(-1)
    assert ids.tolist() == [[0, 1], [0, 1]]  # token 0: zero expert 2 -> id 0, weight 0
    torch.testing.assert_close(w, torch.stack([torch.stack([torch.tensor(0.0), p[0, 1] * 2]), p[1, :2] * 2]))
    torch.testing.assert_close(out, torch.stack([h[0] * p[0, 2] * 2, torch.zeros(K)]))
    # the identity kernel writes whole 256-column blocks only (vLLM's test_zero_expert_moe.py: grid=0 below 256)
    _, _, out = r.zero_expert_router(h[:, :300], logits, 2, bias, E, semantics=V033)
    assert bool((out[0, :256] != 0).any()) and bool((out[:, 256:] == 0).all())
    _, _, out = r.zero_expert_router(h[:, :128], logits, 2, bias, E, semantics=V033)
    assert bool((out == 0).all())
    with pytest.raises(ValueError):
        r.zero_expert_router(h, logits, 2, bias, E, "drop", semantics=V033)
    with pytest.raises(SemanticsError):
        r.zero_expert_router(h, logits, 2, bias, E, semantics=V017)


def test_zero_expert_router_is_the_factory_first_branch_and_runs_through_route():
    kw = dict(top_k=2, has_e_score_correction_bias=True, zero_expert_type="identity", semantics=V033)
    assert r.router_kind(**kw) == "ZeroExpertRouter"
    assert r.router_kind(is_cpu=True, **kw) == "ZeroExpertRouter"
    assert r.router_kind(use_grouped_topk=True, custom_routing_function=True, **kw) == "ZeroExpertRouter"
    assert r.router_kind(routing_simulation_strategy="uniform_random", **kw) == "RoutingSimulatorRouter"
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        r.router_kind(top_k=2, zero_expert_type="identity", semantics=V033)
    with pytest.raises(SemanticsError):
        r.router_kind(top_k=2, has_e_score_correction_bias=True, zero_expert_type="identity", semantics=V017)
    g = torch.Generator().manual_seed(1)
    h, logits, bias = torch.randn(5, 256, generator=g), torch.randn(5, 12, generator=g), torch.randn(12, generator=g)
    got = []
    w, ids = r.route(h, logits, 3, renormalize=False, e_score_correction_bias=bias, zero_expert_type="identity",
                     num_logical_experts=8, routed_scaling_factor=6.0, zero_expert_output_fn=got.append,
                     semantics=V033)
    w0, ids0, out0 = r.zero_expert_router(h, logits, 3, bias, 8, routed_scaling_factor=6.0, semantics=V033)
    assert torch.equal(ids, ids0) and torch.equal(w, w0) and torch.equal(got[0], out0)
    with pytest.raises(ValueError, match="num_logical_experts"):
        r.route(h, logits, 3, e_score_correction_bias=bias, zero_expert_type="identity", semantics=V033)
