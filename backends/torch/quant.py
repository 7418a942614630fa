"""The torch backend's own FP8 / INT8 quantizers (vLLM recipe), written independently of ``reference.quant``.

They implement the ``vllm`` recipe (declared in ``Backend.recipes``): amax floored at 1e-10, ``s = amax / 448``,
UE8M0 scales as ``exp2(ceil(log2(s)))``, codes ``clamp(x / s, +-448)`` (vLLM 0.17) or ``clamp(x * (1 / s), +-448)``
(vLLM 0.33: the semantics point ``quant.per_token_group_quant_op``, read from ``reference.semantics``) cast with
round-to-nearest-even. Non-finite inputs follow the reference's definition (the whole group is poisoned: NaN scale,
NaN codes).
"""

from __future__ import annotations

import torch

from reference.semantics import SemanticsVersion, current_semantics

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
    if current_semantics() == SemanticsVersion.V0_17:
        y = xg / s.unsqueeze(-1)  # vLLM 0.17: one division per element
    else:
        y = xg * (1.0 / s).unsqueeze(-1)  # vLLM 0.33: the group scale's reciprocal (1.0f / y_s), then a multiply
    q = y.masked_fill(bad.unsqueeze(-1), float("nan"))
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
    if desc.dtype == torch.int8 and desc.shape is not None and desc.shape[0] == 1 and desc.shape[1] > 0 \
            and desc.scale is None:
        return per_token_group_quant_int8(x, desc.shape[1])
    raise NotImplementedError(f"torch backend: no activation quantizer for {desc.dtype} {desc.shape}")


# --- formats of vLLM 0.33's schemes (own code; reference.quant specifies them) ------------------------------------
# E2M1 magnitudes of codes 0..7 (bit 3 is the sign).
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nibbles(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """uint8 bytes -> their two 4-bit values along ``dim`` (low nibble first), as int64."""
    v = packed.to(torch.int64).movedim(dim, -1)
    return torch.stack((v & 0xF, v >> 4), -1).flatten(-2).movedim(-1, dim)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 (two per byte, low nibble first) -> fp32 values."""
    c = _nibbles(packed)
    mag = _E2M1.to(packed.device)[c & 7]
    return torch.where(c >= 8, -mag, mag)


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the E2M1 grid, nearest-even, saturating at +-6 (as values, not codes)."""
    a = y.abs().clamp(max=6.0)
    # The grid spacing is 0.5 below 2, 1 below 4, 2 above; torch.round rounds half to even, which on each of these
    # scaled grids is the even E2M1 code.
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r.clamp(max=6.0), y)


def _pow2_even_scale(amax: torch.Tensor, emax: int, mbits: int) -> torch.Tensor:
    """The MX scale of the vllm recipe's "even" rule: amax rounded (half up) to the element's mantissa bits, then
    2^(floor(log2) - emax), clamped to E8M0's range."""
    bits = amax.float().view(torch.int32)
    e = (((bits + (1 << (22 - mbits))) & 0x7F800000) >> 23) - 127
    return torch.exp2((e - emax).clamp(-127, 127).to(torch.float32))


# --- MXFP6 (OCP MX emulation of vLLM 0.33): E3M2 / E2M3 by table (own code; reference.quant.mx specifies them) ---
# (exponent bits, mantissa bits, bias, emax of the largest value)
_FP6 = {"mxfp6_e3m2": (3, 2, 3, 4), "mxfp6_e2m3": (2, 3, 1, 2)}


def _fp6_table(fmt: str) -> torch.Tensor:
    """The 32 non-negative FP6 magnitudes by code (increasing): subnormals m 2^(1-bias-mb), then normals."""
    eb, mb, bias, _ = _FP6[fmt]
    return torch.tensor([(m / 2**mb) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mb) * 2.0 ** (e - bias)
                         for e in range(2**eb) for m in range(2**mb)], dtype=torch.float32)


def _fp6_round(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round fp32 to the FP6 grid by table: the nearer neighbour, a tie to the even code, saturating (values)."""
    table = _fp6_table(fmt).to(y.device)
    a = y.abs().clamp(max=float(table[-1]))
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)  # first grid value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.copysign(torch.where(pick_hi, table[hi], table[lo]), y)


def fp6_values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP6 codes (one per byte, bit 5 the sign) -> fp32 values."""
    c = codes.to(torch.int64)
    mag = _fp6_table(fmt).to(codes.device)[c & 31]
    return torch.where(c >= 32, -mag, mag)


def fake_quant_mx(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """MXFP8 (``"mxfp8"``), MXFP4 (``"mxfp4"``) or MXFP6 (``"mxfp6_e3m2"`` / ``"mxfp6_e2m3"``) quantize-dequantize
    per 32 along the last dim (vllm recipe's "even" scale rule, Quark's for MXFP6), fp32 result."""
    xb = x.float().unflatten(-1, (x.shape[-1] // 32, 32))
    params = {"mxfp8": (8, 3), "mxfp4": (2, 1)}.get(fmt) or (_FP6[fmt][3], _FP6[fmt][1])
    s = _pow2_even_scale(xb.abs().amax(-1, keepdim=True), *params)
    y = xb / s
    q = _fp8(y).float() if fmt == "mxfp8" else _e2m1_round(y) if fmt == "mxfp4" else _fp6_round(y, fmt)
    return (q * s).flatten(-2)


def mx_values(codes: torch.Tensor, scale_bytes: torch.Tensor, fmt: str) -> torch.Tensor:
    """MX codes (fp8 e4m3, packed E2M1 or FP6 one per byte) and E8M0 bytes per 32 -> fp32 values."""
    v = codes.float() if fmt == "mxfp8" else fp6_values(codes, fmt) if fmt in _FP6 else e2m1_values(codes)
    s = torch.exp2(scale_bytes.view(torch.uint8).to(torch.float32) - 127)
    return (v.unflatten(-1, (v.shape[-1] // 32, 32)) * s.unsqueeze(-1)).flatten(-2)


def nvfp4_values(packed: torch.Tensor, per_block: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes times an fp32 factor per 16 elements."""
    v = e2m1_values(packed)
    return (v.unflatten(-1, (v.shape[-1] // 16, 16)) * per_block.float().unsqueeze(-1)).flatten(-2)


def fake_quant_nvfp4_per_token(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 with a per-token global encode scale ``2688 / amax_row``, quantized and dequantized (fp32)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    gs = torch.where(amax == 0, torch.ones_like(amax), torch.full_like(amax, 448.0 * 6.0) / amax)
    xb = xf.unflatten(-1, (x.shape[-1] // 16, 16))
    sf = _fp8(gs * (xb.abs().amax(-1) * (torch.tensor(1.0) / torch.tensor(6.0)))).float()
    denom = sf * (1.0 / gs)
    mult = torch.where(sf == 0, torch.zeros_like(sf), 1.0 / denom)
    q = _e2m1_round(xb * mult.unsqueeze(-1))
    return (q * (sf / gs).unsqueeze(-1)).flatten(-2)


def int8_quant_per_tensor(x: torch.Tensor):
    """Dynamic per-tensor INT8 as vLLM's ``_int8_quantize``: the scale ``amax / 127`` in x's dtype, then x / s."""
    if not bool(torch.isfinite(x.float()).all()):
        raise ValueError("int8_quant_per_tensor: NaN/inf input cannot be quantized to int8")
    s = torch.clamp(x.abs().amax() / 127.0, min=1e-10).float().reshape(1)
    return torch.round(x.float() / s).clamp(-128, 127).to(torch.int8), s


def wna16_weights(qweight: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, bits: int,
                  group: int) -> torch.Tensor:
    """Weight-only INT4 / INT8 ``(E, N, K)``: ``((u - zp) * s)`` rounded to the scales' dtype, returned as fp32."""
    u = _nibbles(qweight) if bits == 4 else qweight.to(torch.int64)
    z = (_nibbles(zp, dim=-2) if zp is not None else torch.full_like(scales, 8 if bits == 4 else 128,
                                                                     dtype=torch.int64))
    ug = u.unflatten(-1, (u.shape[-1] // group, group)).float()
    w = (ug - z.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.flatten(-2).to(scales.dtype).float()


# --- issue 41: block INT8 W8A8 activations and the CPU INT4 W4A8 GEMMs' own INT8 rows (own code) -------------------
def per_token_group_quant_int8(x: torch.Tensor, group_size: int):
    """INT8 per 1 x ``group_size`` group as vLLM's CUDA ``per_token_group_quant_int8``: absmax floored at 1e-10,
    ``s = absmax / 127``, codes ``x * (1 / s)`` clamped to [-128, 127] and truncated toward zero."""
    if x.shape[-1] % group_size:
        raise ValueError(f"K={x.shape[-1]} is not a multiple of group_size={group_size}")
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("per_token_group_quant_int8: NaN/inf input cannot be quantized to int8")
    xg = xf.unflatten(-1, (x.shape[-1] // group_size, group_size))
    a = xg.abs().amax(-1).clamp(min=1e-10)
    s = a / torch.full_like(a, 127.0)  # tensor / tensor: IEEE division on every device
    inv = torch.ones_like(s) / s
    codes = (xg * inv.unsqueeze(-1)).clamp(-128.0, 127.0).trunc().to(torch.int8)
    return codes.flatten(-2), s


def int8_asym_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row quantized to asymmetric INT8 and back (fp32), as ``at::_dyn_quant_matmul_4bit`` packs its left-hand
    side: the range [min(0, min), max(0, max)] onto 255 steps, a nudged zero point (ties to even), codes
    ``round_half_away(x * scale) + zp`` clamped, values ``(q - zp) / scale`` with the reciprocal taken once."""
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("int8_asym_rows: NaN/inf input cannot be quantized to int8")
    lo = xf.amin(-1, keepdim=True).clamp(max=0.0)
    hi = xf.amax(-1, keepdim=True).clamp(min=0.0)
    flat = lo == hi
    mult = torch.where(flat, torch.ones_like(lo), torch.full_like(lo, 255.0) / torch.where(flat, torch.ones_like(hi), hi - lo))
    lo_s, hi_s = lo * mult, hi * mult
    from_min = (lo_s - 128.0) + (hi_s + 127.0) > 0
    zp = torch.where(from_min, -lo_s - 128.0, 127.0 - hi_s).clamp(-128.0, 127.0).round()  # round(): ties to even
    y = xf * mult
    r = torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(-y + 0.5))  # half away from zero
    codes = (r + zp).clamp(-128.0, 127.0)
    return (codes - zp) * (torch.ones_like(mult) / mult)
