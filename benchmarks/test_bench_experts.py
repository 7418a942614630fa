"""The experts step of every backend on the canonical shapes (GPU) or their CPU scale-downs, side by side.

One test per (shape, M, backend.class): ids like ``qwen3_30b-bf16-M64-triton.TritonExperts``. The timed call is
``FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, quant_config)).apply(...)`` (prepare: a1
quantization; experts; finalize), routing precomputed (not timed). Before timing, the output of input set 0 is
checked against the torch backend's (finite, relative L2 error under a loose bound: a sanity check that the
numbers belong to a working kernel; conformance does the real checks).
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import harness, timing

# Loose sanity bounds (relative L2 vs the torch backend): catch garbage, not ulps.
REL_ERR_BOUND = {"bf16": 3e-2, "fp8": 8e-2}


@pytest.mark.parametrize("name", harness.backend_params())
def test_backend(name, device_info):
    """One line per backend: available here (its version is recorded) or skipped with the reason."""
    if name == "reference":
        harness.RESULTS["backends"]["reference"] = "reference (pure torch, per-expert loop)"
        return
    b, reason = harness.backends().get(name, (None, f"backend {name!r} is not registered"))
    if reason is not None:
        harness.skip(f"backend {name}", reason)
        pytest.skip(f"backend {name} not benchmarked: {reason}")
    harness.RESULTS["backends"][name] = b.version


@pytest.mark.benchmark(timer=timing.measured_clock)
@pytest.mark.parametrize("p", harness.experts_params())
def test_experts(benchmark, p: harness.ExpertsParam, device, device_info, ceilings, settings):
    ok, reason = harness.supported(p)
    if not ok:
        harness.skip(p.id, reason)
        pytest.skip(f"{p.impl} does not claim this configuration: {reason}")
    inp = harness.experts_inputs(p.shape, p.M, device, ceilings["l2_bytes"])
    call, prepare_label = harness.make_experts_call(p, inp)
    try:
        out = call(0)
    except Exception as exc:
        harness.RESULTS["records"].append(dict(kind="experts", case=p.shape.id, shape=p.shape.label, M=p.M,
                                               backend=p.backend, impl=p.impl, median_s=None,
                                               error=f"{type(exc).__name__}: {exc}"[:300]))
        pytest.fail(f"{p.impl} claims {p.shape.id} but raised {type(exc).__name__}: {exc}")
    rel_err = None
    if p.backend == "torch":
        harness.remember_oracle(p, out)
    elif os.environ.get("MOE_BENCH_CHECK", "1") != "0":
        ref = harness.oracle_output(p, inp)
        if ref is not None:
            assert torch.isfinite(out).all(), f"{p.id}: non-finite output"
            rel_err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
            bound = REL_ERR_BOUND[p.shape.compute_dtype]
            assert rel_err <= bound, (f"{p.id}: output differs from the torch backend's by rel. L2 {rel_err:.3g} "
                                      f"> {bound} - not timing a wrong kernel (MOE_BENCH_CHECK=0 skips this check)")
    del out
    slowdown = timing.planted_slowdown() if p.backend == "torch" else 0.0
    runner = timing.Runner(call, len(inp.sets), device, settings, slowdown=slowdown,
                           graph_key=f"{p.backend}.{p.impl}.{p.shape.scheme}")
    runner.prepare()
    benchmark.group = f"{p.shape.id} M={p.M}"
    benchmark.pedantic(runner.round, rounds=runner.rounds, warmup_rounds=1, iterations=1)
    runner.close()
    harness.record(
        benchmark, kind="experts", case=p.shape.id, label=p.shape.label, M=p.M, backend=p.backend, impl=p.impl,
        work=inp.work, runner=runner, ceilings=ceilings, device=device_info,
        E=p.shape.E, topk=p.shape.topk, K=p.shape.K, I=p.shape.I, scheme=p.shape.scheme,
        experts_touched=inp.touched, weight_copies=len(inp.weights.copies), prepare=prepare_label,
        rel_err_vs_torch=rel_err, planted_slowdown=slowdown or None, note=p.shape.note or None,
    )
