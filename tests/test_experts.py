"""The reference experts loop and the modular kernel: hand-computed values, an independent dense formulation,
and the properties of seed 002 (chunked == unchunked, EP shards sum to the unsharded output, M == 0, ...)."""

import math

import pytest
import torch

from reference.activation import MoEActivation
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig
from reference.experts import ReferenceExperts, fused_experts
from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP, slice_scales
from reference.routing import determine_expert_map, fused_topk


def make(M=23, K=64, I=48, E=8, topk=3, dtype=torch.bfloat16, seed=0, gated=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    N = 2 * I if gated else I
    w1 = (torch.randn(E, N, K, generator=g) / math.sqrt(K)).to(dtype)
    w2 = (torch.randn(E, K, I, generator=g) / math.sqrt(I)).to(dtype)
    w, ids = fused_topk(None, torch.randn(M, E, generator=g), topk, True)
    return x, w1, w2, w, ids


def dense_oracle(x, w1, w2, w, ids, activation=MoEActivation.SILU):
    """Gather every route's expert weights and contract with einsum: a formulation independent of the loop."""
    dt = x.dtype
    W1 = w1[ids.long()].float()  # (M, topk, N, K)
    h = torch.einsum("mk,mtnk->mtn", x.float(), W1).to(dt)
    if activation is MoEActivation.SILU:
        gate, up = h.float().chunk(2, -1)
        a = (gate * torch.sigmoid(gate) * up).to(dt)
    else:  # RELU2_NO_MUL
        a = (torch.relu(h.float()) ** 2).to(dt)
    y = torch.einsum("mti,mtki->mtk", a.float(), w2[ids.long()].float()).to(dt)
    return (y.float() * w.unsqueeze(-1)).sum(1).to(dt)


def kernel(chunk_size=None, semantics="0.17", **kw):
    """The 0.17 kernel (chunking, inplace, constructor shared experts); tests/test_modular_033.py tests 0.33's."""
    cfg = FusedMoEConfig(8, 3, 64, 48, 8)
    return FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(cfg, FUSED_MOE_UNQUANTIZED_CONFIG),
                          chunk_size=chunk_size, poison=float("nan"), semantics=semantics, **kw)


def test_hand_computed_single_route():
    x = torch.tensor([[1.0, 2.0]])
    w1 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # gate = x0 = 1, up = x1 = 2
    w2 = torch.tensor([[[1.0], [2.0]]])
    out = fused_experts(x, w1, w2, torch.tensor([[0.5]]), torch.tensor([[0]], dtype=torch.int32))
    s = 1 / (1 + math.exp(-1.0)) * 2.0  # silu(1) * 2
    torch.testing.assert_close(out, torch.tensor([[0.5 * s, 0.5 * 2 * s]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", [MoEActivation.SILU, MoEActivation.RELU2_NO_MUL])
def test_matches_dense_oracle(dtype, activation):
    x, w1, w2, w, ids = make(dtype=dtype, gated=activation.is_gated)
    out = fused_experts(x, w1, w2, w, ids, activation=activation)
    ref = dense_oracle(x, w1, w2, w, ids, activation)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)


def test_router_weights_matter():
    x, w1, w2, w, ids = make(dtype=torch.float32)
    a = fused_experts(x, w1, w2, w, ids)
    b = fused_experts(x, w1, w2, torch.ones_like(w), ids)
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 16, 22, 23, 1000])
def test_chunked_equals_unchunked(chunk_size):
    x, w1, w2, w, ids = make()
    ref = fused_experts(x, w1, w2, w, ids)
    out = kernel(chunk_size).apply(x, w1, w2, w, ids)
    assert torch.equal(out, ref)


def test_chunking_switch_env(monkeypatch):
    k = kernel(chunk_size=4)
    assert k._chunk_info(23) == (6, 4)
    monkeypatch.setenv("VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING", "0")
    assert k._chunk_info(23) == (1, 23)
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "5")
    monkeypatch.delenv("VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING")
    assert kernel()._chunk_info(23) == (5, 5)
    assert kernel()._chunk_info(0) == (0, 1)


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_ep_shards_sum_to_unsharded(strategy):
    x, w1, w2, w, ids = make(E=10, dtype=torch.float32)
    full = fused_experts(x, w1, w2, w, ids)
    total = torch.zeros_like(full)
    for rank in range(3):
        n_local, emap, _ = determine_expert_map(3, rank, 10, strategy)
        held = (emap >= 0).nonzero().squeeze(1)
        local_order = held[torch.argsort(emap[held])]
        part = fused_experts(x, w1[local_order], w2[local_order], w, ids, expert_map=emap, global_num_experts=10)
        assert n_local == len(held)
        total += part
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


def test_nonlocal_and_invalid_ids_contribute_nothing():
    x, w1, w2, w, ids = make(E=4, topk=1, dtype=torch.float32)
    emap = torch.tensor([0, 1, -1, -1, 2, 3], dtype=torch.int32)  # 6 global experts, globals 2,3 not held
    ids = torch.tensor([2, 3, -1] * 7 + [2, 3], dtype=torch.int32).unsqueeze(1)
    out = fused_experts(x, w1, w2, w, ids, expert_map=emap, global_num_experts=6)
    assert torch.equal(out, torch.zeros_like(out))


def test_apply_router_weight_on_input():
    x, w1, w2, w, ids = make(topk=1, dtype=torch.float32)
    out = fused_experts(x, w1, w2, w, ids, apply_router_weight_on_input=True)
    ref = fused_experts(x * w, w1, w2, torch.ones_like(w), ids)
    assert torch.equal(out, ref)
    x, w1, w2, w, ids = make(topk=2)
    with pytest.raises(ValueError, match="topk == 1"):
        fused_experts(x, w1, w2, w, ids, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="topk == 1"):
        kernel().apply(x, w1, w2, w, ids, apply_router_weight_on_input=True)


def test_m_zero_gives_empty_output():
    x, w1, w2, w, ids = make(M=0)
    out = kernel().apply(x, w1, w2, w, ids)
    assert out.shape == (0, 64)
    assert fused_experts(x, w1, w2, w, ids).shape == (0, 64)


def test_shared_experts_and_inplace():
    x, w1, w2, w, ids = make()
    ref = fused_experts(x, w1, w2, w, ids)
    shared, routed = kernel(shared_experts=lambda h: h * 2).apply(x, w1, w2, w, ids)
    assert torch.equal(routed, ref) and torch.equal(shared, x * 2)
    latent = torch.randn(23, 5)
    shared, _ = kernel(shared_experts=lambda h: h + 1).apply(x, w1, w2, w, ids, shared_experts_input=latent)
    assert torch.equal(shared, latent + 1)
    xi = x.clone()
    out = kernel(inplace=True).apply(xi, w1, w2, w, ids)
    assert out.data_ptr() == xi.data_ptr() and torch.equal(xi, ref)
    with pytest.raises(ValueError, match="inplace"):
        kernel(inplace=True, shared_experts=lambda h: h)


def testslice_scales():
    s = torch.arange(10.0).unsqueeze(1)
    assert torch.equal(slice_scales(s, 2, 5), s[2:5])
    one = torch.tensor([3.0])
    assert slice_scales(one, 2, 5) is one and slice_scales(None, 0, 1) is None


def test_bad_inputs_raise_clear_errors():
    x, w1, w2, w, ids = make()
    with pytest.raises(ValueError, match="hidden size mismatch"):
        fused_experts(x[:, :32], w1, w2, w, ids)
    with pytest.raises(ValueError, match=r"must be \(M=23, topk\)"):
        fused_experts(x, w1, w2, w[:5], ids[:5])
    with pytest.raises(ValueError, match="integer"):
        fused_experts(x, w1, w2, w, ids.float())
    with pytest.raises(ValueError, match="w2 must be"):
        fused_experts(x, w1, w2[:, :, :10], w, ids)
