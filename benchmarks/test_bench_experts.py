"""The experts step of every backend on the canonical shapes (GPU) or their CPU scale-downs, side by side.

One test per (shape, M, backend.class): ids like ``qwen3_30b-bf16-M64-triton.TritonExperts``. The timed call is
``FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, quant_config)).apply(...)`` (prepare: a1
quantization; experts; finalize), routing precomputed (not timed). Before timing, the output of input set 0 is
checked against the torch backend's (finite, and within ``specs.oracle_tolerance`` of it: the error model's bound of
the case, ``benchmarks.check.experts_bound``, widened by the triangle inequality, since both implementations are
only within that bound of the reference; a sanity check that the numbers belong to a working kernel,
conformance does the real checks against the reference).
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import harness, timing
from benchmarks.check import experts_bound
from reference.metrics import error_stats
from specs import oracle_tolerance


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
            s = error_stats(out, ref)
            rel_err = s.rms_norm  # relative L2 error: RMS(out - ref) / RMS(ref)
            tol = oracle_tolerance(experts_bound(p.shape, inp.weights.copies[0][2], p.M, p.cls).as_tolerance())
            over = [f"{m} {getattr(s, m):.3g} > {b:.3g}" for m, b in tol.items() if not getattr(s, m) <= b]
            assert not over, (f"{p.id}: output differs from the torch backend's: {'; '.join(over)} - not timing a "
                              f"wrong kernel (MOE_BENCH_CHECK=0 skips this check)")
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
