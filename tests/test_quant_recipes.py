"""QuantRecipe registry and validation (field values from the facts file, written by hand)."""

from __future__ import annotations

import dataclasses

import pytest

from reference.semantics import point, use_semantics
from reference.quant import DEEPGEMM, RECIPES, VLLM, VLLM_017, VLLM_033, QuantRecipe, get_recipe


def test_named_recipes_fields():
    assert (VLLM_017.amax_floor, VLLM_017.ue8m0_rounding, VLLM_017.ue8m0_scale_floor, VLLM_017.quant_op) == (
        1e-10, "exp2_ceil_log2", 1e-10, "divide"
    )
    assert VLLM is VLLM_033 and VLLM_033 == dataclasses.replace(VLLM_017, quant_op="reciprocal_multiply")
    assert (DEEPGEMM.amax_floor, DEEPGEMM.ue8m0_rounding, DEEPGEMM.ue8m0_scale_floor, DEEPGEMM.quant_op) == (
        1e-4, "ceil_to_ue8m0", 0.0, "reciprocal_multiply"
    )
    assert VLLM.scale_computation == DEEPGEMM.scale_computation == "amax/max"
    assert VLLM.overflow == DEEPGEMM.overflow == "saturate"
    assert (VLLM.mx_scale_rule, DEEPGEMM.mx_scale_rule) == ("even", "rceil")


def test_registry_and_get_recipe():
    assert dict(RECIPES) == {"vllm": VLLM, "deepgemm": DEEPGEMM}
    assert get_recipe("vllm") is VLLM and get_recipe("deepgemm") is DEEPGEMM
    # "vllm" follows the semantics version (point quant.per_token_group_quant_op)
    with use_semantics("0.17"):
        assert get_recipe("vllm") is VLLM_017 and get_recipe("deepgemm") is DEEPGEMM
        assert get_recipe("vllm", semantics="0.33") is VLLM_033
    assert get_recipe("vllm", semantics="0.17") is VLLM_017
    assert point("quant.per_token_group_quant_op").describe("0.33").count("1 / s") == 1
    custom = dataclasses.replace(VLLM, name="mine", quant_op="reciprocal_multiply")
    assert get_recipe(custom) is custom
    with pytest.raises(ValueError, match=r"valid names: \['deepgemm', 'vllm'\]"):
        get_recipe("triton")
    with pytest.raises(TypeError):
        get_recipe(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RECIPES["x"] = VLLM  # type: ignore[index]


def test_recipe_is_frozen_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        VLLM.amax_floor = 0.0  # type: ignore[misc]
    for field, bad in (
        ("quant_op", "fma"),
        ("ue8m0_rounding", "round"),
        ("overflow", "nan"),
        ("scale_computation", "amax"),
        ("mx_scale_rule", "nearest"),
        ("amax_floor", -1.0),
        ("ue8m0_scale_floor", float("nan")),
    ):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(VLLM, **{field: bad})
    assert isinstance(dataclasses.replace(DEEPGEMM, amax_floor=0.0), QuantRecipe)


def test_vllm_033_register_path_ue8m0_is_exp2_ceil_log2_for_16_bit_inputs():
    """vLLM 0.33's register-resident per_token_group_quant kernel (fp16 / bf16 inputs only) rounds a UE8M0 scale by
    its exponent bits (bump when the mantissa is nonzero); the shared-memory kernel keeps
    exp2f(ceilf(log2f(fmaxf(s, 1e-10)))). The recipe keeps one rule because they agree on every scale amax / 448 of a
    16-bit amax: checked here over every finite bf16 and fp16 value (amax starts at eps = 1e-10)."""
    import ml_dtypes
    import numpy as np
    import torch

    for bits, dt in ((np.arange(65536, dtype=np.uint16), ml_dtypes.bfloat16), (np.arange(65536, dtype=np.uint16),
                                                                                 np.float16)):
        v = np.abs(bits.view(dt).astype(np.float32))
        v = v[np.isfinite(v)]
        amax = torch.from_numpy(np.maximum(v, np.float32(1e-10)))
        s = torch.clamp_min(amax / torch.full_like(amax, 448.0), 1e-10)
        log_rule = torch.exp2(torch.ceil(torch.log2(s)))
        b = s.view(torch.int32)
        bit_rule = ((((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(torch.int32)) << 23).view(torch.float32)
        assert torch.equal(log_rule, bit_rule), int((log_rule != bit_rule).sum())
