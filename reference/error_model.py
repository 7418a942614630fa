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
   Its mean part (a shrink of about ``c m / 2``) has one sign in gate, up and GEMM2, but each is rounded before they
   meet, and what survives a rounding is flips at independent elements: they combine in quadrature as the rest.

2. **A GEMM** sums many independent input differences: the relative mean square carries through
   (``m2_out = m2_in + acc^2`` for a dot product with independent weights). Differences come in two kinds, tracked
   apart: *dense* ones (every element a little: accumulation order), near Gaussian, whose mean |value| is
   ``sqrt(2 / pi)`` of their RMS; and *sparse* ones (a fraction ``q`` of the elements off by a whole grid step:
   rounding flips), whose mean |value| is only ``sqrt(2 / pi) sqrt(q m2)``. A GEMM row sums ``n`` inputs of one
   row, so a sparse fraction ``q`` reaches a fraction ``min(1, n q)`` of the output rows (all of their elements);
   at 1 it has become dense.

3. **Rounding to a grid** with spacing ``s_i`` at element ``i``: an input difference ``d_i`` (|d_i| < s_i) makes
   the two roundings differ by one step with probability ``|d_i| / s_i``, so ``E[diff^2] = s_i |d_i|`` while the
   mean |difference| stays ``|d_i|``. For a floating format with ``p`` mantissa bits, ``s_i = 2^-p |v_i| / mant_i``
   (``mant_i`` in [1, 2)); with ``E[1 / mant] = 1 / (2 ln 2)`` (logarithmically distributed mantissas) and
   ``E|v| = sqrt(2 / pi) rms`` (near-Gaussian values)::

       m2_out = m2_in + min(c_flip * 2^-p * m1_in, 2^-2p / 6),   c_flip = sqrt(2 / pi) / (2 ln 2) = 0.575

   capped at the variance of two independent roundings. What does not flip is *equal* after the rounding: a dense
   input difference becomes a sparse one (``q = m1 / (c_flip s)``); a sparse one flips again with probability
   ``d / (c_flip s)`` per differing element of mean |difference| ``d``, or stays if ``d`` exceeds a step. A uniform grid (INT8, step ``amax / 127``) uses
   ``s = tail(n) / 127`` relative to the RMS, ``tail(n) = sqrt(2 ln n)`` the expected maximum of ``n`` Gaussians.

4. **Dynamic scales**: a scale computed from ``amax`` of a group moves with the group's maximum element, shifting
   every element of the group by the same relative amount. With an fp32 scale the shift's mean |value| is ``m1``
   (the maximum element is one element), so the rounding sees ``2 m1``. A power-of-two (UE8M0) scale moves only when
   ``amax`` crosses a power of two, and a floating grid is invariant under such a move: no extra term. A uniform INT8
   grid is not invariant: fp32 or not, ``2 m1``.

5. **The activation**: a gated activation multiplies two rounded halves, so relative differences add in quadrature
   (``m2 *= kappa^2 + 1``); an activation without a mul carries them times its relative condition number
   ``kappa = |x f'(x) / f(x)|`` (``m2 *= kappa^2``): 1 for SiLU and GELU where they carry the output, 2 for
   ``relu(x)^2``.

6. **The weighted top-k sum** of independent expert outputs keeps the relative mean square (``sum w_k^2 d_k^2`` over
   ``sum w_k^2 y_k^2``), followed by one rounding to the output dtype. Where the router weight meets the GEMM2
   rounding is not fixed across vLLM's kernels (before the store: ``fused_moe_kernel``'s ``MUL_ROUTED_WEIGHT``;
   after it, in the output dtype: ``TopKWeightAndReduceContiguous``), so each term may be rounded as ``y`` on one
   side and as ``w y`` on the other: two independent roundings, ``E[1/mant^2] s^2 / 6 = 0.541 s^2 / 6``, allowed
   to a kernel whose ``SupportRecord.router_weight_rounding`` declares the vLLM form.

7. **Few events**: a sparse difference is a sum over flip events, about ``q x rows x width`` of them at the rounding
   that made them (fewer if the dense difference that drove them came from few events). When the expected count
   ``lam`` is small (a short reduction, few routed rows) the realised mean square scatters around its expectation
   like a Poisson count: it is bounded by its upper quantile ``(lam + z sqrt(lam) + z^2) / lam`` times the
   expectation (``z_events`` in specs; independent parts combine their counts by their relative variances).

Bounds (``k_rms``, ``k_max``, ``tail`` in specs): ``rms_norm <= k_rms * sqrt(m2 * few)`` (``k_rms = 1``: the constants of
steps 1 and 4 are worst cases, so the expectation is already a bound, and step 7 covers its scatter); ``calc_diff`` is
``sum (x - y)^2 / sum (x^2 + y^2) ~= rms_norm^2 / 2``, so ``calc_diff <= (k_rms sqrt(m2))^2 / 2``. The worst
element can be a single step of the coarsest grid in front of GEMM2 (one requantized code flip, ``2^-p`` of one
value) carried by one weight of ``w2`` (``~ N(0, 1/I)``): relative to ``max |y|`` that is
``2^-p * tail_g * tail_w / (sqrt(I) * tail_y)`` with all three tails ``~ tail`` — so ``max_norm <= k_max * sqrt(m2) +
2^-p_a2 * tail / sqrt(I) + 2^-p_out`` (the last: one output-rounding step at the largest element).

Where this model is honest about its limits: a *per-tensor* dynamic scale is one draw per call, so the expectation
in 4 is realised all-or-nothing; the bound holds on average over cases, and the conformance suite's
accumulation probe (``conformance/test_accumulation.py``) is the sharp instrument for accumulation precision
(it uses inputs on which every conforming accumulation is exact). Two known gaps (docs/GPU_NOTES.md, 2026-11-26):
step 3 treats a difference as independent of the value it perturbs, while most of step 1b's is a shrink proportional to
it (whose rounding mean square is 1.57x larger); and step 7 counts flip events as unit-sized, while an event's square
goes as its element's value squared (a compound Poisson sum: on one-route outputs, with a gated activation's heavy
tail, one event can carry the whole mean square). Both show on single-token bf16 cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from reference.config import FusedMoEQuantConfig, FusedMoEQuantDesc

__all__ = ["Accumulation", "ErrorBound", "experts_error_bound", "format_mantissa_bits", "acc_rel", "mma16_rel",
           "emulate_mma16"]

# Mantissa bits of each floating format (s = 2^-p relative spacing at mantissa 1.0).
# Every activation format of specs/schemes.toml is here or INT8 (a uniform grid, step 4): FP8 E4M3 (per tensor,
# static or dynamic, per token, per 1xG group), MXFP8 / MXFP4 (E8M0 power-of-two scales per 32: step 4 adds no
# scale shift), NVFP4 (E2M1 under an E4M3 block scale; with the per-tensor encode scale or one per token, the
# block scale moves with the block's amax either way). Weight-only schemes (WNA16, FP8 W8A16) quantize no
# activation: their weights are the same bits on both sides, so only accumulation and the act-dtype roundings count.
_MANTISSA = {
    torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 2,
    "mxfp8": 3, "mxfp4": 1, "nvfp4": 1,
}
# Formats whose scales are powers of two (a scale change leaves a floating grid's values in place).
_POW2_SCALES = {"mxfp8", "mxfp4"}


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
    """Sum of two independent mean squares, each the sum of a Poisson number of events with expectation ``l``:
    the effective event count of the sum (its relative variance is ``sum v_i^2 / l_i / (sum v_i)^2``)."""
    v = v1 + v2
    if v <= 0:
        return 0.0, math.inf
    var = (v1 * v1 / l1 if l1 < math.inf and v1 else 0.0) + (v2 * v2 / l2 if l2 < math.inf and v2 else 0.0)
    return v, (v * v / var if var > 0 else math.inf)


@dataclass
class _State:
    """The difference between two conforming implementations at one stage, relative to that stage's RMS: a dense
    part (every element differs a little: accumulation order) of mean square ``d2``, and a sparse part (a fraction
    ``q`` of the elements differ by whole grid steps: rounding flips) of mean square ``s2`` over all elements.
    ``ld`` / ``ls``: the expected number of independent flip events each part is made of (inf: accumulation order,
    which every element has); with few events the realised mean square scatters around its expectation (step 7).
    ``rows``: the GEMM rows of the call (routed tokens), for counting events."""

    rows: float = math.inf
    d2: float = 0.0
    ld: float = math.inf
    q: float = 0.0
    s2: float = 0.0
    ls: float = math.inf
    trace: list = field(default_factory=list)

    @property
    def m2(self) -> float:
        return self.d2 + self.s2

    @property
    def events(self) -> float:
        return _combine(self.d2, self.ld, self.s2, self.ls)[1]

    def log(self, stage: str) -> None:
        ev = self.events
        self.trace.append(f"{stage}: rms {math.sqrt(self.m2):.2e} (dense {math.sqrt(self.d2):.1e}, "
                          f"{self.q:.1e} of elements flipped" + (f", ~{ev:.0f} flip events)" if ev < math.inf
                                                                  else ")"))

    def gemm(self, n: int, acc: float, stage: str) -> None:
        # Each output row sums n inputs of one row: a flip anywhere in it reaches all of its outputs.
        self.q = min(1.0, n * self.q)
        if self.q >= 1.0:  # flips in every row: the difference is dense now
            self.d2, self.ld = _combine(self.d2, self.ld, self.s2, self.ls)
            self.q, self.s2, self.ls = 0.0, 0.0, math.inf
        self.d2, self.ld = _combine(self.d2, self.ld, acc * acc, math.inf)
        self.log(f"{stage} (acc {acc:.1e})")

    def scale(self, factor: float) -> None:
        self.d2 *= factor
        self.s2 *= factor
        self.q = min(1.0, self.q * math.sqrt(factor))

    def round(self, s: float, c_flip: float, stage: str, width: int, scale_shift: bool = False) -> None:
        """Rounding to a grid of relative spacing ``s`` (step 3) of a stage ``width`` elements wide;
        ``scale_shift``: a dynamic scale moves with the group's maximum (step 4)."""
        shift = 2.0 if scale_shift else 1.0
        n = self.rows * width
        # The dense part flips a fraction m1 / (c s) of the elements by one step each; what does not flip is equal
        # after rounding. A dense part beyond a step stays dense, plus the variance of two independent roundings.
        m1_d = shift * _SQRT_2_PI * math.sqrt(self.d2)
        if m1_d < c_flip * s:
            new_q, new_s2, d2, ld = m1_d / (c_flip * s), c_flip * s * m1_d, 0.0, math.inf
            new_l = min(self.ld, new_q * n) if new_q > 0 else math.inf
        else:
            new_q, new_s2, new_l = 0.0, 0.0, math.inf
            d2, ld = _combine(self.d2, self.ld, s * s / 6.0, math.inf)
        # The sparse part: elements that differ by d flip again with probability d / (c s), or keep differing.
        if self.q > 0:
            d = shift * _SQRT_2_PI * math.sqrt(self.s2 / self.q)
            if d < c_flip * s:  # one step with probability d / (c s): E[diff^2] = c s d per element
                keep = d / (c_flip * s)
                q_old, s2_old = self.q * keep, max(self.s2, self.q * c_flip * s * d)
                l_old = self.ls * keep if keep > 0 and self.ls < math.inf else self.ls
            else:  # already beyond a step: the difference stays, plus two independent roundings
                q_old, s2_old, l_old = self.q, self.s2 + self.q * s * s / 6.0, self.ls
        else:
            q_old, s2_old, l_old = 0.0, 0.0, math.inf
        self.d2, self.ld = d2, ld
        self.q = min(1.0, new_q + q_old)
        self.s2, self.ls = _combine(new_s2, new_l, s2_old, l_old)
        self.log(stage)


_SQRT_2_PI = math.sqrt(2.0 / math.pi)
# Relative condition number |x f'(x) / f(x)| of the activation's (gate) function where it matters: 1 for SiLU, GELU
# and their clamped forms at the magnitudes that carry the output; relu(x)^2 doubles relative differences.
_ACT_CONDITION = {"RELU2_NO_MUL": 2.0, "RELU2": 2.0}


def _tail(n: int) -> float:
    return math.sqrt(2.0 * math.log(max(n, 2)))


def _requantize(st: _State, desc: FusedMoEQuantDesc, qc: FusedMoEQuantConfig, width: int, c: dict,
                stage: str) -> int | None:
    """Rounding of a dynamically (or statically) quantized activation; returns the grid's mantissa bits (None for
    uniform grids)."""
    fmt = desc.dtype
    if fmt is None:
        return None
    static = desc.scale is not None
    if fmt == torch.int8:
        group = _int8_group(desc, width, st.rows)
        st.round(_tail(group) / 127.0, c["c_flip"], stage + " (int8)", width, scale_shift=True)
        return None
    p = format_mantissa_bits(fmt)
    if p is None:
        raise ValueError(f"error model: no grid for activation format {fmt!r}")
    pow2 = qc.use_ue8m0 or fmt in _POW2_SCALES
    st.round(2.0**-p, c["c_flip"], f"{stage} ({fmt if isinstance(fmt, str) else str(fmt)[6:]})", width,
             scale_shift=not static and not pow2)
    return p


def _int8_group(desc: FusedMoEQuantDesc, width: int, rows: float) -> float:
    """Elements whose amax sets one INT8 step: a row (per token, ``width``), a 1xG group, or, per tensor
    (``kInt8DynamicTensorSym``), every routed row of the call (``rows x width``; one row when the count is unknown,
    the smallest tail, since a larger tensor only widens the step)."""
    if desc.shape == (-1, -1):
        return width * (rows if math.isfinite(rows) else 1.0)
    return width if desc.shape in ((1, -1), None) or desc.shape[1] <= 0 else desc.shape[1]


def _is_fp8_mma(desc: FusedMoEQuantDesc) -> bool:
    return desc.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, "mxfp8")


def experts_error_bound(quant_config: FusedMoEQuantConfig, *, act_dtype: torch.dtype, K: int, I: int,
                        gated: bool = True, activation=None, accumulation: Accumulation | None = None,
                        gemm1_exact: bool = False, routed_rows: float | None = None,
                        router_weight_rounding: str = "reference",
                        constants: dict | None = None) -> ErrorBound:
    """Bounds on the experts output's metrics against the reference for one case.

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
        router_weight_rounding: where the kernel applies the router weight relative to GEMM2's rounding (its
            ``SupportRecord.router_weight_rounding``): ``"reference"`` (round y, weight in fp32) or a vLLM form,
            ``"before_store"`` / ``"output_dtype"`` (step 6).
        constants: ``[error_model]`` of ``specs/tolerances.toml`` (read from specs when None).

    Returns:
        ``ErrorBound`` (see the module docstring for the arithmetic).

    Raises:
        ValueError: an activation dtype or a format the model has no grid for.
    """
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
        fp8 = _is_fp8_mma(desc)
        # bf16/fp16 operands on the MMA: unquantized activations, or weight-only schemes dequantized to the act dtype
        mma16 = desc.dtype is None and act_dtype in (torch.bfloat16, torch.float16)
        return math.hypot(accumulation.relative_error(n, fp8, mma16), ref_acc.relative_error(n, fp8, mma16))

    # a1 is quantized bit-exactly by both sides (the quantizer cases check it): no difference enters GEMM1.
    s_act = 2.0**-p_act
    st.gemm(K, 0.0 if gemm1_exact else acc(K, quant_config.a1), "GEMM1")
    st.round(s_act, c["c_flip"], "h rounded", N)
    if activation is not None:
        gated = activation.is_gated
    cond = _ACT_CONDITION.get(getattr(activation, "name", None), 1.0)
    st.scale(cond * cond + (1.0 if gated else 0.0))
    st.round(s_act, c["c_flip"], "activation rounded", I)
    p_a2 = _requantize(st, quant_config.a2, quant_config, I, c, "a2 requantized")
    st.gemm(I, acc(I, quant_config.a2), "GEMM2")
    st.round(s_act, c["c_flip"], "GEMM2 rounded", K)
    # Step 6: where the router weight is applied is not fixed: the reference rounds y and weights it in fp32; vLLM's
    # fused_moe_kernel weights the fp32 accumulator before its store (MUL_ROUTED_WEIGHT) and rounds w * y, its
    # TopKWeightAndReduceContiguous rounds y and then w * y in the output dtype. Each side's rounding of a term is
    # then independent: the variance of two roundings, E[1 / mant^2] = 3 / (8 ln 2) = 0.541 of s^2 / 6.
    if router_weight_rounding != "reference":
        st.d2, st.ld = _combine(st.d2, st.ld, 0.541 * s_act * s_act / 6.0, math.inf)
        st.log("router weight applied before or after the GEMM2 rounding")
    st.round(s_act, c["c_flip"], "top-k sum rounded", K)
    # Step 7: a mean square made of ~lam independent flip events is realised within its Poisson upper quantile.
    lam, z = st.events, c["z_events"]
    few = 1.0 if lam == math.inf else (lam + z * math.sqrt(lam) + z * z) / lam
    rms = math.sqrt(st.m2 * few)
    expected = math.sqrt(st.m2)
    step = 2.0 ** -(p_a2 if p_a2 is not None else p_act)
    if quant_config.a2.dtype == torch.int8:
        step = _tail(_int8_group(quant_config.a2, I, st.rows)) / 127.0
    single_flip = step * c["tail"] / math.sqrt(I)
    rms_bound = c["k_rms"] * rms
    return ErrorBound(
        max_norm=c["k_max"] * rms + single_flip + 2.0**-p_act,
        rms_norm=rms_bound,
        calc_diff=rms_bound**2 / 2.0,
        expected_rms=expected,
        derivation=tuple(st.trace) + (f"accumulation allowed: {accumulation.name}",
                                      f"few-events factor {few:.2f} on the mean square"),
    )
