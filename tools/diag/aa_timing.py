"""A / A check of the interleaved timing: one table entry timed under several names at once (each its own closure,
CUDA graph and workspaces, as ``tools.triton.tune --variants`` builds its variants), in the given order and reversed.

    python tools/diag/aa_timing.py --shapes qwen3_30b_fp8_channel_token,mixtral_tp2_fp8_tensor --ms 1,64 --copies 6
    python tools/diag/aa_timing.py --ms 1 --shared-ws     # every copy on the same workspaces

Identical calls should read the same: a paired ratio whose 95% interval excludes 1.00 between two copies is a bias
of the method (the position in the round, the graph's memory), not of the config. Why: on the H200 (thirty-second
session) the variant tuner read Qwen3-30B fp8_channel_token M = 1's entry 2.2% slower than the same config under
another name (0.978x, interval 0.977-0.979), which the bench did not confirm.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    from backends.triton import configs as C
    from backends.triton.experts import plan_quant
    from benchmarks.timing import paired_ratio
    from tools.triton.common import draw_inputs, make_weights, time_interleaved
    from tools.triton.tune import _gemms_call, parse_shape, workspaces

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3_30b_fp8_channel_token")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--budget-s", type=float, default=1.8, help="rounds' budget per copy (the tuner's: 0.9)")
    ap.add_argument("--passes", type=int, default=3, help="timings: the order given, reversed, given, ...")
    ap.add_argument("--shared-ws", action="store_true",
                    help="every copy on the same workspaces (tune.workspaces): if the spread goes, their addresses "
                         "were the placement that moved it")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"A / A on {torch.cuda.get_device_name()}")
    for name in args.shapes.split(","):
        sh = parse_shape(name)
        w1, w2, qc, act, dt = make_weights(sh, sh.scheme, dev)
        plan = plan_quant(qc)
        table = C.load_table(sh.E, sh.I, plan.cfg_dtype, plan.block_shape, C.device_name()) or {}
        for M in (int(m) for m in args.ms.split(",")):
            entry = table.get(M)
            if entry is None:
                print(f"{sh.name} M={M}: no entry")
                continue
            R = 4
            _, routes, a1s = draw_inputs(sh, M, dev, plan, qc, dt, R, seed=77 * M)
            outs = torch.empty(M, sh.K, device=dev, dtype=dt)
            names = [f"copy{i}" for i in range(args.copies)]
            for p in range(args.passes):
                order = names if p % 2 == 0 else names[::-1]
                ws = workspaces(sh, M, entry, dev) if args.shared_ws else None
                calls = {n: _gemms_call(sh, entry, w1, w2, qc, act, plan, routes, a1s, outs, ws=ws) for n in order}
                inter, failed = time_interleaved(calls, 8 if M <= 64 else 4, dev, args.budget_s)
                if inter is None:
                    print(f"{sh.name} M={M}: nothing timed: {failed}")
                    break
                ref = order[0]
                cols = []
                for n in order:
                    m = inter.measurements[n]
                    if n == ref:
                        cols.append(f"{n} {m.us:.2f} us")
                    else:
                        r, lo, hi = paired_ratio(inter.rounds[n], inter.rounds[ref])
                        flag = "" if lo <= 1.0 <= hi else " *"
                        cols.append(f"{n} {m.us:.2f} ({r:.3f}, {lo:.3f}-{hi:.3f}){flag}")
                n_rounds = len(inter.rounds[ref])
                print(f"{sh.name} M={M} pass {p} ({'given' if p % 2 == 0 else 'reversed'} order, {n_rounds} rounds"
                      f"{', shared workspaces' if args.shared_ws else ''}; "
                      f"ratio to the first named, * = interval excludes 1.00): " + "; ".join(cols), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
