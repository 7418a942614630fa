"""Fused gated activation + FP8 quantization ops of the torch backend (own code, vectorized; the specification is
``reference.fused_act_quant``)."""

from __future__ import annotations

import torch

_MAX = 448.0


def _codes(v: torch.Tensor) -> torch.Tensor:
    return v.float().clamp(-_MAX, _MAX).to(torch.float8_e4m3fn)


def silu_mul_per_token_group_quant_fp8_colmajor(input, output=None, use_ue8m0=None, eps=1e-10, clamp_limit=None,
                                                group_size=128, alpha=1.0, beta=0.0, *, expert_ends=None,
                                                expert_alignment=0, semantics=None):
    """vLLM 0.33's Triton op (``semantics="0.17"``: the 0.17 scale ``amax / 448``)."""
    from reference.semantics import SemanticsVersion, resolve_semantics

    v033 = resolve_semantics(semantics) >= SemanticsVersion.V0_33
    M, N = input.shape
    d = N // 2
    dt = input.dtype
    g, u = input[:, :d].float(), input[:, d:].float()
    if clamp_limit is not None:
        g, u = g.clamp(max=clamp_limit).to(dt).float(), u.clamp(-clamp_limit, clamp_limit).to(dt).float()
    y = ((g / (1.0 + torch.exp(-g * alpha))).to(dt) * (u + beta).to(dt)).float()  # bf16 x bf16 -> bf16
    y = y.view(M, d // group_size, group_size)
    amax = y.abs().amax(-1).clamp_min(eps)
    s = amax * torch.tensor(1.0 / _MAX) if v033 else amax / _MAX
    if use_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = _codes(y / s[..., None]).view(M, d)
    if output is None:
        output = torch.zeros((M, d), dtype=torch.float8_e4m3fn, device=input.device)
    scales = torch.full((d // group_size, M), float("nan"), device=input.device).t()
    live = torch.ones(M, dtype=torch.bool, device=input.device)
    if expert_ends is not None:
        ends = expert_ends.long()
        prev = torch.cat([ends.new_zeros(1), ends[:-1]])
        starts = (prev + expert_alignment - 1) // expert_alignment * expert_alignment
        rows = torch.arange(M, device=input.device)
        live = ((rows[:, None] >= starts) & (rows[:, None] < ends)).any(1)
    output[live] = q[live]
    scales[live] = s[live]
    return output, scales


def persistent_masked_m_silu_mul_quant(y, tokens_per_expert, num_parallel_tokens=16, group_size=128,
                                       quant_scale_fmt=None):
    """vLLM's masked batched SiLU-mul + FP8 (CUDA kernel, bf16 quantization arithmetic)."""
    from reference.fused_act_quant import DeepGemmQuantScaleFMT as F

    fmt = F.FLOAT32 if quant_scale_fmt is None else quant_scale_fmt
    E, T, H2 = y.shape
    H = H2 // 2
    G = H // group_size
    bf = torch.bfloat16
    gf = y[..., :H].float()
    a = ((gf / (1.0 + torch.exp(-gf))).to(bf) * y[..., H:]).view(E, T, G, group_size)
    amax = torch.maximum(a.abs().amax(-1), torch.tensor(1e-10, dtype=bf))
    s = amax * (torch.tensor(1.0, dtype=bf) / torch.tensor(_MAX, dtype=bf))
    if fmt is not F.FLOAT32:
        s = torch.exp2(torch.ceil(torch.log2(s).to(bf)).to(bf)).to(bf)
    q = _codes(a * (torch.tensor(1.0, dtype=bf) / s)[..., None]).view(E, T, H)
    valid = torch.arange(T, device=y.device)[None, :] < tokens_per_expert.to(y.device).long()[:, None]  # (E, T)
    q = torch.where(valid[..., None], q.view(torch.uint8), 0).view(torch.float8_e4m3fn)
    sf = torch.where(valid[..., None], s.float(), 0.0)
    if fmt is F.UE8M0:
        G4 = -(-G // 4)
        b = torch.zeros(E, T, 4 * G4, dtype=torch.int64, device=y.device)
        b[..., :G] = (sf.view(torch.int32) >> 23).long() & 0xFF
        b = b.view(E, T, G4, 4)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        out = torch.zeros(E, G4, T, dtype=torch.int32, device=y.device).transpose(1, 2)
        out.copy_(word)
        return q, out
    out = torch.zeros(E, G, T, dtype=torch.float32, device=y.device).transpose(1, 2)
    out.copy_(sf)
    return q, out
