"""Kernel hygiene: what correct-on-average kernels still get wrong (shared/facts/vllm-inventory.md "Known MoE
correctness bugs").

- repeated runs are bitwise equal when the backend declares itself deterministic;
- the batched format's padding rows stay zero (the layout promises it);
- CUDA-graph replay equals eager (GPU backends);
- more than 64k tokens x topk x N: offsets past int32 (vLLM #5938, #34279), checked on the last tokens against the
  reference computed for those tokens only (GPU backends).
Outputs and workspaces are poisoned with NaN before every call (``FusedMoEKernel(poison=nan)``), so unwritten
elements fail everywhere in the suite.
"""

from __future__ import annotations

import pytest
import torch

from conformance.cases import ExpertsCase
from conformance.inputs import make_experts_inputs
from conformance.metrics import ConformanceFailure, assert_close, assert_exact
from conformance.test_experts import moe_config_for
from reference.batched import BatchedPrepareAndFinalize
from reference.experts import fused_experts
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from reference.routing import fused_topk
from reference.schemes import quantize_weights, scheme_tolerance_key
from specs import load_models

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
    ok, reason = cls.is_supported_config(cls, moe_config_for(case), qc.weight_key, qc.activation_key,
                                         cls.activation_format())
    if not ok:
        pytest.skip(f"{cls.__name__}: {reason}")


def _experts_params(metafunc):
    classes = list(metafunc.config._moe_backend.experts)
    return [pytest.param(cls, s, id=f"{s}-{cls.__name__}") for cls in classes for s in SCHEMES]


def pytest_generate_tests(metafunc):
    if "experts_cls" in metafunc.fixturenames and "scheme" in metafunc.fixturenames:
        params = _experts_params(metafunc)
        metafunc.parametrize(("experts_cls", "scheme"), params or [pytest.param(None, None, id="no-experts")])


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


def test_batched_padding_rows_stay_zero(backend, experts_cls, scheme, repro, record):
    if experts_cls is None or experts_cls.activation_format() != FusedMoEActivationFormat.BatchedExperts:
        pytest.skip("not a batched-format experts class")
    case, inputs = _inputs(backend, experts_cls, scheme)
    record(component="hygiene", scheme=f"batched-padding-{scheme}")
    moe_config, qc = moe_config_for(case), inputs.quant_config
    prepare = BatchedPrepareAndFinalize(case.tokens, moe_config.num_local_experts)
    a1q, a1q_scale, meta, _, _ = prepare.prepare(inputs.hidden_states, inputs.topk_weights, inputs.topk_ids,
                                                 inputs.global_num_experts, inputs.expert_map, False, qc)
    experts = experts_cls(moe_config, qc, max_num_tokens=case.tokens, num_dispatchers=1)
    E, T = a1q.shape[:2]
    shapes = experts.workspace_shapes(T, inputs.w1.shape[1], inputs.hidden_states.shape[1], inputs.topk_ids.shape[1],
                                      inputs.global_num_experts, E, meta, case.activation)
    ws13, ws2, out = (torch.full(s, float("nan"), dtype=inputs.hidden_states.dtype, device=a1q.device) for s in shapes)
    experts.apply(out, a1q, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids, case.activation,
                  inputs.global_num_experts, inputs.expert_map, a1q_scale, None, ws13, ws2, meta, False)
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
    kernel = _kernel(experts_cls, moe_config_for(case), inputs.quant_config, case.tokens)
    eager = _apply(kernel, inputs, case)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _apply(kernel, inputs, case)  # warm-up on the capture stream (JIT, autotuning, allocations)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = _apply(kernel, inputs, case)
    except Exception as exc:
        raise ConformanceFailure(f"{experts_cls.__name__} cannot be captured in a CUDA graph: {type(exc).__name__}: "
                                 f"{exc}\n  reproduce: {repro}") from exc
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_exact(captured, eager, case=case.id, what="CUDA-graph replay vs eager", repro=repro)


@pytest.mark.parametrize("M", [180_000])
def test_offsets_past_int32(backend, M, tolerances, repro, record):
    """Qwen3-30B-A3B shapes with M * topk * N > 2^31 (N = 1536): the last tokens must still be right."""
    if backend.device != "cuda":
        pytest.skip("needs a GPU (about 10 GB of activations and intermediates)")
    m = load_models()["qwen3_30b_a3b"]
    E, K, I, topk = 16, m.hidden_size, m.intermediate_size, m.top_k
    assert M * topk * 2 * I > 2**31
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, K, device="cuda", generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, I, device="cuda", generator=g) * I**-0.5).bfloat16()
    w, ids = fused_topk(None, torch.randn(M, E, device="cuda", generator=g), topk, True)
    case = ExpertsCase(m, "bf16", M, 8, 0)
    for cls in backend.experts:
        if cls.activation_format() != FusedMoEActivationFormat.Standard:
            continue
        moe_config = moe_config_for(case)
        _, _, qc = quantize_weights("bf16", w1, w2)
        ok, reason = cls.is_supported_config(cls, moe_config, None, None, FusedMoEActivationFormat.Standard)
        if not ok:
            continue
        record(component="hygiene", scheme="int32-offsets")
        out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, qc)).apply(x, w1, w2, w, ids)
        tail = slice(M - 64, M)
        ref = fused_experts(x[tail], w1, w2, w[tail], ids[tail])
        assert_close(out[tail], ref, tolerances["experts"]["bfloat16"], case=f"{cls.__name__}-M{M}",
                     what="last 64 tokens", repro=repro)
        return
    pytest.skip(f"backend {backend.name} has no standard-format experts class claiming bf16")
