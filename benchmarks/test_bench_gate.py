"""Router gate GEMM tiers (reference.gate) at M in {1, 16, 32, 256}: the backends' ``dsv3_router_gemm`` /
``fp32_router_gemm`` / ``router_gemm_cublas`` / ``gate_linear`` (GateLinear's tier for this device) ops where a
backend offers them, and torch's ``F.linear`` / ``torch.mm(out_dtype=fp32)`` as the fallbacks every tier is measured
against. Ids like ``dsv3_gate-M16-cuda.dsv3_router_gemm``. Weight copies rotate (the 3-4 MB weight fits in L2).
"""

from __future__ import annotations

import pytest

from benchmarks import harness, timing


@pytest.mark.benchmark(timer=timing.measured_clock)
@pytest.mark.parametrize("p", harness.gate_params())
def test_gate(benchmark, p: harness.GateParam, device, device_info, ceilings, settings):
    sets, work = harness.gate_inputs(p.shape, p.M, device, ceilings["l2_bytes"])
    call, reason = harness.make_gate_call(p, sets)
    if call is None:
        harness.skip(p.id, reason)
        pytest.skip(reason)
    try:
        out = call(0)
    except (NotImplementedError, ValueError) as exc:  # ValueError includes reference.gate.GateContractError
        # An op outside its contract here (a tier the backend does not implement, torch.mm(out_dtype) on CPU):
        # not a regression of anything, so skipped with the reason; other exceptions fail the test.
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        harness.skip(p.id, f"{type(exc).__name__}: {first}")
        pytest.skip(f"{p.backend}.{p.op} does not run this case: {first}")
    assert out.shape == (p.M, p.shape.E)
    slowdown = timing.planted_slowdown() if p.backend == "torch" else 0.0
    runner = timing.Runner(call, len(sets), device, settings, slowdown=slowdown, graph_key=f"{p.backend}.{p.op}")
    runner.prepare()
    benchmark.group = f"{p.shape.id} M={p.M}"
    benchmark.pedantic(runner.round, rounds=runner.rounds, warmup_rounds=1, iterations=1)
    runner.close()
    impl = p.op + (f"[{call.tier}]" if hasattr(call, "tier") else "")
    harness.record(benchmark, kind="gate", case=p.shape.id, label=p.shape.label, M=p.M, backend=p.backend,
                   impl=impl, work=work, runner=runner, ceilings=ceilings, device=device_info,
                   H=p.shape.H, E=p.shape.E, op=p.op, tier=getattr(call, "tier", None),
                   planted_slowdown=slowdown or None)
