"""Run one benchmark shape's experts step a few times, for a profiler to capture its kernels.

    ncu -k regex:fused_moe_kernel --launch-skip 2 -c 2 --section SpeedOfLight --section Occupancy \
        python3 -m backends.triton.profile dsv3_tp8_fp8blk 4096

The first call compiles and warms up; the second is the one to profile (GEMM1 and GEMM2 are its 3rd and 4th
``fused_moe_kernel`` launches with ``--launch-skip 2``). Uses the tuned table entry of the GPU, as the bench does.
"""

from __future__ import annotations

import sys

import torch


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python3 -m backends.triton.profile SHAPE M [calls]")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU: profiling needs one")
        return 2
    from backends.triton.bench import SHAPES, make_routing, make_weights
    from backends.triton.experts import fused_experts

    sh = next((s for s in SHAPES if s.name == argv[0]), None)
    if sh is None:
        print(f"unknown shape {argv[0]!r}; names: {[s.name for s in SHAPES]}")
        return 2
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
