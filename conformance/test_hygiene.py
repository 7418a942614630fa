"""Kernel hygiene: what correct-on-average kernels still get wrong (shared/facts/vllm-inventory.md "Known MoE
correctness bugs").

- the router weight applied on the input (topk == 1) is applied exactly once, on a synthetic top-1 Qwen3-30B-A3B
  (EP rank 0 and the last rank, bf16 and block FP8, chunked), beside test_experts.py's Llama-4 cases;
- repeated runs are bitwise equal when the backend declares itself deterministic;
- the batched format's padding rows stay zero (the layout promises it);
- CUDA-graph replay equals eager (GPU backends);
- one experts call over more than 2^31 intermediate elements (tokens x topk x N): offsets past int32 (vLLM #5938,
  #34279), checked on the first and last tokens against the reference computed for those tokens only (GPU
  backends; the CPU proof that the case is real is tests/test_offsets_int32.py).
Outputs and workspaces are poisoned with NaN before every call (``FusedMoEKernel(poison=nan)``), so unwritten
elements fail everywhere in the suite.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.cases import ExpertsCase
from conformance.experts_case import claims_config, moe_config_for
from conformance.hygiene import (OFFSETS_PAST_INT32, OffsetsCase, check_offsets_case, inputs_error_bound,
                                 run_with_reference)
from conformance.inputs import make_experts_inputs
from conformance.metrics import ConformanceFailure, assert_close, assert_exact
from reference.batched import BatchedPrepareAndFinalize
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from specs import ModelSpec, load_models

SCHEMES = ["bf16", "fp8_block128"]


def _case(scheme: str, M: int = 64) -> ExpertsCase:
    m = load_models()["qwen3_30b_a3b"]
    return ExpertsCase(m, scheme, M, m.cpu_ep_size, 0)


def _kernel(cls, moe_config, qc, M):
    if cls.activation_format() == FusedMoEActivationFormat.BatchedExperts:
        return FusedMoEKernel(BatchedPrepareAndFinalize(M, moe_config.num_local_experts),
                              cls(moe_config, qc, max_num_tokens=M, num_dispatchers=1), poison=float("nan"))
    return FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, qc), poison=float("nan"))


def _claimed(cls, case, qc):
    ok, reason = claims_config(cls, moe_config_for(case), qc)
    if not ok:
        pytest.skip(f"{cls.__name__}: {reason}")


def _experts_params(metafunc):
    classes = list(metafunc.config._moe_backend.experts)
    return [pytest.param(cls, s, id=f"{s}-{cls.__name__}") for cls in classes for s in SCHEMES]


def pytest_generate_tests(metafunc):
    if "experts_cls" in metafunc.fixturenames and "scheme" in metafunc.fixturenames:
        params = _experts_params(metafunc)
        metafunc.parametrize(("experts_cls", "scheme"), params or [pytest.param(None, None, id="no-experts")])
    if "experts_cls" in metafunc.fixturenames and "rw_case" in metafunc.fixturenames:
        classes = list(metafunc.config._moe_backend.experts)
        params = [pytest.param(cls, c, id=f"{c.id}-{cls.__name__}") for c in ROUTER_WEIGHT_ON_INPUT_CASES
                  for cls in classes]
        metafunc.parametrize(("experts_cls", "rw_case"), params or [pytest.param(None, None, id="no-experts")])


def _inputs(backend, experts_cls, scheme, M=64):
    if experts_cls is None:
        pytest.skip(f"backend {backend.name} offers no experts implementation")
    case = _case(scheme, M)
    inputs = make_experts_inputs(case, backend.device)
    _claimed(experts_cls, case, inputs.quant_config)
    return case, inputs


def _apply(kernel, inputs, case):
    return kernel.apply(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids,
                        activation=case.activation, global_num_experts=inputs.global_num_experts,
                        expert_map=inputs.expert_map)


def test_repeated_runs_are_bitwise_equal(backend, experts_cls, scheme, repro, record):
    if not backend.deterministic:
        pytest.skip(f"backend {backend.name} does not declare itself deterministic")
    case, inputs = _inputs(backend, experts_cls, scheme)
    record(component="hygiene", scheme=f"determinism-{scheme}")
    kernel = _kernel(experts_cls, moe_config_for(case), inputs.quant_config, case.tokens)
    first = _apply(kernel, inputs, case)
    for _ in range(3):
        assert_exact(_apply(kernel, inputs, case), first, case=case.id, what="repeated run", repro=repro)


def _batched_experts_call(experts_cls, case, inputs):
    """``(call() -> output, meta, E)``: the batched prepare run once, eagerly (the reference's
    BatchedPrepareAndFinalize scatters with host loops: it stands for a dispatch, not for the code under test), and
    a call of the experts' ``apply`` alone on its slots, into a NaN-filled output."""
    moe_config, qc = moe_config_for(case), inputs.quant_config
    prepare = BatchedPrepareAndFinalize(case.tokens, moe_config.num_local_experts)
    experts = experts_cls(moe_config, qc, max_num_tokens=case.tokens, num_dispatchers=1)
    a1q, a1q_scale, meta, _, _ = prepare.prepare(inputs.hidden_states, inputs.topk_weights, inputs.topk_ids,
                                                 inputs.global_num_experts, inputs.expert_map, False, qc,
                                                 defer_input_quant=experts.expects_unquantized_inputs)
    E, T = a1q.shape[:2]
    shapes = experts.workspace_shapes(T, inputs.w1.shape[1], inputs.hidden_states.shape[1], inputs.topk_ids.shape[1],
                                      inputs.global_num_experts, E, meta, case.activation)
    ws13, ws2, out = (torch.full(s, float("nan"), dtype=inputs.hidden_states.dtype, device=a1q.device) for s in shapes)

    def call():
        experts.apply(out, a1q, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids, case.activation,
                      inputs.global_num_experts, inputs.expert_map, a1q_scale, None, ws13, ws2, meta, False)
        return out

    return call, meta, E


def test_batched_padding_rows_stay_zero(backend, experts_cls, scheme, repro, record):
    if experts_cls is None or experts_cls.activation_format() != FusedMoEActivationFormat.BatchedExperts:
        pytest.skip("not a batched-format experts class")
    case, inputs = _inputs(backend, experts_cls, scheme)
    record(component="hygiene", scheme=f"batched-padding-{scheme}")
    call, meta, E = _batched_experts_call(experts_cls, case, inputs)
    out = call()
    counts = meta.expert_num_tokens.cpu()
    for e in range(E):
        pad = out[e, int(counts[e]):]
        if pad.numel() and not bool((pad == 0).all()):
            raise ConformanceFailure(f"{experts_cls.__name__}: expert slot {e} has non-zero padding rows past its "
                                     f"{int(counts[e])} tokens\n  reproduce: {repro}")


def test_cuda_graph_replay_equals_eager(backend, experts_cls, scheme, repro, record):
    if backend.device != "cuda":
        pytest.skip("CUDA graphs need a CUDA backend")
    case, inputs = _inputs(backend, experts_cls, scheme)
    record(component="hygiene", scheme=f"cuda-graph-{scheme}")
    if experts_cls.activation_format() == FusedMoEActivationFormat.BatchedExperts:
        # the experts alone: the reference's batched prepare syncs with the host (it stands for a dispatch)
        experts_call, _, _ = _batched_experts_call(experts_cls, case, inputs)
        run = lambda: experts_call().clone()  # noqa: E731
    else:
        kernel = _kernel(experts_cls, moe_config_for(case), inputs.quant_config, case.tokens)
        run = lambda: _apply(kernel, inputs, case)  # noqa: E731
    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up on the capture stream (JIT, autotuning, allocations)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = run()
    except Exception as exc:
        raise ConformanceFailure(f"{experts_cls.__name__} cannot be captured in a CUDA graph: {type(exc).__name__}: "
                                 f"{exc}\n  reproduce: {repro}") from exc
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_exact(captured, eager, case=case.id, what="CUDA-graph replay vs eager", repro=repro)


@pytest.mark.parametrize("oc", [OFFSETS_PAST_INT32], ids=lambda oc: str(oc.tokens))
def test_offsets_past_int32(backend, oc: OffsetsCase, repro, record):
    """Qwen3-30B-A3B shapes, ONE experts call (chunk size = M) whose GEMM1 output holds M * topk * N > 2^31
    elements (vLLM #5938, #34279): the first and last tokens must still be right.

    Runs on GPU backends only. On a CPU it needs tens of GB (activations 0.7 GB, the intermediates 4.4 GB in bf16
    and more in fp32 in a torch implementation), so CPU backends skip it; tests/test_offsets_int32.py proves on
    CPU that this case crosses 2^31 in one call and that the same check goes red on a backend whose offsets wrap
    (a small analogue with a tiny offset width)."""
    if backend.device != "cuda":
        pytest.skip(f"needs a GPU: one {oc.tokens}-token call with {oc.largest_intermediate / 1e9:.2f}e9-element "
                    "intermediates takes tens of GB on a CPU (its CPU proof: tests/test_offsets_int32.py)")
    ran = check_offsets_case(backend.experts, oc, "cuda", repro, record)
    if not ran:
        pytest.skip(f"backend {backend.name} has no standard-format experts class claiming bf16")


def _top1(name: str) -> ModelSpec:
    """A synthetic top-1 variant of a model: Llama-4 routing (top-1 of the logits, weight = sigmoid(logit), so
    weights are not 1 and a dropped or doubled weight shows) with the router weight applied on the input."""
    return dataclasses.replace(load_models()[name], name=f"{name}_top1", top_k=1, scoring_func="llama4",
                               renormalize=False, apply_router_weight_on_input=True)


def _router_weight_on_input_cases() -> list[ExpertsCase]:
    """Ordered so that consecutive cases share cached weights (inputs.py keeps one shard): Llama-4 at a rank > 0 was
    tried and left out (drawing its 0.5 GB shard costs ~20 s on a 2-core CPU)."""
    q = _top1("qwen3_30b_a3b")
    return [ExpertsCase(q, "bf16", M, q.cpu_ep_size, 0) for M in (1, 16, 64)] + [
        ExpertsCase(q, "bf16", 40, q.cpu_ep_size, 0, chunk_size=16),  # weights on the input, then chunks
        ExpertsCase(q, "fp8_block128", 16, q.cpu_ep_size, 0),  # weighted input, then quantized per 1x128 group
        ExpertsCase(q, "bf16", 16, q.cpu_ep_size, q.cpu_ep_size - 1),  # the last rank
    ]


# The router weight applied on the input (topk == 1; vLLM's Llama-4 path). test_experts.py holds this bug class with
# Llama-4 (EP rank 0) only. Specs TODO (conformance/cases.py is being rewritten from backend claims): a top-1 model
# variant / an ``apply_router_weight_on_input`` option in specs/cases.toml would carry these cases.
ROUTER_WEIGHT_ON_INPUT_CASES = _router_weight_on_input_cases()


def test_router_weight_on_input(backend, experts_cls, rw_case: ExpertsCase, repro, record):
    """topk == 1 with ``apply_router_weight_on_input``: prepare multiplies the input by the weight, so the experts
    must not weight their output again (nor skip what the flag asks): the output equals the reference's."""
    if experts_cls is None:
        pytest.skip(f"backend {backend.name} offers no experts implementation")
    case = rw_case
    inputs = make_experts_inputs(case, backend.device)
    _claimed(experts_cls, case, inputs.quant_config)
    assert case.model.top_k == 1 and case.model.apply_router_weight_on_input
    w = inputs.topk_weights.float()
    assert bool(((w - 1).abs() > 1e-3).any()), f"{case.id}: router weights all ~1, the case cannot see the bug"
    record(component="hygiene", scheme=f"router-weight-on-input-{case.scheme}", model=case.model.name,
           tokens=case.tokens, experts_class=experts_cls.__name__)
    out, expected = run_with_reference(experts_cls, case, inputs, apply_router_weight_on_input=True)
    assert_close(out, expected, inputs_error_bound(experts_cls, case, inputs, apply_router_weight_on_input=True),
                 case=f"{case.id}-router-weight-on-input", what=f"{experts_cls.__name__} output", repro=repro)
