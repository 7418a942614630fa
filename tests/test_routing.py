"""The reference router against hand-computed cases and properties."""

import math

import pytest
import torch

from reference.routing import (
    determine_expert_map,
    fused_topk,
    fused_topk_bias,
    grouped_topk,
    llama4_routing,
    select_experts,
    topk_softmax,
)
from reference.semantics import use_semantics


def test_fused_topk_softmax_hand_computed():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), math.log(4.0)]])  # softmax = [1,2,3,4]/10
    w, ids = fused_topk(None, logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2]]
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.3]]), rtol=0, atol=1e-7)
    w, _ = fused_topk(None, logits, 2, renormalize=True)
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 3 / 7]]), rtol=0, atol=1e-7)


def test_fused_topk_sigmoid_hand_computed():
    logits = torch.tensor([[0.0, 2.0, -1.0]])
    w, ids = fused_topk(None, logits, 2, renormalize=False, scoring_func="sigmoid")
    assert ids.tolist() == [[1, 0]]
    s = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    torch.testing.assert_close(w, torch.tensor([[s(2.0), 0.5]]), rtol=0, atol=1e-7)


def test_ties_lower_index_wins():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    _, ids = fused_topk(None, logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2]]
    _, ids = grouped_topk(None, torch.zeros(1, 8), 3, True, 4, 2)
    assert ids.tolist() == [[0, 1, 2]]  # every group ties: groups 0 and 1 are kept, lowest experts first


def test_grouped_topk_with_bias_hand_computed():
    # E=8 in 4 groups of 2, keep 2 groups, top-3. Scores are sigmoid(logits); choose by biased score.
    logits = torch.tensor([[2.0, -2.0, 0.5, 0.4, -1.0, 3.0, 0.0, 0.1]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    s = torch.sigmoid(logits)
    b = s + bias
    group_scores = [float(b[0, 2 * g] + b[0, 2 * g + 1]) for g in range(4)]  # sum of the top-2 = both members
    kept = sorted(range(4), key=lambda g: -group_scores[g])[:2]
    assert sorted(kept) == [2, 3]  # groups {4,5} and {6,7}
    w, ids = grouped_topk(None, logits, 3, renormalize=True, num_expert_group=4, topk_group=2,
                          scoring_func="sigmoid", routed_scaling_factor=2.5, e_score_correction_bias=bias)
    # biased scores in the kept groups: 4: .269, 5: .953, 6: 1.0, 7: 1.025 -> descending 7, 6, 5
    assert ids.tolist() == [[7, 6, 5]]
    sel = s[0, [7, 6, 5]]  # weights come from the UNBIASED scores
    torch.testing.assert_close(w[0], sel / sel.sum() * 2.5, rtol=1e-6, atol=0)


def test_grouped_topk_without_bias_uses_group_max():
    logits = torch.tensor([[0.0, 5.0, 1.0, 1.0, 4.0, 4.0, 0.0, 0.0]])
    _, ids = grouped_topk(None, logits, 2, True, 4, 1)  # group 0 has the max (5.0)
    assert sorted(ids[0].tolist()) == [0, 1]


def test_grouped_topk_invalid_grouping_raises_and_select_experts_falls_back():
    logits = torch.randn(3, 6)
    with pytest.raises(ValueError, match="num_expert_group"):
        grouped_topk(None, logits, 2, True, 4, 2)
    w, ids, _ = select_experts(torch.randn(3, 4), logits, 2, True, True, topk_group=2, num_expert_group=4)
    w2, ids2 = fused_topk(None, logits, 2, True)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)


def test_single_group_equals_fused_topk_bias():
    logits, bias = torch.randn(16, 32), torch.randn(32) * 0.1
    a = grouped_topk(None, logits, 4, True, 1, 1, scoring_func="sigmoid", e_score_correction_bias=bias,
                     routed_scaling_factor=2.5)
    b = fused_topk_bias(None, logits, bias, 4, True, routed_scaling_factor=2.5)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_topk_softmax_equals_softmax_topk_renormalize():
    logits = torch.randn(64, 32)
    w, ids = topk_softmax(None, logits, 4)
    w2, ids2 = fused_topk(None, logits, 4, True)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2, rtol=1e-6, atol=1e-7)


def test_llama4_routing():
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    w, ids = llama4_routing(None, logits, 1)
    assert ids.tolist() == [[2]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[2.0]])))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@use_semantics("0.17")  # the seed-era rule; 0.33 clamps instead (tests/test_routing_semantics.py)
def test_nonfinite_logits_raise_by_default_and_never_give_out_of_range_ids(bad):
    logits = torch.randn(5, 16)
    logits[2, 3] = bad
    with pytest.raises(ValueError, match="token 2, expert 3"):
        fused_topk(None, logits, 4, True)
    logits[4] = float("nan")  # an all-NaN row (CUDA-graph padding)
    for fn in (lambda: fused_topk(None, logits, 4, True, check_finite=False),
               lambda: grouped_topk(None, logits, 4, True, 4, 2, check_finite=False),
               lambda: topk_softmax(None, logits, 4, check_finite=False)):
        _, ids = fn()
        assert int(ids.min()) >= 0 and int(ids.max()) < 16


def test_topk_larger_than_experts_raises():
    with pytest.raises(ValueError, match="topk=9"):
        fused_topk(None, torch.randn(2, 8), 9, True)


def test_determine_expert_map_linear_gives_remainder_to_first_ranks():
    maps = [determine_expert_map(3, r, 8)[1].tolist() for r in range(3)]
    assert maps[0] == [0, 1, 2, -1, -1, -1, -1, -1]
    assert maps[1] == [-1, -1, -1, 0, 1, 2, -1, -1]
    assert maps[2] == [-1, -1, -1, -1, -1, -1, 0, 1]
    assert [determine_expert_map(3, r, 8)[0] for r in range(3)] == [3, 3, 2]


def test_determine_expert_map_round_robin():
    assert determine_expert_map(3, 1, 8, "round_robin")[1].tolist() == [-1, 0, -1, -1, 1, -1, -1, 2]
    assert determine_expert_map(1, 0, 8) == (8, None, None)
    with pytest.raises(ValueError, match="strategy"):
        determine_expert_map(2, 0, 8, "random")


def test_determine_expert_map_return_expert_mask():
    """vLLM's ``return_expert_mask`` (AITER): the mask holds 1 for held and shared experts, 0 for the others and the
    sentinel; the map grows by the shared experts' local ids. Without it the mask is None."""
    local, emap, mask = determine_expert_map(2, 1, 6, num_fused_shared_experts=2, return_expert_mask=True)
    assert local == 3
    assert emap.tolist() == [-1, -1, -1, 0, 1, 2, 3, 4]
    assert mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0] and mask.dtype == torch.int32
    local, emap, mask = determine_expert_map(2, 1, 6, num_fused_shared_experts=2)
    assert mask is None and emap.tolist() == [-1, -1, -1, 0, 1, 2]


def test_every_expert_on_exactly_one_rank():
    for strategy in ("linear", "round_robin"):
        held = torch.zeros(37, dtype=torch.int32)
        for r in range(5):
            held += (determine_expert_map(5, r, 37, strategy)[1] >= 0).int()
        assert held.tolist() == [1] * 37


def test_zero_experts_identity():
    hidden = torch.randn(4, 8)
    logits = torch.full((4, 6), -10.0)
    logits[:, 5] = 10.0  # zero expert (id 5 >= 4 real experts) always chosen
    logits[:, 1] = 5.0
    w, ids, zero = select_experts(hidden, logits, 2, False, False, scoring_func="sigmoid",
                                  global_num_experts=4, zero_expert_num=2, zero_expert_type="identity")
    assert ids[:, 0].tolist() == [0] * 4 and w[:, 0].tolist() == [0.0] * 4  # zero slot neutralized
    torch.testing.assert_close(zero, hidden * torch.sigmoid(torch.tensor(10.0)))


def test_select_experts_plain_topk_ignores_routed_scaling_factor():
    """vLLM's router factory builds FusedTopKRouter without routed_scaling_factor (router/router_factory.py,
    router/fused_topk_router.py): plain top-k weights are not scaled; ``scale_plain_topk=True`` scales them. The grouped
    and biased routers scale either way."""
    g = torch.Generator().manual_seed(3)
    hidden, logits = torch.randn(5, 8, generator=g), torch.randn(5, 16, generator=g)
    plain_w, plain_ids = fused_topk(hidden, logits, 4, True)
    w, ids, _ = select_experts(hidden, logits, 4, False, True, routed_scaling_factor=2.5)
    assert torch.equal(ids, plain_ids) and torch.equal(w, plain_w)
    w, ids, _ = select_experts(hidden, logits, 4, False, True, routed_scaling_factor=2.5, scale_plain_topk=True)
    assert torch.equal(ids, plain_ids) and torch.equal(w, plain_w * 2.5)
    bias = torch.zeros(16)
    for kw in (dict(e_score_correction_bias=bias), dict(use_grouped_topk=True, num_expert_group=4, topk_group=2)):
        args = dict(use_grouped_topk=False, renormalize=True, scoring_func="sigmoid") | kw
        one, _, _ = select_experts(hidden, logits, 4, routed_scaling_factor=1.0, **args)
        scaled, _, _ = select_experts(hidden, logits, 4, routed_scaling_factor=2.5, **args)
        torch.testing.assert_close(scaled, one * 2.5)


def test_models_with_routed_scaling_factor_route_through_a_scaling_router():
    """Every model of specs/models.toml with routed_scaling_factor != 1 uses grouped top-k or a correction bias, so
    vLLM applies the factor and so do the conformance inputs (the plain top-k default above does not touch them)."""
    from specs import load_models

    for m in load_models().values():
        if m.routed_scaling_factor != 1.0:
            assert m.use_grouped_topk or m.e_score_correction_bias, m.name
