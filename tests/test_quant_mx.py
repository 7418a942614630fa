"""MX formats: E8M0 decode, MX scale rules, MXFP8, E2M1 encode / decode / packing, MXFP4.

Oracles: ml_dtypes float8_e8m0fnu / float4_e2m1fn / float8_e4m3fn, torch's own float8_e8m0fnu,
numpy.frexp for exponents and mantissas (the scale-rule equivalences of the facts file), and
hand tables.
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
    ceil_to_ue8m0,
    e2m1_decode,
    e2m1_encode,
    e8m0_to_fp32,
    mx_scale_e8m0,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    pack_fp4,
    unpack_fp4,
)


@pytest.fixture(autouse=True)
def _seed_torch():
    # unseeded torch.randn in a test still draws the same inputs on every run
    torch.manual_seed(0)


F32 = np.float32
E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
RULES = ["floor", "ceil", "even", "rceil"]
HAND_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def all_bf16() -> tuple[torch.Tensor, np.ndarray]:
    bits = np.arange(65536, dtype=np.uint16)
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16), bits.view(ml_dtypes.bfloat16).astype(F32)


def frexp_em(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """amax = 2^E * m with 1 <= m < 2 (numpy.frexp on float64; independent of bit tricks).
    amax = 0 gets E = -10^6, i.e. "below every clamp" (OCP: the scale of a zero block is 2^-127)."""
    mant, e = np.frexp(a.astype(np.float64))
    return np.where(a == 0, -(10**6), e - 1), mant * 2


# ----------------------------------------------------------------------------------------------
# E8M0


def test_e8m0_decode_all_bytes_matches_ml_dtypes_and_torch():
    b = np.arange(256, dtype=np.uint8)
    got = e8m0_to_fp32(torch.from_numpy(b)).numpy()
    want = b.view(ml_dtypes.float8_e8m0fnu).astype(F32)
    torch_want = torch.from_numpy(b).view(torch.float8_e8m0fnu).float().numpy()
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(got, torch_want, equal_nan=True)
    assert got[0] == 2.0**-127 and math.isnan(got[255]) and got[127] == 1.0
    # float8_e8m0fnu tensors are accepted too
    assert np.array_equal(e8m0_to_fp32(torch.from_numpy(b).view(torch.float8_e8m0fnu)).numpy(), want, equal_nan=True)


# ----------------------------------------------------------------------------------------------
# scale rules


def amax_samples() -> np.ndarray:
    rng = np.random.default_rng(5)
    exps = rng.integers(-100, 100, size=20000)
    mants = rng.uniform(1, 2, size=20000)
    special_m = np.array([1.0, 1.5, 1.75, 1.9375, 2 - 2.0**-23])
    specials = []
    for m in special_m:
        for e in (-90, -3, 0, 5, 90):
            v = F32(np.ldexp(m, e))
            specials += [v, np.nextafter(v, F32(np.inf)), np.nextafter(v, F32(0))]
    return np.concatenate([np.ldexp(mants, exps).astype(F32), np.array(specials, F32)])


@pytest.mark.parametrize(
    "element,emax,rceil_thr,even_thr",
    [("e4m3", 8, 1.75, 1.9375), ("e2m1", 2, 1.5, 1.75)],
)
def test_scale_rule_equivalences(element, emax, rceil_thr, even_thr):
    a = amax_samples()
    E, m = frexp_em(a)
    floor_byte = np.clip(E - emax, -127, 127) + 127  # OCP: 2^(floor(log2 amax) - emax)
    got = {r: mx_scale_e8m0(torch.from_numpy(a), element=element, scale_rule=r).numpy().astype(int) for r in RULES}
    assert np.array_equal(got["floor"], floor_byte)
    assert np.array_equal(got["ceil"], np.clip(E + (m > 1) - emax, -127, 127) + 127)
    # facts: RCEIL = FLOOR + [m > 1.75], EVEN = FLOOR + [m >= 1.9375] (E4M3); E2M1: 1.5 / 1.75
    assert np.array_equal(got["rceil"], np.clip(E + (m > rceil_thr) - emax, -127, 127) + 127)
    assert np.array_equal(got["even"], np.clip(E + (m >= even_thr) - emax, -127, 127) + 127)


def test_rceil_equals_deepgemm_ceil_of_amax_over_elem_max():
    # DeepGEMM: ceil_to_ue8m0(amax / 448) (resp. / 6); equal to the exact RCEIL where amax/max is normal
    a = amax_samples()
    for element, mx in (("e4m3", 448.0), ("e2m1", 6.0)):
        ours = mx_scale_e8m0(torch.from_numpy(a), element=element, scale_rule="rceil")
        dg = ceil_to_ue8m0(torch.from_numpy(a) / mx)
        dg_byte = np.frexp(dg.numpy().astype(np.float64))[1] - 1 + 127
        assert np.array_equal(ours.numpy().astype(int), dg_byte)


def test_scale_rule_zero_subnormal_and_non_finite():
    a = torch.tensor([0.0, -0.0, 1e-45, 1e-40, float("inf"), float("nan"), -float("inf")])
    for r in RULES:
        for el in ("e4m3", "e2m1"):
            assert mx_scale_e8m0(a, element=el, scale_rule=r).tolist() == [0, 0, 0, 0, 255, 255, 255]
    with pytest.raises(ValueError):
        mx_scale_e8m0(a, element="e5m2", scale_rule="floor")
    with pytest.raises(ValueError):
        mx_scale_e8m0(a, element="e4m3", scale_rule="nearest")


# ----------------------------------------------------------------------------------------------
# MXFP8


def oracle_mxfp8(x: np.ndarray, rule: str):
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(F32)
    E, mant = frexp_em(np.abs(xb).max(-1))
    bump = {"floor": 0, "ceil": mant > 1, "even": mant >= 1.9375, "rceil": mant > 1.75}[rule]
    e = np.clip(E + bump - 8, -127, 127)
    y = xb / np.ldexp(F32(1), e)[..., None].astype(F32)
    q = np.clip(y, -448, 448).astype(F32).astype(E4M3).view(np.uint8)
    return q.reshape(m, k), (e + 127).astype(np.uint8)


@pytest.mark.parametrize("rule", RULES)
def test_mxfp8_matches_oracle(rule):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(16, 256, generator=g) * torch.logspace(-20, 20, 16).unsqueeze(1)).to(torch.bfloat16)
    q, s = mxfp8_quantize(x, scale_rule=rule)
    want_q, want_s = oracle_mxfp8(x.float().numpy(), rule)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (16, 8)
    assert np.array_equal(s.numpy(), want_s)
    assert np.array_equal(q.view(torch.uint8).numpy(), want_q)
    # FLOOR saturates (block max / X in [256, 512)), CEIL / RCEIL never exceed 448
    ratio = np.abs(x.float().numpy().reshape(16, 8, 32)).max(-1) / e8m0_to_fp32(s).numpy()
    if rule == "floor":
        assert ratio.min() >= 256 and ratio.max() < 512
    if rule in ("ceil", "rceil"):
        assert ratio.max() <= 448


@pytest.mark.parametrize("rule", RULES)
def test_mxfp8_round_trip_on_grid(rule):
    # codes with |v| <= 256 and a +-256 in every block: amax = 2^(e+8) exactly, every rule gives e
    rng = np.random.default_rng(9)
    b = rng.integers(0, 256, size=(8, 128), dtype=np.uint8)
    b[(b & 0x7F) > 0x78] = 0x78  # |v| <= 256 (0x78 = 256), no NaN
    b[:, ::32] = np.where(rng.random((8, 4)) < 0.5, 0x78, 0xF8)
    e = rng.integers(-100, 100, size=(8, 4))
    byte = torch.from_numpy((e + 127).astype(np.uint8))
    q = torch.from_numpy(b).view(torch.float8_e4m3fn)
    x = mxfp8_dequantize(q, byte)
    q2, s2 = mxfp8_quantize(x, scale_rule=rule)
    assert torch.equal(s2, byte)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_mxfp8_zero_and_poisoned_blocks():
    x = torch.randn(2, 128)
    x[0, :32] = 0
    x[1, 40] = float("nan")
    x[1, 100] = float("inf")
    q, s = mxfp8_quantize(x)
    assert s[0, 0].item() == 0 and not q.view(torch.uint8)[0, :32].any()
    assert s[1, 1].item() == 255 and s[1, 3].item() == 255
    assert torch.isnan(q[1, 32:64].float()).all() and torch.isnan(q[1, 96:].float()).all()
    want_q, want_s = oracle_mxfp8(x[:, :].numpy()[[0]], "floor")
    assert np.array_equal(s[0].numpy(), want_s[0]) and np.array_equal(q[0].view(torch.uint8).numpy(), want_q[0])
    d = mxfp8_dequantize(q, s)
    assert torch.isnan(d[1, 32:64]).all() and torch.isfinite(d[1, :32]).all()


def test_mx_errors():
    with pytest.raises(ValueError, match="multiple"):
        mxfp8_quantize(torch.randn(2, 48))
    with pytest.raises(ValueError, match="multiple"):
        mxfp4_quantize(torch.randn(2, 48))
    with pytest.raises(TypeError):
        mxfp8_quantize(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError):
        mxfp4_quantize(torch.randn(2, 64), scale_rule="round")


# ----------------------------------------------------------------------------------------------
# E2M1


def test_e2m1_decode_hand_table():
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got[:8] == HAND_E2M1 and got[8:] == [-v for v in HAND_E2M1]
    assert math.copysign(1.0, got[8]) == -1.0  # code 8 is -0.0
    want = np.arange(16, dtype=np.uint8).view(E2M1).astype(F32)
    assert np.array_equal(np.array(got, F32), want)


def test_e2m1_encode_every_bf16_matches_ml_dtypes():
    x, vals = all_bf16()
    keep = ~np.isnan(vals)
    got = e2m1_encode(x[torch.from_numpy(keep)]).numpy()
    want = vals[keep].astype(E2M1).view(np.uint8)
    bad = got != want
    assert not bad.any(), (vals[keep][bad][:5], got[bad][:5], want[bad][:5])


def test_e2m1_encode_hand_ties_and_saturation():
    inf = float("inf")
    x = torch.tensor([0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.0, 7.0, 1e30, inf, -0.25, -0.0, -5.0])
    # RNE: ties go to the even code (0, 2, 2, 4, 4, 6, 6); above 5 -> 6 (code 7); sign in bit 3
    assert e2m1_encode(x).tolist() == [0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 7, 8, 8, 14]
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([1.0, float("nan")]))


@settings(max_examples=50, deadline=None, database=None)
@given(st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=64))
def test_e2m1_encode_fp32_matches_ml_dtypes(vals):
    a = np.array(vals, F32)
    assert np.array_equal(e2m1_encode(torch.from_numpy(a)).numpy(), a.astype(E2M1).view(np.uint8))


def test_e2m1_quantize_of_decode_is_identity():
    c = torch.arange(16, dtype=torch.uint8)
    back = e2m1_encode(e2m1_decode(c))
    assert back.tolist() == list(range(16))


def test_pack_fp4_hand_bytes_and_errors():
    c = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert pack_fp4(c).tolist() == [[0x21, 0xF3]]  # element 2i in the low nibble
    assert unpack_fp4(torch.tensor([0x21, 0xF3], dtype=torch.uint8)).tolist() == [1, 2, 3, 15]
    with pytest.raises(ValueError):
        pack_fp4(torch.tensor([1, 2, 3], dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack_fp4(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(TypeError):
        pack_fp4(torch.tensor([1, 2]))


@settings(max_examples=30, deadline=None, database=None)
@given(shape=st.tuples(st.integers(0, 4), st.integers(1, 20)), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_fp4_round_trip(shape, seed):
    rng = np.random.default_rng(seed)
    c = torch.from_numpy(rng.integers(0, 16, size=(shape[0], 2 * shape[1]), dtype=np.uint8))
    p = pack_fp4(c)
    assert p.shape == (shape[0], shape[1])
    assert torch.equal(unpack_fp4(p), c)
    # byte i = c[2i] + 16 * c[2i+1]
    assert np.array_equal(p.numpy(), c.numpy()[:, 0::2] + 16 * c.numpy()[:, 1::2])


# ----------------------------------------------------------------------------------------------
# MXFP4


def oracle_mxfp4(x: np.ndarray, rule: str):
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(F32)
    E, mant = frexp_em(np.abs(xb).max(-1))
    bump = {"floor": 0, "ceil": mant > 1, "even": mant >= 1.75, "rceil": mant > 1.5}[rule]
    e = np.clip(E + bump - 2, -127, 127)
    y = xb / np.ldexp(F32(1), e)[..., None].astype(F32)
    c = y.astype(F32).astype(E2M1).view(np.uint8).reshape(m, k)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)


@pytest.mark.parametrize("rule", RULES)
def test_mxfp4_matches_oracle(rule):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(12, 320, generator=g) * torch.logspace(-10, 10, 12).unsqueeze(1)).to(torch.bfloat16)
    p, s = mxfp4_quantize(x, scale_rule=rule)
    want_p, want_s = oracle_mxfp4(x.float().numpy(), rule)
    assert p.dtype == torch.uint8 and p.shape == (12, 160) and s.shape == (12, 10)
    assert np.array_equal(s.numpy(), want_s)
    assert np.array_equal(p.numpy(), want_p)


@pytest.mark.parametrize("rule", RULES)
def test_mxfp4_round_trip_on_grid(rule):
    # codes with |v| <= 4 and a +-4 in every block: amax = 2^(e+2) exactly, every rule gives e
    rng = np.random.default_rng(10)
    c = rng.integers(0, 16, size=(6, 64), dtype=np.uint8)
    c[(c & 7) == 7] -= 1  # |v| <= 4
    c[:, ::32] = np.where(rng.random((6, 2)) < 0.5, 6, 14)
    e = rng.integers(-120, 120, size=(6, 2))
    byte = torch.from_numpy((e + 127).astype(np.uint8))
    packed = pack_fp4(torch.from_numpy(c))
    x = mxfp4_dequantize(packed, byte)
    p2, s2 = mxfp4_quantize(x, scale_rule=rule)
    assert torch.equal(s2, byte) and torch.equal(p2, packed)


def test_mxfp4_zero_and_poisoned_blocks():
    x = torch.randn(1, 96)
    x[0, :32] = 0
    x[0, 70] = -float("inf")
    p, s = mxfp4_quantize(x)
    assert s.tolist()[0][:3] == [0, s[0, 1].item(), 255]
    assert not p[0, :16].any() and not p[0, 32:].any()
    d = mxfp4_dequantize(p, s)
    assert torch.isnan(d[0, 64:]).all() and (d[0, :32] == 0).all()
    want_p, want_s = oracle_mxfp4(x[:, 32:64].numpy(), "floor")
    assert np.array_equal(p[:, 16:32].numpy(), want_p) and s[0, 1].item() == want_s[0, 0]


def test_mxfp4_dequantize_hand_values():
    # block scale byte 126 (0.5) and 129 (4): codes 7 (6) and 9 (-0.5)
    c = torch.zeros(64, dtype=torch.uint8)
    c[0], c[1], c[32], c[33] = 7, 9, 7, 9
    d = mxfp4_dequantize(pack_fp4(c), torch.tensor([126, 129], dtype=torch.uint8))
    assert d[[0, 1, 32, 33]].tolist() == [3.0, -0.25, 24.0, -2.0]


def test_ties_toward_zero_e2m1_variant_is_caught():
    """DeepGEMM's test helper rounds E2M1 ties toward zero (0.75 -> 0.5); the bf16 sweep that
    checks e2m1_encode must reject such a variant."""

    def ties_toward_zero(x: torch.Tensor) -> torch.Tensor:
        a = x.float().abs()
        code = torch.zeros(a.shape, dtype=torch.uint8)
        for mid in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            code += (a > mid).to(torch.uint8)
        return code | (torch.signbit(x.float()).to(torch.uint8) << 3)

    x, vals = all_bf16()
    keep = ~np.isnan(vals)
    want = vals[keep].astype(E2M1).view(np.uint8)
    xs = x[torch.from_numpy(keep)]
    assert np.array_equal(e2m1_encode(xs).numpy(), want)
    assert (ties_toward_zero(xs).numpy() != want).sum() > 0


def test_mx_empty_rows():
    q, s = mxfp8_quantize(torch.empty(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 2)
    p, s4 = mxfp4_quantize(torch.empty(0, 64, dtype=torch.bfloat16))
    assert p.shape == (0, 32) and s4.shape == (0, 2)
    assert mxfp4_dequantize(p, s4).shape == (0, 64) and mxfp8_dequantize(q, s).shape == (0, 64)


@pytest.mark.parametrize("rule", RULES)
def test_mx_subnormal_blocks_match_oracle(rule):
    # amax below 2^-126 (fp32 subnormal): every rule clamps the exponent to -127 (byte 0)
    x = torch.zeros(2, 64)
    x[0, :3] = torch.tensor([2.0**-130, -(2.0**-133), 2.0**-127])
    x[1, 32:34] = torch.tensor([2.0**-126, 3 * 2.0**-128])
    q, s = mxfp8_quantize(x, scale_rule=rule)
    want_q, want_s = oracle_mxfp8(x.numpy(), rule)
    assert np.array_equal(s.numpy(), want_s) and np.array_equal(q.view(torch.uint8).numpy(), want_q)
    p, s4 = mxfp4_quantize(x, scale_rule=rule)
    want_p, want_s4 = oracle_mxfp4(x.numpy(), rule)
    assert np.array_equal(s4.numpy(), want_s4) and np.array_equal(p.numpy(), want_p)


# ----------------------------------------------------------------------------------------------
# MXFP6 (E3M2 / E2M3): oracle ml_dtypes float6_e3m2fn / float6_e2m3fn; scale rule "even" = Quark's even_round

from reference.quant import fp6_decode, fp6_encode, mxfp6_dequantize, mxfp6_quantize, pack_fp6, unpack_fp6  # noqa: E402

FP6 = {"e3m2": (ml_dtypes.float6_e3m2fn, 28.0, 4, 2), "e2m3": (ml_dtypes.float6_e2m3fn, 7.5, 2, 3)}


def _ml_codes(x: np.ndarray, element: str) -> np.ndarray:
    return x.astype(F32).astype(FP6[element][0]).view(np.uint8)


@pytest.mark.parametrize("element", sorted(FP6))
def test_fp6_decode_every_code_matches_ml_dtypes(element):
    codes = np.arange(64, dtype=np.uint8)
    want = codes.view(FP6[element][0]).astype(F32)
    got = fp6_decode(torch.from_numpy(codes), element).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bitwise: -0.0 is code 32
    assert float(got.max()) == FP6[element][1] and len(set(got[:32].tolist())) == 32


@pytest.mark.parametrize("element", sorted(FP6))
def test_fp6_encode_representable_values_ties_and_saturation(element):
    """Every representable value encodes to its own code; every midpoint between neighbours (both signs) rounds to
    the even code as ml_dtypes does; values just off a midpoint go to the nearer neighbour; past the largest value
    (and +-inf) saturates."""
    vals = np.arange(32, dtype=np.uint8).view(FP6[element][0]).astype(F32)  # 0 .. max, increasing
    assert np.all(np.diff(vals) > 0)
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(F32)  # exact in fp32
    assert np.array_equal(mids.astype(np.float64), (vals[:-1].astype(np.float64) + vals[1:]) / 2)
    near = np.concatenate([np.nextafter(mids, F32(0)), np.nextafter(mids, F32(np.inf))])
    big = np.array([vals[-1] * 1.0625, vals[-1] * 1.2, 1e30, np.inf], dtype=F32)
    x = np.concatenate([vals, mids, near, big])
    x = np.concatenate([x, -x])
    got = fp6_encode(torch.from_numpy(x), element).numpy()
    assert np.array_equal(got, _ml_codes(x, element))
    assert np.array_equal(got[: len(vals)], np.arange(32))
    # ties to even: the midpoint's code has mantissa LSB 0
    tie_codes = got[len(vals): 2 * len(vals) - 1]
    assert np.all(tie_codes % 2 == 0)
    assert np.all(got[-len(big):] == 63) and np.all(got[len(x) // 2 - len(big): len(x) // 2] == 31)


@pytest.mark.parametrize("element", sorted(FP6))
def test_fp6_encode_every_bf16_matches_ml_dtypes(element):
    t, want = all_bf16()
    fin = ~np.isnan(want)
    got = fp6_encode(t[torch.from_numpy(fin)], element).numpy()
    assert np.array_equal(got, _ml_codes(want[fin], element))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_fp6_encode_fp32_matches_ml_dtypes(vals):
    x = np.array(vals, dtype=F32)
    for element in FP6:
        assert np.array_equal(fp6_encode(torch.from_numpy(x), element).numpy(), _ml_codes(x, element))


def test_fp6_errors():
    with pytest.raises(ValueError, match="NaN"):
        fp6_encode(torch.tensor([float("nan")]), "e3m2")
    with pytest.raises(ValueError, match="element"):
        fp6_encode(torch.zeros(2), "e4m3")
    with pytest.raises(TypeError):
        fp6_encode(torch.zeros(2, dtype=torch.int32), "e2m3")
    with pytest.raises(ValueError, match="0..63"):
        fp6_decode(torch.tensor([64], dtype=torch.uint8), "e3m2")
    with pytest.raises(ValueError, match="divisible by 4"):
        pack_fp6(torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="divisible by 3"):
        unpack_fp6(torch.zeros(4, dtype=torch.uint8))


def test_pack_fp6_quark_layout_hand_bytes_and_round_trip():
    # Quark Pack_fp6: byte0 = v1[1:0] v0[5:0], byte1 = v2[3:0] v1[5:2], byte2 = v3[5:0] v2[5:4] (MSB first)
    c = torch.tensor([[0b000001, 0b110010, 0b101011, 0b111111]], dtype=torch.uint8)
    b = pack_fp6(c)
    assert b.tolist() == [[0b10_000001, 0b1011_1100, 0b111111_10]]
    assert torch.equal(unpack_fp6(b), c)
    codes = torch.randint(0, 64, (3, 5, 96), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    p = pack_fp6(codes)
    assert p.shape == (3, 5, 72) and torch.equal(unpack_fp6(p), codes)


@pytest.mark.parametrize("element", sorted(FP6))
def test_fp6_scale_rule_even_is_quarks_even_round(element):
    """Quark's even_round (vLLM 0.33 mxfp6_utils.py): round amax's fp32 mantissa to mbits (add 2^(22-mbits), keep
    sign and exponent), floor(log2) - emax, clamp [-127, 127]. Oracle: frexp with the mantissa threshold
    2 - 2^-(mbits+1) (E3M2: 1.875, E2M3: 1.9375)."""
    _, _, emax, mbits = FP6[element]
    a = amax_samples()
    E, m = frexp_em(a)
    want = np.clip(E + (m >= 2 - 2.0 ** -(mbits + 1)) - emax, -127, 127) + 127
    got = mx_scale_e8m0(torch.from_numpy(a), element=element, scale_rule="even").numpy().astype(int)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("element", sorted(FP6))
def test_mxfp6_matches_oracle_and_dequantizes_exactly_to_bf16(element):
    t, vmax, emax, mbits = FP6[element]
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(12, 320, generator=g) * torch.logspace(-10, 10, 12).unsqueeze(1)).to(torch.bfloat16)
    codes, s = mxfp6_quantize(x, element)
    xb = x.float().numpy().reshape(12, 10, 32)
    E, m = frexp_em(np.abs(xb).max(-1))
    e = np.clip(E + (m >= 2 - 2.0 ** -(mbits + 1)) - emax, -127, 127)
    y = (xb / np.ldexp(F32(1), e)[..., None].astype(F32)).reshape(12, 320)
    assert np.array_equal(s.numpy(), (e + 127).astype(np.uint8))
    assert codes.shape == (12, 320) and np.array_equal(codes.numpy(), _ml_codes(y, element))
    deq = mxfp6_dequantize(codes, s, element)
    want = (codes.numpy().view(t).astype(F32).reshape(12, 10, 32) * np.ldexp(F32(1), e)[..., None]).reshape(12, 320)
    assert np.array_equal(deq.numpy(), want)
    # vLLM's emulation casts the dequantized values to the activation dtype: exact here
    assert torch.equal(mxfp6_dequantize(codes, s, element, out_dtype=torch.bfloat16).float(), deq)
    # on the grid, quantize(dequantize(q)) == q
    c2, s2 = mxfp6_quantize(deq, element)
    assert torch.equal(c2, codes) and torch.equal(s2, s)


def test_mxfp6_zero_and_poisoned_blocks():
    x = torch.zeros(2, 64)
    x[1, 3] = float("inf")
    codes, s = mxfp6_quantize(x, "e3m2")
    assert s.tolist() == [[0, 0], [255, 0]] and int(codes.max()) == 0
    d = mxfp6_dequantize(codes, s, "e3m2")
    assert torch.isnan(d[1, :32]).all() and (d[1, 32:] == 0).all() and (d[0] == 0).all()
