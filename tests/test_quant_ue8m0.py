"""UE8M0 scales: ceil_to_ue8m0 against an exact oracle, exponent bytes, packed-UE8M0 words,
DeepGemmQuantScaleFMT.

Oracles: math.frexp / numpy.frexp on the exact float64 value (independent of fp32 bit tricks),
hand-computed words, and a python loop for the packing.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.quant import (
    DeepGemmQuantScaleFMT,
    ceil_to_ue8m0,
    pack_ue8m0,
    ue8m0_byte,
    unpack_ue8m0,
)


@pytest.fixture(autouse=True)
def _seed_torch():
    # unseeded torch.randn in a test still draws the same inputs on every run
    torch.manual_seed(0)


F32 = np.float32


def oracle_ceil_ue8m0_slow(v: float) -> float:
    """Smallest power of two >= |v|, clamped to [2^-126, 2^127]; inf/NaN -> 2^127 (DeepGEMM)."""
    if math.isnan(v) or math.isinf(v):
        return 2.0**127
    a = abs(v)
    if a == 0.0:
        return 2.0**-126
    m, e = math.frexp(a)  # a = m * 2^e, 0.5 <= m < 1, exact
    p = e - 1 if m == 0.5 else e
    return math.ldexp(1.0, min(max(p, -126), 127))


def oracle_ceil_ue8m0_np(v: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling-NaN bit patterns
        a = np.abs(v.astype(np.float64))
    finite = np.isfinite(a)
    m, e = np.frexp(np.where(finite, a, 1.0))
    p = np.where(m == 0.5, e - 1, e)
    p = np.where(a == 0, -126, p)
    p = np.clip(p, -126, 127)
    p = np.where(finite, p, 127)
    return np.ldexp(1.0, p).astype(F32)


def interesting_fp32() -> np.ndarray:
    """Powers of two over the whole fp32 range and 1..4 ULPs either side, plus specials."""
    pows = np.ldexp(np.float64(1), np.arange(-149, 128)).astype(F32)
    vals = [pows]
    up, down = pows.copy(), pows.copy()
    for _ in range(4):
        up = np.nextafter(up, F32(np.inf))
        down = np.nextafter(down, F32(0))
        vals += [up, down]
    vals.append(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, np.finfo(F32).max, np.finfo(F32).tiny, 1.5, -3.0], F32))
    return np.concatenate(vals)


def mismatches(fn, xs: np.ndarray) -> int:
    """Number of inputs where ``fn`` differs bitwise from the exact oracle (the check every
    ceil_to_ue8m0 test below uses)."""
    got = fn(torch.from_numpy(xs.copy())).numpy()
    want = oracle_ceil_ue8m0_np(xs)
    return int((got.view(np.uint32) != want.view(np.uint32)).sum())


def test_ceil_to_ue8m0_against_slow_oracle():
    xs = interesting_fp32()
    got = ceil_to_ue8m0(torch.from_numpy(xs.copy())).tolist()
    for x, g in zip(xs.tolist(), got):
        assert g == oracle_ceil_ue8m0_slow(x), (x, g)


def test_ceil_to_ue8m0_every_bf16():
    allbits = np.arange(65536, dtype=np.uint16)
    vals = allbits.view(ml_dtypes.bfloat16).astype(F32)
    x = torch.from_numpy(allbits.view(np.int16).copy()).view(torch.bfloat16)
    got = ceil_to_ue8m0(x).numpy()
    want = oracle_ceil_ue8m0_np(vals)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_ceil_to_ue8m0_random_fp32_bit_patterns():
    rng = np.random.default_rng(0)
    xs = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(F32)
    assert mismatches(ceil_to_ue8m0, xs) == 0


def test_exp2_ceil_log2_is_not_the_ceiling():
    # x a few ULPs above 2^k: fp32 log2 rounds to k, so exp2(ceil(log2 x)) returns 2^k < x
    k = np.arange(-120, 120)
    x = (np.ldexp(np.float64(1), k) * (1 + 2.0**-23)).astype(F32)
    xt = torch.from_numpy(x)
    naive = torch.exp2(torch.ceil(torch.log2(xt))).numpy()
    exact = oracle_ceil_ue8m0_np(x)
    assert np.array_equal(ceil_to_ue8m0(xt).numpy(), exact)
    wrong = naive != exact
    assert wrong.sum() > 100  # most k
    assert np.all(naive[wrong] < x[wrong])  # the naive result is below the input: not a ceiling
    assert mismatches(lambda t: torch.exp2(torch.ceil(torch.log2(t.abs()))), x) > 0


def test_one_bit_change_is_caught():
    """A floor-instead-of-ceil variant (drop the ``+ (mantissa != 0)``) must fail the same check."""

    def floor_variant(x: torch.Tensor) -> torch.Tensor:
        bits = x.abs().float().view(torch.int32)
        exp = (bits >> 23) & 0xFF  # the one-bit change: no round-up for a non-zero mantissa
        return (exp.clamp(1, 254) << 23).view(torch.float32)

    def no_clamp_variant(x: torch.Tensor) -> torch.Tensor:
        bits = x.abs().float().view(torch.int32)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        return (exp << 23).view(torch.float32)

    xs = interesting_fp32()
    assert mismatches(ceil_to_ue8m0, xs) == 0
    assert mismatches(floor_variant, xs) > 0
    assert mismatches(no_clamp_variant, xs) > 0
    bf = np.arange(65536, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(F32)
    assert mismatches(floor_variant, bf) > 0


def test_ue8m0_byte_every_exponent_and_nan():
    e = np.arange(-127, 128)
    x = torch.from_numpy(np.ldexp(np.float64(1), e).astype(F32))
    assert ue8m0_byte(x).tolist() == (e + 127).tolist()
    assert ue8m0_byte(torch.tensor([float("nan")])).tolist() == [255]
    # cross-check with ml_dtypes' E8M0 encoder on exact powers of two
    assert np.array_equal(ue8m0_byte(x).numpy(), x.numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8))


@pytest.mark.parametrize("bad", [0.0, 1.5, -2.0, float("inf"), 2.0**-128, 3.0 * 2.0**-130])
def test_ue8m0_byte_rejects_values_without_encoding(bad):
    with pytest.raises(ValueError, match="power of two"):
        ue8m0_byte(torch.tensor([1.0, bad]))


def test_pack_ue8m0_hand_words():
    s = torch.tensor([[1.0, 2.0, 0.5, 2.0**-127], [1.0, 1.0, 1.0, 2.0]])
    p = pack_ue8m0(s)
    assert p.dtype == torch.int32 and p.shape == (2, 1) and p.stride() == (1, 4)
    # bytes 127, 128, 126, 0 (group 0 in the least significant byte)
    assert p[0, 0].item() == 127 | 128 << 8 | 126 << 16 | 0 << 24 == 0x007E807F
    # 127, 127, 127, 128 -> 0x807F7F7F, negative as int32
    assert p[1, 0].item() == 0x807F7F7F - 2**32


@pytest.mark.parametrize("mn,g", [(1, 1), (3, 5), (4, 8), (5, 7), (130, 56)])
def test_pack_ue8m0_layout_and_padding(mn, g):
    rng = np.random.default_rng(mn * 100 + g)
    e = rng.integers(-127, 128, size=(mn, g))
    s = torch.from_numpy(np.ldexp(np.float64(1), e).astype(F32))
    p = pack_ue8m0(s)
    gp, amn = -(-g // 4), -(-mn // 4) * 4
    assert p.shape == (mn, gp) and p.stride() == (1, amn)
    # python-loop oracle for every word, padding bytes 0
    for m in range(mn):
        for j in range(gp):
            word = 0
            for i in range(4):
                gi = 4 * j + i
                word |= (int(e[m, gi]) + 127 if gi < g else 0) << (8 * i)
            assert (p[m, j].item() & 0xFFFFFFFF) == word
    # the storage rows between MN and align(MN, 4) are zero
    storage = torch.empty(0, dtype=torch.int32).set_(p.untyped_storage())
    full = storage[: gp * amn].reshape(gp, amn)
    assert torch.equal(full[:, :mn], p.t()) and not full[:, mn:].any()
    assert torch.equal(unpack_ue8m0(p, g), s)


def test_pack_ue8m0_batched():
    s = torch.exp2(torch.randint(-20, 20, (3, 6, 9)).float())
    p = pack_ue8m0(s)
    assert p.shape == (3, 6, 3) and p.stride() == (3 * 8, 1, 8)
    for b in range(3):
        assert torch.equal(p[b], pack_ue8m0(s[b]))
    assert torch.equal(unpack_ue8m0(p, 9), s)


@settings(max_examples=30, deadline=None, database=None)
@given(mn=st.integers(1, 40), g=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(mn, g, seed):
    rng = np.random.default_rng(seed)
    e = rng.integers(-127, 128, size=(mn, g))
    s = torch.from_numpy(np.ldexp(np.float64(1), e).astype(F32))
    assert torch.equal(unpack_ue8m0(pack_ue8m0(s), g), s)
    # unpacking is independent of the strides it is given
    assert torch.equal(unpack_ue8m0(pack_ue8m0(s).contiguous(), g), s)


def test_pack_unpack_errors_and_nan():
    with pytest.raises(ValueError):
        pack_ue8m0(torch.tensor([[1.0, 3.0]]))
    with pytest.raises(TypeError):
        pack_ue8m0(torch.tensor([[1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError):
        unpack_ue8m0(pack_ue8m0(torch.ones(2, 4)), 5)
    p = pack_ue8m0(torch.tensor([[float("nan"), 1.0]]))
    assert p[0, 0].item() == 255 | 127 << 8
    u = unpack_ue8m0(p, 2)
    assert math.isnan(u[0, 0].item()) and u[0, 1].item() == 1.0


def test_deep_gemm_scale_fmt_from_capability():
    F = DeepGemmQuantScaleFMT
    assert F.from_capability(9) is F.FLOAT32_CEIL_UE8M0
    assert F.from_capability((9, 0)) is F.FLOAT32_CEIL_UE8M0
    assert F.from_capability(10) is F.UE8M0
    assert F.from_capability(12) is F.UE8M0
    for major in (9, 10, 12):
        assert F.from_capability(major, use_e8m0=False) is F.FLOAT32
    with pytest.raises(ValueError):
        F.from_capability(8)
    assert [f.name for f in F] == ["FLOAT32", "FLOAT32_CEIL_UE8M0", "UE8M0"]
