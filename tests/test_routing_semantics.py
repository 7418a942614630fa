"""Versioned routing semantics (reference.semantics, reference.routing) against independent oracles: hand-computed
tables, numpy re-computations and properties, under both versions for every point that differs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reference import routing as r33
from reference.routing import (
    RoutingMethodType,
    fused_topk,
    fused_topk_bias,
    grouped_topk,
    llama4_routing,
    topk_softmax,
)
from reference.semantics import (
    ENV_VAR,
    SemanticsError,
    SemanticsVersion,
    current_semantics,
    format_table,
    point,
    points,
    register_point,
    resolve_semantics,
    use_semantics,
)

ROOT = Path(__file__).resolve().parents[1]
V017, V033 = "0.17", "0.33"
BOTH = [V017, V033]


# ---------------------------------------------------------------------------------------------------- oracles


def np_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Descending, lower index first on ties (stable sort of -x)."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k]


def np_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_sqrtsoftplus(x):
    x = x.astype(np.float64)
    return np.sqrt(np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))))


def np_renorm(w, scale=1.0):
    s = w.sum(axis=-1, keepdims=True)
    return w / np.where(s > 0, s, 1.0) * scale


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- selection


def test_default_is_newest_and_env_var_context_and_keyword(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert current_semantics() is SemanticsVersion.V0_33 == SemanticsVersion.newest()
    monkeypatch.setenv(ENV_VAR, "0.17")
    assert current_semantics() is SemanticsVersion.V0_17
    with use_semantics("0.33.0") as v:
        assert v is SemanticsVersion.V0_33 and current_semantics() is v
        with use_semantics("v0.17"):
            assert current_semantics() is SemanticsVersion.V0_17
            assert resolve_semantics("0.33") is SemanticsVersion.V0_33  # explicit keyword wins
        assert current_semantics() is SemanticsVersion.V0_33
    assert current_semantics() is SemanticsVersion.V0_17
    monkeypatch.setenv(ENV_VAR, "0.99")
    with pytest.raises(ValueError, match="0.17, 0.33"):
        current_semantics()
    for bad in ("0.33.1", "1.0", ""):
        with pytest.raises(ValueError):
            SemanticsVersion.parse(bad)
    assert SemanticsVersion.V0_17 < SemanticsVersion.V0_33 and max(SemanticsVersion) is SemanticsVersion.V0_33


def test_env_var_reaches_the_routing_functions(monkeypatch):
    logits = torch.tensor([[float("nan"), 1.0, 2.0]])
    monkeypatch.setenv(ENV_VAR, "0.17")
    with pytest.raises(ValueError, match="not finite"):
        fused_topk(None, logits, 2, True)
    monkeypatch.setenv(ENV_VAR, "0.33")
    w, ids = fused_topk(None, logits, 2, True)
    assert ids.tolist() == [[0, 1]] and w.tolist() == [[0.0, 0.0]]


EXPECTED_POINTS = {
    "routing.nonfinite_logits", "routing.sqrtsoftplus", "routing.hash_routing", "routing.image_token_bias",
    "routing.padding_rows", "routing.fused_shared_expert_slots", "routing.gemma4_per_expert_scale",
    "routing.minimax2_epsilon", "routing.eplb_replica_choice", "routing.routing_method_type_values",
    "routing.router_factory", "routing.invalid_grouping_fallback", "routing.grouped_topk_nonfinite",
    "routing.custom_routing_method_type", "routing.cpu_router", "routing.zero_expert_router",
    "routing.model_routers_033",
}


def test_registry_names_every_routing_point_with_both_versions_and_upstream():
    names = {p.name for p in points("routing")}
    assert EXPECTED_POINTS <= names
    for p in points("routing"):
        for v in SemanticsVersion:
            assert p.behaviour[v] and p.upstream[v]
        assert "0.33.0" in p.upstream[SemanticsVersion.V0_33]
        assert p.reference.startswith("reference.")
    assert "2654435769" in point("routing.eplb_replica_choice").describe("0.33")
    with pytest.raises(KeyError, match="known"):
        point("routing.nope")
    with pytest.raises(ValueError, match="does not say"):
        register_point("test.incomplete", component="test", behaviour={"0.33": "x"}, upstream={"0.33": "y"},
                       reference="reference.x")
    with pytest.raises(ValueError, match="already registered"):
        p = point("routing.sqrtsoftplus")
        register_point(p.name, component=p.component, behaviour={v: "other" for v in SemanticsVersion},
                       upstream=p.upstream, reference=p.reference)


def test_table_prints_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "reference.semantics"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, ENV_VAR: "0.17"}, check=True).stdout
    assert "default 0.17" in out
    for name in EXPECTED_POINTS:
        assert name in out
    md = format_table(markdown=True, component="routing")
    assert md.splitlines()[0].startswith("| point | version |")
    assert len(md.splitlines()) == 2 + 2 * len(points("routing"))


# ---------------------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("fn", ["fused_topk", "fused_topk_bias"])
def test_nonfinite_raise_under_017_clamp_under_033(fn):
    logits = torch.tensor([[0.0, 1.0, float("nan"), 2.0]])
    call = {
        "fused_topk": lambda **kw: fused_topk(None, logits, 2, True, scoring_func="sigmoid", **kw),
        "fused_topk_bias": lambda **kw: fused_topk_bias(None, logits, torch.zeros(4), 2, True, **kw),
    }[fn]
    with pytest.raises(ValueError, match="token 0, expert 2"):
        call(semantics=V017)
    with pytest.raises(ValueError, match="token 0, expert 2"):
        call(semantics=V033, check_finite=True)  # explicit validation under either version
    w, ids = call(semantics=V033)
    # sigmoid scores [0.5, s(1), 0 (clamped NaN), s(2)]: top-2 = experts 3, 1
    s1, s2 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))
    assert ids.tolist() == [[3, 1]]
    torch.testing.assert_close(w, torch.tensor([[s2 / (s1 + s2), s1 / (s1 + s2)]]), rtol=1e-6, atol=0)
    assert torch.equal(call(semantics=V033, check_finite=False)[1], ids)


def test_clamp_hand_table_softmax_and_sigmoid():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [1.0, nan, 0.0, 2.0, 0.5],  # softmax: any NaN makes the whole row NaN -> all 0 -> ids 0, 1, 2
        [1.0, inf, 0.0, 2.0, 0.5],  # +inf: exp(inf - inf) = NaN -> row NaN -> all 0
        [1.0, -inf, 0.0, 2.0, 0.5],  # -inf alone: finite softmax, that expert 0
        [-inf] * 5,  # all -inf: NaN -> all 0
    ])
    w, ids = fused_topk(None, logits, 3, True, semantics=V033)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2], [3, 0, 4], [0, 1, 2]]
    assert torch.isfinite(w).all()
    assert w[[0, 1, 3]].abs().sum() == 0  # zero sum: divided by 1 (kernel rule), not NaN
    p = np_softmax(np.array([1.0, -np.inf, 0.0, 2.0, 0.5]))
    np.testing.assert_allclose(w[2].numpy(), np_renorm(p[[3, 0, 4]]), rtol=1e-6)
    # sigmoid: NaN -> 0, +inf -> 1 (finite), -inf -> 0
    w, ids = fused_topk(None, logits, 2, False, scoring_func="sigmoid", semantics=V033)
    assert ids.tolist()[:2] == [[3, 0], [1, 3]]
    assert w[1, 0] == 1.0 and torch.isfinite(w).all()
    assert ids[3].tolist() == [0, 1] and w[3].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("with_bias", [False, True])
def test_clamp_like_vllm_test_fused_topk_nan_inf_clamp(scoring_func, bad, with_bias):
    """vLLM 0.33.0 tests/kernels/moe/test_fused_topk.py: poisoned rows give unique ids and finite weights, the
    normal row matches the unpoisoned routing."""
    g = _gen(0)
    E, k = 16, 4
    logits = torch.randn(4, E, generator=g)
    logits[1:] = bad
    bias = torch.randn(E, generator=g) if with_bias else None
    if with_bias:
        w, ids = fused_topk_bias(None, logits, bias, k, False, scoring_func=scoring_func, semantics=V033)
        w0, ids0 = fused_topk_bias(None, logits[:1], bias, k, False, scoring_func=scoring_func, semantics=V017)
    else:
        w, ids = fused_topk(None, logits, k, False, scoring_func=scoring_func, semantics=V033)
        w0, ids0 = fused_topk(None, logits[:1], k, False, scoring_func=scoring_func, semantics=V017)
    assert torch.equal(ids[:1], ids0) and torch.equal(w[:1], w0)
    for row in range(1, 4):
        assert ids[row].unique().numel() == k and torch.isfinite(w[row]).all()
        assert bool(((ids[row] >= 0) & (ids[row] < E)).all())
    if not with_bias and not (scoring_func == "sigmoid" and bad > 0):
        assert ids[1].tolist() == list(range(k))  # all scores 0: lower index first


def test_no_clamp_points_keep_raising_under_033():
    logits = torch.randn(3, 8)
    logits[1, 2] = float("nan")
    for call in (lambda: grouped_topk(None, logits, 2, True, 4, 2), lambda: topk_softmax(None, logits, 2),
                 lambda: llama4_routing(None, logits, 1)):
        for v in BOTH:
            with use_semantics(v), pytest.raises(ValueError, match="token 1, expert 2"):
                call()


@pytest.mark.parametrize("num_experts", [512, 896, 1024])
@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_single_group_nonfinite_like_vllm(num_experts, num_finite, renormalize):
    """vLLM 0.33.0 tests/kernels/moe/test_grouped_topk.py::test_grouped_topk_single_group_nonfinite_scores, the
    expectations re-derived by hand: NaN logits everywhere but ``arange(num_finite)``, then one +inf and one -inf;
    sigmoid, bias 0, k = 16, rsf 2.5."""
    nan, inf = float("nan"), float("inf")
    logits = torch.full((1, num_experts), nan, dtype=torch.bfloat16)
    if num_finite:
        logits[0, :num_finite] = torch.arange(num_finite, dtype=torch.bfloat16)
    logits[0, num_finite], logits[0, num_finite + 1] = inf, -inf
    w, ids = grouped_topk(None, logits, 16, renormalize, 1, 1, scoring_func="sigmoid", routed_scaling_factor=2.5,
                          e_score_correction_bias=torch.zeros(num_experts), semantics=V033)
    if num_finite == 0:  # no valid expert: ids 0..k-1, 1/k or 0, no scaling
        assert ids.tolist() == [list(range(16))]
        assert w.tolist() == [[1 / 16 if renormalize else 0.0] * 16]
    else:  # valid ones by score, then the invalid ones by index (+inf at num_finite comes first)
        assert ids.tolist() == [list(range(num_finite - 1, -1, -1)) + [num_finite]]
        fv = np_sigmoid(np.arange(num_finite - 1, -1, -1, dtype=np.float64))
        if renormalize:
            fv = fv / fv.sum()
        np.testing.assert_allclose(w[0].numpy(), np.append(fv * 2.5, 0.0), rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="not finite"):  # 0.17: no single-group kernel, no rule
        grouped_topk(None, logits, 16, renormalize, 1, 1, scoring_func="sigmoid",
                     e_score_correction_bias=torch.zeros(num_experts), semantics=V017)


def test_grouped_topk_single_group_softmax_bias_and_mixed_rows():
    """Softmax is computed over the row first (fused_grouped_topk), so -inf logits are valid experts of score 0 and
    any NaN / +inf logit invalidates the whole row; a non-finite bias invalidates its expert in every row; finite
    rows route exactly as without the rule."""
    nan, inf = float("nan"), float("inf")
    g = _gen(21)
    E, k = 128, 4
    logits = torch.randn(5, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.05
    logits[1, 3] = -inf
    logits[2, 9] = nan
    logits[3, 0] = inf
    w, ids = grouped_topk(None, logits, k, True, 1, 1, scoring_func="softmax", routed_scaling_factor=2.0,
                          e_score_correction_bias=bias, semantics=V033)
    w0, ids0 = grouped_topk(None, logits[[0, 4]], k, True, 1, 1, scoring_func="softmax", routed_scaling_factor=2.0,
                            e_score_correction_bias=bias, semantics=V033)
    assert torch.equal(ids[[0, 4]], ids0) and torch.equal(w[[0, 4]], w0)
    x = logits[1].double().numpy()
    p = np_softmax(x)  # expert 3 has score 0 and stays valid
    ref = np_topk(p + bias.double().numpy(), k)
    assert ids[1].tolist() == ref.tolist()
    np.testing.assert_allclose(w[1].numpy(), p[ref] / p[ref].sum() * 2.0, rtol=2e-6)
    for row in (2, 3):  # softmax row NaN: no valid expert
        assert ids[row].tolist() == list(range(k)) and w[row].tolist() == [1 / k] * k
    bad_bias = bias.clone()
    top = int(ids[0, 0])
    bad_bias[top] = nan
    w, ids = grouped_topk(None, logits[:1], k, False, 1, 1, scoring_func="sigmoid", e_score_correction_bias=bad_bias,
                          semantics=V033)
    s = np_sigmoid(logits[0].double().numpy())
    key = np.where(np.arange(E) == top, -np.inf, s + bad_bias.double().numpy())
    ref = np_topk(key, k)
    assert ids[0].tolist() == ref.tolist() and top not in ids[0].tolist()
    np.testing.assert_allclose(w[0].numpy(), s[ref], rtol=1e-6)


def test_grouped_topk_nonfinite_without_the_single_group_kernel_raises():
    """No rule where the single-group kernels do not run: several groups, no bias, E / k outside the tiers, 0.17;
    check_finite=True raises even where the rule exists."""
    logits = torch.randn(2, 1152)
    logits[0, 1] = float("nan")
    bias = torch.zeros(1152)
    cases = [
        dict(logits=logits[:, :256], k=8, G=8, tg=4, bias=bias[:256], v=V033),  # DeepSeek-V3: multi-group
        dict(logits=logits[:, :384], k=8, G=1, tg=1, bias=None, v=V033),  # no bias: native torch path
        dict(logits=logits, k=8, G=1, tg=1, bias=bias, v=V033),  # E = 1152 > 1024: no tier
        dict(logits=logits[:, :768], k=17, G=1, tg=1, bias=bias[:768], v=V033),  # k = 17 > 16 at E = 768
        dict(logits=logits[:, :384], k=8, G=1, tg=1, bias=bias[:384], v=V017),
    ]
    for c in cases:
        with pytest.raises(ValueError, match="not finite"):
            grouped_topk(None, c["logits"], c["k"], True, c["G"], c["tg"], scoring_func="sigmoid",
                         e_score_correction_bias=c["bias"], semantics=c["v"])
    with pytest.raises(ValueError, match="not finite"):
        grouped_topk(None, logits[:, :384], 8, True, 1, 1, scoring_func="sigmoid", e_score_correction_bias=bias[:384],
                     check_finite=True, semantics=V033)
    assert r33.single_group_kernel_applies(512, 22, 1, 1, "sigmoid", True, semantics=V033)
    assert not r33.single_group_kernel_applies(768, 22, 1, 1, "sigmoid", True, semantics=V033)
    assert r33.single_group_kernel_applies(512, 32, 1, 1, "softmax", True, semantics=V033)
    assert not r33.single_group_kernel_applies(512, 32, 1, 1, "sigmoid", True, semantics=V033)


def test_017_check_finite_false_ranks_nan_lowest_weights_unspecified():
    logits = torch.tensor([[float("nan"), 0.0, 1.0]])
    _, ids = fused_topk(None, logits, 3, False, scoring_func="sigmoid", check_finite=False, semantics=V017)
    assert ids.tolist() == [[2, 1, 0]]
    w, ids = fused_topk(None, logits, 3, False, scoring_func="sigmoid", check_finite=False, semantics=V033)
    assert ids.tolist() == [[2, 1, 0]] and w[0, 2] == 0.0  # clamped NaN scores 0 ranks below sigmoid(0) = .5


# ---------------------------------------------------------------------------------------------------- sqrtsoftplus


def test_sqrtsoftplus_hand_table_and_numpy_oracle():
    x = torch.tensor([[0.0, 25.0, -3.0, 1.0]])
    w, ids = fused_topk_bias(None, x, None, 2, False, scoring_func="sqrtsoftplus", semantics=V033)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(w, torch.tensor([[5.0, math.sqrt(math.log1p(math.e))]]), rtol=1e-6, atol=0)
    w, _ = fused_topk_bias(None, torch.zeros(1, 4), None, 1, False, scoring_func="sqrtsoftplus", semantics=V033)
    assert abs(float(w) - math.sqrt(math.log(2.0))) < 1e-7

    g = _gen(1)
    logits = torch.randn(33, 64, generator=g) * 4
    bias = torch.randn(64, generator=g) * 0.5
    w, ids = fused_topk_bias(None, logits, bias, 6, True, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
                             semantics=V033)
    s = np_sqrtsoftplus(logits.numpy())
    ref_ids = np_topk(s + bias.numpy().astype(np.float64), 6)
    assert np.array_equal(ids.numpy(), ref_ids)
    np.testing.assert_allclose(w.numpy(), np_renorm(np.take_along_axis(s, ref_ids, 1), 1.5), rtol=2e-6)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32


def test_sqrtsoftplus_nonfinite_and_versions():
    x = torch.tensor([[float("nan"), 1.0, 2.0, 0.5]])
    w, ids = fused_topk_bias(None, x, None, 4, True, scoring_func="sqrtsoftplus", semantics=V033)
    assert ids[0, -1] == 0 and w[0, -1] == 0.0 and torch.isfinite(w).all()  # NaN score clamped to 0, ranked last
    # topk_softplus_sqrt_kernels.cu: +inf scores +inf (chosen first); renormalized its weight is inf / inf = NaN and
    # the others x / inf = 0; unnormalized it stays +inf * rsf. -inf scores sqrt(softplus(-inf)) = 0.
    x = torch.tensor([[1.0, float("inf"), -float("inf"), 2.0, float("inf")]])
    w, ids = fused_topk_bias(None, x, None, 4, True, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
                             semantics=V033)
    assert ids.tolist() == [[1, 4, 3, 0]]
    assert torch.isnan(w[0, :2]).all() and w[0, 2:].tolist() == [0.0, 0.0]
    w, ids = fused_topk_bias(None, x, torch.full((5,), 0.25), 5, False, scoring_func="sqrtsoftplus",
                             routed_scaling_factor=1.5, semantics=V033)
    assert ids.tolist() == [[1, 4, 3, 0, 2]] and w[0, :2].tolist() == [math.inf] * 2 and w[0, 4] == 0.0
    np.testing.assert_allclose(w[0, 2:4].numpy(), 1.5 * np_sqrtsoftplus(np.array([2.0, 1.0])), rtol=1e-6)
    with pytest.raises(ValueError, match="not finite"):
        fused_topk_bias(None, x, None, 2, True, scoring_func="sqrtsoftplus", check_finite=True, semantics=V033)
    with pytest.raises(SemanticsError, match="0.33"):
        fused_topk_bias(None, torch.randn(2, 4), torch.zeros(4), 2, True, scoring_func="sqrtsoftplus",
                        semantics=V017)
    with pytest.raises(SemanticsError):  # no bias is a 0.33 form too
        fused_topk_bias(None, torch.randn(2, 4), None, 2, True, semantics=V017)


# ---------------------------------------------------------------------------------------------------- hash, image


def _hash_case(seed=2, M=24, E=32, k=6, vocab=40):
    g = _gen(seed)
    logits = torch.randn(M, E, generator=g)
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)]).to(torch.int32)
    input_ids = torch.randint(0, vocab, (M,), generator=g)
    return logits, table, input_ids


def test_hash_routing_is_a_lookup():
    logits, table, input_ids = _hash_case()
    bias = torch.randn(32, generator=_gen(9)) * 10  # a bias must not change hashed rows
    w, ids = fused_topk_bias(None, logits, bias, 6, True, scoring_func="sqrtsoftplus", input_tokens=input_ids,
                             hash_indices_table=table, routed_scaling_factor=2.5, semantics=V033)
    assert torch.equal(ids, table[input_ids.long()])  # exactly the table's rows, in the table's order
    s = np_sqrtsoftplus(logits.numpy())
    ref_w = np_renorm(np.take_along_axis(s, table[input_ids.long()].numpy().astype(np.int64), 1), 2.5)
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=2e-6)
    # the same token id gets the same experts wherever it occurs
    for t in range(len(input_ids)):
        same = (input_ids == input_ids[t]).nonzero().flatten()
        assert all(torch.equal(ids[t], ids[u]) for u in same)


def test_hash_routing_errors():
    logits, table, input_ids = _hash_case()
    kw = dict(scoring_func="sqrtsoftplus", hash_indices_table=table, semantics=V033)
    with pytest.raises(ValueError, match="vocabulary"):
        fused_topk_bias(None, logits, None, 6, True, input_tokens=input_ids + 100, **kw)
    with pytest.raises(ValueError, match="experts per token"):
        fused_topk_bias(None, logits, None, 4, True, input_tokens=input_ids, **kw)
    with pytest.raises(ValueError, match="input_tokens"):
        fused_topk_bias(None, logits, None, 6, True, **kw)
    with pytest.raises(ValueError, match="sqrtsoftplus"):
        fused_topk_bias(None, logits, torch.zeros(32), 6, True, scoring_func="sigmoid", input_tokens=input_ids,
                        hash_indices_table=table, semantics=V033)
    with pytest.raises(SemanticsError):
        r33.hash_topk_ids(input_ids, table, 6, 32, semantics=V017)


def test_image_token_bias_sentinel_block():
    lo = 100
    ids_in = torch.tensor([99, 100, 102, 104, 105, 3])
    assert r33.image_token_mask(ids_in, lo).tolist() == [False, True, True, True, False, False]
    assert not r33.image_token_mask(ids_in, 0).any()  # 0 disables
    g = _gen(4)
    M, E, k = 6, 16, 3
    logits = torch.randn(M, E, generator=g)
    bias, bias_vl = torch.randn(E, generator=g), torch.randn(E, generator=g) * 5
    w, ids = fused_topk_bias(None, logits, bias, k, True, scoring_func="sqrtsoftplus", input_tokens=ids_in,
                             bias_vl=bias_vl, image_sentinel_lo=lo, semantics=V033)
    s = np_sqrtsoftplus(logits.numpy())
    img = np.array([False, True, True, True, False, False])
    row_bias = np.where(img[:, None], bias_vl.numpy(), bias.numpy())
    ref_ids = np_topk(s + row_bias, k)
    assert np.array_equal(ids.numpy(), ref_ids)
    np.testing.assert_allclose(w.numpy(), np_renorm(np.take_along_axis(s, ref_ids, 1)), rtol=2e-6)
    # with a hash table: text rows look up, image rows choose by score + bias_vl
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(110)]).to(torch.int64)
    w, ids = fused_topk_bias(None, logits, None, k, True, scoring_func="sqrtsoftplus", input_tokens=ids_in,
                             hash_indices_table=table, bias_vl=bias_vl, image_sentinel_lo=lo, semantics=V033)
    assert torch.equal(ids[~torch.from_numpy(img)], table[ids_in[~torch.from_numpy(img)]].int())
    assert np.array_equal(ids.numpy()[img], np_topk(s + bias_vl.numpy(), k)[img])
    with pytest.raises(SemanticsError):
        fused_topk_bias(None, logits, bias, k, True, scoring_func="sqrtsoftplus", input_tokens=ids_in,
                        bias_vl=bias_vl, image_sentinel_lo=lo, semantics=V017)


# ---------------------------------------------------------------------------------------------------- padding, shared


def test_padding_rows_get_minus_one_and_zero():
    g = _gen(5)
    logits = torch.randn(6, 16, generator=g)
    logits[1] = float("nan")  # a CUDA-graph padding row, flagged
    pad = torch.tensor([False, True, False, False, True, False])
    w, ids = fused_topk(None, logits, 4, True, is_padding=pad, semantics=V033)
    assert (ids[pad] == -1).all() and (w[pad] == 0).all()
    w0, ids0 = fused_topk(None, logits[~pad], 4, True, semantics=V033)
    assert torch.equal(ids[~pad], ids0) and torch.equal(w[~pad], w0)
    w, ids = fused_topk_bias(None, logits, torch.zeros(16), 6, True, scoring_func="sqrtsoftplus", is_padding=pad,
                             semantics=V033)
    assert (ids[pad] == -1).all() and (w[pad] == 0).all() and torch.isfinite(w).all()
    with pytest.raises(SemanticsError):
        fused_topk(None, logits, 4, True, is_padding=pad, check_finite=False, semantics=V017)
    with pytest.raises(ValueError, match="signed"):
        r33.apply_padding_rows(w, ids.to(torch.uint8), pad, semantics=V033)
    with pytest.raises(ValueError, match="bool"):
        r33.apply_padding_rows(w, ids, pad.int(), semantics=V033)


def test_grouped_router_masks_padding_only_with_skip_padding():
    logits = torch.randn(2, 64, generator=_gen(6))
    pad = torch.tensor([False, True])
    for skip in (False, True):
        w, ids = r33.grouped_topk_router(None, logits, 8, 8, 4, is_padding=pad, skip_padding=skip, semantics=V033)
        assert (ids[0] >= 0).all()
        assert bool((ids[1] == -1).all()) == skip and bool((w[1] == 0).all()) == skip


def test_fused_shared_expert_slots_follow_the_routed_ones():
    g = _gen(7)
    M, E, k, n = 5, 16, 4, 2
    logits, bias = torch.randn(M, E, generator=g), torch.randn(E, generator=g)
    pad = torch.tensor([False, False, True, False, False])
    w, ids = r33.route(torch.randn(M, 8), logits, k, scoring_func="sigmoid", e_score_correction_bias=bias,
                       routed_scaling_factor=2.5, num_fused_shared_experts=n, shared_expert_weight=0.75,
                       is_padding=pad, semantics=V033)
    assert ids.shape == (M, k + n) and w.shape == (M, k + n)
    assert ids[:, k:].tolist() == [[E, E + 1]] * M and (w[:, k:] == 0.75).all()
    routed_w, routed_ids = fused_topk_bias(None, logits, bias, k, True, routed_scaling_factor=2.5, is_padding=pad,
                                           semantics=V033)
    assert torch.equal(ids[:, :k], routed_ids) and torch.equal(w[:, :k], routed_w)
    torch.testing.assert_close(w[~pad, :k].sum(-1), torch.full((M - 1,), 2.5))  # shared slots not renormalized
    assert (ids[2, :k] == -1).all() and ids[2, k:].tolist() == [E, E + 1]  # padding row keeps its shared slots
    with pytest.raises(SemanticsError):
        r33.append_fused_shared_experts(w, ids, E, n, semantics=V017)
    same = r33.append_fused_shared_experts(w, ids, E, 0, semantics=V033)
    assert same[0] is w and same[1] is ids


# ---------------------------------------------------------------------------------------------------- gemma4, minimax2


def test_gemma4_hand_table_and_oracle():
    x = torch.tensor([[0.0, math.log(3.0), math.log(2.0), math.log(3.0)]])  # softmax ~ [1, 3, 2, 3]
    scale = torch.tensor([1.0, 2.0, 0.5, 4.0])
    w, ids = r33.gemma4_routing(x, 2, scale, semantics=V033)
    assert ids.tolist() == [[1, 3]]  # tie 3 = 3: lower index first
    torch.testing.assert_close(w, torch.tensor([[0.5 * 2.0, 0.5 * 4.0]]), rtol=1e-6, atol=0)
    g = _gen(8)
    logits, scale = torch.randn(40, 128, generator=g), torch.rand(128, generator=g)
    w, ids = r33.gemma4_routing(logits.to(torch.bfloat16), 8, scale, semantics=V033)
    xl = logits.to(torch.bfloat16).float().numpy()
    ref_ids = np_topk(xl, 8)
    assert np.array_equal(ids.numpy(), ref_ids)
    p = np.take_along_axis(np_softmax(xl.astype(np.float64)), ref_ids, 1)
    np.testing.assert_allclose(w.numpy(), np_renorm(p) * scale.numpy()[ref_ids], rtol=2e-6)
    with pytest.raises(SemanticsError):
        r33.gemma4_routing(logits, 8, scale, semantics=V017)
    with pytest.raises(ValueError, match="per_expert_scale"):
        r33.gemma4_routing(logits, 8, scale[:5], semantics=V033)


def test_minimax2_epsilon():
    g = _gen(10)
    logits, bias = torch.randn(16, 32, generator=g), torch.randn(32, generator=g) * 0.1
    w, ids = r33.minimax2_routing(logits, bias, 4, 2.0, semantics=V033)
    w2, ids2 = fused_topk_bias(None, logits, bias, 4, True, routed_scaling_factor=2.0, semantics=V033)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2, rtol=2e-7, atol=0)  # the epsilon vanishes next to a normal sum
    # all selected sigmoids ~ e^-60 ~ 8.8e-27: the epsilon dominates, weights are not normalized to 2.0
    tiny = torch.full((1, 4), -60.0)
    w, ids = r33.minimax2_routing(tiny, torch.zeros(4), 2, 2.0, semantics=V033)
    s = 1 / (1 + math.exp(60.0))
    expect = s * 2.0 / (2 * s + 1e-20)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[expect, expect]]), rtol=1e-5, atol=0)
    assert float(w.sum()) < 1e-5
    w_plain, _ = fused_topk_bias(None, tiny, torch.zeros(4), 2, True, routed_scaling_factor=2.0, semantics=V033)
    torch.testing.assert_close(w_plain, torch.tensor([[1.0, 1.0]]))
    with pytest.raises(SemanticsError):
        r33.minimax2_routing(tiny, torch.zeros(4), 2, semantics=V017)


# ---------------------------------------------------------------------------------------------------- EPLB


def _eplb_maps():
    # 3 logical experts; expert 0 has replicas [4, 0], expert 1 [1], expert 2 [2, 3, 5]; 6 physical
    l2p = torch.tensor([[4, 0, -1], [1, -1, -1], [2, 3, 5]])
    count = torch.tensor([2, 1, 3])
    return l2p, count


def test_eplb_017_position_modulo_hand_table():
    l2p, count = _eplb_maps()
    ids = torch.tensor([[0, 2], [2, 0], [1, 2]], dtype=torch.int32)  # flat positions 0..5
    load = torch.zeros(6, dtype=torch.int64)
    phys = r33.eplb_logical_to_physical(ids, l2p, count, expert_load_view=load, semantics=V017)
    # pos % count: (0%2, 1%3) (2%3, 3%2) (4%1, 5%3) -> replicas (0, 1) (2, 1) (0, 2)
    assert phys.tolist() == [[4, 3], [5, 0], [1, 5]] and phys.dtype == torch.int32
    assert load.tolist() == np.bincount(np.array([4, 3, 5, 0, 1, 5]), minlength=6).tolist()
    with pytest.raises(ValueError):
        r33.eplb_logical_to_physical(torch.tensor([[-1, 0]]), l2p, count, semantics=V017)


def test_eplb_033_knuth_hash_hand_table():
    l2p, count = _eplb_maps()
    ids = torch.tensor([[0, 2], [2, 0], [1, 2], [-1, 0]], dtype=torch.int64)
    load = torch.zeros(6, dtype=torch.int64)
    phys = r33.eplb_logical_to_physical(ids, l2p, count, expert_load_view=load, num_unpadded_tokens=3,
                                        semantics=V033)
    ref = []
    for t, row in enumerate(ids.tolist()):
        h = (t * 2654435769) & 0xFFFFFFFF  # python ints: exact
        ref.append([-1 if e < 0 else int(l2p[e, h % int(count[e])]) for e in row])
    assert phys.tolist() == ref
    # token 0 hashes to 0, token 1 to 2654435769 (odd, 2654435769 % 3 == 0), token 2 to 1013904242 (even, % 3 == 2)
    assert ref[:3] == [[4, 2], [2, 0], [1, 5]]
    counted = [p for t, row in enumerate(ref) for p in row if t < 3 and p >= 0]  # token 3 is padding
    assert load.tolist() == np.bincount(np.array(counted), minlength=6).tolist()
    load2 = torch.zeros(6, dtype=torch.int64)
    r33.eplb_logical_to_physical(ids, l2p, count, expert_load_view=load2, record_enabled=False, semantics=V033)
    assert load2.sum() == 0
    with pytest.raises(SemanticsError):
        r33.eplb_logical_to_physical(ids[:3], l2p, count, num_unpadded_tokens=3, semantics=V017)


def test_eplb_every_physical_id_is_a_replica_of_its_logical_expert():
    g = _gen(11)
    L, R = 8, 3
    count = torch.randint(1, R + 1, (L,), generator=g)
    perm = torch.randperm(L * R, generator=g)
    l2p = torch.full((L, R), -1)
    for e in range(L):
        l2p[e, : count[e]] = perm[e * R: e * R + count[e]]
    ids = torch.randint(0, L, (64, 4), generator=g)
    for v in BOTH:
        phys = r33.eplb_logical_to_physical(ids, l2p, count, semantics=v)
        for e, p in zip(ids.flatten().tolist(), phys.flatten().tolist()):
            assert p in l2p[e, : count[e]].tolist()


# ---------------------------------------------------------------------------------------------------- enum, factory


def test_routing_method_type_values_per_version():
    assert {m.name: int(m) for m in RoutingMethodType} == {
        "Default": 0, "Renormalize": 1, "DeepSeekV3": 2, "Llama4": 3, "RenormalizeNaive": 4, "TopK": 5,
        "SigmoidRenorm": 6, "MiniMax2": 7, "Sigmoid": 8, "Unspecified": 9, "DeepseekV4": 100, "Custom": 101,
        "Simulated": 102}  # vLLM 0.33.0 fused_moe/config.py
    assert {m.name: int(m) for m in r33.RoutingMethodType017} == {
        "Default": 0, "Renormalize": 1, "DeepSeekV3": 2, "Llama4": 3, "RenormalizeNaive": 4, "TopK": 5,
        "Custom": 6, "Simulated": 7, "Unspecified": 8}  # vLLM 0.17.0 fused_moe/config.py
    assert r33.routing_method_type_value("Custom", semantics=V017) == 6
    assert r33.routing_method_type_value(RoutingMethodType.Custom, semantics=V033) == 101
    assert r33.routing_method_type_value("Unspecified", semantics=V033) == 9
    with pytest.raises(SemanticsError, match="MiniMax2"):
        r33.routing_method_type_value("MiniMax2", semantics=V017)
    from reference.config import RoutingMethodType as ConfigRMT

    assert ConfigRMT is RoutingMethodType


@pytest.mark.parametrize("args,v017,v033", [
    (("softmax", 8, True, None, False), "Renormalize", "RenormalizeNaive"),
    (("softmax", 8, False, None, False), "Default", "Default"),
    (("sigmoid", 1, False, None, False), "Llama4", "Sigmoid"),
    (("sigmoid", 8, True, None, False), "Unspecified", "SigmoidRenorm"),
    (("sigmoid", 8, True, 8, True), "DeepSeekV3", "DeepSeekV3"),
    (("sigmoid", 8, True, None, True), "Unspecified", "MiniMax2"),
    (("sigmoid", 8, False, 8, True), "DeepSeekV3", "Unspecified"),
    (("softmax", 8, True, None, True), "Unspecified", "Unspecified"),
    (("sqrtsoftplus", 6, True, None, True), "Unspecified", "DeepseekV4"),
])
def test_get_routing_method_type_per_version(args, v017, v033):
    assert r33.get_routing_method_type(*args, semantics=V017).name == v017
    assert r33.get_routing_method_type(*args, semantics=V033).name == v033


@pytest.mark.parametrize("kw,v017,v033", [
    # degenerate grouping, softmax, no scaling: 0.17 keeps the grouped router (Renormalize != Unspecified),
    # 0.33 falls through (routing method RenormalizeNaive either way)
    (dict(use_grouped_topk=True, num_expert_group=1, topk_group=1), "GroupedTopKRouter", "FusedTopKRouter"),
    # ... a scaling factor the plain router cannot apply keeps 0.33 grouped
    (dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, routed_scaling_factor=2.5),
     "GroupedTopKRouter", "GroupedTopKRouter"),
    # sigmoid without bias, degenerate: 0.17 Unspecified -> falls through; 0.33 Sigmoid == Sigmoid -> falls through
    (dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, scoring_func="sigmoid", renormalize=False),
     "FusedTopKRouter", "FusedTopKRouter"),
    # sigmoid + bias, G = 1: 0.33 DeepSeekV3 (groups) != MiniMax2 (none) -> stays grouped
    (dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, scoring_func="sigmoid",
          has_e_score_correction_bias=True), "GroupedTopKRouter", "GroupedTopKRouter"),
    (dict(use_grouped_topk=True, num_expert_group=8, topk_group=4), "GroupedTopKRouter", "GroupedTopKRouter"),
    (dict(custom_routing_function=True), "CustomRoutingRouter", "CustomRoutingRouter"),
    (dict(has_e_score_correction_bias=True, scoring_func="sigmoid"), "FusedTopKBiasRouter", "FusedTopKBiasRouter"),
    (dict(), "FusedTopKRouter", "FusedTopKRouter"),
    (dict(routing_simulation_strategy="uniform"), "RoutingSimulatorRouter", "RoutingSimulatorRouter"),
    (dict(has_hash_indices_table=True, scoring_func="sqrtsoftplus"), SemanticsError, "FusedTopKBiasRouter"),
    (dict(is_cpu=True, use_grouped_topk=True, num_expert_group=8, topk_group=4), SemanticsError, "CPURouter"),
    (dict(zero_expert_type="identity", has_e_score_correction_bias=True), SemanticsError, "ZeroExpertRouter"),
    (dict(num_fused_shared_experts=1, aiter_shared_experts_enabled=True), SemanticsError,
     "AiterSharedRoutedFusedMoERouter"),
])
def test_router_kind_per_version(kw, v017, v033):
    for v, expect in ((V017, v017), (V033, v033)):
        if expect is SemanticsError:
            with pytest.raises(SemanticsError):
                r33.router_kind(top_k=8, semantics=v, **kw)
        else:
            assert r33.router_kind(top_k=8, semantics=v, **kw) == expect, v


def test_router_kind_errors():
    for v in BOTH:
        with pytest.raises(ValueError, match="num_expert_group"):
            r33.router_kind(top_k=2, use_grouped_topk=True, semantics=v)
        with pytest.raises(ValueError, match="custom"):
            r33.router_kind(top_k=2, use_grouped_topk=True, num_expert_group=2, topk_group=1,
                            custom_routing_function=True, semantics=v)


def test_invalid_grouping_fallback_per_version():
    g = _gen(12)
    logits, bias = torch.randn(7, 6, generator=g), torch.randn(6, generator=g)  # E = 6, G = 4: invalid
    x = logits.numpy().astype(np.float64)
    for v in BOTH:  # no bias: softmax, no routed_scaling_factor, in both releases
        w, ids = r33.grouped_topk_router(None, logits, 2, 4, 2, scoring_func="sigmoid", routed_scaling_factor=2.5,
                                         semantics=v)
        p = np_softmax(x)
        ref_ids = np_topk(p, 2)
        assert np.array_equal(ids.numpy(), ref_ids)
        np.testing.assert_allclose(w.numpy(), np_renorm(np.take_along_axis(p, ref_ids, 1)), rtol=1e-6)
    for v, score in ((V017, np_softmax(x)), (V033, np_sigmoid(x))):  # bias: 0.17 softmax, 0.33 the layer's sigmoid
        w, ids = r33.grouped_topk_router(None, logits, 2, 4, 2, scoring_func="sigmoid", routed_scaling_factor=2.5,
                                         e_score_correction_bias=bias, semantics=v)
        ref_ids = np_topk(score + bias.numpy(), 2)
        assert np.array_equal(ids.numpy(), ref_ids), v
        np.testing.assert_allclose(w.numpy(), np_renorm(np.take_along_axis(score, ref_ids, 1), 2.5), rtol=1e-6)


def test_select_experts_follows_the_invalid_grouping_fallback():
    """select_experts (seed 003's wrapper) runs GroupedTopKRouter's fallback of the selected release."""
    g = _gen(14)
    hidden, logits, bias = torch.randn(5, 8, generator=g), torch.randn(5, 60, generator=g), torch.randn(60, generator=g)
    for v in BOTH:  # E = 60, G = 8: invalid grouping
        with use_semantics(v):
            w, ids, _ = r33.select_experts(hidden, logits, 4, True, True, topk_group=4, num_expert_group=8,
                                           scoring_func="sigmoid", routed_scaling_factor=2.5,
                                           e_score_correction_bias=bias)
        w2, ids2 = r33.grouped_topk_router(None, logits, 4, 8, 4, scoring_func="sigmoid", routed_scaling_factor=2.5,
                                           e_score_correction_bias=bias, semantics=v)
        assert torch.equal(ids, ids2) and torch.equal(w, w2)
        with use_semantics(v):
            w, ids, _ = r33.select_experts(hidden, logits, 4, True, True, topk_group=4, num_expert_group=8,
                                           scoring_func="sigmoid", routed_scaling_factor=2.5)
        w2, ids2 = fused_topk(None, logits, 4, True, scoring_func="softmax", semantics=v)  # no scale, softmax
        assert torch.equal(ids, ids2) and torch.equal(w, w2)


def test_route_end_to_end_matches_the_pieces():
    g = _gen(13)
    hidden, logits = torch.randn(9, 8, generator=g), torch.randn(9, 64, generator=g)
    bias = torch.randn(64, generator=g) * 0.1
    for v in BOTH:
        w, ids = r33.route(hidden, logits, 8, use_grouped_topk=True, num_expert_group=8, topk_group=4,
                           scoring_func="sigmoid", routed_scaling_factor=2.5, e_score_correction_bias=bias,
                           semantics=v)
        w2, ids2 = grouped_topk(None, logits, 8, True, 8, 4, scoring_func="sigmoid", routed_scaling_factor=2.5,
                                e_score_correction_bias=bias)
        assert torch.equal(ids, ids2) and torch.equal(w, w2)
    l2p = torch.arange(128).reshape(64, 2)
    count = torch.full((64,), 2)
    for v in BOTH:
        w, ids = r33.route(hidden, logits, 4, eplb=(l2p, count), semantics=v)
        w0, ids0 = fused_topk(None, logits, 4, True, semantics=v)
        assert torch.equal(w, w0) and torch.equal(ids // 2, ids0)  # each physical id is a replica of the logical
    with pytest.raises(SemanticsError):
        r33.route(hidden, logits, 4, is_padding=torch.zeros(9, dtype=torch.bool), semantics=V017)
