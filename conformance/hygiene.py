"""Library code of the hygiene tests (conformance/test_hygiene.py, conformance/test_padding.py,
tests/test_offsets_int32.py): the offsets-past-int32 case and its check, and one experts class run beside its
reference behind the modular kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conformance.cases import ExpertsCase, chunking_defined, kernel_chunk_kwargs
from conformance.experts_case import case_error_bound, inputs_heavy_values, moe_config_for
from conformance.metrics import assert_close
from reference.activation import MoEActivation
from reference.batched import BatchedPrepareAndFinalize, BatchedReferenceExperts
from reference.experts import fused_experts, fused_experts_with_heavy
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from reference.routing import fused_topk
from reference.schemes import quantize_weights
from specs import ModelSpec, load_models

__all__ = ["OFFSETS_PAST_INT32", "OffsetsCase", "check_offsets_case", "inputs_error_bound", "run_with_reference"]


@dataclass(frozen=True)
class OffsetsCase:
    """One experts call whose largest intermediate, GEMM1's output of ``tokens * topk`` rows of ``N`` elements,
    holds at least ``limit`` elements: a kernel that computes row offsets in 32-bit signed integers wraps there
    (``limit = 2**31``). Routing is ``fused_topk`` over ``local_experts`` experts (no expert map), bf16.

    ``limit`` is a parameter so that tests/test_offsets_int32.py can run the same check on a small CPU analogue (a
    tiny "int width") against a planted backend whose offsets wrap at that width."""

    model: ModelSpec
    tokens: int
    local_experts: int
    limit: int = 2**31
    seed: int = 5
    checked_tokens: int = 64  # the first and the last ``checked_tokens`` tokens are compared with the reference

    @property
    def N(self) -> int:
        return self.model.intermediate_size * (2 if MoEActivation.from_str(self.model.activation).is_gated else 1)

    @property
    def largest_intermediate(self) -> int:
        """Elements of GEMM1's output for one experts call over all ``tokens``: ``tokens * topk * N``."""
        return self.tokens * self.model.top_k * self.N

    def experts_case(self) -> ExpertsCase:
        return ExpertsCase(self.model, "bf16", self.tokens, self.model.num_experts // self.local_experts, 0)

    def kernel(self, cls, moe_config, qc) -> FusedMoEKernel:
        """Chunk size = tokens: the modular kernel makes exactly one experts call, whatever the environment says."""
        return FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, qc), poison=float("nan"),
                              **kernel_chunk_kwargs(max(self.tokens, 1)))


# Qwen3-30B-A3B (K = 2048, N = 2 * 768 = 1536, topk 8): 180000 * 8 * 1536 = 2.21e9 > 2^31 = 2.15e9 elements in
# one call. (The modular kernel's default 16384-token chunks would cut each call to 16384 * 8 * 1536 = 2.0e8.)
OFFSETS_PAST_INT32 = OffsetsCase(load_models()["qwen3_30b_a3b"], 180_000, 16)


def check_offsets_case(experts_classes, oc: OffsetsCase, device: str, repro: str | None = None,
                       record=None) -> list[str]:
    """Run ``oc`` through every standard-format class of ``experts_classes`` that claims bf16; returns their names.

    Each class gets ONE ``apply`` call over all tokens (asserted with a spy on ``apply``: one call, ``tokens``
    rows, ``tokens * topk * N >= oc.limit``); the first and last ``oc.checked_tokens`` tokens are compared with
    ``reference.experts.fused_experts`` computed for those tokens only, within the error model's bound over their
    routes (``conformance.experts_case.case_error_bound``).

    Raises:
        AssertionError: the case's own precondition fails (it does not cross ``oc.limit`` in one call).
        ConformanceFailure: a class's output differs from the reference on the checked tokens.
    """
    M, topk, K, E = oc.tokens, oc.model.top_k, oc.model.hidden_size, oc.local_experts
    assert oc.largest_intermediate >= oc.limit, (
        f"precondition: {M} tokens x topk {topk} x N {oc.N} = {oc.largest_intermediate} elements does not reach "
        f"{oc.limit}; the case tests nothing")
    g = torch.Generator(device=device).manual_seed(oc.seed)
    x = torch.randn(M, K, device=device, generator=g, dtype=torch.bfloat16)
    w1 = (torch.randn(E, oc.N, K, device=device, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, oc.model.intermediate_size, device=device, generator=g)
          * oc.model.intermediate_size**-0.5).bfloat16()
    w, ids = fused_topk(None, torch.randn(M, E, device=device, generator=g), topk, True)
    case = oc.experts_case()
    moe_config = moe_config_for(case)
    assert moe_config.num_local_experts == E, (moe_config.num_local_experts, E)
    _, _, qc = quantize_weights("bf16", w1, w2)
    c = min(oc.checked_tokens, M)
    checked = torch.cat([torch.arange(c), torch.arange(max(c, M - c), M)]).to(device)
    ref, heavy = fused_experts_with_heavy(x[checked], w1, w2, w[checked], ids[checked], activation=case.activation)
    ran = []
    for cls in experts_classes:
        if cls.activation_format() != FusedMoEActivationFormat.Standard:
            continue
        ok, _ = cls.is_supported_config(cls, moe_config, None, None, FusedMoEActivationFormat.Standard)
        if not ok:
            continue
        if record is not None:
            record(component="hygiene", scheme="int32-offsets", tokens=M, experts_class=cls.__name__)
        kernel = oc.kernel(cls, moe_config, qc)
        calls, inner = [], kernel.fused_experts.apply

        def spy(*args, **kwargs):
            calls.append(kwargs["topk_ids"].shape[0] if "topk_ids" in kwargs else args[5].shape[0])
            return inner(*args, **kwargs)

        kernel.fused_experts.apply = spy
        out = kernel.apply(x, w1, w2, w, ids, activation=case.activation)
        assert calls == [M] and M * topk * w1.shape[1] >= oc.limit, (
            f"precondition: {cls.__name__} was called with {calls} rows, not once with all {M} tokens: no single "
            f"call reached {oc.limit} elements")
        tol = case_error_bound(case, qc, cls, topk_ids=ids[checked], heavy=heavy).as_tolerance()
        assert_close(out[checked], ref, tol, case=f"{case.id}-{cls.__name__}",
                     what=f"{cls.__name__}: first and last {c} tokens of one {M}-token call "
                          f"({oc.largest_intermediate} intermediate elements)", repro=repro)
        ran.append(cls.__name__)
        del out, kernel
    return ran


def run_with_reference(experts_cls, case: ExpertsCase, inputs, apply_router_weight_on_input: bool = False):
    """``(out, expected)``: ``experts_cls`` behind the modular kernel (NaN-poisoned; standard format: the case's
    chunk size; batched: capacity M per expert) and its reference (standard: ``reference.experts.fused_experts``;
    batched: ``BatchedReferenceExperts`` behind the same prepare/finalize, as in test_experts.py). Judge them with
    ``inputs_error_bound``."""
    moe_config, qc = moe_config_for(case), inputs.quant_config
    kwargs = dict(activation=case.activation, global_num_experts=inputs.global_num_experts,
                  expert_map=inputs.expert_map, apply_router_weight_on_input=apply_router_weight_on_input)
    args = (inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids)
    if experts_cls.activation_format() == FusedMoEActivationFormat.BatchedExperts:
        cap, E_local = max(case.tokens, 1), moe_config.num_local_experts

        def kernel(cls):
            return FusedMoEKernel(BatchedPrepareAndFinalize(cap, E_local),
                                  cls(moe_config, qc, max_num_tokens=cap, num_dispatchers=1), poison=float("nan"))

        return kernel(experts_cls).apply(*args, **kwargs), kernel(BatchedReferenceExperts).apply(*args, **kwargs)
    if case.chunk_size and not chunking_defined():
        pytest.skip("a chunked case: vLLM 0.33 semantics have no activation chunking (run with --vllm-semantics 0.17)")
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts_cls(moe_config, qc), poison=float("nan"),
                         **kernel_chunk_kwargs(case.chunk_size)).apply(*args, **kwargs)
    return out, fused_experts(*args, quant_config=qc, **kwargs)


def inputs_error_bound(experts_cls, case: ExpertsCase, inputs, apply_router_weight_on_input: bool = False) -> dict:
    """The error model's bound (``as_tolerance()``) on ``experts_cls``'s output for ``case`` over the routes that
    ``inputs`` hold here (its ``topk_ids`` and ``expert_map``: padded routes add no rows), with the heavy event on
    the call's own values (``conformance.experts_case.inputs_heavy_values``: a reference run of its own)."""
    return case_error_bound(case, inputs.quant_config, experts_cls, topk_ids=inputs.topk_ids,
                            expert_map=inputs.expert_map,
                            heavy=inputs_heavy_values(case, inputs, apply_router_weight_on_input)).as_tolerance()
