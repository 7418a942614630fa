"""Numerics profiles (reference/profiles.py): each rounding point against an independent oracle (torch's own ops in
the act dtype, written as the upstream code is; an independent accumulator emulation), selection like the semantics
version, and the default left bit-identical."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from reference.activation import MoEActivation
from reference.experts import fused_experts
from reference.profiles import (DEFAULT_PROFILE, ENV_VAR, PROFILES, apply_activation_per_op, current_profile,
                                get_profile, inplace_fp8_gemm, resolve_profile, truncate_mantissa, use_profile)
from reference.schemes import quantize_weights


def _layer(M=5, E=4, K=64, I=32, topk=2, seed=0, dtype=torch.bfloat16, interleave=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * I, K, generator=g) * K**-0.5).to(dtype)
    w2 = (torch.randn(E, K, I, generator=g) * I**-0.5).to(dtype)
    logits = torch.randn(M, E, generator=g)
    w, ids = torch.topk(logits.softmax(-1), topk, dim=-1)
    return x, w1, w2, (w / w.sum(-1, keepdim=True)).float(), ids.int()


def test_selection_like_the_semantics_version(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert current_profile() is DEFAULT_PROFILE and DEFAULT_PROFILE.name == "vllm"
    monkeypatch.setenv(ENV_VAR, "transformers_eager")
    assert current_profile().name == "transformers_eager"
    with use_profile("torch_native_activation"):
        assert current_profile().name == "torch_native_activation"
        with use_profile("vllm"):
            assert current_profile().name == "vllm"
        assert resolve_profile("fp8_inplace_accumulation").name == "fp8_inplace_accumulation"
    assert current_profile().name == "transformers_eager"
    with pytest.raises(ValueError, match="choose one of vllm"):
        get_profile("cuda_fast")
    assert set(PROFILES) == {"vllm", "torch_native_activation", "transformers_eager", "fp8_inplace_accumulation"}
    assert PROFILES["fp8_inplace_accumulation"].defect and not PROFILES["transformers_eager"].defect


def test_default_profile_is_the_loop_unchanged(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    x, w1, w2, w, ids = _layer()
    base = fused_experts(x, w1, w2, w, ids)
    # The loop written out (reference/experts.py's docstring): fp32 GEMMs, four rounding points, fp32 weighted sum.
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = (x[t].float() @ w1[e].float().T).bfloat16().float()
            g = (F.silu(h[:32]) * h[32:]).bfloat16().float()
            y = (g @ w2[e].float().T).bfloat16().float()
            out[t] += w[t, k] * y
    assert torch.equal(base, out.bfloat16())
    assert torch.equal(base, fused_experts(x, w1, w2, w, ids, profile="vllm"))


@pytest.mark.parametrize("act", [MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH,
                                 MoEActivation.SWIGLUOAI])
def test_per_op_activation_is_torch_in_the_act_dtype(act):
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(64, 96, generator=g) * 3).bfloat16()
    got = apply_activation_per_op(act, h)
    if act is MoEActivation.SWIGLUOAI:  # transformers GptOssExperts._apply_gate, verbatim, in bf16
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(min=None, max=7.0)
        up = up.clamp(min=-7.0, max=7.0)
        glu = gate * torch.sigmoid(gate * 1.702)
        want = (up + 1) * glu
    else:  # vLLM SiluAndMul.forward_native / transformers ACT2FN[act](gate) * up, in bf16
        fn = {MoEActivation.SILU: F.silu, MoEActivation.GELU: F.gelu,
              MoEActivation.GELU_TANH: lambda t: F.gelu(t, approximate="tanh")}[act]
        # contiguous halves: torch's strided GELU path (scalar erf) differs from its vectorized one by an fp32 ulp
        # in the far negative tail, which can move a bf16 rounding; the profile is defined on the vectorized one
        want = fn(h[..., :48].contiguous()) * h[..., 48:]
    assert want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    # and it is a different rounding from the fused form (two roundings instead of one) on enough elements
    from reference.activation import apply_moe_activation

    assert (got != apply_moe_activation(act, h)).any()


def _hf_eager(x, w1, w2, w, ids, bias1=None, bias2=None, act=F.silu):
    """transformers' MixtralExperts.forward (5.x), with the GEMMs as fp32 matmuls rounded once (F.linear on the CPU)."""
    final = torch.zeros_like(x)
    E = w1.shape[0]
    mask = F.one_hot(ids.long(), num_classes=E + 1).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == E:
            continue
        pos, tok = torch.where(mask[e])
        h = (x[tok].float() @ w1[e].float().T).to(x.dtype)
        if bias1 is not None:
            h = h + bias1[e]
        gate, up = h.chunk(2, dim=-1)
        cur = act(gate) * up
        y = (cur.float() @ w2[e].float().T).to(x.dtype)
        if bias2 is not None:
            y = y + bias2[e]
        y = y * w[tok, pos, None]
        final.index_add_(0, tok, y.to(final.dtype))
    return final


@pytest.mark.parametrize("M", [1, 7])
def test_transformers_eager_is_the_hf_loop(M):
    x, w1, w2, w, ids = _layer(M=M, topk=3)
    got = fused_experts(x, w1, w2, w, ids, profile="transformers_eager")
    assert torch.equal(got, _hf_eager(x, w1, w2, w, ids))
    assert not torch.equal(got, fused_experts(x, w1, w2, w, ids))  # a different rounding, not a no-op


def test_transformers_eager_bias_after_store_and_expert_map():
    from reference.config import FusedMoEQuantConfig

    x, w1, w2, w, ids = _layer(M=6, E=4, topk=2, seed=3)
    g = torch.Generator().manual_seed(9)
    b1, b2 = torch.randn(4, 64, generator=g).bfloat16(), torch.randn(4, 64, generator=g).bfloat16()
    import dataclasses

    from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG

    qc = dataclasses.replace(FUSED_MOE_UNQUANTIZED_CONFIG,
                             w1=dataclasses.replace(FUSED_MOE_UNQUANTIZED_CONFIG.w1, bias=b1),
                             w2=dataclasses.replace(FUSED_MOE_UNQUANTIZED_CONFIG.w2, bias=b2))
    assert isinstance(qc, FusedMoEQuantConfig) and qc.w1_bias is not None
    got = fused_experts(x, w1, w2, w, ids, quant_config=qc, profile="transformers_eager")
    assert torch.equal(got, _hf_eager(x, w1, w2, w, ids, b1, b2))
    # EP: this rank holds global experts 2, 3 as local 0, 1; the HF module sees local ids, E_local as its sentinel
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    got = fused_experts(x, w1[2:], w2[2:], w, ids, expert_map=emap, global_num_experts=4, profile="transformers_eager")
    local = torch.where(emap[ids.long()] >= 0, emap[ids.long()], 2)
    assert torch.equal(got, _hf_eager(x, w1[2:], w2[2:], w, local))


def _emulated_inplace(a, w, bits, chunk):
    """An independent accumulator emulation (tests/emulated_backends.py's: log2-based truncation, never promoted)."""
    from tests.emulated_backends import mma_accumulate

    return mma_accumulate(a, w, mantissa_bits=bits, promote_every=None, chunk=chunk)


def test_inplace_fp8_gemm_against_an_independent_emulation():
    g = torch.Generator().manual_seed(2)
    aq = (torch.randn(8, 2048, generator=g) * 40).to(torch.float8_e4m3fn)
    wq = (torch.randn(16, 2048, generator=g) * 40).to(torch.float8_e4m3fn)
    got = inplace_fp8_gemm(aq, None, wq, None, mantissa_bits=14, k_step=32)
    assert torch.equal(got, _emulated_inplace(aq.float(), wq.float(), 14, 32))
    exact = aq.double() @ wq.double().T
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert 1e-5 < rel < 1e-2  # loses precision, as the probe shows; fp32 over K = 2048 is ~1e-7
    sa, sw = torch.rand(8, 1, generator=g) + 0.5, torch.rand(16, 1, generator=g) + 0.5
    assert torch.equal(inplace_fp8_gemm(aq, sa, wq, sw), got * sa * sw.T)


def test_truncate_mantissa_is_exact():
    x = torch.tensor([1.0, 1.0 + 2**-14, 1.0 + 2**-15, -(1 + 2**-15), 3 * 2**-20, 0.0], dtype=torch.float64)
    assert truncate_mantissa(x, 14).tolist() == [1.0, 1.0 + 2**-14, 1.0, -1.0, 3 * 2**-20, 0.0]


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_channel_token"])
def test_fp8_inplace_profile_loses_precision_with_k(scheme):
    errs = []
    for K in (256, 4096):
        x, w1, w2, w, ids = _layer(M=4, E=2, K=K, I=64, topk=1)
        w1q, w2q, qc = quantize_weights(scheme, w1, w2)
        exact = fused_experts(x, w1q, w2q, w, ids, quant_config=qc, accumulate_dtype=torch.float64)
        inpl = fused_experts(x, w1q, w2q, w, ids, quant_config=qc, profile="fp8_inplace_accumulation")
        errs.append(((inpl.float() - exact.float()).norm() / exact.float().norm()).item())
    assert errs[1] > errs[0]
    # block FP8 is untouched by the point
    x, w1, w2, w, ids = _layer(M=4, E=2, K=256, I=128, topk=1)
    w1q, w2q, qc = quantize_weights("fp8_block128", w1, w2)
    assert torch.equal(fused_experts(x, w1q, w2q, w, ids, quant_config=qc, profile="fp8_inplace_accumulation"),
                       fused_experts(x, w1q, w2q, w, ids, quant_config=qc))
