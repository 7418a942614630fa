"""The torch backend's routing under both vLLM semantics versions (backends/torch/routing.py).

Its own code, selected like the reference (``semantics=`` > ``use_semantics`` > ``$MOE_VLLM_SEMANTICS`` > newest):
under 0.33 ``fused_topk`` / ``fused_topk_bias`` clamp non-finite scores to 0 (vLLM 0.33.0's topk_softmax /
topk_sigmoid kernels) and do not raise by default; under 0.17 they raise; the other ops raise under both."""

from __future__ import annotations

import pytest
import torch

from backends.torch import routing as tr
from reference import routing as ref
from reference.semantics import ENV_VAR, SemanticsError, use_semantics

E, K = 64, 4


def _logits(bad: float) -> torch.Tensor:
    x = torch.randn(6, E, generator=torch.Generator().manual_seed(3))
    x[1, 5] = bad
    x[3] = bad
    return x


CLAMPED = {
    "fused_topk": lambda x, **kw: tr.fused_topk(None, x, K, True, **kw),
    "fused_topk_bias": lambda x, **kw: tr.fused_topk_bias(None, x, torch.linspace(-0.1, 0.1, E), K, True,
                                                          routed_scaling_factor=2.5, **kw),
}
REF = {
    "fused_topk": lambda x, **kw: ref.fused_topk(None, x, K, True, **kw),
    "fused_topk_bias": lambda x, **kw: ref.fused_topk_bias(None, x, torch.linspace(-0.1, 0.1, E), K, True,
                                                           routed_scaling_factor=2.5, **kw),
}
UNCLAMPED = {
    "grouped_topk": lambda x, **kw: tr.grouped_topk(None, x, K, True, 8, 4, **kw),
    "topk_softmax": lambda x, **kw: tr.topk_softmax(None, x, K, True, **kw),
    "llama4_routing": lambda x, **kw: tr.llama4_routing(None, x, 1, False, **kw),
}


def _assert_clamped(w, ids):
    assert bool(((ids >= 0) & (ids < E)).all())
    assert all(ids[t].unique().numel() == K for t in range(ids.shape[0]))
    assert bool(torch.isfinite(w).all()), w


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", list(CLAMPED))
def test_033_clamps_by_default_and_matches_reference(name, bad):
    x = _logits(bad)
    for kw in ({}, {"check_finite": False}):
        with use_semantics("0.33"):
            w, ids = CLAMPED[name](x, **kw)
            rw, rids = REF[name](x, **kw)
        _assert_clamped(w, ids)
        # Every row, clamped ones included: same id sets (no ties in these rows) and weights as the reference.
        for t in range(x.shape[0]):
            if bool((rw[t] == 0).all()):  # every score clamped to 0 (a softmax row with NaN/+inf, an all-bad row):
                assert bool((w[t] == 0).all())  # ties among the zeros: any k unique ids, weights 0
                continue
            assert set(ids[t].tolist()) == set(rids[t].tolist()), (t, ids[t], rids[t])
            order, rorder = ids[t].argsort(), rids[t].argsort()
            torch.testing.assert_close(w[t][order], rw[t][rorder])
    with use_semantics("0.33"), pytest.raises(ValueError):
        CLAMPED[name](x, check_finite=True)


@pytest.mark.parametrize("name", list(CLAMPED))
def test_017_raises_by_default(name):
    x = _logits(float("nan"))
    with use_semantics("0.17"):
        with pytest.raises(ValueError):
            CLAMPED[name](x)
        w, ids = CLAMPED[name](x, check_finite=False)
    assert bool(((ids >= 0) & (ids < E)).all())


@pytest.mark.parametrize("name", list(UNCLAMPED))
@pytest.mark.parametrize("version", ["0.17", "0.33"])
def test_unclamped_ops_raise_under_both(name, version):
    x = _logits(float("nan"))
    with pytest.raises(ValueError):
        UNCLAMPED[name](x, semantics=version)
    w, ids = UNCLAMPED[name](x, check_finite=False, semantics=version)
    assert bool(((ids >= 0) & (ids < ids.new_tensor(E))).all())


def test_selection_order(monkeypatch):
    x = _logits(float("nan"))
    f = CLAMPED["fused_topk"]
    monkeypatch.setenv(ENV_VAR, "0.17")
    with pytest.raises(ValueError):
        f(x)
    _assert_clamped(*f(x, semantics="0.33"))  # the keyword wins over the env var
    with use_semantics("0.33"):
        _assert_clamped(*f(x))  # the block wins over the env var
        with pytest.raises(ValueError):
            f(x, semantics="0.17")  # the keyword wins over the block
    monkeypatch.delenv(ENV_VAR)
    _assert_clamped(*f(x))  # unset: the newest, 0.33
    with pytest.raises(ValueError):
        f(x, semantics="0.99")


def test_padding_rows_033_only():
    x = torch.randn(4, E, generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([False, True, False, True])
    w, ids = tr.fused_topk(None, x, K, True, is_padding=pad, semantics="0.33")
    assert bool((ids[pad] == -1).all()) and bool((w[pad] == 0).all())
    assert bool((ids[~pad] >= 0).all())
    with pytest.raises(SemanticsError):
        tr.fused_topk(None, x, K, True, is_padding=pad, semantics="0.17")
    with pytest.raises(SemanticsError):
        tr.fused_topk_bias(None, x, None, K, True, semantics="0.17")
    w, ids = tr.fused_topk_bias(None, x, None, K, True, scoring_func="softmax", semantics="0.33")
    rw, rids = tr.fused_topk(None, x, K, True, semantics="0.33")
    torch.testing.assert_close(w, rw)
    assert torch.equal(ids, rids)
