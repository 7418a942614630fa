"""Shared ``@triton.jit`` helpers of the triton backend: exact FP8/INT8 encoders, UE8M0 scale rounding, the MoE
activations, and the act-dtype rounding used at every rounding point of ``reference.experts``.

Why hand-written encoders: a backend is checked *bit-exactly* against ``reference.quant`` under a declared recipe, so
every quantizer here computes its codes with IEEE operations whose result is specified bit for bit:

* divisions use ``tl.math.div_rn`` (Triton's ``/`` on fp32 is ``div.full.f32``, an approximation on NVIDIA GPUs);
* FP8 E4M3 codes are produced by :func:`fp8e4m3_code`: the hardware ``cvt.rn.satfinite.e4m3x2.f32`` on the GPU,
  checked over all 2^32 fp32 inputs against :func:`fp8e4m3_code_soft` (clamp to +-448, round-to-nearest-even on the
  E4M3 grid with the ``(a + C) - C`` trick, then integer packing), which the interpreter runs instead (its float
  converter truncates and mishandles NaN);
* UE8M0 (power-of-two) scales come from the exponent bits, never from ``log2``/``exp2`` approximations.

``EMU`` (constexpr) is True only under ``TRITON_INTERPRET=1``: the interpreter multiplies raw bf16 bit patterns in
``tl.dot`` and truncates fp32 -> bf16, so in that mode operands are upcast before ``tl.dot`` and bf16 stores are
rounded explicitly (RNE). On the GPU, ``EMU`` is False and the hardware paths are used.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

# every floating-point launch passes FP_FUSION (FMA contraction pinned on; the why: backends._triton_launch)
from backends._triton_launch import FP_FUSION  # noqa: F401

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Triton 3.6's interpreter cannot index with a runtime loop bound under numpy >= 2.3: patched in one shared place.
import backends._triton_interpreter  # noqa: E402,F401  (applies the patch under TRITON_INTERPRET=1)

# Activation codes shared by the kernels (constexpr ``ACT``); ``activation_code`` maps MoEActivation to them.
ACT_NONE = 0  # identity (no activation: plain GEMM output)
ACT_SILU = 1
ACT_GELU = 2
ACT_GELU_TANH = 3
ACT_SWIGLUOAI = 4
ACT_SWIGLUOAI_UNINTERLEAVE = 5
ACT_SWIGLUSTEP = 6
ACT_SILU_NO_MUL = 11
ACT_GELU_NO_MUL = 12
ACT_RELU2_NO_MUL = 13


@triton.jit
def round_to_bf16_grid(x):
    """fp32 -> fp32 value on the bfloat16 grid, round-to-nearest-even (NaN kept, overflow -> inf as RNE does)."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def to_act(x, DT: tl.constexpr, EMU: tl.constexpr):
    """Round fp32 ``x`` to the activation dtype ``DT`` (one RNE rounding; exact emulation under the interpreter)."""
    if EMU:
        if DT == tl.bfloat16:
            x = round_to_bf16_grid(x)
    return x.to(DT)


# fp32 -> bf16 -> fp32 for two values an instruction: cvt.rn.bf16x2.f32 puts $3's bf16 in the high half and $2's in
# the low half (each half cvt.rn.bf16.f32's bits, NaN canonical alike); a shift and a mask widen them back
BF16X2_ROUND_ASM = tl.constexpr(
    "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $3, $2; shl.b32 $0, p, 16; and.b32 $1, p, 0xffff0000; }")


@triton.jit
def act_rounded(x, DT: tl.constexpr, EMU: tl.constexpr, PACKED: tl.constexpr):
    """``to_act(x, DT, EMU).to(float32)``: fp32 ``x`` rounded once to the activation dtype, as the fp32 value the next
    step computes with (the same bits either way). ``PACKED`` (bf16 on the GPU): two values per conversion
    (``BF16X2_ROUND_ASM``) instead of one ``F2F.BF16.F32`` a value, which issues on sm_90's slow conversion pipe
    beside the activation's ``MUFU`` (docs/notes/triton.md, twenty-sixth and twenty-eighth sessions)."""
    if EMU:
        return to_act(x, DT, EMU).to(tl.float32)
    elif PACKED and DT == tl.bfloat16:
        return tl.inline_asm_elementwise(BF16X2_ROUND_ASM, "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def mul_rn(a, b, EMU: tl.constexpr):
    """IEEE fp32 product, never contracted into an FMA by the compiler (``mul.rn.f32`` on the GPU)."""
    if EMU:
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def div_rn_by_scale(x, s, r, EMU: tl.constexpr, FAST: tl.constexpr = False):
    """``x / s`` (fp32) for the FP8 codes of a per-token quantizer: ``s`` (broadcastable) the row's scale, ``r`` its
    reciprocal ``RN(1 / s)``.

    Default: the IEEE quotient (``div.rn.f32``, about a dozen instructions with a slow-path branch on sm_90).
    ``FAST`` (the GPU only; under the interpreter the IEEE quotient): ``q0 = RN(x * r)``, ``rem = fma(-q0, s, x)``,
    ``q0`` where ``rem`` is 0 (a zero keeps its sign) else ``fma(rem, r, q0)``: three instructions. Its FP8 codes
    equal the IEEE quotient's for every ``x`` of a bf16 / fp16 row and ``s = max(amax / 448, 1 / (448 * 512))`` with
    ``amax`` the row's largest ``|x|`` (tests/test_exact_division.py enumerates every such pair, with IEEE and with
    the flush-to-zero ``mul.rn.ftz`` / ``fma.rn.ftz`` that libdevice's ``mul_rn`` / ``fma_rn`` compile to under
    Triton; the fp32 quotients differ only below 2^-64). Not claimed for fp32 rows, nor for other scale rules.
    """
    if FAST and not EMU:
        q0 = libdevice.mul_rn(x, r)
        rem = libdevice.fma_rn(-q0, s, x)
        return tl.where(rem == 0, q0, libdevice.fma_rn(rem, r, q0))
    else:
        return tl.math.div_rn(x, s)


@triton.jit
def _snap(a, c, EMU: tl.constexpr):
    # (a + c) - c with explicit round-to-nearest adds (no contraction / reassociation possible)
    if EMU:
        return (a + c) - c
    else:
        return libdevice.sub_rn(libdevice.add_rn(a, c), c)


@triton.jit
def fp8e4m3_code_soft(q, EMU: tl.constexpr = False):
    """uint8 FP8 E4M3 code of fp32 ``q`` in integer and fp32 arithmetic: saturate to +-448 (inf too), round to nearest
    even, NaN -> 0x7F.

    Bit-identical to ``reference.quant.to_e4m3_satfinite`` (clamp, then RNE cast) for every non-NaN input; the
    definition :func:`fp8e4m3_code` uses under the interpreter, and the oracle its hardware path is checked against
    over all 2^32 inputs (``tests/test_triton_gpu.py``).
    """
    isnan = q != q
    a = tl.minimum(tl.abs(q), 448.0)
    ab = a.to(tl.int32, bitcast=True)
    e = tl.maximum(((ab >> 23) & 0xFF) - 127, -6)
    # C = 1.5 * 2^(e + 20): fp32 additions at C's binade round to multiples of 2^(e - 3), the E4M3 spacing for
    # |q| in [2^e, 2^(e+1)) (2^-9 for subnormals); C's low mantissa bit is 0, so ties go to even codes.
    c = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = _snap(a, c, EMU)
    rb = r.to(tl.int32, bitcast=True)
    er = ((rb >> 23) & 0xFF) - 127
    code = tl.where(er >= -6, ((er + 7) << 3) | ((rb >> 20) & 7), (r * 512.0).to(tl.int32))
    sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
    code = code | (sign << 7)
    code = tl.where(isnan, 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def fp8e4m3_code(q, EMU: tl.constexpr = False, FINITE: tl.constexpr = False):
    """uint8 FP8 E4M3 code of fp32 ``q``: saturate to +-448 (inf too), round to nearest even, NaN -> 0x7F.

    On the GPU one ``cvt.rn.satfinite.e4m3x2.f32`` per two elements (Triton's fp32 -> fp8e4nv cast rounds to nearest
    even; satfinite clamps overflow and inf to +-448), about 30 integer / fp32 instructions per element fewer than
    :func:`fp8e4m3_code_soft`, which it equals bit for bit; NaN of either sign is mapped to 0x7F explicitly unless
    ``FINITE`` (the caller overwrites the codes of NaN inputs itself). Under the interpreter (``EMU``), whose float
    converter truncates, the software encoder.
    """
    if EMU:
        return fp8e4m3_code_soft(q, EMU)
    else:
        code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        if FINITE:
            return code
        return tl.where(q != q, tl.full(code.shape, 0x7F, tl.uint8), code)


@triton.jit
def int8_code(v, EMU: tl.constexpr = False):
    """int8 of fp32 ``v``: round half to even, saturate to [-128, 127] (``cvt.rni`` on the GPU; the
    ``(v + 1.5*2^23) - 1.5*2^23`` trick under the interpreter)."""
    v = tl.minimum(tl.maximum(v, -128.0), 127.0)
    if EMU:
        r = ((v + 12582912.0) - 12582912.0).to(tl.int32)
    else:
        r = libdevice.float2int_rn(v)
    return r.to(tl.int8)


@triton.jit
def ue8m0_round(s, floor, EXACT: tl.constexpr):
    """Round positive fp32 scales up to powers of two.

    ``EXACT`` (DeepGEMM ``ceil_to_ue8m0``): ``2^(e + (mantissa != 0))``, exponent clamped to [1, 254].
    Otherwise vLLM's ``exp2f(ceilf(log2f(fmaxf(s, floor))))`` as torch evaluates it: ``log2`` of an fp32 value a few
    ULPs above ``2^e`` rounds to the integer ``e``, so those values stay at ``2^e``. The band of mantissas that round
    down is ``m <= floor(ln2 * 2^(E-1))`` with ``E = floor(log2 |e|)`` (half that when ``e = -2^E``, where the
    fp32 spacing below ``|e|`` halves); checked against torch's CPU ``log2`` for every exponent in [-60, 20].
    """
    s = tl.maximum(s, floor)
    b = s.to(tl.int32, bitcast=True)
    ebits = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    if EXACT:
        out_e = ebits + (m != 0).to(tl.int32)
        out_e = tl.minimum(tl.maximum(out_e, 1), 254)
    else:
        e = ebits - 127
        k = tl.abs(e)
        E = ((k >= 2).to(tl.int32) + (k >= 4).to(tl.int32) + (k >= 8).to(tl.int32) + (k >= 16).to(tl.int32)
             + (k >= 32).to(tl.int32) + (k >= 64).to(tl.int32) + (k >= 128).to(tl.int32))
        # floor(ln2 * 2^(E-1)) for E = 0..7: 0 0 1 2 5 11 22 44;
        # halved band (k a power of two, e < 0): 0 0 0 1 2 5 11 22
        t_full = tl.where(E >= 7, 44, tl.where(E >= 6, 22, tl.where(E >= 5, 11, tl.where(
            E >= 4, 5, tl.where(E >= 3, 2, tl.where(E >= 2, 1, 0))))))
        t_half = tl.where(E >= 7, 22, tl.where(E >= 6, 11, tl.where(E >= 5, 5, tl.where(
            E >= 4, 2, tl.where(E >= 3, 1, 0)))))
        pow2neg = (e < 0) & ((k & (k - 1)) == 0)
        t = tl.where(pow2neg, t_half, t_full)
        t = tl.where(k == 0, 0, t)
        out_e = ebits + (m > t).to(tl.int32)
    return (out_e << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_group_scale(amax, amax_floor, ue8m0_floor, USE_UE8M0: tl.constexpr, UE8M0_EXACT: tl.constexpr,
                    SCALE_INV: tl.constexpr):
    """Group scale from fp32 amax under a recipe: ``max(amax, floor) / 448`` (or ``1 / (448 / amax)``),
    UE8M0-rounded when asked."""
    a = tl.maximum(amax, amax_floor)
    if SCALE_INV:
        s = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), tl.math.div_rn(tl.full(a.shape, 448.0, tl.float32), a))
    else:
        s = tl.math.div_rn(a, tl.full(a.shape, 448.0, tl.float32))
    if USE_UE8M0:
        s = ue8m0_round(s, ue8m0_floor, UE8M0_EXACT)
    return s


@triton.jit
def _max_nan(a, b):
    # a max that propagates NaN (max.NaN.f32): the reduction of |y| is NaN if any element is, inf if any is inf
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def finite_abs(y):
    """``(|y| with NaN / inf as 0, 1 where NaN / inf)`` elementwise: what the row amax and its poisoning read."""
    ay = tl.abs(y)
    badv = (y != y) | (ay == float("inf"))
    return tl.where(badv, 0.0, ay), badv.to(tl.int32)


@triton.jit
def tile_amax(y):
    """Per row of a tile: (largest finite |y|, count of NaN / inf)."""
    ay, bad = finite_abs(y)
    return tl.max(ay, axis=1), tl.sum(bad, axis=1)


@triton.jit
def fp8_quant_rows(y, amax_floor, ue8m0_floor, USE_UE8M0: tl.constexpr, UE8M0_EXACT: tl.constexpr,
                   SCALE_INV: tl.constexpr, RECIP_MUL: tl.constexpr, EMU: tl.constexpr = False):
    """Quantize a ``[R, G]`` fp32 tile as R groups of G (one group per row): returns (uint8 codes, fp32 scales [R]).

    A row holding NaN/inf is poisoned (scale NaN, codes 0x7F), as ``reference.quant`` defines. Masked-out columns
    must be passed as 0.
    """
    # one NaN-propagating max per element finds both the amax and the poisoned rows (NaN or inf: not <= FLT_MAX);
    # a poisoned row's scale and codes are computed from garbage and overwritten below
    if EMU:  # the interpreter runs a combine_fn reduction one element pair at a time in Python (about 100x its
        # built-in max): the finite amax and the poisoned rows as inf, which gives the same scales and codes below
        amax, nbad = tile_amax(y)
        amax = tl.where(nbad > 0, float("inf"), amax)
    else:
        amax = tl.reduce(tl.abs(y), 1, _max_nan)
    poisoned = ~(amax <= 3.4028234663852886e38)
    s = fp8_group_scale(amax, amax_floor, ue8m0_floor, USE_UE8M0, UE8M0_EXACT, SCALE_INV)
    if RECIP_MUL:
        inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        q = mul_rn(y, tl.broadcast_to(inv[:, None], y.shape), EMU)
    else:
        q = tl.math.div_rn(y, tl.broadcast_to(s[:, None], y.shape))
    codes = fp8e4m3_code(q, EMU, FINITE=True)
    codes = tl.where(poisoned[:, None], 0x7F, codes.to(tl.int32)).to(tl.uint8)
    s = tl.where(poisoned, float("nan"), s)
    return codes, s


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu_erf(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_tanh(x):
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 * _sigmoid(2.0 * z) - 1.0))


@triton.jit
def apply_act(g, u, ACT: tl.constexpr, alpha, beta, limit, HAS_LIMIT: tl.constexpr):
    """The MoE activation on fp32 gate ``g`` and up ``u`` (``u`` ignored by the *_NO_MUL forms and ACT_NONE).

    Formulas as ``reference.activation.apply_moe_activation``; ``alpha``/``beta``/``limit`` are the resolved
    values (defaults filled in on the host); ``HAS_LIMIT`` says whether SILU / SWIGLUOAI_UNINTERLEAVE clamp.
    """
    if ACT == 0:
        y = g
    elif ACT == 1:
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g * _sigmoid(g) * u
    elif ACT == 2:
        y = _gelu_erf(g) * u
    elif ACT == 3:
        y = _gelu_tanh(g) * u
    elif ACT == 4:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1.0) * g * _sigmoid(alpha * g)
    elif ACT == 5:
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g * _sigmoid(alpha * g) * (u + beta)
    elif ACT == 6:
        y = tl.minimum(g * _sigmoid(g), limit) * tl.minimum(tl.maximum(u, -limit), limit)
    elif ACT == 11:
        y = g * _sigmoid(g)
    elif ACT == 12:
        y = _gelu_erf(g)
    else:  # ACT == 13
        r = tl.maximum(g, 0.0)
        y = r * r
    return y


@triton.jit
def route_local_experts(ids_ptr, emap_ptr, offs, numel, num_ids, HAS_MAP: tl.constexpr):
    """Routes ``offs`` (``< numel``) of the flat ``topk_ids``: ``(mask, local expert)``, the local expert -1 for an id
    outside ``[0, num_ids)`` (a -1 sentinel included) or one the expert map (``HAS_MAP``) drops. The route layout's
    kernels (align.py) and ``fused_moe_kernel``'s ``ROUTE_TILES`` read routes through it."""
    m = offs < numel
    ids = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
    valid = m & (ids >= 0) & (ids < num_ids)
    if HAS_MAP:
        le = tl.load(emap_ptr + tl.where(valid, ids, 0), mask=valid, other=-1).to(tl.int32)
    else:
        le = ids
    return m, tl.where(valid, le, -1)
