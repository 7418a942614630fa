"""The fused activation + FP8 quantization ops (reference.fused_act_quant) against their composition from the
reference's parts and vLLM's tests' oracles (test_silu_mul_per_token_group_quant_fp8_colmajor.py,
test_silu_mul_fp8_quant_deep_gemm.py)."""

import pytest
import torch

from reference.fused_act_quant import (
    DeepGemmQuantScaleFMT,
    gated_act_at_input_precision,
    persistent_masked_m_silu_mul_quant,
    silu_mul_per_token_group_quant_fp8_colmajor,
)
from reference.quant.fp8 import per_token_group_quant_fp8
from reference.semantics import SemanticsError, use_semantics

BF = torch.bfloat16


def _x(M, N, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, N, generator=g) * scale).to(BF)


def test_input_precision_rounding_points_by_hand():
    x = torch.tensor([[2.0, 3.0]], dtype=BF)
    silu2 = torch.tensor(2.0 / (1 + torch.exp(torch.tensor(-2.0)).item())).to(BF)
    assert gated_act_at_input_precision(x).item() == (silu2.float() * 3.0).to(BF).float().item()
    x = torch.tensor([[9.0, -9.0]], dtype=BF)  # clamp 7: g -> 7, u -> -7; beta 1: u + 1 = -6
    g7 = torch.tensor(7.0 / (1 + torch.exp(torch.tensor(-7.0 * 1.702)).item())).to(BF)
    got = gated_act_at_input_precision(x, clamp_limit=7.0, alpha=1.702, beta=1.0).item()
    assert got == (g7.float() * -6.0).to(BF).float().item()


def test_colmajor_017_is_the_composition_with_per_token_group_quant_fp8():
    """0.17: amax / 448 = the reference quantizer (vllm recipe, eps 1e-10) on the narrowed product, column-major."""
    x = _x(16, 512)
    with use_semantics("0.17"):
        for ue8m0 in (False, True):
            q, s = silu_mul_per_token_group_quant_fp8_colmajor(x, use_ue8m0=ue8m0)
            rq, rs = per_token_group_quant_fp8(gated_act_at_input_precision(x), 128, eps=1e-10,
                                               column_major_scales=True, use_ue8m0=ue8m0)
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
            assert s.stride() == (1, 16)
        with pytest.raises(SemanticsError):
            silu_mul_per_token_group_quant_fp8_colmajor(x, clamp_limit=7.0)


def test_colmajor_033_scale_is_a_reciprocal_multiply_and_codes_follow():
    x = _x(16, 512, seed=1)
    q, s = silu_mul_per_token_group_quant_fp8_colmajor(x)
    y = gated_act_at_input_precision(x).reshape(16, 2, 128)
    amax = y.abs().amax(-1).clamp_min(1e-10)
    want = amax * torch.tensor(1 / 448.0, dtype=torch.float32)
    assert torch.equal(s, want) and s.stride() == (1, 16)
    codes = (y / want.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(16, 256)
    assert torch.equal(q.view(torch.uint8), codes.view(torch.uint8))
    assert not torch.equal(want, amax / 448.0)  # the release difference is visible on these inputs


def test_colmajor_expert_ends_leave_dead_rows_unwritten():
    x = _x(32, 256, seed=2)
    out = torch.full((32, 128), 7.0).to(torch.float8_e4m3fn)
    ends = torch.tensor([3, 16 + 5], dtype=torch.int32)  # expert 0 rows 0-2, expert 1 rows 16-20 (alignment 16)
    q, s = silu_mul_per_token_group_quant_fp8_colmajor(x, out, expert_ends=ends, expert_alignment=16)
    live = torch.zeros(32, dtype=torch.bool)
    live[0:3] = True
    live[16:21] = True
    full_q, full_s = silu_mul_per_token_group_quant_fp8_colmajor(x)
    assert torch.equal(q[live].view(torch.uint8), full_q[live].view(torch.uint8))
    assert torch.equal(s[live], full_s[live])
    assert bool((q[~live].float() == 7.0).all()) and bool(torch.isnan(s[~live]).all())


def _vllm_test_ref(gate, up, ceil_ue8m0):
    """vLLM's test_silu_mul_fp8_quant_deep_gemm.py silu_mul_quant / do_quant (CUDA branch), verbatim in spirit."""
    act = (gate.float() / (1.0 + torch.exp(-gate.float()))).to(BF)
    x = (act * up).view(-1, 128)
    one = torch.tensor([1.0], dtype=BF)
    fmax = torch.tensor([448.0], dtype=BF)
    amax = x.abs().amax(dim=1).clamp(min=torch.tensor([1e-10], dtype=BF))
    s = amax * (one / fmax)
    if ceil_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s).to(BF)).to(BF)).to(BF)
    xq = torch.clamp(x * (one / s).view(-1, 1), min=-448.0, max=448.0).to(torch.float8_e4m3fn)
    return xq.view(gate.shape), s.view(gate.shape[0], gate.shape[1] // 128)


@pytest.mark.parametrize("fmt", list(DeepGemmQuantScaleFMT))
@pytest.mark.parametrize("E,T,H", [(1, 4, 128), (8, 16, 384), (17, 31, 768)])
def test_persistent_masked_like_vllms_test(fmt, E, T, H):
    g = torch.Generator().manual_seed(E * 100 + H)
    counts = torch.randint(0, T, (E,), generator=g, dtype=torch.int32)
    y = torch.empty(E, T, 2 * H)
    for e in range(E):
        for t in range(T):
            ex = int(torch.randint(1, 20, (1,), generator=g))
            y[e, t].uniform_(-(2.0**ex), 2.0**ex, generator=g)
    y = y.to(BF)
    q, s = persistent_masked_m_silu_mul_quant(y, counts, quant_scale_fmt=fmt)
    G = H // 128
    assert q.shape == (E, T, H) and s.stride()[1] == 1
    for e, n in enumerate(counts.tolist()):
        rq, rs = _vllm_test_ref(y[e, :n, :H], y[e, :n, H:], fmt is not DeepGemmQuantScaleFMT.FLOAT32)
        assert torch.equal(q[e, :n].view(torch.uint8), rq.view(torch.uint8))
        if fmt is DeepGemmQuantScaleFMT.UE8M0:
            assert s.dtype == torch.int32
            words = torch.tensor(s[e, :n].tolist(), dtype=torch.int32)
            got = words.view(torch.uint8).reshape(n, 4 * s.shape[-1])[:, :G]
            want = (rs.float().view(torch.int32) >> 23).to(torch.uint8)
            assert torch.equal(got, want)
        else:
            assert s.dtype == torch.float32 and torch.equal(s[e, :n], rs.float())
        assert bool((s[e, n:] == 0).all())
