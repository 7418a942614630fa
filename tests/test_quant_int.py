"""INT8 W8A8 and INT4 (W4A16 / W4A8) against numpy (np.rint = round-half-even), ml_dtypes
float8_e4m3fn, and hand-computed values and packed words."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.quant import (
    dequant_int4_group,
    dequant_int8,
    int4_group_quant,
    int8_quant_per_channel,
    int8_quant_per_token,
    int8_quant_static,
    pack_int4,
    unpack_int4,
    w4a8_dequantize_weight,
    w4a8_quantize_weight,
)


@pytest.fixture(autouse=True)
def _seed_torch():
    # unseeded torch.randn in a test still draws the same inputs on every run
    torch.manual_seed(0)


F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn


def test_int8_per_token_hand_values():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -127.0, 63.5], [0.0] * 8])
    q, s = int8_quant_per_token(x)
    # absmax 127 -> multiplier 1: half-even rounding 0.5->0, 1.5->2, 2.5->2, 63.5->64
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -127, 64], [0] * 8]
    assert s.tolist() == [[1.0], [0.0]]  # zero row: s = 0, q = 0
    assert q.dtype == torch.int8 and s.dtype == torch.float32


def test_int8_per_token_matches_numpy():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1024, 1024, generator=g) * torch.logspace(-4, 4, 1024).unsqueeze(1)).to(torch.bfloat16)
    q, s = int8_quant_per_token(x)
    xf = x.float().numpy()
    absmax = np.abs(xf).max(-1, keepdims=True).astype(F32)
    mult = F32(127) / absmax  # IEEE fp32 division, as the kernel's 127.0f / absmax
    q_want = np.clip(np.rint(xf * mult), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(s.numpy(), absmax / F32(127))
    np.testing.assert_array_equal(q.numpy(), q_want)
    # dequant is q * s
    np.testing.assert_array_equal(dequant_int8(q, s).numpy(), q_want.astype(F32) * (absmax / F32(127)))
    # sensitivity: a multiplier rounded twice (torch's `127.0 / t` = t.reciprocal() * 127) is caught
    twice = (F32(1) / absmax * F32(127)).astype(F32)
    assert (np.clip(np.rint(xf * twice), -128, 127).astype(np.int8) != q.numpy()).any()


def test_int8_per_channel_3d():
    w = torch.randn(3, 5, 64)
    w[1, 2] = 0
    q, s = int8_quant_per_channel(w)
    assert q.shape == w.shape and s.shape == (3, 5, 1)
    absmax = np.abs(w.numpy()).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        q_want = np.where(absmax == 0, 0, np.clip(np.rint(w.numpy() * (F32(127) / absmax)), -128, 127))
    np.testing.assert_array_equal(q.numpy(), q_want.astype(np.int8))
    assert s[1, 2, 0].item() == 0 and not q[1, 2].any()
    with pytest.raises(ValueError):
        int8_quant_per_channel(torch.randn(64))


def test_int8_static_saturates_and_rounds_half_even():
    x = torch.tensor([200.0, -300.0, 127.5, -128.5, 0.5, 1.5, -127.4])
    q, s = int8_quant_static(x, 1.0)
    assert q.tolist() == [127, -128, 127, -128, 0, 2, -127] and s.tolist() == [1.0]
    y = torch.randn(4, 50) * 3
    q2, _ = int8_quant_static(y, 0.03)
    want = np.clip(np.rint(y.numpy() / F32(0.03)), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(q2.numpy(), want)


def test_int8_errors():
    with pytest.raises(ValueError, match="NaN"):
        int8_quant_per_token(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError):
        int8_quant_static(torch.ones(2), 0.0)
    with pytest.raises(TypeError):
        int8_quant_per_token(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError):
        dequant_int8(torch.ones(2), 1.0)


def test_int4_group_quant_hand_values():
    w = torch.zeros(1, 256)
    w[0, :4] = torch.tensor([7.0, -8.0, 3.5, 2.5])  # s = max(7/7, 8/8) = 1
    w[0, 128:131] = torch.tensor([1.0, 10.0, 5.0])  # all positive: s = max(10/7, 1/8) = 10/7
    q, s = int4_group_quant(w, 128)
    assert s[0, 0].item() == 1.0
    assert q[0, :4].tolist() == [7, -8, 4, 2]  # 3.5 -> 4, 2.5 -> 2 (half even)
    assert s[0, 1].item() == float(F32(10) / F32(7))
    # fp32: 1 / s = 0.7 -> 1 ; 10 / s = 7.0 ; 5 / s rounds to exactly 3.5 in fp32 -> 4 (half even)
    assert q[0, 128:131].tolist() == [1, 7, 4]
    z, sz = int4_group_quant(torch.zeros(2, 128), 128)
    assert not z.any() and not sz.any()


def test_int4_group_quant_matches_numpy():
    w = (torch.randn(2, 6, 512) * 0.05).to(torch.bfloat16)
    q, s = int4_group_quant(w, 128)
    wf = w.float().numpy().reshape(2, 6, 4, 128)
    s_want = np.maximum(np.abs(wf.max(-1)) / F32(7), np.abs(wf.min(-1)) / F32(8)).astype(F32)
    q_want = np.clip(np.rint(wf / s_want[..., None]), -8, 7).astype(np.int8).reshape(2, 6, 512)
    np.testing.assert_array_equal(s.numpy(), s_want)
    np.testing.assert_array_equal(q.numpy(), q_want)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    d = dequant_int4_group(q, s, 128)
    np.testing.assert_array_equal(d.numpy(), (q_want.reshape(2, 6, 4, 128) * s_want[..., None]).reshape(2, 6, 512))
    with pytest.raises(ValueError, match="multiple"):
        int4_group_quant(torch.randn(4, 100), 128)


def test_pack_int4_hand_words():
    assert pack_int4(torch.tensor([1, 2, 3, 4, 5, 6, 7, -8], dtype=torch.int8)).tolist() == [0x87654321 - 2**32]
    assert pack_int4(torch.tensor([-1] * 8, dtype=torch.int8)).tolist() == [-1]
    assert pack_int4(torch.tensor([0] * 7 + [7], dtype=torch.int8)).tolist() == [0x70000000]
    assert pack_int4(torch.tensor([[-8, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]])).tolist() == [[8, 1]]
    assert unpack_int4(torch.tensor([0x87654321 - 2**32], dtype=torch.int32)).tolist() == [1, 2, 3, 4, 5, 6, 7, -8]
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([8] + [0] * 7))
    with pytest.raises(ValueError, match="multiple"):
        pack_int4(torch.zeros(12, dtype=torch.int8))


@settings(max_examples=30, deadline=None, database=None)
@given(rows=st.integers(0, 5), words=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_int4_round_trip(rows, words, seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, size=(rows, words * 8)).astype(np.int8)
    p = pack_int4(torch.from_numpy(q))
    assert p.dtype == torch.int32 and p.shape == (rows, words)
    assert np.array_equal(unpack_int4(p).numpy(), q)
    # python oracle for the words: nibble i of word j is element 8j + i, LSB first
    for r in range(rows):
        for j in range(words):
            want = sum((int(q[r, 8 * j + i]) & 0xF) << (4 * i) for i in range(8))
            assert (int(p[r, j]) & 0xFFFFFFFF) == want


def test_w4a8_weight_matches_ml_dtypes_oracle():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(2, 16, 256, generator=g) * 2.0
    packed, scales = w4a8_quantize_weight(w, 128)
    assert packed.dtype == torch.int32 and packed.shape == (2, 16, 32)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (2, 16, 2)
    q_ref, s_ref = int4_group_quant(w, 128)
    assert torch.equal(unpack_int4(packed), q_ref)
    s_e4m3 = s_ref.numpy().astype(E4M3)
    assert np.array_equal(scales.view(torch.uint8).numpy(), s_e4m3.view(np.uint8))
    deq = w4a8_dequantize_weight(packed, scales, 128)
    prod = q_ref.numpy().reshape(2, 16, 2, 128).astype(F32) * s_e4m3.astype(F32)[..., None]
    want = np.clip(prod, -448, 448).astype(E4M3).astype(F32).reshape(2, 16, 256)
    np.testing.assert_array_equal(deq.numpy(), want)
    # every dequantized weight is an E4M3 value
    assert np.array_equal(deq.numpy().astype(E4M3).astype(F32), deq.numpy())


def test_int_empty_rows():
    q, s = int8_quant_per_token(torch.empty(0, 8))
    assert q.shape == (0, 8) and s.shape == (0, 1)
    q4, s4 = int4_group_quant(torch.empty(0, 256), 128)
    assert q4.shape == (0, 256) and s4.shape == (0, 2)
    assert pack_int4(q4).shape == (0, 32)
    p, sc = w4a8_quantize_weight(torch.empty(0, 128))
    assert p.shape == (0, 16) and sc.shape == (0, 1)
