"""Profile one benchmark shape's experts step: for an external profiler, or as a per-kernel breakdown.

    ncu -k regex:fused_moe_kernel --launch-skip 2 -c 2 --section SpeedOfLight --section Occupancy \
        python3 -m tools.triton.profile dsv3_tp8_fp8blk 4096

runs the step a few times (default 2): the first call compiles and warms up; the second is the one to profile
(GEMM1 and GEMM2 are its 3rd and 4th ``fused_moe_kernel`` launches with ``--launch-skip 2``).

    python3 -m tools.triton.profile --breakdown qwen3_30b_fp8blk:8 dsv3_ep8_fp8blk:8

times the GEMM stage as ``python -m benchmarks --backend triton`` does (its ``gemms`` column: GEMM1 with its fused activation, the requantization kernel when one runs,
GEMM2; a CUDA graph of >= 10 calls over 10 routings, ``benchmarks.timing``) and prints, per kernel in launch order, its device time per
call from ``torch.profiler`` over 5 graph replays, the sum, and the idle time between kernels (graph time per call
minus the sum). A kernel launched with programmatic dependent launch (``PDL`` entries) starts during the previous
one and counts its wait as device time, so the sum then exceeds the graph time. Both use the tuned table entry of
the GPU, as the benchmark does.
"""

from __future__ import annotations

import sys

import torch


def _shape(name):
    from tools.triton.common import shape

    return shape(name)


def breakdown(name: str, M: int, R: int = 10, replays: int = 5) -> dict:
    """Per-kernel device time (us per call) of the GEMM stage of bench shape ``name`` at ``M`` tokens:
    ``{"graph_us", "kernels": [(position:name, us)], "sum_us"}``."""
    from backends.triton import configs as C
    from tools.triton.common import draw_inputs, make_weights, time_us
    from backends.triton.experts import plan_quant, run_experts, step_layout

    sh = _shape(name)
    dev = torch.device("cuda")
    w1, w2, qc, act, dt = make_weights(sh, sh.scheme, dev)
    plan = plan_quant(qc)
    cfg = C.get_config(M, sh.E, sh.I, sh.K, sh.topk, plan.cfg_dtype, plan.block_shape)
    _, routes, a1s = draw_inputs(sh, M, dev, plan, qc, dt, R, seed=1000 * M)  # the bench's inputs
    lays = [step_layout(ids, cfg, sh.E) for _, ids in routes]
    out = torch.empty(M, sh.K, device=dev, dtype=dt)

    def call(i):
        r = i % R
        run_experts(out=out, a1q=a1s[r][0], a1q_scale=a1s[r][1], w1=w1, w2=w2, topk_weights=routes[r][0],
                    topk_ids=routes[r][1], activation=act, expert_map=None, num_ids=sh.E, qc=qc, plan=plan,
                    cfg=cfg, layout=lays[r], stages="gemms")

    from benchmarks.timing import kernel_breakdown

    graph_us, runner = time_us(call, R, dev, keep_runner=True)  # benchmarks.timing: a graph of >= R calls
    try:
        kernels = kernel_breakdown(runner, replays)
    finally:
        runner.close()
    return dict(graph_us=graph_us, kernels=kernels, sum_us=sum(t for _, t in kernels))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[0] != "--breakdown" and len(argv) < 2):
        print("usage: python3 -m tools.triton.profile SHAPE M [calls]\n"
              "       python3 -m tools.triton.profile --breakdown SHAPE:M [SHAPE:M ...]")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU: profiling needs one")
        return 2
    if argv[0] == "--breakdown":
        print(f"GEMM stage per kernel on {torch.cuda.get_device_name()} (us per call)")
        for spec in argv[1:]:
            name, _, m = spec.partition(":")
            r = breakdown(name, int(m))
            ks = ", ".join(f"{k} {t:.2f}" for k, t in r["kernels"])
            print(f"{name} M={m}: graph {r['graph_us']:.2f}, kernels {r['sum_us']:.2f} ({ks}), "
                  f"between kernels {r['graph_us'] - r['sum_us']:.2f}", flush=True)
        return 0
    from tools.triton.common import make_routing, make_weights
    from backends.triton.experts import fused_experts

    sh = _shape(argv[0])
    M, calls = int(argv[1]), int(argv[2]) if len(argv) > 2 else 2
    dev = torch.device("cuda")
    w1, w2, qc, act, dt = make_weights(sh, sh.scheme, dev)
    x = torch.randn(M, sh.K, device=dev, dtype=dt)
    w, ids = make_routing(M, sh.E, sh.topk, dev, seed=M)
    for _ in range(calls):
        fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc)
    torch.cuda.synchronize()
    print(f"{sh.name} M={M}: {calls} calls done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
