"""Experts conformance: the backend's ``FusedMoEExpertsModular`` classes, driven by the reference's modular kernel
(``MoEPrepareAndFinalizeNoEP`` + ``FusedMoEKernel``, outputs and workspaces poisoned with NaN), against
``reference.experts.fused_experts`` on real model shapes (one EP rank's experts, routing over all experts), for
every quantization scheme the specs give the model. Standard-format classes run behind ``MoEPrepareAndFinalizeNoEP``,
batched-format classes behind ``reference.batched.BatchedPrepareAndFinalize`` (capacity M per expert).

Support claims are tested both ways: a configuration the class claims (seed 002 ``is_supported_config``) must match
the reference; one it does not claim must raise an error, never return a tensor ("works but not claimed" and
"returned garbage" both fail).
"""

from __future__ import annotations

import pytest

from conformance.cases import (ExpertsCase, chunking_defined, claim_cases, claim_coverage, experts_cases,
                               kernel_chunk_kwargs, situ_params)
from conformance.experts_case import (case_error_bound, dump_case, inputs_heavy_values, load_inputs, moe_config_for,
                                     variant_reason, weights_key)
from conformance.metrics import ConformanceFailure, assert_close
from reference.batched import BatchedPrepareAndFinalize, BatchedReferenceExperts
from reference.experts import fused_experts_with_heavy
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames and "experts_cls" in metafunc.fixturenames:
        backend = metafunc.config._moe_backend
        classes = list(backend.experts)
        on_gpu = backend.device == "cuda"
        cases = experts_cases(include_gpu_only=on_gpu)
        params = []
        for c in cases:  # cases outermost: consecutive cases share the cached weights of their model
            for cls in classes or [None]:
                params.append(pytest.param(cls, c, id=c.id if len(classes) <= 1 else f"{c.id}-{cls.__name__}"))
        # Then the cases derived from each class's claims (SupportRecord) that the spec list does not already hold.
        spec_ids = {c.id for c in cases}
        coverage = {}
        for cls in classes:
            derived = claim_cases(cls, on_gpu) if backend.unavailable_reason() is None else []
            for c in derived:
                if c.id not in spec_ids:
                    params.append(pytest.param(cls, c, id=c.id if len(classes) <= 1 else f"{c.id}-{cls.__name__}"))
            if cls.support is not None:
                coverage[cls.__name__] = {"claims": cls.support.describe(),
                                          "coverage": claim_coverage(cls, cases + derived)}
        metafunc.config._moe_claims = coverage
        # Cases that share weights run one after another (a stable sort by what conformance.inputs caches: the
        # model's bf16 weights per EP shard, then the scheme's codes): each is drawn and quantized once per worker
        # (worksteal hands each worker a contiguous run), where drawing and quantizing DeepSeek-V3's 8 local experts
        # costs ten times the case itself.
        params.sort(key=lambda p: weights_key(p.values[1]))
        metafunc.parametrize(("experts_cls", "case"), params)


def test_experts(backend, experts_cls, case: ExpertsCase, tolerances, repro, record, request):
    if experts_cls is None:
        pytest.skip(f"backend {backend.name} offers no experts implementation")
    if case.chunk_size and not chunking_defined():
        pytest.skip("a chunked case: vLLM 0.33 semantics have no activation chunking (run with --vllm-semantics 0.17)")
    inputs = load_inputs(request, case, backend.device)
    qc = inputs.quant_config
    moe_config = moe_config_for(case)
    fmt = experts_cls.activation_format()
    claimed, reason = experts_cls.is_supported_config(experts_cls, moe_config, qc.weight_key, qc.activation_key, fmt)
    record(model=case.model.name, scheme=case.scheme, component="experts", tokens=case.tokens,
           experts_class=experts_cls.__name__, origin=case.origin, regime=case.regime,
           activation=case.activation.name, ep_size=case.ep_size, ep_rank=case.ep_rank, tp_size=case.tp_size,
           chunk_size=case.chunk_size)
    kwargs = dict(activation=case.activation, global_num_experts=inputs.global_num_experts,
                  expert_map=inputs.expert_map, apply_router_weight_on_input=case.model.apply_router_weight_on_input)
    from conformance.profile_match import judged_profile, profile_verdict

    profile = judged_profile(request.config, backend, experts_cls)
    what = f"{experts_cls.__name__} output"
    batched = fmt == FusedMoEActivationFormat.BatchedExperts
    if batched and not profile.is_default:
        pytest.skip(f"numerics profile {profile.name}: the batched format's reference (per-slot activation scales) "
                    "is specified for the vllm profile only")
    cap = max(case.tokens, 1)  # batched capacity: each token routes to an expert at most once

    def kernel_for(cls):
        if batched:
            return FusedMoEKernel(BatchedPrepareAndFinalize(cap, moe_config.num_local_experts),
                                  cls(moe_config, qc, max_num_tokens=cap, num_dispatchers=1), poison=float("nan"))
        return FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, qc), poison=float("nan"),
                              **kernel_chunk_kwargs(case.chunk_size))

    def run():
        return kernel_for(experts_cls).apply(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights,
                                             inputs.topk_ids, **kwargs)

    def reference_and_heavy(prof=profile):
        """The reference output and the call's values at GEMM2's input (the error model's heavy event, step 7b)."""
        # The batched format defines per-tensor activation scales per expert slot, so it has its own reference.
        if batched:
            if not prof.is_default:
                raise NotImplementedError(f"numerics profile {prof.name}: the batched reference is vLLM's only")
            return (kernel_for(BatchedReferenceExperts).apply(inputs.hidden_states, inputs.w1, inputs.w2,
                                                              inputs.topk_weights, inputs.topk_ids, **kwargs),
                    inputs_heavy_values(case, inputs, case.model.apply_router_weight_on_input))
        return fused_experts_with_heavy(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights,
                                    inputs.topk_ids, quant_config=qc, **kwargs, **situ_params(case.activation),
                                    profile=prof)

    def reference(prof=profile):
        return reference_and_heavy(prof)[0]


    variant = variant_reason(experts_cls, case.activation, qc) if claimed else None
    if variant is not None:  # the keys are claimed, a variant of them is not: skipped, the kernel never called
        record(support="variant unclaimed", reason=variant)
        pytest.skip(f"unclaimed variant: {variant}")
    if not claimed and case.tokens == 0:
        pytest.skip(f"unsupported ({reason}); with M == 0 nothing runs, so the refusal cannot be observed")

    def expected_and_bound():
        expected, heavy = reference_and_heavy()
        bound = case_error_bound(case, qc, experts_cls, profile=profile, heavy=heavy)
        record(bounds=bound.as_tolerance(), expected_rms=bound.expected_rms, profile=profile.name)
        return expected, heavy, bound

    if not claimed:
        try:
            out = run()
        except Exception as exc:  # the required behaviour for an unclaimed configuration
            record(support="unsupported", reason=reason)
            pytest.skip(f"unsupported, and raises as required ({type(exc).__name__}): {reason}")
        expected, _, bound = expected_and_bound()
        try:
            assert_close(out, expected, bound.as_tolerance(), case=case.id, what=what, repro=repro)
        except ConformanceFailure as exc:
            raise ConformanceFailure(
                f"{experts_cls.__name__} does not claim this configuration ({reason}) yet returned a tensor "
                f"instead of raising, and it is wrong:\n{exc}") from None
        raise ConformanceFailure(
            f"works but not claimed: {experts_cls.__name__} matches the reference on {case.id} although "
            f"is_supported_config says: {reason}. Claim it (its _supports_* predicates) or raise.\n  reproduce: {repro}")

    record(support="claimed")
    try:
        out = run()
    except Exception as exc:
        raise ConformanceFailure(
            f"claimed but fails: {experts_cls.__name__} claims {case.scheme} / {case.activation.name} but raised "
            f"{type(exc).__name__}: {exc}\n  case: {case.id}\n  reproduce: {repro}") from exc
    expected, heavy, bound = expected_and_bound()
    tol = bound.as_tolerance()
    try:
        stats = assert_close(out, expected, tol, case=case.id, what=what, repro=repro)
    except ConformanceFailure as exc:
        from conformance.diagnose import diagnose

        try:
            diagnosis = diagnose(backend, experts_cls, kernel_for, inputs, case, tol, profile=profile,
                                 apply_router_weight_on_input=case.model.apply_router_weight_on_input)
        except Exception as dexc:  # diagnosis is best effort; never hide the failure itself
            diagnosis = f"diagnosis failed: {type(dexc).__name__}: {dexc}"
        verdict = profile_verdict(out.cpu(), lambda p: reference(p).cpu(),
                                  lambda p: case_error_bound(case, qc, experts_cls, profile=p,
                                                             heavy=heavy).as_tolerance(), profile,
                                  case=case.id)
        dumped = dump_case(request, case, inputs, out, expected, diagnosis)
        raise ConformanceFailure(f"{exc}\n  {verdict}\n  diagnosis: {diagnosis}\n  error model "
                                 "(reference/error_model.py): " + "; ".join(bound.derivation) + dumped) from None
    record(**stats.as_dict())
