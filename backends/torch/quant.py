"""The torch backend's own FP8 / INT8 quantizers (vLLM recipe), written independently of ``reference.quant``.

They implement the ``vllm`` recipe (declared in ``Backend.recipes``): amax floored at 1e-10, ``s = amax / 448``,
UE8M0 scales as ``exp2(ceil(log2(s)))``, codes ``clamp(x / s, +-448)`` cast with round-to-nearest-even. Non-finite
inputs follow the reference's definition (the whole group is poisoned: NaN scale, NaN codes).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _fp8(y: torch.Tensor) -> torch.Tensor:
    # Clamp first: torch's own fp8 overflow behaviour changed between versions (NaN vs saturation).
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def per_token_group_quant_fp8(x, group_size=128, *, column_major_scales=False, tma_aligned_scales=False,
                              use_ue8m0=False):
    if x.shape[-1] % group_size:
        raise ValueError(f"K={x.shape[-1]} is not a multiple of group_size={group_size}")
    if not x.is_contiguous():
        raise ValueError("per_token_group_quant_fp8 needs a contiguous input")
    G = x.shape[-1] // group_size
    xg = x.float().unflatten(-1, (G, group_size))
    amax = xg.abs().amax(-1)
    bad = ~torch.isfinite(amax)
    a = amax.clamp(min=1e-10)
    s = a / torch.full_like(a, FP8_MAX)  # tensor / scalar would be a reciprocal multiply on CUDA
    if use_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s.clamp(min=1e-10))))
    s = s.masked_fill(bad, float("nan"))
    q = (xg / s.unsqueeze(-1)).masked_fill(bad.unsqueeze(-1), float("nan"))
    q = _fp8(q).flatten(-2)
    if column_major_scales:
        M = x.shape[-2]
        stride = (M + 3) // 4 * 4 if tma_aligned_scales else M
        buf = torch.empty(*s.shape[:-2], G, stride, dtype=torch.float32, device=x.device)
        buf[..., :M] = s.transpose(-1, -2)
        s = buf[..., :M].transpose(-1, -2)
    return q, s


def scaled_fp8_quant(x, scale=None, *, use_per_token_if_dynamic=False, scale_ub=None):
    xf = x.float()
    if scale is not None:
        s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(1)
        return _fp8(xf * (1.0 / s)), s
    if use_per_token_if_dynamic:
        amax = xf.abs().amax(-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=float(scale_ub))
        s = torch.maximum(amax / torch.full_like(amax, FP8_MAX), torch.tensor(1.0 / (FP8_MAX * 512.0), device=x.device))
        bad = ~torch.isfinite(amax)
        s = s.masked_fill(bad, float("nan"))
        return _fp8((xf / s).masked_fill(bad, float("nan"))), s
    amax = xf.abs().amax().reshape(1) if xf.numel() else torch.zeros(1, device=x.device)
    s = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    if not bool(torch.isfinite(amax).all()):
        return _fp8(torch.full_like(xf, float("nan"))), torch.full_like(s, float("nan"))
    return _fp8(xf * inv), s


def int8_quant_per_token(x):
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("int8_quant_per_token: NaN/inf input cannot be quantized to int8")
    absmax = xf.abs().amax(-1, keepdim=True)
    mult = torch.where(absmax == 0, torch.zeros_like(absmax), torch.full_like(absmax, 127.0) / absmax)
    return torch.round(xf * mult).clamp(-128, 127).to(torch.int8), absmax / torch.full_like(absmax, 127.0)


def dequant(q: torch.Tensor, s: torch.Tensor | None, group: tuple[int, int] | None) -> torch.Tensor:
    """Codes ``q (..., R, C)`` times a scale per ``group`` tile, in fp32 (tiles must divide the dims)."""
    x = q.float()
    if s is None:
        return x
    if s.numel() == 1:
        return x * s.float().reshape(())
    R, C = q.shape[-2:]
    gr = R if group is None or group[0] == -1 else group[0]
    gc = C if group is None or group[1] == -1 else group[1]
    if R % gr or C % gc:
        raise ValueError(f"torch backend: {R}x{C} is not a multiple of the {gr}x{gc} scale tiles")
    sf = s.float().reshape(*q.shape[:-2], R // gr, 1, C // gc, 1)
    return (x.reshape(*q.shape[:-2], R // gr, gr, C // gc, gc) * sf).reshape(q.shape)


def quantize_activation(x: torch.Tensor, desc, use_ue8m0: bool):
    """Quantize an activation as the quant-config descriptor says: ``(codes, scales)`` or ``(x, None)``."""
    if desc.dtype is None:
        return x, None
    if desc.dtype == FP8:
        if desc.shape is not None and desc.shape[0] == 1 and desc.shape[1] > 0:
            return per_token_group_quant_fp8(x, desc.shape[1], use_ue8m0=use_ue8m0)
        return scaled_fp8_quant(x, desc.scale, use_per_token_if_dynamic=desc.shape == (1, -1))
    if desc.dtype == torch.int8 and desc.shape == (1, -1) and desc.scale is None:
        return int8_quant_per_token(x)
    raise NotImplementedError(f"torch backend: no activation quantizer for {desc.dtype} {desc.shape}")
