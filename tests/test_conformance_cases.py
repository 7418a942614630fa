"""The conformance suite's case list (conformance/cases.py): the TP-sharded experts cases."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.cases import ExpertsCase, experts_cases, parallel_config, tp_shard
from specs import load_models


def test_tp_cases_shard_the_intermediate_size_and_run_on_the_gpu_only():
    """The ``tp_size`` extras of specs/cases.toml: one TP rank's shard (intermediate size / tp, every expert local),
    in the id, named as a TP layout in the layer config; gpu_only (the reference at M = 1024 costs minutes on a CPU).
    They hold the shapes of the Triton tables' TP entries (Mixtral TP2: E=8, N=7168; DeepSeek-V3 TP8: E=256, N=256)."""
    models = load_models()
    tp = [c for c in experts_cases(include_gpu_only=True) if c.tp_size > 1]
    assert not [c for c in experts_cases() if c.tp_size > 1]
    shapes = {(c.model.name, c.model.num_experts // c.ep_size, c.model.intermediate_size) for c in tp}
    assert {("mixtral_8x7b", 8, 7168), ("qwen3_235b_a22b", 128, 384), ("deepseek_v3", 256, 256)} <= shapes
    for c in tp:
        full = models[c.model.name]
        assert c.model.intermediate_size * c.tp_size == full.intermediate_size, c.id
        assert c.ep_size == 1 and c.id.endswith(f"-tp{c.tp_size}"), c.id
        pc = parallel_config(c)
        assert (pc.tp_size, pc.ep_size, pc.use_ep) == (c.tp_size, 1, False)


def test_tp_shard_rejects_what_vllm_cannot_lay_out():
    m = load_models()["qwen3_30b_a3b"]
    with pytest.raises(ValueError, match="needs ep_size 1"):
        tp_shard(m, 2, ep_size=8)
    with pytest.raises(ValueError, match="does not divide intermediate_size 768"):
        tp_shard(m, 5)


def test_a_tp_case_draws_the_shard_and_configures_the_layer_with_it():
    """End to end on a small stand-in model: the case's weights have the shard's intermediate size, and the layer
    config the experts class is asked about carries it as ``intermediate_size_per_partition`` with the TP size."""
    from conformance.experts_case import moe_config_for
    from conformance.inputs import make_experts_inputs

    small = dataclasses.replace(load_models()["qwen3_30b_a3b"], name="qwen3_30b_a3b", num_experts=8, top_k=2,
                                hidden_size=256, intermediate_size=512)
    case = ExpertsCase(tp_shard(small, 2), "bf16", 4, 1, 0, tp_size=2)
    inputs = make_experts_inputs(case, "cpu")
    assert tuple(inputs.w1.shape) == (8, 2 * 256, 256) and tuple(inputs.w2.shape) == (8, 256, 256)
    cfg = moe_config_for(case)
    assert cfg.intermediate_size_per_partition == 256 and cfg.moe_parallel_config.tp_size == 2
