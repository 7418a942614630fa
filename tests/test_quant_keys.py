"""QuantKey / ScaleDesc / GroupShape and the named keys (fields written out by hand)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference.quant as rq
from reference.quant import GroupShape, QuantKey, ScaleDesc

FP8, FP4, E8M0, F32 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, torch.float32
F16, BF16 = torch.float16, torch.bfloat16

# name -> (dtype, scale dtype, static, group shape, scale2 or None)
EXPECTED = {
    "kFp8StaticTensorSym": (FP8, F32, True, (-1, -1), None),
    "kFp8DynamicTensorSym": (FP8, F32, False, (-1, -1), None),
    "kFp8StaticTokenSym": (FP8, F32, True, (1, -1), None),
    "kFp8DynamicTokenSym": (FP8, F32, False, (1, -1), None),
    "kFp8StaticChannelSym": (FP8, F32, True, (-1, 1), None),
    "kFp8Dynamic128Sym": (FP8, F32, False, (1, 128), None),
    "kFp8Dynamic64Sym": (FP8, F32, False, (1, 64), None),
    "kFp8Static128BlockSym": (FP8, F32, True, (128, 128), None),
    "kFp8Static128BlockE8M0Sym": (FP8, E8M0, True, (128, 128), None),
    "kMxfp8Static": (FP8, E8M0, True, (1, 32), None),
    "kMxfp8Dynamic": (FP8, E8M0, False, (1, 32), None),
    "kMxfp4Static": (FP4, E8M0, True, (1, 32), None),
    "kMxfp4Dynamic": (FP4, E8M0, False, (1, 32), None),
    # MXFP6 (vLLM 0.33 quant_utils.py: scalar_types.float6_e3m2f / float6_e2m3f, E8M0 per 1x32)
    "kMxfp6E3M2Static": (rq.keys.FP6_E3M2_DTYPE, E8M0, True, (1, 32), None),
    "kMxfp6E3M2Dynamic": (rq.keys.FP6_E3M2_DTYPE, E8M0, False, (1, 32), None),
    "kMxfp6E2M3Static": (rq.keys.FP6_E2M3_DTYPE, E8M0, True, (1, 32), None),
    "kMxfp6E2M3Dynamic": (rq.keys.FP6_E2M3_DTYPE, E8M0, False, (1, 32), None),
    "kNvfp4Static": (FP4, FP8, True, (1, 16), (F32, True, (-1, -1))),
    "kNvfp4Dynamic": (FP4, FP8, False, (1, 16), (F32, True, (-1, -1))),
    "kInt8StaticChannelSym": (torch.int8, F32, True, (-1, 1), None),
    "kInt8DynamicTokenSym": (torch.int8, F32, False, (1, -1), None),
    "kInt8StaticTensorSym": (torch.int8, F32, True, (-1, -1), None),
    "kInt8DynamicTensorSym": (torch.int8, F32, False, (-1, -1), None),
    "kInt8Dynamic32Sym": (torch.int8, F32, False, (1, 32), None),
    "kNvfp4DynamicToken": (FP4, FP8, False, (1, 16), (F32, False, (1, -1))),
    "kFp8Static64BlockSym": (FP8, F32, True, (64, 64), None),
    "kInt4StaticGroup128Sym": (torch.int4, F32, True, (1, 128), None),
    # vLLM 0.33 weight-only keys: fp16 scale descriptor, group (1, -1) = "size at runtime", or group 32
    "kInt4Static": (torch.int4, F16, True, (1, -1), None),
    "kInt4Static32": (torch.int4, F16, True, (1, 32), None),
    "kInt8Static": (torch.int8, F16, True, (1, -1), None),
    # vLLM 0.33's W4A8 keys (experts/cpu_int4_moe.py): int8 storage, bf16 group scales / fp32 channel scales
    "kInt4W4A8StaticGroup128Sym": (torch.int8, BF16, True, (1, 128), None),
    "kInt4W4A8StaticGroup64Sym": (torch.int8, BF16, True, (1, 64), None),
    "kInt4W4A8StaticGroup32Sym": (torch.int8, BF16, True, (1, 32), None),
    "kInt4W4A8StaticGroupSym": (torch.int8, BF16, True, (1, -1), None),
    "kInt4W4A8StaticChannelSym": (torch.int8, F32, True, (-1, 1), None),
}
# issue 41 (FP8 / INT pairs): reference-only names of keys vLLM 0.33 builds unnamed
EXPECTED.update({
    "kFp8Static128x64BlockSym": (FP8, F32, True, (128, 64), None),
    "kFp8Static64x128BlockSym": (FP8, F32, True, (64, 128), None),
    "kFp8Static32BlockSym": (FP8, F32, True, (32, 32), None),
    "kInt8Static128BlockSym": (torch.int8, F32, True, (128, 128), None),
    "kInt8Dynamic128Sym": (torch.int8, F32, False, (1, 128), None),
})
# asymmetric keys: name -> (dtype, scale dtype, static, group shape)
EXPECTED_ASYM = {
    "kInt4StaticAsym": (torch.uint4, F16, True, (1, -1)),
    "kInt4Static32Asym": (torch.uint4, F16, True, (1, 32)),
    "kInt8DynamicTokenAsym": (torch.int8, F32, False, (1, -1)),
    "kInt8StaticTensorAsym": (torch.int8, F32, True, (-1, -1)),
    "kInt8DynamicTensorAsym": (torch.int8, F32, False, (-1, -1)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_key_fields(name):
    key = getattr(rq, name)
    dtype, sdtype, static, gs, s2 = EXPECTED[name]
    assert key.dtype == dtype and key.symmetric
    assert key.scale == ScaleDesc(sdtype, static, GroupShape(*gs))
    if s2 is None:
        assert key.scale2 is None
    else:
        assert key.scale2 == ScaleDesc(s2[0], s2[1], GroupShape(*s2[2]))
    assert rq.QUANT_KEYS[name] is key


@pytest.mark.parametrize("name", sorted(EXPECTED_ASYM))
def test_asymmetric_key_fields(name):
    key = getattr(rq, name)
    dtype, sdtype, static, gs = EXPECTED_ASYM[name]
    assert key.dtype == dtype and not key.symmetric and key.scale2 is None
    assert key.scale == ScaleDesc(sdtype, static, GroupShape(*gs))
    assert rq.QUANT_KEYS[name] is key


def test_all_named_keys_are_distinct_and_registered():
    names = list(EXPECTED) + list(EXPECTED_ASYM)
    # vLLM 0.33 defines kInt4W4A8StaticChannelSym with the very fields of kInt8StaticChannelSym: equal keys.
    assert rq.kInt4W4A8StaticChannelSym == rq.kInt8StaticChannelSym
    keys = [getattr(rq, n) for n in names if n != "kInt4W4A8StaticChannelSym"]
    assert len(set(keys)) == len(keys)
    assert set(rq.QUANT_KEYS) == set(names)


def test_version_sets_name_known_keys():
    """KEYS_NEW_IN_0_33 / REFERENCE_ONLY_KEYS name registered keys, and never the same one."""
    assert rq.KEYS_NEW_IN_0_33 <= set(rq.QUANT_KEYS) and rq.REFERENCE_ONLY_KEYS <= set(rq.QUANT_KEYS)
    assert not rq.KEYS_NEW_IN_0_33 & rq.REFERENCE_ONLY_KEYS
    assert {"kNvfp4DynamicToken", "kInt4Static", "kInt4StaticAsym", "kInt8Static",
            "kInt4W4A8StaticGroup128Sym"} <= rq.KEYS_NEW_IN_0_33
    assert "kFp8Static64BlockSym" in rq.REFERENCE_ONLY_KEYS


def test_reprs():
    assert repr(rq.kFp8Static128BlockSym) == "QuantKey(fp8e4m3, static, 128x128 blocks, sym)"
    assert repr(rq.kFp8Dynamic128Sym) == "QuantKey(fp8e4m3, dynamic, 1x128 groups, sym)"
    assert repr(rq.kFp8DynamicTokenSym) == "QuantKey(fp8e4m3, dynamic, per-token, sym)"
    assert repr(rq.kMxfp4Static) == "QuantKey(fp4e2m1, static, 1x32 groups, e8m0 scales, sym)"
    assert repr(rq.kNvfp4Dynamic) == (
        "QuantKey(fp4e2m1, dynamic, 1x16 groups, fp8e4m3 scales, scale2=fp32 static per-tensor, sym)"
    )
    assert repr(rq.kStaticTensorScale) == "ScaleDesc(fp32, static, per-tensor)"
    assert str(QuantKey(FP8, rq.kStaticTensorScale, symmetric=False)).endswith(", asym)")


def test_group_shape_predicates():
    G = GroupShape
    assert G.PER_TENSOR == (-1, -1) and G.PER_TOKEN == (1, -1) and G.PER_CHANNEL == (-1, 1)
    assert G.PER_TENSOR.is_per_tensor() and not G.PER_TOKEN.is_per_tensor()
    assert G.PER_TOKEN.is_per_token() and G.PER_CHANNEL.is_per_channel()
    assert G(1, 128).is_per_group() and not G(128, 128).is_per_group()
    assert G(1, 128).row == 1 and G(1, 128).col == 128


def test_keys_are_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        rq.kFp8Dynamic128Sym.symmetric = False  # type: ignore[misc]
    d = {(rq.kFp8Static128BlockSym, rq.kFp8Dynamic128Sym): "deep_gemm"}
    again = (
        QuantKey(FP8, ScaleDesc(F32, True, GroupShape(128, 128))),
        rq.create_fp8_quant_key(False, GroupShape(1, 128)),
    )
    assert d[again] == "deep_gemm"  # equality is by value (seed 001's tuple comparison)
    assert rq.kFp8Static128BlockSym != rq.kFp8Static128BlockE8M0Sym


def test_fp8_static_block_key_is_the_named_key_where_one_exists():
    """issue 41: any bn x bk FP8 block key, equal to the named ones; vLLM's Triton experts need both dims > 1."""
    assert rq.fp8_static_block_key(128, 128) == rq.kFp8Static128BlockSym
    assert rq.fp8_static_block_key(64, 64) == rq.kFp8Static64BlockSym
    assert rq.fp8_static_block_key(128, 64) == rq.kFp8Static128x64BlockSym
    assert rq.fp8_static_block_key(96, 32).scale.group_shape == GroupShape(96, 32)
    assert rq.REFERENCE_ONLY_KEYS_FP_INT <= rq.REFERENCE_ONLY_KEYS
    with pytest.raises(ValueError, match="both dims > 1"):
        rq.fp8_static_block_key(1, 128)
