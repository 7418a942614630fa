"""The error model of the experts step: how far a *conforming* kernel's output may lie from the reference's.

Both the reference and a kernel compute the same rounding points (``reference.experts``: GEMM1 -> ROUND(act dtype)
-> activation -> ROUND -> requantize a2 -> GEMM2 -> ROUND -> weighted top-k sum -> ROUND). They differ only in
how each GEMM accumulates: fp32 in another order, or, on tensor cores with FP8 operands, a narrower partial
accumulator that a conforming kernel promotes into fp32 at least every ``promote_every`` K elements (DeepGEMM and
CUTLASS promote every 128; DeepSeek-V3 technical report, section 3.3.2). Those small accumulation differences are
then *amplified* where the pipeline rounds: a value that lands near a rounding boundary flips to the neighbouring
grid point. The model follows the difference through every stage and gives, per case, a bound on the three metrics
of ``reference.metrics`` (``max_norm``, ``rms_norm``, ``calc_diff``). Every constant is data in
``specs/tolerances.toml [error_model]``; nothing is fitted to a kernel's measurements.

Derivation (all errors relative to the RMS of the tensor at that stage; ``m1`` = mean |difference|, ``m2`` = mean
squared difference, both tracked because rounding turns *mean absolute* input differences into *squared* output
differences):

1. **Accumulation** of a length-``n`` dot product whose running sum has magnitude ``sqrt(k) * sigma`` after ``k``
   terms: each addition into an accumulator with unit roundoff ``u`` errs by at most ``u * |S_k|`` (uniform, random
   sign), so the error variance is ``sum_k u^2 k sigma^2 / 3 = u^2 n^2 sigma^2 / 6`` against ``|y|^2 = n sigma^2``::

       acc(n, u) = u * sqrt(n / 6)                         (relative RMS)

   fp32: ``u = 2^-24``. An MMA partial accumulator with ``b`` mantissa bits (Hopper FP8 wgmma: about 14,
   ``mma_mantissa_bits``) restarted at every promotion: ``acc(min(n, P), 2^-b)`` with ``P = promote_every``; the
   fp32 sum of the ``n / P`` promoted partials adds ``acc(n / P, 2^-24)``, negligible. Two implementations
   differ by the root sum of squares of their two accumulation errors.
   ``Accumulation.fast()`` (no promotion: ``P = n``) is the opt-in recipe of ``torch._scaled_mm(use_fast_accum=True)``
   and vLLM's in-place ``tl.dot(a, b, acc)``; its error grows with sqrt(K) and it is never the default.

1b. **A 16-bit-operand MMA** (bf16 / fp16 tensor cores) does not round to nearest: every step of ``B`` products
   (one k-step, ``mma16_block``) is aligned with the accumulator to the largest magnitude among them, truncated to
   ``p`` bits below it (``mma16_align_bits``) and normalized to fp32 *toward zero* (Fasi et al. 2021; Khattak &
   Mikaitis 2025). The normalization drops on average ``c = 2^-24 / (2 ln 2)`` of the running sum ``S_k`` (half an ulp of a
   log-distributed mantissa), always toward zero, so over ``m = n / B`` steps the error is ``-c sum_k S_k``: for a
   random walk that has RMS ``c sigma_B m^1.5 / sqrt 3`` against ``|S_m| = sigma_B sqrt m``, a relative ``c m / sqrt 3``,
   linear in ``n`` where round-to-nearest grows as ``sqrt n``. The truncated products and the normalization's spread
   add ``0.541 (B 2^-2p / 3 + 2^-46 / 12) m / 2`` in mean square (``mma16_rel``). Emulated (float64, bit by bit) this
   bound holds with 1.3-2.2x to spare at n = 1024..14336, as ``acc`` does for fp32. It applies to GEMMs whose operands
   are bf16 / fp16 (unquantized, and weight-only schemes dequantized to the act dtype), never to fp32 operands.
   Its mean part is a *shrink proportional to the result*: the regression of ``-c sum_k S_k`` on ``S_m`` is
   ``c m / 2``, 3/4 of the mean square (``Accumulation.shrink``); step 3 rounds it as a proportional difference.
   The SM90 parameters were read off test vectors (``tools/diag/mma_probe.py`` on an H200, 2026-11-26): cuBLAS, Triton
   wgmma and mma.sync all keep 25 bits below the step's largest magnitude, truncate negative terms toward zero, and
   align the accumulator with the products.

2. **A GEMM** sums many independent input differences: the relative mean square carries through
   (``m2_out = m2_in + acc^2`` for a dot product with independent weights). Differences come in two kinds, tracked
   apart: *dense* ones (every element a little: accumulation order), near Gaussian, whose mean |value| is
   ``sqrt(2 / pi)`` of their RMS; and *sparse* ones (a fraction ``q`` of the elements off by a whole grid step:
   rounding flips), whose mean |value| is only ``sqrt(2 / pi) sqrt(q m2)``. A GEMM row sums ``n`` inputs of one
   row, so a sparse fraction ``q`` reaches a fraction ``min(1, n q)`` of the output rows (all of their elements);
   at 1 it has become dense.

3. **Rounding to a grid** with spacing ``s`` at an element: two values ``d`` apart, each rounded, differ by ``k`` or
   ``k + 1`` steps where ``|d| / s = k + f`` (the latter with probability ``f``), so ``E[diff^2] = s^2 (k^2 +
   (2k + 1) f)`` with variance ``s^4 f (1 - f) (2k + 1)^2`` (``_round_pair``): ``s |d|`` for a difference under a
   step (a *flip* with probability ``|d| / s``), never less than ``d^2`` (a rounding never shrinks a difference). For a floating
   format ``s = 2^-p |v| / mant``; INT8's uniform grid has ``s = tail(n) / 127`` of the RMS, ``tail(n) = sqrt(2 ln n)``.
   The expectation is taken by quadrature (``_expect``) over the stage's values (``_stage_values``: Gaussian for GEMM
   outputs, the activation's output on Gaussian gate and up otherwise, a heavy-tailed product), logarithmically
   distributed mantissas and the difference, which comes in three kinds that round differently:
   *additive* (value-independent, Gaussian: accumulation order; it flips small values most), *proportional*
   (``d = eps v``: the tensor core's shrink of step 1b; an earlier flip, which is one step of its grid, a fixed
   fraction of its element: its flips land at any value, and ``E[diff^2] = 2^-p E[1/mant] eps`` per element is
   1.57x the additive form's at equal mean square), and *kept* (an additive difference beyond the step at values far
   smaller than it: a fixed few elements that stay different). A flip's relative size and the mean square of the
   values where flips land are carried to the next rounding. A GEMM turns the rows a flip reaches into an additive
   difference over those rows.

4. **Dynamic scales**: a scale computed from the amax of a group follows the group's largest element. Where two
   conforming kernels differ there (a flip of that element: probability ``qt``, tracked for the largest values, which
   additive differences rarely flip), the whole group is rounded on a grid moved by that element's relative step: a
   proportional difference of every element (step 3). A dense difference moves it by ``sqrt(d2) / tail(group)``
   always. Per token or per 1xG group, the moved groups are ``groups x qt`` events (step 7); a *per-tensor* scale is
   one draw, all or nothing, so its move is counted in full when ``qt`` exceeds the normal tail beyond ``z_events``. A power-of-two (UE8M0, MX) scale moves
   only across a power of two, under which a floating grid is invariant: no term. Static scales never move.

5. **The activation**: a gated activation multiplies two rounded halves, so relative differences add in quadrature
   (``m2 *= kappa^2 + 1``); an activation without a mul carries them times its relative condition number
   ``kappa = |x f'(x) / f(x)|`` (``m2 *= kappa^2``): 1 for SiLU and GELU where they carry the output, 2 for
   ``relu(x)^2``.

6. **The weighted top-k sum** of independent expert outputs keeps the relative mean square (``sum w_k^2 d_k^2`` over
   ``sum w_k^2 y_k^2``), followed by one rounding to the output dtype. A flip in any of a row's ``routes_per_row``
   routes reaches the sum, by an amount not proportional to it: the sparse part spreads over that many times the
   elements and is rounded as additive (``_State.reduce``). Where the router weight meets the GEMM2
   rounding is not fixed across vLLM's kernels (before the store: ``fused_moe_kernel``'s ``MUL_ROUTED_WEIGHT``;
   after it, in the output dtype: ``TopKWeightAndReduceContiguous``), so each term may be rounded as ``y`` on one
   side and as ``w y`` on the other: two independent roundings, ``E[1/mant^2] s^2 / 6 = 0.541 s^2 / 6``, allowed
   to a kernel whose ``SupportRecord.router_weight_rounding`` declares the vLLM form.

7. **Few events**: a mean square made of Bernoulli flips scatters around its expectation: ``n`` elements with
   per-element variance ``V`` give a relative variance ``V / (n T^2)``, i.e. ``lam = n T^2 / V`` *effective* events
   (the flips' sizes go as their values, so a heavy-tailed stage has fewer effective events than flips); and a part
   driven by an upstream difference made of few events inherits its relative variance (a flip at one large gated
   product drives every rounding after it). The realised mean square is bounded by the upper quantile
   ``(lam + z sqrt(lam) + z^2) / lam`` times the expectation (``z_events`` in specs).

7b. **One heavy event**. The random variable is the realised output mean square ``S = sum_j Y_j`` over the flips
   at GEMM2's input (the last grid before it: a2's, else the activation's), a compound Poisson sum: each of the
   ``n = rows x I`` elements flips with odds ``o(v)`` that depend on its value ``v`` (relative to the stage's RMS),
   by one grid step ``2^-p v / mant``; GEMM2 and the top-k sum carry its relative mean square (steps 2, 6), so a
   flip adds ``Y = (2^-p v / mant)^2 / n``. Step 7's quantile treats ``S`` as nearly Gaussian; one flip at an
   extreme gated product is not. The odds ``o(v)`` do not grow with ``|v|``: a flip of an additive difference has
   odds ``|d| / s`` with ``s`` proportional to ``|v|``, one of a proportional difference (a shrink, an earlier flip)
   the same odds at every value; so beyond the top quadrature node ``v_top`` they are at most its odds ``qt``
   (tracked through every stage, step 4). Split the flips at ``t >= v_top`` with ``n qt P(|v| > t) = alpha``,
   ``alpha = P(N(0,1) > z)`` (the normal tail of step 4's all-or-nothing rule): the expected number of flips
   beyond ``t``, hence the probability of one (Markov), is at most ``alpha``. The rest are independent,
   non-negative and at most ``b = (r t)^2 / n``, and their sum
   has variance at most ``V = m2^2 / lam_eff`` (step 7's effective count). One event's relative size ``r`` (mantissa 1: each grid's
   largest relative step) is the step of GEMM2's input grid ``2^-p`` that it tips plus, where GEMM1 may differ, the
   h flip under the value carried through the activation (``max(cond, 1) 2^-p_act`` gated: a gate flip times its
   condition number or an up flip; ``cond 2^-p_act`` otherwise): one GEMM1 output rounded the other way under a
   large gated product moves it by its own step and may tip its rounding at GEMM2's input as well. Bennett's inequality,
   ``P(S - E S >= s) <= exp(-(V / b^2) h(b s / V))`` with ``h(u) = (1 + u) ln(1 + u) - u``, set equal to
   ``exp(-z^2 / 2)``, gives the ``s`` that the realised sum exceeds its mean by only with that probability; the
   few-events factor is the larger of step 7's and ``1 + s / m2``. Bennett, not its relaxation Bernstein
   (``s <= z sqrt(V) + (z^2 / 3) b``): the latter pays up to 3x more range than the inequality needs when the sum
   is one or two events of size ``b``. No constant is set here: ``z`` is step 7's. ``t`` comes from the stage's
   distribution (``_stage_quantile``: |f(g) u| for a gated product, g, u ~ N(0, 1)); it grows only
   logarithmically with the call, and ``b`` falls as ``1 / rows``, so the term matters for calls of a few rows
   (decode) and short reductions with a coarse a2 grid. The call's values are known to the harness, only the flips
   are random: given the call's own values at GEMM2's input weighted by their routes' router weights
   (``heavy_values``: ``|v| w / (rms(v) rms(w))``; a flip on route ``r`` weighs ``w_r^2 / E[w^2]``), ``t`` is at
   least the largest of them but the ``c = floor(alpha / qt)`` above it, whose flips the call makes with at most
   that probability: one value far out in the call's own tail (Mixtral bf16 M1's gated product at 15.6x the RMS)
   or on a heavily weighted route (the fp8_tensor_static gelu_tanh regression's flip) is then the event itself, not
   a tail the distribution makes unlikely. Left out, at probability ``alpha`` per case: a flip beyond ``t``.

Bounds (``k_rms``, ``k_max``, ``tail`` in specs): ``rms_norm <= k_rms * sqrt(m2 * few)`` (``k_rms = 1``: the constants of
steps 1 and 4 are worst cases, so the expectation is already a bound, and step 7 covers its scatter); ``calc_diff`` is
``sum (x - y)^2 / sum (x^2 + y^2) ~= rms_norm^2 / 2``, so ``calc_diff <= (k_rms sqrt(m2))^2 / 2``. The worst
element can be a single step of the coarsest grid in front of GEMM2 (one requantized code flip, ``2^-p`` of one
value) carried by one weight of ``w2`` (``~ N(0, 1/I)``): relative to ``max |y|`` that is
``2^-p * tail_g * tail_w / (sqrt(I) * tail_y)`` with all three tails ``~ tail`` — so ``max_norm <= k_max * sqrt(m2) +
2^-p_a2 * tail / sqrt(I) + 2^-p_out`` (the last: one output-rounding step at the largest element).

Where this model is honest about its limits: a *per-tensor* dynamic scale's move (step 4) outweighs what a reduced-
precision accumulator adds, so for those schemes the output bound cannot reject one; the conformance suite's
accumulation probe (``conformance/test_accumulation.py``) is the sharp instrument for accumulation precision
(it uses inputs on which every conforming accumulation is exact), and below K ~ 4096 an in-place FP8 accumulation
adds less than the conforming roundings scatter at the output even per token: only the probe rejects it. Step 7b takes heavy events only
at GEMM2's input (an earlier one as the flip it carries there, 7b's ``r``), on the call's own values where the
caller gives them (the conformance suite does; without them, on the stage's distribution with the router weights at
their RMS), and leaves a flip beyond its ``t`` to that probability. Step 5's condition
numbers are taken where the activations carry the output, not at their clamps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from reference.config import FusedMoEQuantConfig, FusedMoEQuantDesc

__all__ = ["STAGES", "Accumulation", "ErrorBound", "experts_error_bound", "heavy_values", "format_mantissa_bits", "acc_rel",
           "mma16_rel",
           "emulate_mma16"]

# Mantissa bits of each floating format (s = 2^-p relative spacing at mantissa 1.0).
# Every activation format of specs/schemes.toml is here or INT8 (a uniform grid, step 4): FP8 E4M3 (per tensor,
# static or dynamic, per token, per 1xG group), MXFP8 / MXFP4 (E8M0 power-of-two scales per 32: step 4 adds no
# scale shift), NVFP4 (E2M1 under an E4M3 block scale; with the per-tensor encode scale or one per token, the
# block scale moves with the block's amax either way). Weight-only schemes (WNA16, FP8 W8A16) quantize no
# activation: their weights are the same bits on both sides, so only accumulation and the act-dtype roundings count.
# Issue 41's pairs use the same terms: FP8 weights of any scale layout (per tensor / channel / any bn x bk block) with
# FP8 activations per 1xG group, per token, static per tensor or none; block INT8 W8A8's activations per 1xG group
# (INT8's uniform step over the group, step 4 per group; truncated codes differ from rounded ones only in where the
# grid's boundaries sit, so two values d apart still differ by k or k + 1 steps: step 3 unchanged); the CPU INT4
# W4A8 GEMMs' own asymmetric INT8 rows (``_gemm_input_int8_rows``: the per-token INT8 step, two scale extremes).
STAGES = ("gemm1", "activation", "gemm2", "output")  # what ``experts_error_bound(stage=...)`` can bound

_MANTISSA = {
    torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 2,
    "mxfp8": 3, "mxfp4": 1, "nvfp4": 1,
    # OCP MXFP6 (vLLM 0.33 OCP MX emulation): E3M2 / E2M3 elements under E8M0 scales per 32
    "mxfp6_e3m2": 2, "mxfp6_e2m3": 3,
}
# Formats whose scales are powers of two (a scale change leaves a floating grid's values in place).
_POW2_SCALES = {"mxfp8", "mxfp4", "mxfp6_e3m2", "mxfp6_e2m3"}
# Activation formats that no MMA takes natively in vLLM 0.33: the experts fake-quantize them to the activation dtype
# (fused_moe/utils.py::_mxfp6_e3m2_quantize, ocp_mx_emulation_moe.py) and run a bf16 / fp16 GEMM (step 1b).
_EMULATED_16BIT = {"mxfp6_e3m2", "mxfp6_e2m3"}


def format_mantissa_bits(fmt) -> int | None:
    """Mantissa bits of a floating format (dtype or format name); None for integer or unknown formats."""
    return _MANTISSA.get(fmt)


def acc_rel(n: int, unit_roundoff: float) -> float:
    """Relative RMS error of a length-``n`` sum accumulated with unit roundoff ``u``: ``u * sqrt(n / 6)``."""
    return unit_roundoff * math.sqrt(max(n, 1) / 6.0)


def mma16_rel(n: int, block: int, align_bits: int) -> float:
    """Relative RMS error of a length-``n`` dot product on a 16-bit-operand MMA that, every ``block`` products,
    aligns them and the accumulator to the largest magnitude, keeps ``align_bits`` bits below it (truncating) and
    normalizes the sum to fp32 toward zero (step 1b): ``sqrt((c m / sqrt 3)^2 + 0.541 (B 2^-2p / 3 + 2^-46 / 12) m / 2)``
    with ``m = ceil(n / B)`` steps and ``c = 2^-24 / (2 ln 2)``."""
    m = math.ceil(max(n, 1) / block)
    coherent = 2.0**-24 / (2.0 * math.log(2.0)) * m / math.sqrt(3.0)  # E[1 / mant] of log-distributed mantissas
    random2 = 0.541 * (block * 2.0 ** (-2 * align_bits) / 3.0 + 2.0**-46 / 12.0) * m / 2.0
    return math.sqrt(coherent * coherent + random2)


def emulate_mma16(a: torch.Tensor, w: torch.Tensor, *, block: int = 16, align_bits: int = 24,
                     rows_per_pass: int = 64) -> torch.Tensor:
    """``a (R, K) @ w (N, K).T`` on an emulated 16-bit-operand tensor core (step 1b, bit by bit): every
    ``block`` products are aligned with the accumulator to the largest magnitude among them, truncated toward zero
    ``align_bits`` bits below it, summed exactly, and the sum normalized to fp32's 24 significant bits toward zero.
    Products of bf16 / fp16 values are exact in float64. Returns fp32 ``(R, N)``."""
    a64, w64 = a.double(), w.double()
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.float32)
    for r0 in range(0, a.shape[0], rows_per_pass):
        ar = a64[r0:r0 + rows_per_pass]
        acc = torch.zeros(ar.shape[0], w.shape[0], dtype=torch.float64)
        for k0 in range(0, a.shape[1], block):
            terms = torch.cat([acc[:, :, None], ar[:, None, k0:k0 + block] * w64[None, :, k0:k0 + block]], dim=2)
            top = torch.floor(torch.log2(terms.abs().amax(dim=2, keepdim=True).clamp_min(1e-300)))
            q = torch.exp2(top - align_bits)
            s = (torch.trunc(terms / q) * q).sum(dim=2)
            ulp = torch.exp2(torch.floor(torch.log2(s.abs().clamp_min(1e-300))) - 23)
            acc = torch.trunc(s / ulp) * ulp
        out[r0:r0 + rows_per_pass] = acc.float()
    return out


@dataclass(frozen=True)
class Accumulation:
    """How a kernel accumulates a GEMM's products.

    ``mma_mantissa_bits``: precision of a tensor-core partial accumulator (None: fp32 throughout);
    ``promote_every``: K elements after which the partial is added into an fp32 accumulator (None: never, the
    partial spans the whole reduction: "fast accumulation"). Applies to GEMMs whose MMA takes FP8 operands.
    ``mma16_block`` / ``mma16_align_bits``: a bf16 / fp16 MMA that aligns and normalizes toward zero every
    ``mma16_block`` products (step 1b; None: fp32 round to nearest). INT8 MMAs accumulate exactly in int32.
    ``Accumulation.allowed(constants)`` is what every kernel may do; the reference is ``fp32()``.
    """

    name: str = "fp32"
    mma_mantissa_bits: int | None = None
    promote_every: int | None = None
    mma16_block: int | None = None
    mma16_align_bits: int = 24

    @staticmethod
    def fp32() -> "Accumulation":
        return Accumulation("fp32")

    @staticmethod
    def allowed(constants: dict) -> "Accumulation":
        """What every kernel is allowed (``[error_model]``): fp32 in any order; an FP8 MMA partial of
        ``mma_mantissa_bits`` promoted every ``promote_every`` K elements; a bf16/fp16 MMA that aligns each step of
        ``mma16_block`` products and normalizes toward zero (``mma16_align_bits`` bits kept below the step's largest
        magnitude), as the SM90 tensor cores do (step 1b)."""
        b, p = constants["mma_mantissa_bits"], constants["promote_every"]
        blk, bits = constants["mma16_block"], constants["mma16_align_bits"]
        return Accumulation(f"mma{b}-promote{p}, mma16 aligned-{bits} toward zero every {blk}", b, p, blk, bits)

    @staticmethod
    def promoted(mantissa_bits: int, promote_every: int) -> "Accumulation":
        """An MMA partial of ``mantissa_bits`` bits promoted into fp32 every ``promote_every`` K elements."""
        return Accumulation(f"mma{mantissa_bits}-promote{promote_every}", mantissa_bits, promote_every)

    @staticmethod
    def fast(mantissa_bits: int) -> "Accumulation":
        """Opt-in fast accumulation: the MMA partial is never promoted (``use_fast_accum=True``)."""
        return Accumulation(f"mma{mantissa_bits}-fast", mantissa_bits, None)

    def relative_error(self, n: int, fp8_mma: bool, mma16: bool = False) -> float:
        """Relative RMS accumulation error of a length-``n`` reduction (step 1 of the derivation); ``mma16``: the
        GEMM's operands are bf16/fp16 (step 1b applies where ``mma16_block`` is set)."""
        fp32 = acc_rel(n, 2.0**-24)
        if mma16 and not fp8_mma and self.mma16_block is not None:
            return max(fp32, mma16_rel(n, self.mma16_block, self.mma16_align_bits))
        if not fp8_mma or self.mma_mantissa_bits is None:
            return fp32
        span = n if self.promote_every is None else min(n, self.promote_every)
        partial = acc_rel(span, 2.0**-self.mma_mantissa_bits)
        return math.sqrt(partial**2 + acc_rel(math.ceil(n / span), 2.0**-24) ** 2)

    def shrink(self, n: int, fp8_mma: bool, mma16: bool = False) -> float:
        """The part of ``relative_error`` that is a shrink proportional to the value (step 1b: the normalization
        toward zero drops ``c sum_k S_k``, whose regression on the result ``S_m`` is ``c m / 2``, 3/4 of its mean
        square); 0 where the accumulation rounds to nearest."""
        if not (mma16 and not fp8_mma and self.mma16_block is not None):
            return 0.0
        m = math.ceil(max(n, 1) / self.mma16_block)
        return 2.0**-24 / (2.0 * math.log(2.0)) * m / 2.0


@dataclass(frozen=True)
class ErrorBound:
    """Per-case bounds on ``max_norm`` / ``rms_norm`` / ``calc_diff``, with the model's expected RMS and the stage
    trace that produced it (``derivation``: one line per stage, for failure messages)."""

    max_norm: float
    rms_norm: float
    calc_diff: float
    expected_rms: float
    derivation: tuple[str, ...] = field(default=(), compare=False)

    def as_tolerance(self) -> dict:
        return {"max_norm": self.max_norm, "rms_norm": self.rms_norm, "calc_diff": self.calc_diff}


def _combine(v1: float, l1: float, v2: float, l2: float) -> tuple[float, float]:
    """Sum of two independent mean squares, each realised from an effective number ``l`` of independent events (step
    7): the effective event count of the sum (its relative variance is ``sum v_i^2 / l_i / (sum v_i)^2``)."""
    v = v1 + v2
    if v <= 0:
        return 0.0, math.inf
    var = (v1 * v1 / l1 if l1 < math.inf and v1 else 0.0) + (v2 * v2 / l2 if l2 < math.inf and v2 else 0.0)
    return v, (v * v / var if var > 0 else math.inf)


# ---- Step 3's expectations, by quadrature over the values of a stage, their mantissas and the difference --------
_NODES = 128  # value nodes per stage distribution (each the RMS of an equal-probability slice: tails kept)
_MANTS = 16   # log-uniform mantissas in [1, 2)
_ZS = 32      # |z| nodes of a Gaussian difference


def _slices(samples: torch.Tensor, nodes: int = _NODES) -> torch.Tensor:
    """Equal-probability nodes of |samples| (sorted, cut into ``nodes`` slices, each slice's RMS), scaled so that
    the mean square is 1: the stage's values relative to its RMS."""
    a = samples.abs().double().flatten().sort().values
    v = a[: a.numel() // nodes * nodes].view(nodes, -1).pow(2).mean(1).sqrt()
    return v / v.pow(2).mean().sqrt()


def _half_normal_quantiles(n: int) -> torch.Tensor:
    return torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(n, dtype=torch.float64) + 0.5) / (2 * n) + 0.5)


@functools.lru_cache(maxsize=None)
def _stage_values(activation_name: str | None) -> torch.Tensor:
    """|values| of a stage relative to its RMS (``_NODES`` equal-weight nodes): Gaussian (GEMM outputs; ``None``),
    or the activation's output on GEMM1 outputs ~ N(0, 1) (gate and up independent), which for a gated product is
    heavy-tailed (its kurtosis sets how few events carry a stage's mean square, step 7)."""
    g = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(4096, dtype=torch.float64) + 0.5) / 4096)
    if activation_name is None:
        return _slices(g)
    from reference.activation import MoEActivation, SITU_KIMI_K3_BETA, SITU_KIMI_K3_LINEAR_BETA, apply_moe_activation

    act = MoEActivation[activation_name]
    if act.is_gated:
        gg, uu = torch.meshgrid(g[::64], g[::64], indexing="ij")  # 64 x 64 (gate, up) pairs
        x = torch.stack([gg.flatten(), uu.flatten()], dim=1)  # [gate | up] halves, also SWIGLUOAI's even / odd
    else:
        x = g[:, None]
    kw = dict(situ_beta=SITU_KIMI_K3_BETA, situ_linear_beta=SITU_KIMI_K3_LINEAR_BETA) if act.name == "SITU" else {}
    y = apply_moe_activation(act, x.float(), **kw).double()
    return _slices(y)


@functools.lru_cache(maxsize=None)
def _stage_quantile(activation_name: str | None, p: float) -> float:
    """The value ``t`` (relative to the stage's RMS) that a stage's |values| exceed with probability ``p``: for a
    gated product |f(g) u| (``f`` the activation's gate function, g, u ~ N(0, 1) independent) by quadrature of
    ``P(|f(g) u| > t) = E_g[erfc(t / (|f(g)| sqrt 2))]``; without a mul |f(g)|; Gaussian (``None``): |g|. Step 7b."""
    g = torch.linspace(-12.0, 12.0, 48001, dtype=torch.float64)
    dens = torch.exp(-0.5 * g * g)
    dens /= dens.sum()
    gated = False
    if activation_name is None:
        f = g.abs()
    else:
        from reference.activation import MoEActivation, SITU_KIMI_K3_BETA, SITU_KIMI_K3_LINEAR_BETA, apply_moe_activation

        act = MoEActivation[activation_name]
        gated = act.is_gated
        kw = dict(situ_beta=SITU_KIMI_K3_BETA, situ_linear_beta=SITU_KIMI_K3_LINEAR_BETA) if act.name == "SITU" else {}
        x = torch.stack([g, torch.ones_like(g)], dim=1) if gated else g[:, None]  # the gate at unit up
        f = apply_moe_activation(act, x.float(), **kw).double().flatten().abs()
    rms = math.sqrt(float((dens * f * f).sum()))  # E[u^2] = 1

    def tail(t: float) -> float:
        if gated:
            return float((dens * torch.erfc(t / (f.clamp_min(1e-300) * math.sqrt(2.0)))).sum())
        return float((dens * (f > t)).sum())

    lo, hi = 0.0, 64.0 * rms
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if tail(mid) > p else (lo, mid)
    return hi / rms


_MANT = torch.exp2((torch.arange(_MANTS, dtype=torch.float64) + 0.5) / _MANTS)  # log-uniform mantissas
_Z = _half_normal_quantiles(_ZS)
_Z = _Z / _Z.pow(2).mean().sqrt()  # mean square 1 exactly: the quadrature must not shrink a difference


def _round_pair(d: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rounding ``x`` and ``x + d`` to a grid of spacing ``s`` (``x`` uniform modulo ``s``): the mean and variance of
    the squared difference of the two results, and the flip probability where ``|d| < s``. With ``|d| / s = k + f``
    the difference is ``k`` or ``k + 1`` steps (the latter with probability ``f``)."""
    # A zero value (an activation's clamp, relu) is zero on both sides: no step there, no difference.
    live = s > 0
    r = torch.where(live, d.abs() / torch.where(live, s, 1.0), 0.0)
    k = torch.floor(r)
    f = r - k
    mean = s * s * (k * k + (2 * k + 1) * f)
    var = s**4 * f * (1 - f) * (2 * k + 1) ** 2
    return mean, var, torch.where(k == 0, f, torch.zeros_like(f))


@dataclass
class _Rounded:
    """What a rounding made of one part of the difference: ``flip`` (mean square of the one-step flips, relative to
    the stage's RMS^2), ``flip_var`` (its per-element variance), ``q`` (fraction of elements flipped), ``e`` (mean
    relative step |diff / v| at a flipped element), ``w`` (mean v^2 at a flipped element: flips favour small values
    when the difference is value-independent), ``stay`` (mean square where the difference exceeded a step and
    survives, plus its rounding), ``stay_var``."""

    flip: float = 0.0
    flip_var: float = 0.0
    q: float = 0.0
    e: float = 0.0
    w: float = 1.0
    stay: float = 0.0
    stay_var: float = 0.0
    q_stay: float = 0.0
    q_top: float = 0.0  # probability that an element among the largest values (the top node) differs

    def scaled(self, p: float) -> "_Rounded":
        """The same part present at a fraction ``p`` of the elements (``q_top`` is conditional: unchanged)."""
        return dataclasses.replace(self, flip=self.flip * p, flip_var=self.flip_var * p, stay=self.stay * p,
                                   stay_var=self.stay_var * p, q=self.q * p, q_stay=self.q_stay * p)


def _expect(d: torch.Tensor, v: torch.Tensor, step, weight: torch.Tensor) -> _Rounded:
    """Expectations of ``_round_pair`` over a grid of elements (values ``v``, differences ``d``, per-element grid
    spacing ``step``, probability weights ``weight``, all broadcast together)."""
    mean, var, fp = _round_pair(d, step)
    wgt = weight.expand_as(mean)
    flipping = (mean > 0) & (fp > 0)
    q = float((wgt * fp).sum())
    flip = float((wgt * torch.where(flipping, mean, 0.0)).sum())
    flip_var = float((wgt * torch.where(flipping, var, 0.0)).sum())
    stay = float((wgt * torch.where(flipping, 0.0, mean)).sum())
    stay_var = float((wgt * torch.where(flipping, 0.0, var)).sum())
    vv = v.expand_as(mean)
    rel_step = (step / vv.clamp_min(1e-30)).expand_as(mean)
    e = float((wgt * fp * rel_step).sum()) / q if q > 0 else 0.0
    w = float((wgt * fp * vv * vv).sum()) / q if q > 0 else 1.0
    q_stay = float((wgt * ((~flipping) & (mean > 0))).sum())
    # The nodes run from the smallest values to the largest: the last one is where a scale's amax sits.
    differs = torch.where(flipping, fp, (mean > 0).to(fp.dtype)).expand_as(mean)
    q_top = float(differs[-1].mean())
    return _Rounded(flip, flip_var, q, e, w, stay, stay_var, q_stay, q_top)


def _round_additive(sigma: float, values: torch.Tensor, grid) -> _Rounded:
    """A value-independent Gaussian difference of RMS ``sigma`` (relative) rounded on ``grid`` (``("float", p)``: a
    step of ``2^-p |v| / mant``; ``("uniform", s)``: a step ``s`` relative to the RMS)."""
    if sigma <= 0:
        return _Rounded()
    v = values[:, None, None]
    d = sigma * _Z[None, None, :]
    weight = torch.full((values.numel(), 1 if grid[0] == "uniform" else _MANTS, _ZS), 1.0).double()
    weight /= weight.sum()
    step = _grid_step(grid, v)
    return _expect(d, v, step, weight)


def _round_proportional(eps: float, values: torch.Tensor, grid, value_weight: float = 1.0) -> _Rounded:
    """A difference proportional to the value, ``d = eps v`` (a tensor core's shrink, or an earlier flip: one step of
    a grid is a fixed fraction of its element), rounded on ``grid``; ``value_weight``: mean v^2 where it sits."""
    if eps <= 0:
        return _Rounded()
    v = values[:, None]
    weight = torch.full((values.numel(), 1 if grid[0] == "uniform" else _MANTS), 1.0).double()
    weight /= weight.sum()
    r = _expect(eps * v, v, _grid_step(grid, v[..., None])[..., 0], weight)
    if grid[0] == "float":  # both d and the step scale with |v|: the squares scale with the value weight
        r.flip, r.flip_var, r.stay, r.stay_var = (r.flip * value_weight, r.flip_var * value_weight**2,
                                                  r.stay * value_weight, r.stay_var * value_weight**2)
        r.w = r.w * value_weight
    return r


def _grid_step(grid, v: torch.Tensor) -> torch.Tensor:
    """The grid's spacing at values ``v`` ``(N, 1, 1)``: ``(N, 1, 1)`` for a uniform grid, ``(N, _MANTS, 1)`` over
    the mantissas for a floating one."""
    kind, x = grid
    if kind == "uniform":
        return torch.full_like(v, float(x))
    return (2.0**-x) * v / _MANT[None, :, None]


@dataclass
class _State:
    """The difference between two conforming implementations at one stage, relative to that stage's RMS:
    - a dense additive part (every element differs a little, independently of its value: accumulation order) of
      mean square ``d2``;
    - a dense proportional part ``eps`` (every element shrunk by the same relative amount: the 16-bit tensor core's
      normalization toward zero, step 1b);
    - a sparse part: a fraction ``q`` of the elements differ by about one grid step (rounding flips), mean square
      ``s2`` over all elements, mean relative size ``e`` at those elements (a step is proportional to its value)
      and mean v^2 ``w`` there.
    ``ld`` / ``ls``: the effective number of independent events each mean square is made of (inf: accumulation
    order, which every element has); with few, the realised mean square scatters around its expectation (step 7).
    ``rows``: the GEMM rows of the call (routed tokens), for counting events."""

    rows: float = math.inf
    d2: float = 0.0
    ld: float = math.inf
    eps: float = 0.0
    q: float = 0.0
    s2: float = 0.0
    ls: float = math.inf
    e: float = 0.0
    w: float = 1.0
    k2: float = 0.0
    lk: float = math.inf
    qk: float = 0.0
    sparse_additive: bool = False
    qt: float = 0.0  # probability that an element among the stage's largest values differs (where an amax sits)
    trace: list = field(default_factory=list)

    @property
    def m2(self) -> float:
        return self.d2 + self.eps * self.eps + self.s2 + self.k2

    @property
    def events(self) -> float:
        v, l = _combine(self.d2 + self.eps * self.eps, self.ld, self.s2, self.ls)
        return _combine(v, l, self.k2, self.lk)[1]

    def log(self, stage: str) -> None:
        ev = self.events
        self.trace.append(f"{stage}: rms {math.sqrt(self.m2):.2e} (dense {math.sqrt(self.d2):.1e}"
                          + (f", shrink {self.eps:.1e}" if self.eps else "")
                          + f", {self.q:.1e} of elements flipped"
                          + (f", ~{ev:.0f} effective flip events)" if ev < math.inf else ")"))

    def gemm(self, n: int, acc: float, shrink: float = 0.0, *, stage: str) -> None:
        """A GEMM over ``n`` inputs of a row, adding ``acc`` (additive) and ``shrink`` (proportional) accumulation
        differences; a flip anywhere in a row reaches all of its outputs, a uniform shrink of the inputs shrinks the
        outputs alike."""
        # The rows a flip or a kept difference reaches now differ everywhere, by a value-independent amount.
        rows_hit = min(1.0, n * (self.q + self.qk))
        v, l = _combine(self.s2, self.ls, self.k2, self.lk)
        self.qk, self.k2, self.lk, self.e, self.w = 0.0, 0.0, math.inf, 0.0, 1.0
        if rows_hit >= 1.0:  # in every row: dense now
            self.d2, self.ld = _combine(self.d2, self.ld, v, l)
            self.q, self.s2, self.ls, self.sparse_additive = 0.0, 0.0, math.inf, False
        else:
            self.q, self.s2, self.ls, self.sparse_additive = rows_hit, v, l, v > 0
        self.qt = self.q  # a reached row differs at every element, its largest included
        self.d2, self.ld = _combine(self.d2, self.ld, acc * acc, math.inf)
        self.eps = math.hypot(self.eps, shrink)
        self.log(f"{stage} (acc {math.hypot(acc, shrink):.1e}" + (f", of it shrink {shrink:.1e})" if shrink else ")"))

    def reduce(self, routes: float) -> None:
        """The weighted top-k sum of ``routes`` expert outputs per row (step 6): relative mean squares carry over, a
        flip in any of a row's routes reaches the sum, and what a flip in ``y_k`` moves is not proportional to the
        sum ``sum_k w_k y_k``: with more than one route the sparse part is value-independent there."""
        if routes <= 1.0 or self.q <= 0:
            return
        self.q = min(1.0, self.q * routes)
        self.qt = min(1.0, self.qt * routes)
        if self.q >= 1.0:
            self.d2, self.ld = _combine(self.d2, self.ld, self.s2, self.ls)
            self.q, self.s2, self.ls, self.e, self.w, self.sparse_additive = 0.0, 0.0, math.inf, 0.0, 1.0, False
        else:
            self.sparse_additive = True
        self.log(f"top-k sum of {routes:.2g} routes per row")

    def scale(self, factor: float, spread: int, cond: float) -> None:
        """The activation: relative mean squares times ``factor`` (step 5); ``spread`` inputs per output (2 for a
        gated product: a flip in the gate or the up half reaches the output); a flip's relative size times
        ``cond`` at most."""
        self.d2 *= factor
        self.eps *= math.sqrt(factor)
        self.s2 *= factor
        self.k2 *= factor
        self.q = min(1.0, self.q * spread)
        self.qk = min(1.0, self.qk * spread)
        self.qt = min(1.0, self.qt * spread)  # the largest products: a large gate and a large up
        self.e *= max(cond, 1.0)

    def round(self, grid, values: torch.Tensor, stage: str, width: int, scale_group: float | None = None,
              z: float = 3.0) -> None:
        """Rounding to ``grid`` (step 3) of a stage ``width`` elements wide whose values are ``values``;
        ``scale_group``: elements per dynamic fp32 scale (step 4: the scale follows the group's largest element, and
        where that element differs the whole group's grid moves); None for a static or power-of-two scale; ``z``:
        the quantile of step 7 (a per-tensor scale's shift is one draw: counted in full when likelier than the
        normal tail beyond ``z``)."""
        n = self.rows * width
        a = _round_additive(math.sqrt(self.d2), values, grid)
        pr = _round_proportional(self.eps, values, grid)
        if self.q <= 0:
            sp = _Rounded()
        elif self.sparse_additive:  # rows a GEMM spread a difference over: value-independent there
            sp = _round_additive(math.sqrt(self.s2 / self.q), values, grid)
        else:  # earlier flips: one step of their grid, proportional to their element
            sp = _round_proportional(self.e, values, grid, self.w)
        shift_parts = []
        if scale_group is not None:
            groups = n / scale_group if math.isfinite(n) else math.inf
            # A dense difference moves every group's largest element by ~ sqrt(d2) / tail of the group's values.
            dense = _round_proportional(math.sqrt(self.d2) / _tail(int(min(scale_group, 1e12))), values, grid)
            shift_parts.append((dense, 0.0))
            # A flipped or kept largest element moves its group's scale by one step of it: every element of the
            # group is then rounded on a grid moved by that fraction.
            p_max = self.qt
            if p_max > 0 and self.q > 0:
                moved = _round_proportional(self.e, values, grid)
                if not math.isfinite(groups) or groups <= 1.0:  # one scale for the call: all or nothing
                    if p_max >= 0.5 * math.erfc(z / math.sqrt(2.0)):
                        shift_parts.append((moved, 0.0))
                else:
                    shift_parts.append((moved.scaled(p_max), 1.0 / max(groups * p_max, 1e-9)))
        sp = sp.scaled(self.q)  # only a fraction q of the elements carry the sparse part
        # Each part's mean square scatters with the events upstream that made it (relative variance 1 / l) and with
        # this rounding's own Bernoulli steps (per-element variance V over n elements): step 7.
        relvar = lambda l: 0.0 if not math.isfinite(l) else 1.0 / max(l, 1e-9)  # noqa: E731
        parts = ((a, relvar(self.ld)), (pr, 0.0), (sp, relvar(self.ls)), *shift_parts)
        flip = sum(r.flip for r, _ in parts)
        flip_var = sum(r.flip**2 * rv + (r.flip_var / n if math.isfinite(n) else 0.0) for r, rv in parts)
        # What exceeded a step keeps its difference: the additive part only at elements far smaller than their
        # difference (a fixed, value-correlated few, never re-flipped: ``k2``), the sparse part at its elements.
        fixed = a.stay + pr.stay + sum(r.stay for r, _ in shift_parts)
        fixed_var = (a.stay**2 * relvar(self.ld) + (a.stay_var + pr.stay_var) / n) if math.isfinite(n) else 0.0
        q_fixed = sum(r.q_stay for r in (a, pr)) + sum(r.q_stay for r, _ in shift_parts)
        stay = sp.stay
        stay_var = sp.stay**2 * relvar(self.ls) + (sp.stay_var / n if math.isfinite(n) else 0.0)
        self.k2, self.lk = _combine(self.k2, self.lk, fixed, fixed * fixed / fixed_var if fixed_var > 0 else math.inf)
        self.qk = min(1.0, self.qk + q_fixed)
        self.d2, self.ld, self.eps = 0.0, math.inf, 0.0
        self.s2 = flip + stay
        var = flip_var + stay_var
        self.ls = self.s2 * self.s2 / var if var > 0 else math.inf
        q_new = sum(r.q for r, _ in parts)
        self.q = min(1.0, q_new + sp.q_stay)
        self.sparse_additive = False
        # An element among the largest differs after this rounding if it flipped now, or differed before and still
        # does (the sparse part's top-value odds are qt, not q: flips of an additive difference favour small values).
        self.qt = min(1.0, a.q_top + pr.q_top + self.qt * sp.q_top)
        if q_new > 0:
            self.e = sum(r.e * r.q for r, _ in parts) / q_new
            self.w = sum(r.w * r.q for r, _ in parts) / q_new
        self.log(stage)


# Relative condition number |x f'(x) / f(x)| of the activation's (gate) function where it matters: 1 for SiLU, GELU
# and their clamped forms at the magnitudes that carry the output; relu(x)^2 doubles relative differences.
_ACT_CONDITION = {"RELU2_NO_MUL": 2.0, "RELU2": 2.0}


def _tail(n: int) -> float:
    return math.sqrt(2.0 * math.log(max(n, 2)))


def _requantize(st: _State, desc: FusedMoEQuantDesc, qc: FusedMoEQuantConfig, width: int, values: torch.Tensor,
                stage: str, z: float = 3.0, extremes: int = 1) -> int | None:
    """Rounding of a dynamically (or statically) quantized activation; returns the grid's mantissa bits (None for
    uniform grids). ``extremes``: elements whose flip moves a dynamic INT8 scale (1: the amax; 2: an asymmetric
    range's min and max, each a step-4 event, so the group counts twice)."""
    fmt = desc.dtype
    if fmt is None:
        return None
    static = desc.scale is not None
    if fmt == torch.int8:
        group = _int8_group(desc, width, st.rows)
        st.round(("uniform", _tail(group) / 127.0), values, stage + " (int8)", width,
                 scale_group=None if static else group / extremes, z=z)
        return None
    p = format_mantissa_bits(fmt)
    if p is None:
        raise ValueError(f"error model: no grid for activation format {fmt!r}")
    pow2 = qc.use_ue8m0 or fmt in _POW2_SCALES  # a floating grid is invariant under a power-of-two move
    st.round(("float", p), values, f"{stage} ({fmt if isinstance(fmt, str) else str(fmt)[6:]})", width,
             scale_group=None if static or pow2 else _scale_group(desc, width, st.rows), z=z)
    return p


def _scale_group(desc: FusedMoEQuantDesc, width: int, rows: float) -> float:
    """Elements under one dynamic scale: the call's routed rows (per tensor), a row (per token) or a 1xG group."""
    shape = desc.shape or (-1, -1)
    if shape == (-1, -1):
        return width * rows if math.isfinite(rows) else math.inf
    if shape == (1, -1) or shape[1] <= 0:
        return width
    return min(shape[1], width)


def _int8_group(desc: FusedMoEQuantDesc, width: int, rows: float) -> float:
    """Elements whose amax sets one INT8 step: a row (per token, ``width``), a 1xG group, or, per tensor
    (``kInt8DynamicTensorSym``), every routed row of the call (``rows x width``; one row when the count is unknown,
    the smallest tail, since a larger tensor only widens the step)."""
    if desc.shape == (-1, -1):
        return width * (rows if math.isfinite(rows) else 1.0)
    return width if desc.shape in ((1, -1), None) or desc.shape[1] <= 0 else desc.shape[1]


def _gemm_input_int8_rows(quant_config: FusedMoEQuantConfig) -> FusedMoEQuantConfig | None:
    """Issue 41: for a weight format whose GEMMs quantize their own input rows (CPU INT4 W4A8,
    ``reference.quant.moe.gemm_input_quantizer``: asymmetric INT8 per row), the config with a2 described as the INT8
    per-token grid that bounds it; None otherwise. The asymmetric codes ``(q - zp) * recip`` with an integer zero
    point lie on the multiples of ``recip`` (a uniform grid anchored at 0: a zero-point change moves no grid point),
    whose step ``range / 255 <= 2 amax / 255 < amax / 127`` is at most the symmetric per-token step of step 3; its
    scale follows the row's min and max, two step-4 extremes (``_requantize(extremes=2)``). GEMM1's input rows are
    quantized bit-exactly by both sides, like a prepared a1."""
    if quant_config.w2.dtype != "int4_w4a8_int8":
        return None
    return dataclasses.replace(quant_config, a2=FusedMoEQuantDesc(torch.int8, (1, -1)))


def _is_fp8_mma(desc: FusedMoEQuantDesc) -> bool:
    return desc.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, "mxfp8")


def heavy_values(activation: torch.Tensor, topk_weights: torch.Tensor, local: torch.Tensor, *,
                 apply_router_weight_on_input: bool = False, top: int = 64) -> torch.Tensor:
    """Step 7b on the call's own values: ``|v| w / (rms(v) rms(w))`` at GEMM2's input, the largest ``top`` of them,
    descending (float64, CPU).

    Args:
        activation: the reference's activation output per route, ``(M, topk, N')`` (``reference.experts.fused_experts``
            ``stages["activation"]``: GEMM2's input before a2's requantization, which moves a value by less than the
            step that 7b counts).
        topk_weights: ``(M, topk)`` router weights; local: ``(M, topk)`` bool, the routes held here (the rest are
            zeros in ``activation`` and weigh nothing).
        apply_router_weight_on_input: the weight was applied to the input (it is already in ``v``): ``w = 1``.

    A flip on route ``r`` at value ``v`` adds ``(2^-p v w_r)^2 / (n E[v^2] E[w^2])`` to the output's relative mean
    square (steps 2 and 6 with the route's weight), so the call's heavy events are its values weighted by their
    routes' weights; the module docstring's 7b is the same term on the stage's distribution with ``w`` at its RMS.
    Returns an empty tensor when nothing is held."""
    v = activation[local].float()
    if v.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    w = torch.ones(v.shape[0], device=v.device) if apply_router_weight_on_input else topk_weights[local].float()
    rms_v, rms_w = v.square().mean().sqrt(), w.square().mean().sqrt()
    if not (rms_v > 0 and rms_w > 0):
        return torch.zeros(0, dtype=torch.float64)
    u = (v.abs() * w.abs()[:, None]).flatten() / (rms_v * rms_w)
    return u.topk(min(top, u.numel())).values.double().cpu()


def _heavy_event(st: "_State", I: int, step: float, activation, gated: bool, z: float,
                 realised: torch.Tensor | None = None) -> tuple[float, float]:
    """Step 7b: ``(b, t)``: the output mean square (relative) of one flip at GEMM2's input at the value ``t`` (relative
    to that stage's RMS, at least the top quadrature node's) beyond which the call's expected number of flips, at
    the top values' odds ``qt``, is the normal tail beyond ``z``; ``(0, 0)`` when the call's rows are unknown or a
    flip at the largest values is that unlikely anywhere. ``realised``: the call's own weighted values
    (``heavy_values``): ``t`` is then also at least the largest of them whose flip, with the ones above it, the
    call makes with more than that probability (``qt`` times their count above ``alpha``)."""
    n = st.rows * I
    lam = n * st.qt  # flips per call if every element had the flip odds of the largest values
    alpha = 0.5 * math.erfc(z / math.sqrt(2.0))
    if not math.isfinite(n) or lam <= alpha:
        return 0.0, 0.0
    name = activation.name if activation is not None else ("SILU" if gated else "SILU_NO_MUL")
    # qt is the flip odds at the top node's value: an upper bound on the odds beyond it only, so t never below it.
    t = max(_stage_quantile(name, alpha / lam), float(_stage_values(name)[-1]))
    if realised is not None and realised.numel() and st.qt > 0:
        # The call's values are given, only the flips are random: the ones beyond u_(c) (c of them, c qt <= alpha)
        # are left to their probability; a list shorter than c ends above u_(c), so its last is an upper bound.
        c = int(alpha / st.qt)
        t = max(t, float(realised[min(c, realised.numel() - 1)]))
    return (step * t) ** 2 / n, t


def _bennett_excess(var: float, b: float, z: float) -> float:
    """Step 7b: the excess ``s`` over its mean that a sum of independent terms in ``[0, b]`` with variance ``var``
    exceeds with probability at most ``exp(-z^2 / 2)`` by Bennett's inequality: the root of ``(var / b^2) h(b s /
    var) = z^2 / 2``, ``h(u) = (1 + u) ln(1 + u) - u`` (bisection; ``h`` is increasing)."""
    if var <= 0 or b <= 0:
        return 0.0
    target = z * z * b * b / (2.0 * var)
    h = lambda u: (1.0 + u) * math.log1p(u) - u  # noqa: E731
    lo, hi = 0.0, 1.0
    while h(hi) < target:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if h(mid) < target else (lo, mid)
    return hi * var / b


def experts_error_bound(quant_config: FusedMoEQuantConfig, *, act_dtype: torch.dtype, K: int, I: int,
                        gated: bool = True, activation=None, accumulation: Accumulation | None = None,
                        gemm1_exact: bool = False, routed_rows: float | None = None,
                        router_weight_rounding: str = "reference", routes_per_row: float = 1.0,
                        constants: dict | None = None, stage: str = "output",
                        heavy: torch.Tensor | None = None) -> ErrorBound:
    """Bounds on the experts output's metrics against the reference for one case (or on one of its intermediates).

    Args:
        quant_config: the case's ``FusedMoEQuantConfig`` (formats of a1, a2, weights; UE8M0 scales).
        act_dtype: the activations' (and output's) dtype: bf16, fp16 or fp32.
        K: hidden size (GEMM1's reduction); I: intermediate size (GEMM2's reduction).
        gated: the activation multiplies two halves (``MoEActivation.is_gated``); ignored when ``activation`` is given.
        activation: the ``MoEActivation`` (its gating and relative condition number, step 5).
        accumulation: what the kernel is allowed (default ``Accumulation.allowed``: fp32, a promoted FP8 MMA partial,
            or the 16-bit MMA of step 1b, from ``specs/tolerances.toml [error_model]``); the reference side is fp32.
        gemm1_exact: the inputs are on a grid where every product and every partial sum of GEMM1 within a promotion
            interval is exact in an accumulator of ``mma_mantissa_bits`` bits (the accumulation probe): a conforming
            GEMM1 is then exact, and only what follows it may differ.
        routed_rows: rows of the call's GEMMs (routes to this rank's experts, ~ M * topk * E_local / E), for the
            count of flip events (step 7); None: many (no small-count allowance).
        routes_per_row: expected routes to this rank's experts per token (``topk x E_local / E``; every route local:
            ``topk``), summed by the weighted top-k sum (step 6).
        router_weight_rounding: where the kernel applies the router weight relative to GEMM2's rounding (its
            ``SupportRecord.router_weight_rounding``): ``"reference"`` (round y, weight in fp32) or a vLLM form,
            ``"before_store"`` / ``"output_dtype"`` (step 6).
        constants: ``[error_model]`` of ``specs/tolerances.toml`` (read from specs when None).
        heavy: the call's own weighted values at GEMM2's input (``heavy_values``), for step 7b's heavy event on the
            call itself; None: on the stage's distribution only.
        stage: what is compared (``STAGES``): ``"output"`` (the experts output ``(M, K)``, the default), or an
            intermediate of ``reference.experts.experts_unreduced(stages=...)`` by route: ``"gemm1"`` (GEMM1's
            output rounded to the act dtype, ``(M, topk, N)``), ``"activation"`` (the activation's output rounded,
            ``(M, topk, N')``, before any requantization) or ``"gemm2"`` (GEMM2's output rounded, before the router
            weight and the top-k sum, ``(M, topk, K)``). The model is followed up to that stage only and bounded
            there by the same rule as the output (step 7's scatter of the events made so far; ``max_norm``: ``k_max``
            times that plus the largest difference a single event leaves at the stage's largest element: one act-dtype
            step at GEMM1; a gate flip carried times the condition number, an up flip and the activation's own
            step at the activation; one a2 code flip carried by a weight of ``w2`` and GEMM2's own step at GEMM2).

    Returns:
        ``ErrorBound`` (see the module docstring for the arithmetic).

    Raises:
        ValueError: an activation dtype or a format the model has no grid for, or an unknown ``stage``.
    """
    if stage not in STAGES:
        raise ValueError(f"error model: stage must be one of {STAGES}, got {stage!r}")
    if constants is None:
        from specs import load_tolerances

        constants = load_tolerances()["error_model"]
    c = constants
    if act_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"error model: activation dtype must be bf16, fp16 or fp32, got {act_dtype}")
    if accumulation is None:
        accumulation = Accumulation.allowed(c)
    ref_acc = Accumulation.fp32()
    p_act = _MANTISSA[act_dtype]
    st = _State(rows=math.inf if routed_rows is None else max(float(routed_rows), 1.0))
    N = 2 * I if gated else I

    def acc(n, desc):
        """(additive, proportional) relative accumulation differences of a length-n GEMM (steps 1, 1b)."""
        fp8 = _is_fp8_mma(desc)
        # bf16/fp16 operands on the MMA: unquantized activations, or weight-only schemes dequantized to the act dtype
        mma16 = (desc.dtype is None or desc.dtype in _EMULATED_16BIT) and act_dtype in (torch.bfloat16, torch.float16)
        total = math.hypot(accumulation.relative_error(n, fp8, mma16), ref_acc.relative_error(n, fp8, mma16))
        shrink = accumulation.shrink(n, fp8, mma16)
        return math.sqrt(max(total * total - shrink * shrink, 0.0)), shrink

    # a1 is quantized bit-exactly by both sides (the quantizer cases check it): no difference enters GEMM1.
    act_grid = ("float", p_act)
    gaussian = _stage_values(None)
    if activation is not None:
        gated = activation.is_gated
    act_values = _stage_values(activation.name if activation is not None else "SILU" if gated else "SILU_NO_MUL")
    if gemm1_exact:
        st.gemm(K, 0.0, stage="GEMM1")
    else:
        st.gemm(K, *acc(K, quant_config.a1), stage="GEMM1")
    st.round(act_grid, gaussian, "h rounded", N)
    step_act = 2.0**-p_act
    if stage == "gemm1":  # one h flip at the largest element
        return _stage_bound(st, c, step_act, accumulation)
    cond = _ACT_CONDITION.get(getattr(activation, "name", None), 1.0)
    st.scale(cond * cond + (1.0 if gated else 0.0), 2 if gated else 1, cond)
    st.round(act_grid, act_values, "activation rounded", I)
    if stage == "activation":  # a flip of its gate (carried times cond) and of its up half, then its own rounding
        return _stage_bound(st, c, (cond + (1.0 if gated else 0.0) + 1.0) * step_act, accumulation)
    rows_qc = _gemm_input_int8_rows(quant_config)  # issue 41: GEMM2 quantizes its own rows (asymmetric INT8)
    if rows_qc is not None:
        quant_config = rows_qc
    p_a2 = _requantize(st, quant_config.a2, quant_config, I, act_values,
                       "a2 quantized in GEMM2" if rows_qc is not None else "a2 requantized", z=c["z_events"],
                       extremes=2 if rows_qc is not None else 1)
    # Step 7b: the heaviest flip at GEMM2's input that the call makes with more than the normal tail's probability.
    # One event's largest size at GEMM2's input, relative to its value (mantissa 1): an h flip under it carried
    # through the activation (a gate flip times cond, an up flip once) plus the one step of GEMM2's input grid that
    # it may tip there; the flip of that grid alone where GEMM1 is exact.
    carried = 0.0 if gemm1_exact else (max(cond, 1.0) if gated else cond) * step_act
    heavy_step = 2.0 ** -(p_a2 if p_a2 is not None else p_act) + carried
    b, t_heavy = _heavy_event(st, I, heavy_step, activation, gated, c["z_events"], heavy)
    st.gemm(I, *acc(I, quant_config.a2), stage="GEMM2")
    st.round(act_grid, gaussian, "GEMM2 rounded", K)
    if stage == "gemm2":  # one a2 code flip carried by one weight of w2 (as at the output), then its own rounding
        return _stage_bound(st, c, _single_flip(quant_config, p_a2, p_act, I, st.rows, c) + step_act, accumulation)
    # Step 6: where the router weight is applied is not fixed: the reference rounds y and weights it in fp32; vLLM's
    # fused_moe_kernel weights the fp32 accumulator before its store (MUL_ROUTED_WEIGHT) and rounds w * y, its
    # TopKWeightAndReduceContiguous rounds y and then w * y in the output dtype. Each side's rounding of a term is
    # then independent: the variance of two roundings, E[1 / mant^2] = 3 / (8 ln 2) = 0.541 of s^2 / 6.
    if router_weight_rounding != "reference":
        st.d2, st.ld = _combine(st.d2, st.ld, 0.541 * 2.0 ** (-2 * p_act) / 6.0, math.inf)
        st.log("router weight applied before or after the GEMM2 rounding")
    st.reduce(routes_per_row)
    st.round(act_grid, gaussian, "top-k sum rounded", K)
    # Step 7: a mean square made of ~lam independent flip events is realised within its Poisson upper quantile, and
    # (7b) within Bennett's bound for a sum of variance m2^2 / lam whose single events are at most b.
    return _stage_bound(st, c, _single_flip(quant_config, p_a2, p_act, I, st.rows, c) + step_act, accumulation,
                        heavy=(b, t_heavy))


def _single_flip(quant_config: FusedMoEQuantConfig, p_a2: int | None, p_act: int, I: int, rows: float,
                 c: dict) -> float:
    """The largest element's share of one code flip in front of GEMM2 (one step of the coarsest grid there, carried
    by one weight of ``w2``): ``step * tail / sqrt(I)``."""
    step = 2.0 ** -(p_a2 if p_a2 is not None else p_act)
    if quant_config.a2.dtype == torch.int8:
        step = _tail(_int8_group(quant_config.a2, I, rows)) / 127.0
    return step * c["tail"] / math.sqrt(I)


def _stage_bound(st: _State, c: dict, single_event: float, accumulation: Accumulation,
                 heavy: tuple[float, float] = (0.0, 0.0)) -> ErrorBound:
    """Step 7 and the bounds: the mean square so far, realised within the Poisson upper quantile of its effective
    events; ``max_norm`` adds ``single_event`` (the largest difference one event can leave at the stage's largest
    element, relative to it); ``heavy``: step 7b's ``(b, t)`` (the experts output only)."""
    b, t_heavy = heavy
    lam, z = st.events, c["z_events"]
    few = 1.0 if lam == math.inf else (lam + z * math.sqrt(lam) + z * z) / lam
    if st.m2 > 0 and b > 0 and lam < math.inf:
        few_b = 1.0 + _bennett_excess(st.m2 * st.m2 / lam, b, z) / st.m2
        if few_b > few:
            st.trace.append(f"one heavy event (step 7b): a flip at {t_heavy:.1f}x the RMS of GEMM2's input, "
                            f"{math.sqrt(b):.2e} rms alone ({b / st.m2:.2f} of the mean square)")
            few = few_b
    rms = math.sqrt(st.m2 * few)
    rms_bound = c["k_rms"] * rms
    return ErrorBound(
        max_norm=c["k_max"] * rms + single_event,
        rms_norm=rms_bound,
        calc_diff=rms_bound**2 / 2.0,
        expected_rms=math.sqrt(st.m2),
        derivation=tuple(st.trace) + (f"accumulation allowed: {accumulation.name}",
                                      f"few-events factor {few:.2f} on the mean square"),
    )
