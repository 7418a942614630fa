"""Weight-only INT4 / INT8 (WNA16): integer weights with one scale (and optionally one zero point) per group of K,
activations left in bf16 / fp16.

The weight format of vLLM 0.33's ``TritonWNA16Experts`` (``fused_moe/experts/triton_moe.py``; kernel
``fused_moe.py::fused_moe_kernel_gptq_awq``), chosen by ``fused_moe/oracle/int_wna16.py`` (quant keys
``kInt4Static``, ``kInt4StaticAsym``, ``kInt4Static32``, ``kInt4Static32Asym``, ``kInt8Static``). Stored as the
Triton kernel reads it:

- codes are *unsigned*: INT4 ``u in [0, 15]``, two per byte along K (element ``2j`` in the low nibble of byte ``j``),
  ``(..., N, K // 2)`` uint8; INT8 ``u in [0, 255]``, ``(..., N, K)`` uint8;
- symmetric formats have an implicit zero point (``uint4b8``: 8; ``uint8b128``: 128), asymmetric INT4 a zero point
  per group, packed two per byte along N (row ``2i`` in the low nibble): ``(..., N // 2, K // group)`` uint8;
- scales ``(..., N, K // group)`` in the activation dtype (vLLM stores them in ``params_dtype``).

Dequantization (the kernel, per K block): ``b = ((u - zp) * scale).to(compute_type)``: the difference times the
scale in fp32 (exact: at most 9 x 8 significant bits), rounded once to the activation dtype. The GEMM then runs on
those rounded weights with fp32 accumulation. That rounding is a rounding point of the scheme: a kernel that
keeps the fp32 product differs from vLLM.

Quantization (the reference's, to build test weights; mirrors ``quantization/utils/quant_utils.py::
quantize_weights``): per group along K, in fp32,

- symmetric: ``s = max(|max| / qmax, |min| / |qmin|)`` (qmax, qmin = 7, -8 or 127, -128), stored as
  ``s' = scale_dtype(s)``; ``u = clamp(rne(w / s'), qmin, qmax) + bias`` (bias 8 or 128);
- asymmetric INT4: ``s = max(max - min, 1e-5) / 15``, ``s' = scale_dtype(s)``, ``zp = clamp(rne(-min / s'), 0, 15)``,
  ``u = clamp(rne(w / s') + zp, 0, 15)``.

Codes are computed with the *stored* scale ``s'`` (vLLM's helper divides by the unrounded ``s`` and then casts
the scale), so every code is the nearest one under the scale the kernel multiplies; and the zero point is
``rne(-min / s')`` where vLLM takes ``rne(|min / s|)`` (the same whenever ``min <= 0``; for an all-positive group
vLLM's absolute value gives a zero point that cannot represent ``min``). A zero group (``s = 0`` symmetric) gets
codes of the zero point.

Integers have no NaN: the quantizer raises ValueError on NaN / inf input.
"""

from __future__ import annotations

import torch

from ._common import check_dtype, check_high_precision, check_last_dim_multiple, check_positive_int

__all__ = ["WNA16_BIAS", "pack_uint4", "unpack_uint4", "wna16_quantize", "wna16_dequantize"]

#: Implicit zero point of the symmetric formats (vLLM ``scalar_types.uint4b8`` / ``uint8b128``).
WNA16_BIAS = {4: 8, 8: 128}


def _check_bits(num_bits: int) -> None:
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits must be 4 or 8 (WNA16 INT4 / INT8), got {num_bits!r}")


def pack_uint4(u: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack unsigned 4-bit values two per byte along ``dim``: element ``2j`` in the low nibble of byte ``j``.

    The layout of ``fused_moe_kernel_gptq_awq``'s INT4 weights (``dim=-1``, K) and zero points (``dim=-2``, N).

    Args: u uint8 / int integer tensor with values in [0, 15]; ``u.shape[dim]`` even.
    Returns: uint8, ``u.shape`` with ``dim`` halved.
    Raises: TypeError (dtype); ValueError (odd length along ``dim``, values out of [0, 15]).
    """
    check_dtype(u, "u", (torch.uint8, torch.int8, torch.int32, torch.int64))
    if u.dim() == 0 or u.shape[dim] % 2:
        raise ValueError(f"pack_uint4: dim {dim} of {tuple(u.shape)} must have an even length")
    if u.numel() and (int(u.min()) < 0 or int(u.max()) > 15):
        raise ValueError(f"pack_uint4: values must be in [0, 15], got [{int(u.min())}, {int(u.max())}]")
    v = u.to(torch.int32).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 2, 2)
    return (v[..., 0] | (v[..., 1] << 4)).to(torch.uint8).movedim(-1, dim)


def unpack_uint4(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_uint4`: uint8 -> uint8 values in [0, 15], ``dim`` doubled. Raises TypeError."""
    check_dtype(packed, "packed", (torch.uint8,))
    if packed.dim() == 0:
        raise ValueError("unpack_uint4 needs at least one dimension")
    v = packed.to(torch.int32).movedim(dim, -1)
    out = torch.stack((v & 0xF, v >> 4), dim=-1).reshape(*v.shape[:-1], v.shape[-1] * 2)
    return out.to(torch.uint8).movedim(-1, dim)


def wna16_quantize(
    w: torch.Tensor,
    *,
    num_bits: int = 4,
    group_size: int = 128,
    zero_points: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize weights ``w (..., N, K)`` to WNA16 (see the module docstring for the rule and the layout).

    Args:
        w: float16 / bfloat16 / float32 ``(..., N, K)``; ``K % group_size == 0``, K even for INT4.
        num_bits: 4 or 8. group_size: positive, divides K. zero_points: asymmetric INT4 (``kInt4StaticAsym`` /
            ``kInt4Static32Asym``); INT8 is symmetric only (``kInt8Static``), N even for INT4 zero points.
        scale_dtype: the stored scales' dtype (the activation dtype: bf16 or fp16; fp32 allowed).

    Returns:
        ``(qweight, scales, zp)``: qweight uint8 ``(..., N, K // 2)`` (INT4) or ``(..., N, K)`` (INT8); scales
        ``scale_dtype`` ``(..., N, K // group_size)``; zp uint8 ``(..., N // 2, K // group_size)`` or None.

    Raises:
        TypeError: dtype of w. ValueError: bad num_bits / group_size / shapes, INT8 with zero points, NaN / inf.
    """
    check_high_precision(w, "w")
    _check_bits(num_bits)
    check_positive_int(group_size, "group_size")
    if w.dim() < 2:
        raise ValueError(f"wna16_quantize: w must be (..., N, K), got {tuple(w.shape)}")
    check_last_dim_multiple(w, group_size, "wna16_quantize")
    if scale_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"wna16_quantize: scale_dtype must be bf16, fp16 or fp32, got {scale_dtype}")
    if zero_points and num_bits != 4:
        raise ValueError("wna16_quantize: zero points are defined for INT4 only (vLLM has no kInt8StaticAsym)")
    if num_bits == 4 and w.shape[-1] % 2:
        raise ValueError(f"wna16_quantize: INT4 packs two per byte along K; K={w.shape[-1]} is odd")
    if zero_points and w.shape[-2] % 2:
        raise ValueError(f"wna16_quantize: INT4 zero points pack two per byte along N; N={w.shape[-2]} is odd")
    wf = w.to(torch.float32)
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("wna16_quantize: w contains NaN or inf; integer formats cannot represent them")
    G = w.shape[-1] // group_size
    wg = wf.reshape(*w.shape[:-1], G, group_size)
    mx, mn = wg.amax(dim=-1), wg.amin(dim=-1)
    if zero_points:
        qmax = 15
        s = (mx - mn).clamp(min=1e-5) / torch.tensor(float(qmax))
        s_st = s.to(scale_dtype).to(torch.float32)
        zp = torch.round(-mn / s_st).clamp(0, qmax)
        u = (torch.round(wg / s_st.unsqueeze(-1)) + zp.unsqueeze(-1)).clamp(0, qmax)
        zp_out = pack_uint4(zp.to(torch.uint8), dim=-2)
    else:
        qmax, qmin, bias = (7, -8, 8) if num_bits == 4 else (127, -128, 128)
        s = torch.maximum(mx.abs() / torch.tensor(float(qmax)), mn.abs() / torch.tensor(float(-qmin)))
        s_st = s.to(scale_dtype).to(torch.float32)
        safe = torch.where(s_st == 0, torch.ones_like(s_st), s_st).unsqueeze(-1)
        q = torch.round(wg / safe).clamp(qmin, qmax)
        q = torch.where((s_st == 0).unsqueeze(-1), torch.zeros_like(q), q)
        u = q + bias
        zp_out = None
    u = u.to(torch.uint8).reshape(w.shape)
    qweight = pack_uint4(u) if num_bits == 4 else u
    return qweight, s_st.to(scale_dtype), zp_out


def wna16_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zp: torch.Tensor | None = None,
    *,
    num_bits: int = 4,
    group_size: int = 128,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The weight ``fused_moe_kernel_gptq_awq`` multiplies: ``((u - zp) * scale).to(out_dtype)``, ``(..., N, K)``.

    ``u - zp`` and its product with the scale are exact in fp32; the one rounding is to ``out_dtype`` (the kernel's
    ``compute_type``, the activation dtype). ``zp`` None means the symmetric bias (8 / 128).

    Args: qweight uint8 ``(..., N, K // 2)`` (INT4) / ``(..., N, K)`` (INT8); scales float ``(..., N, K // group)``;
        zp uint8 ``(..., N // 2, K // group)`` (INT4 only) or None.
    Raises: TypeError (dtypes); ValueError (num_bits, shapes that do not match, INT8 with zp).
    """
    check_dtype(qweight, "qweight", (torch.uint8,))
    _check_bits(num_bits)
    check_positive_int(group_size, "group_size")
    if not scales.is_floating_point():
        raise TypeError(f"scales must be floating point, got {scales.dtype}")
    u = unpack_uint4(qweight) if num_bits == 4 else qweight
    check_last_dim_multiple(u, group_size, "wna16_dequantize")
    G = u.shape[-1] // group_size
    if tuple(scales.shape) != tuple(u.shape[:-1]) + (G,):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match weights {tuple(u.shape)} / group "
                         f"{group_size}")
    if zp is None:
        z = torch.full(scales.shape, float(WNA16_BIAS[num_bits]), device=scales.device)
    else:
        if num_bits != 4:
            raise ValueError("wna16_dequantize: zero points are defined for INT4 only")
        check_dtype(zp, "zp", (torch.uint8,))
        z = unpack_uint4(zp, dim=-2).to(torch.float32)
        if tuple(z.shape) != tuple(scales.shape):
            raise ValueError(f"zp unpacks to {tuple(z.shape)}, scales are {tuple(scales.shape)}")
    ug = u.to(torch.float32).reshape(*u.shape[:-1], G, group_size)
    y = (ug - z.unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)
    return y.reshape(u.shape).to(out_dtype)
