"""INT formats of vLLM 0.33's fused-MoE paths that the seeds lack (issue 41): block INT8 W8A8 and the CPU INT4 W4A8
experts' in-kernel INT8 activations.

Block INT8 W8A8 (``fused_moe/fused_moe.py`` with ``use_int8_w8a8`` and a ``block_shape``; vLLM's
``tests/kernels/moe/test_block_int8.py``): weights carry one fp32 scale per ``bn x bk`` block, activations are
quantized per 1 x ``bk`` group by ``quantization/utils/int8_utils.py::per_token_group_quant_int8``, whose codes are
*truncated* toward zero (vLLM's test ``test_block_int8_quantization_truncates_fractional_values``), unlike the
per-token INT8 quantizer's round-to-nearest-even.

CPU INT4 W4A8 (``fused_moe/experts/cpu_int4_moe.py``, keys ``kInt4W4A8Static{Channel,Group32,Group64,Group128,
Group}Sym`` with activation key None): the experts take unquantized activations and ``csrc/cpu/
dynamic_4bit_int_moe_cpu.cpp`` calls ``at::_dyn_quant_matmul_4bit`` for both GEMMs, which quantizes its left-hand
side to INT8 per row, *asymmetrically* (a zero point), inside the GEMM. The rule is PyTorch's
(``aten/src/ATen/native/cpu/int4mm_kernel.cpp``: ``ref_dyn_quant_matmul_4bit_channelwise_kernel`` /
``_groupwise_kernel``'s ``input_quant_pack_8bit_channelwise``; on AArch64 with KleidiAI the same "qai8dx" packing
``kai_run_lhs_quant_pack_qai8dxp_*``, which the fallback reproduces): see :func:`dyn_quant_int8_per_row_asym`.

Integers have no NaN: every quantizer here raises ValueError on NaN or inf input.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from ._common import cdiv, check_block_weight, check_dtype, check_high_precision, check_last_dim_multiple, check_positive_int

__all__ = [
    "per_token_group_quant_int8",
    "per_block_quant_int8",
    "dyn_quant_int8_per_row_asym",
    "dequant_int8_per_row_asym",
    "int4_w4a8_int8_quantize_weight",
    "int4_w4a8_int8_dequantize_weight",
]


def _check_finite(xf: torch.Tensor, fn: str) -> None:
    if not bool(torch.isfinite(xf).all()):
        raise ValueError(f"{fn}: input contains NaN or inf; integer formats cannot represent them")


def per_token_group_quant_int8(
    x: torch.Tensor,
    group_size: int,
    eps: float = 1e-10,
    dtype: torch.dtype = torch.int8,
    *,
    quant_op: Literal["reciprocal_multiply", "divide"] = "reciprocal_multiply",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric INT8 per 1 x ``group_size`` group along the last dim, codes truncated toward zero.

    Mirrors vLLM 0.33 ``quantization/utils/int8_utils.py::per_token_group_quant_int8`` (its signature: ``x,
    group_size, eps=1e-10``): on CUDA ``torch.ops._C.per_token_group_quant_int8``
    (``csrc/quantization/w8a8/fp8/per_token_group_quant.cu``, ``per_token_group_quant_8bit_kernel`` /
    ``_register_kernel`` with ``DST_DTYPE = int8_t``), in fp32 per group::

        absmax = max(eps, max |x|)          (the reduction starts at eps)
        s      = absmax / 127               (IEEE division)
        inv    = 1 / s                      ("one div.rn per group")
        q      = int8_t(clamp(x * inv, -128, 127))    C++ float -> int8_t conversion: truncation toward zero

    ``quant_op="divide"`` is the Triton fallback of non-CUDA platforms (``_per_token_group_quant_int8``:
    ``tl.clamp(y / y_s, ...).to(int8)``, also truncating). Scales are fp32 ``(..., K // group_size)`` row-major.
    A zero group gets ``s = 1e-10 / 127`` and codes 0.

    Args: x ``(..., K)`` float16 / bfloat16 / float32, ``K % group_size == 0``; group_size positive; eps >= 0;
        dtype: the codes' dtype, ``torch.int8`` only (vLLM: "only torch.int8 is supported for now").
    Returns: ``(q int8 like x, s float32 (..., K // group_size))``.
    Raises: TypeError (dtype of x); ValueError (``K % group_size``, NaN / inf, 0-d input, unknown quant_op, a
        ``dtype`` other than int8).
    """
    fn = "per_token_group_quant_int8"
    if dtype != torch.int8:
        raise ValueError(f"{fn}: only torch.int8 codes are defined (as vLLM's), got {dtype}")
    check_high_precision(x, "x")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension")
    g = check_positive_int(group_size, "group_size")
    check_last_dim_multiple(x, g, fn)
    if quant_op not in ("reciprocal_multiply", "divide"):
        raise ValueError(f"{fn}: quant_op must be 'reciprocal_multiply' (CUDA) or 'divide' (Triton), got {quant_op!r}")
    xf = x.to(torch.float32)
    _check_finite(xf, fn)
    xg = xf.reshape(*x.shape[:-1], x.shape[-1] // g, g)
    absmax = xg.abs().amax(dim=-1) if g else torch.zeros(xg.shape[:-1])
    absmax = torch.clamp(absmax, min=float(eps))
    s = absmax / torch.full_like(absmax, 127.0)
    if quant_op == "reciprocal_multiply":
        y = xg * (torch.ones_like(s) / s).unsqueeze(-1)
    else:
        y = xg / s.unsqueeze(-1)
    q = torch.trunc(y.clamp(-128.0, 127.0)).to(torch.int8)
    return q.reshape(x.shape), s


def per_block_quant_int8(w: torch.Tensor, block_shape: Sequence[int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 weights with one fp32 scale per ``bn x bk`` block (the checkpoint side of block INT8 W8A8).

    The kernel receives codes and scales, so this is the reference's checkpoint rule, not a kernel's: per block
    ``s = max(|w|) / 127`` (fp32; an all-zero block gets ``s = 1e-10 / 127``), ``q = clamp(rne(w / s), -127, 127)``.
    Partial blocks at the N / K edges are zero-padded for the amax. (vLLM's test helper
    ``tests/kernels/quant_utils.py::per_block_cast_to_int8`` scales by 256 / amax and wraps: not a usable rule.)

    Args: w ``(N, K)`` or ``(E, N, K)`` float16 / bfloat16 / float32; block_shape ``(bn, bk)`` positive.
    Returns: ``(q int8 like w, s float32 (..., ceil(N / bn), ceil(K / bk)))``.
    Raises: TypeError (dtype); ValueError (rank, block shape, NaN / inf).
    """
    fn = "per_block_quant_int8"
    bn, bk = check_block_weight(w, block_shape, fn)
    wf = w.to(torch.float32)
    _check_finite(wf, fn)
    n, k = w.shape[-2:]
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    batch = w.shape[:-2]
    padded = torch.zeros(*batch, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = wf
    view = padded.reshape(*batch, nb, bn, kb, bk)
    amax = view.abs().amax(dim=(-3, -1)).clamp(min=1e-10)
    s = amax / torch.full_like(amax, 127.0)
    q = torch.round(view / s.unsqueeze(-1).unsqueeze(-3)).clamp(-127, 127)
    q = q.reshape(*batch, nb * bn, kb * bk)[..., :n, :k].to(torch.int8).contiguous()
    return q, s


def dyn_quant_int8_per_row_asym(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU INT4 W4A8 GEMMs' own activation quantization: dynamic *asymmetric* INT8 per row, in fp32.

    Mirrors ``at::_dyn_quant_matmul_4bit``'s LHS packing, which vLLM 0.33's ``csrc/cpu/dynamic_4bit_int_moe_cpu.cpp``
    calls for both GEMMs of ``experts/cpu_int4_moe.py`` (PyTorch ``aten/src/ATen/native/cpu/int4mm_kernel.cpp``,
    ``input_quant_pack_8bit_channelwise``; KleidiAI's ``qai8dx`` packing on AArch64). Per row, fp32 throughout::

        rmin  = min(0, min x),  rmax = max(0, max x)
        scale = 1 if rmin == rmax else 255 / (rmax - rmin)        (the quantizing multiplier)
        recip = 1 / scale                                          (stored: the dequantizing scale)
        dmin, dmax = rmin * scale, rmax * scale
        zp    = (-128 - dmin) if (-128 + dmin) + (127 + dmax) > 0 else (127 - dmax)
        zp    = lrintf(clamp(zp, -128, 127))                       (round half to even)
        q     = clamp(std::round(x * scale) + zp, -128, 127)      (std::round: half away from zero)

    Dequantized (as the kernel's integer dot product ``sum (q - zp) w`` times ``recip``): ``(q - zp) * recip``
    (:func:`dequant_int8_per_row_asym`). The rows are quantized independently, so quantizing the rows routed to an
    expert (the kernel) and quantizing every row once give the same codes.

    Args: x ``(..., K)`` float16 / bfloat16 / float32 (bf16 / fp16 are widened exactly, as the kernel casts them).
    Returns: ``(q int8 like x, recip float32 (..., 1), zp int32 (..., 1))``.
    Raises: TypeError (dtype); ValueError (NaN / inf, 0-d input).
    """
    fn = "dyn_quant_int8_per_row_asym"
    check_high_precision(x, "x")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension")
    xf = x.to(torch.float32)
    _check_finite(xf, fn)
    if xf.shape[-1]:
        mn, mx = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
    else:
        mn = mx = torch.zeros(*xf.shape[:-1], 1)
    zero = torch.zeros_like(mn)
    rmin, rmax = torch.minimum(zero, mn), torch.maximum(zero, mx)
    same = rmin == rmax
    scale = torch.where(same, torch.ones_like(rmin), torch.full_like(rmin, 255.0) / torch.where(same, torch.ones_like(rmin), rmax - rmin))
    recip = torch.ones_like(scale) / scale
    dmin, dmax = rmin * scale, rmax * scale
    err = (dmin + (-128.0)) + (dmax + 127.0)  # fp32: (qmin + descaled_min) + (qmax + descaled_max)
    zp = torch.where(err > 0, (-dmin) + (-128.0), (-dmax) + 127.0)  # qmin - dmin, qmax - dmax
    zp = torch.round(zp.clamp(-128.0, 127.0)).to(torch.int32)  # lrintf: nearest, ties to even
    p = xf * scale
    r = torch.sign(p) * torch.floor(p.abs() + 0.5)  # std::round: half away from zero (exact for |p| < 2^23)
    q = (r + zp.to(torch.float32)).clamp(-128.0, 127.0).to(torch.int8)
    return q, recip, zp


def dequant_int8_per_row_asym(q: torch.Tensor, recip: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    """``(q - zp) * recip`` in fp32 (one rounding of the exact integer ``q - zp`` times the fp32 ``recip``), the value
    the CPU kernel's integer dot product ``sum (q - zp) w`` scales by ``recip``. Raises TypeError if q is not int8."""
    check_dtype(q, "q", (torch.int8,))
    return (q.to(torch.int32) - zp.to(torch.int32)).to(torch.float32) * recip.to(torch.float32)


def int4_w4a8_int8_quantize_weight(w: torch.Tensor, group_size: int | None = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 weights stored as int8 values in [-8, 7] with bf16 group scales (``group_size``) or fp32 channel scales
    (``group_size=None``): the format of vLLM 0.33's ``kInt4W4A8StaticGroup{32,64,128}Sym`` /
    ``kInt4W4A8StaticGroupSym`` / ``kInt4W4A8StaticChannelSym`` (``experts/cpu_int4_moe.py``; the kernel packs the
    values as nibbles ``v + 8`` with ``at::_dyn_quant_pack_4bit_weight``: bf16 group scales for the groupwise
    kernel, fp32 for the channelwise one).

    Checkpoint rule (the kernel receives values and scales): per group ``s = max(|max w| / 7, |min w| / 8)`` in
    fp32, stored in the scale dtype (bf16 for groups, fp32 per channel), then ``q = clamp(rne(w / s_stored), -8, 7)``
    with the *stored* scale, so the pair is self-consistent; an all-zero group gets ``s = 1`` and codes 0.

    Args: w ``(..., N, K)`` float16 / bfloat16 / float32; group_size a positive multiple of 32 dividing K (the
        kernel's rule: ``!(block_size % 32) && !(K % block_size)``), or None per output channel.
    Returns: ``(q int8 (..., N, K) in [-8, 7], s (..., N, K // group_size) bf16 | (..., N, 1) fp32)``.
    Raises: TypeError (dtype); ValueError (group size, NaN / inf).
    """
    fn = "int4_w4a8_int8_quantize_weight"
    check_high_precision(w, "w")
    K = w.shape[-1]
    if group_size is None:
        g, sdt = K, torch.float32
    else:
        g = check_positive_int(group_size, "group_size")
        if g % 32:
            raise ValueError(f"{fn}: group_size must be a multiple of 32 (the kernel's rule), got {g}")
        check_last_dim_multiple(w, g, fn)
        sdt = torch.bfloat16
    wf = w.to(torch.float32)
    _check_finite(wf, fn)
    wg = wf.reshape(*w.shape[:-1], K // g, g)
    s = torch.maximum(wg.amax(-1).abs() / torch.full_like(wg.amax(-1), 7.0),
                      wg.amin(-1).abs() / torch.full_like(wg.amin(-1), 8.0))
    s = torch.where(s == 0, torch.ones_like(s), s).to(sdt)
    q = torch.round(wg / s.to(torch.float32).unsqueeze(-1)).clamp(-8, 7).to(torch.int8).reshape(w.shape)
    return q, s


def int4_w4a8_int8_dequantize_weight(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``q * s`` per group along K in fp32 (exact: a 4-bit integer times a bf16 / fp32 scale); the group size is
    ``K // s.shape[-1]`` (channelwise: one scale per row). Raises TypeError / ValueError on dtypes or shapes."""
    check_dtype(q, "q", (torch.int8,))
    K, G = q.shape[-1], s.shape[-1]
    if G == 0 or K % G or tuple(s.shape[:-1]) != tuple(q.shape[:-1]):
        raise ValueError(f"scales {tuple(s.shape)} do not tile weights {tuple(q.shape)} along K")
    qg = q.to(torch.float32).reshape(*q.shape[:-1], G, K // G)
    return (qg * s.to(torch.float32).unsqueeze(-1)).reshape(q.shape)
