"""The per-token FP8 quantizer's division without a division: ``jit.div_rn_by_scale`` with ``FAST`` (the GPU path).

vLLM's dynamic per-token quantizer computes ``fp8(x / s)`` with an IEEE division per element, ``s = max(amax / 448,
1 / (448 * 512))`` the row's scale (``reference.quant.scaled_fp8_quant``; the act_quant kernel's QMODE 2). On the GPU
``div.rn.f32`` is about a dozen instructions with a slow-path branch; the FAST form is one multiply by the row's
reciprocal ``r = RN(1 / s)`` and two FMAs::

    q0 = RN(x * r);  rem = fma(-q0, s, x);  q = rem == 0 ? q0 : fma(rem, r, q0)

That form is not an IEEE division in general. It is claimed only where the rows are bf16 or fp16 (the activation
dtypes; x is the activation rounded to it) and ``amax`` is the row's largest |x|, and there its FP8 codes equal the
division's for every x and every amax: enumerated here exhaustively, up to sign (the form is odd in x: a zero keeps its
sign through the ``rem == 0`` branch), with an exact FMA (products of two fp32 are exact in fp64; the sum is rounded
once through TwoSum), both with IEEE multiply / FMA and with the flush-to-zero forms the GPU runs (Triton's
libdevice ``mul_rn`` / ``fma_rn`` compile to ``.ftz``). The fp32 quotients themselves differ where x is near fp32's
underflow (the remainder, or with FTZ x itself, is then not representable), always for quotients below 2^-64
(2.5e-29 at most for bf16 with IEEE, 5.2e-26 with FTZ; none for fp16), far under the 2^-10 below which every code
is 0: bounded below. The GPU's own arithmetic is checked over the same enumeration in tests/test_triton_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference.quant.fp8 import _MIN_PER_TOKEN_SCALE

f32, f64 = np.float32, np.float64
# the scale's floor 1 / (448 * 512), from the reference that defines it (the triton quantizers' _MIN_TOKEN_SCALE)
_MIN_SCALE = f32(_MIN_PER_TOKEN_SCALE.item())


def _rn32_of_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``RN32(a + b)`` exactly, for float64 arrays: TwoSum gives ``a + b = hi + lo`` exactly; ``RN32(hi + lo)`` is
    ``RN32(hi)`` unless ``hi`` is exactly halfway between two fp32 values, where the sign of ``lo`` decides."""
    hi = a + b
    bb = hi - a
    lo = (a - (hi - bb)) + (b - bb)
    r = hi.astype(f32)
    up, dn = np.nextafter(r, f32(np.inf)), np.nextafter(r, f32(-np.inf))
    mid_up = (r.astype(f64) + up.astype(f64)) / 2
    mid_dn = (r.astype(f64) + dn.astype(f64)) / 2
    lower = np.where(hi == mid_up, r, dn)
    upper = np.where(hi == mid_up, up, r)
    at_mid = (hi == mid_up) | (hi == mid_dn)
    return np.where(at_mid & (lo > 0), upper, np.where(at_mid & (lo < 0), lower, r))


def _fma32(a: np.ndarray, b, c: np.ndarray) -> np.ndarray:
    """IEEE fp32 ``fma(a, b, c)``: the product of two fp32 is exact in fp64, the sum rounded once."""
    return _rn32_of_sum(a.astype(f64) * np.asarray(b, dtype=f32).astype(f64), c.astype(f64))


def _ftz(v: np.ndarray) -> np.ndarray:
    """Subnormal fp32 to a zero of the same sign (the ``.ftz`` forms of PTX's ``mul`` / ``fma``)."""
    return np.where(np.abs(v) < f32(2.0 ** -126), np.copysign(f32(0.0), v), v).astype(f32)


def fast_quotient(x: np.ndarray, s: np.float32, ftz: bool = False) -> np.ndarray:
    """The FAST form of ``jit.div_rn_by_scale`` (fp32 arrays). ``ftz``: as the GPU runs it under Triton's default
    (libdevice's ``mul_rn`` / ``fma_rn`` become ``mul.rn.ftz.f32`` / ``fma.rn.ftz.f32``: subnormal inputs and
    results are flushed to zero)."""
    f = _ftz if ftz else (lambda v: v)
    r = f32(f32(1.0) / s)
    x = f(x)
    q0 = f((x * r).astype(f32))
    rem = f(_fma32(-q0, s, x))
    return np.where(rem == 0, q0, f(_fma32(rem, r, q0))).astype(f32)


def _e4m3(q: np.ndarray) -> torch.Tensor:
    """FP8 E4M3 codes of fp32 ``q``, saturating as the kernels' ``cvt.rn.satfinite`` does."""
    return torch.from_numpy(np.clip(q, -448.0, 448.0)).to(torch.float8_e4m3fn).view(torch.uint8)


def _magnitudes(dtype: torch.dtype) -> np.ndarray:
    """Every positive finite value of a 16-bit float dtype, as fp32, ascending."""
    bits = torch.arange(1, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).float().numpy()


def _enumerate(dtype: torch.dtype, stride: int, ftz: bool) -> tuple[int, int, int, float]:
    """Over every ``stride``-th amax of ``dtype`` (and the largest) and every x of ``dtype`` with ``0 < x <= amax``:
    (pairs, FP8 code mismatches, fp32 quotient mismatches, largest quotient among those)."""
    xs = _magnitudes(dtype)
    idx = sorted(set(range(0, xs.size, stride)) | {xs.size - 1})
    pairs = bad8 = bad32 = 0
    worst = 0.0
    for i in idx:
        amax = xs[i]
        s = np.maximum((amax / f32(448.0)).astype(f32), _MIN_SCALE).astype(f32)
        x = xs[: i + 1]
        want = (x / s).astype(f32)  # numpy's fp32 division is IEEE
        got = fast_quotient(x, s, ftz)
        pairs += x.size
        bad8 += int((_e4m3(got) != _e4m3(want)).sum())
        diff = got != want
        if diff.any():
            bad32 += int(diff.sum())
            worst = max(worst, float(np.abs(want[diff]).max()))
    return pairs, bad8, bad32, worst


def test_the_exact_fma_emulation_is_exact():
    """The oracle's own FMA: against Python's exact rationals on random fp32 triples (including cancellations and
    ties, where a double rounding through fp64 would differ)."""
    from fractions import Fraction

    g = np.random.default_rng(0)
    a = g.standard_normal(4000).astype(f32)
    b = g.standard_normal(4000).astype(f32)
    c = (-(a.astype(f64) * b.astype(f64))).astype(f32)  # near-total cancellation
    c[::2] = g.standard_normal(2000).astype(f32) * f32(2.0 ** -30)
    # and exact ties of the fp64 sum: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is halfway between two fp32 values, and
    # +-2^-80 decides (a double rounding through fp64 drops it and rounds to even)
    t = f32(1.0 + 2.0 ** -12)
    a = np.concatenate([a, [t, t, -t, -t]]).astype(f32)
    b = np.concatenate([b, [t, t, t, t]]).astype(f32)
    c = np.concatenate([c, [2.0 ** -80, -(2.0 ** -80), 2.0 ** -80, -(2.0 ** -80)]]).astype(f32)
    got = _fma32(a, b, c)
    naive = (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(f32)
    assert (got[-4:] != naive[-4:]).any(), "the constructed ties do not separate an exact FMA from a double rounding"
    for k in range(a.size):
        exact = Fraction(float(a[k])) * Fraction(float(b[k])) + Fraction(float(c[k]))
        # RN32 of the exact rational: the nearest fp32 (ties to even) among the neighbours of fp32(float(exact))
        cand = f32(float(exact))
        nbrs = [np.nextafter(cand, f32(-np.inf)), cand, np.nextafter(cand, f32(np.inf))]
        dist = [abs(Fraction(float(v)) - exact) for v in nbrs]
        m = min(dist)
        best = [v for v, d in zip(nbrs, dist, strict=True) if d == m]
        want = best[0] if len(best) == 1 else next(v for v in best if not (v.view(np.uint32) & 1))
        assert got[k] == want, (a[k], b[k], c[k], got[k], want)


@pytest.mark.parametrize("ftz", [False, True], ids=["ieee", "ftz"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_quotient_codes_equal_the_division_sampled(dtype, ftz):
    """Every x against every 61st amax (a few seconds): the FP8 codes are the division's."""
    pairs, bad8, bad32, worst = _enumerate(dtype, 61, ftz)
    assert pairs > 10**6
    for s in (f32(1.0), _MIN_SCALE, f32(0.0123)):  # zeros keep their sign, as x / s does
        z = fast_quotient(np.array([0.0, -0.0], dtype=f32), s, ftz)
        assert list(np.signbit(z)) == [False, True] and not z.any()
        v = np.array([-1.5, -448.0 * float(s), -(2.0 ** -130)], dtype=f32)  # odd in x
        assert np.array_equal(fast_quotient(v, s, ftz), -fast_quotient(-v, s, ftz))
    assert bad8 == 0, f"{bad8} of {pairs} FP8 codes differ from the IEEE division's"
    assert worst < 2.0 ** -64, f"an fp32 quotient of {worst} differs (only quotients near underflow may)"


@pytest.mark.slow
@pytest.mark.parametrize("ftz", [False, True], ids=["ieee", "ftz"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_quotient_codes_equal_the_division_exhaustive(dtype, ftz):
    """Every (x, amax) pair of the dtype with 0 < x <= amax (5.3e8 for bf16, 5.0e8 for fp16): the claim of
    ``jit.div_rn_by_scale``'s FAST form, with IEEE and with flush-to-zero multiply / FMA."""
    pairs, bad8, bad32, worst = _enumerate(dtype, 1, ftz)
    assert bad8 == 0, f"{bad8} of {pairs} FP8 codes differ from the IEEE division's"
    assert worst < 2.0 ** -64, f"an fp32 quotient of {worst} differs (only quotients near underflow may)"
