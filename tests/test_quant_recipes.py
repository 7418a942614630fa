"""QuantRecipe registry and validation (field values from the facts file, written by hand)."""

from __future__ import annotations

import dataclasses

import pytest

from reference.quant import DEEPGEMM, RECIPES, VLLM, QuantRecipe, get_recipe


def test_named_recipes_fields():
    assert (VLLM.amax_floor, VLLM.ue8m0_rounding, VLLM.ue8m0_scale_floor, VLLM.quant_op) == (
        1e-10, "exp2_ceil_log2", 1e-10, "divide"
    )
    assert (DEEPGEMM.amax_floor, DEEPGEMM.ue8m0_rounding, DEEPGEMM.ue8m0_scale_floor, DEEPGEMM.quant_op) == (
        1e-4, "ceil_to_ue8m0", 0.0, "reciprocal_multiply"
    )
    assert VLLM.scale_computation == DEEPGEMM.scale_computation == "amax/max"
    assert VLLM.overflow == DEEPGEMM.overflow == "saturate"
    assert (VLLM.mx_scale_rule, DEEPGEMM.mx_scale_rule) == ("even", "rceil")


def test_registry_and_get_recipe():
    assert dict(RECIPES) == {"vllm": VLLM, "deepgemm": DEEPGEMM}
    assert get_recipe("vllm") is VLLM and get_recipe("deepgemm") is DEEPGEMM
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
