"""Per-kernel breakdown of ``DeepGemmExperts``' whole experts step, on a GPU: where the step spends its time
around the two grouped GEMMs (issue 26).

    python -m backends.deep_gemm.tools.breakdown --shapes dsv3_ep8-fp8_block128 --ms 8,64,4096
    python -m backends.deep_gemm.tools.breakdown --shapes dsv3_ep8-fp8_block128 --ms 8 --expected-m 1,4,16,64

The step is the benchmark's (``benchmarks.harness``: the same weights, rotating inputs and ``FusedMoEKernel``), timed
by ``benchmarks.timing`` in a CUDA graph; then ``torch.profiler`` records 3 graph replays and each kernel's device
time per call is listed in launch order, with the sum and the idle time between kernels (graph time - sum).
``--expected-m`` times the step once per ``expected_m`` hint of the masked GEMMs (M < 128) instead of the default
``experts.expected_m_for``.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _step(shape_id: str, M: int):
    from backends.deep_gemm import DeepGemmExperts
    from benchmarks import harness, shapes, timing
    from benchmarks.harness import ExpertsParam

    shape = shapes.experts_shape(shape_id)
    dev = torch.device("cuda")
    inp = harness.experts_inputs(shape, M, dev, timing.device_info()["l2_bytes"])
    call, _ = harness.make_experts_call(ExpertsParam(shape, M, "deep_gemm", DeepGemmExperts), inp)
    return call, len(inp.sets), dev


def breakdown(shape_id: str, M: int, replays: int = 3) -> dict:
    """``{"graph_us", "kernels": [(position:name, us per call)], "sum_us"}`` of the step at ``M`` tokens."""
    from benchmarks import timing

    call, n, dev = _step(shape_id, M)
    m, runner = timing.measure(call, n, dev, keep_runner=True)
    try:
        kernels = [(name[:90], us) for name, us in timing.kernel_breakdown(runner, replays)]
    finally:
        runner.close()
    return dict(graph_us=m.seconds * 1e6, kernels=kernels, sum_us=sum(t for _, t in kernels))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="dsv3_ep8-fp8_block128,qwen3_30b-fp8_block128")
    ap.add_argument("--ms", default="1,8,64,1024,4096")
    ap.add_argument("--expected-m", default="", help="comma-separated expected_m hints to time (M < 128 only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("breakdown: needs a CUDA GPU")
        return 2
    from backends.deep_gemm import experts as X
    from benchmarks import timing

    ms = [int(t) for t in args.ms.split(",") if t]
    for sid in [s for s in args.shapes.split(",") if s]:
        for M in ms:
            if args.expected_m:
                default = X.expected_m_for
                cells = []
                try:
                    for em in [int(t) for t in args.expected_m.split(",") if t]:
                        X.expected_m_for = lambda M, topk, E, em=em: em
                        call, n, dev = _step(sid, M)
                        cells.append(f"{em}: {timing.measure(call, n, dev).seconds * 1e6:.1f}")
                finally:
                    X.expected_m_for = default
                print(f"{sid} M={M} step us by expected_m: "
                      + ", ".join(cells), flush=True)
                continue
            try:
                b = breakdown(sid, M)
            except Exception as exc:  # noqa: BLE001 - one failing case does not stop the others
                print(f"{sid} M={M}: {type(exc).__name__}: {exc}", flush=True)
                continue
            print(f"\n{sid} M={M}: graph {b['graph_us']:.1f} us per step, kernels {b['sum_us']:.1f} us, "
                  f"idle {b['graph_us'] - b['sum_us']:.1f} us", flush=True)
            for name, us in b["kernels"]:
                print(f"  {us:8.1f} us  {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
