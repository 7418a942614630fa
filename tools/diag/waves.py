"""Tiles and waves of the triton backend's GEMMs on the bench's own routings, per shape and M (a GPU, or the CPU's
default tables).

    python tools/diag/waves.py --shapes mixtral_tp2-fp8_tensor,mixtral_tp2-bf16 --ms 768,1024,4096

For each routing set ``python -m benchmarks`` draws (``benchmarks.harness.experts_inputs``) and each GEMM of the
table entry the step runs (``configs.get_config``), prints the row tiles (``BLOCK_SIZE_M`` tiles, and on a
``HALF_TAIL`` tile list the experts' half-height tails, ``+Nt``; a GEMM2 on the layout's half blocks counts
those), times the N tiles, and that count over the GPU's SMs: the waves a persistent (``gluon_ws``) launch runs. A
launch of 2.55 waves takes three waves' time when its tiles cost the same: on the H200, Mixtral TP2's GEMM2 took
89-91 us at 256 tiles (1.94 waves) and 128-131 us at both 336 and 384 (2.55 and 2.91;
docs/notes/breakdown/issue44-waves-h200.txt). What the table's tiles leave idle in the last wave, before any kernel
is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    from backends.triton import configs as C
    from backends.triton.experts import gemm2_on_half_blocks, layout_block, plan_quant
    from benchmarks import shapes as S
    from benchmarks.harness import experts_inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", required=True, help="comma-separated bench shape ids (benchmarks/suites.toml)")
    ap.add_argument("--ms", required=True, help="comma-separated token counts")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    for sid in args.shapes.split(","):
        shape = S.experts_shape(sid)
        for M in (int(m) for m in args.ms.split(",")):
            inp = experts_inputs(shape, M, dev, 50 << 20)
            plan = plan_quant(inp.weights.copies[0][2])
            cfg = C.get_config(M, shape.E, shape.I, shape.K, shape.topk, plan.cfg_dtype, plan.block_shape)
            block = layout_block(cfg)  # the rows each expert is padded to
            # which GEMMs run the tile list (HALF_TAIL: each expert's blocks in pairs, an odd last one a tail)
            on_list = {"gemm1": block != cfg["gemm1"]["BLOCK_SIZE_M"],
                       "gemm2": block != cfg["gemm1"]["BLOCK_SIZE_M"] and not gemm2_on_half_blocks(cfg)}
            print(f"{sid} M={M} ({C.device_name()} table, {sms} SMs):")
            for _, _, ids in inp.sets:
                counts = torch.bincount(ids.flatten().long(), minlength=shape.E)[:shape.E].tolist()
                blocks = [-(-c // block) for c in counts]
                parts = []
                for gemm, n in (("gemm1", shape.I), ("gemm2", shape.K)):
                    bn = cfg[gemm]["BLOCK_SIZE_N"]
                    full, tails = (sum(b // 2 for b in blocks), sum(b % 2 for b in blocks)) if on_list[gemm] else \
                        (sum(blocks), 0)
                    tiles = (full + tails) * -(-n // bn)
                    parts.append(f"{gemm} {full}+{tails}t x {-(-n // bn)} = {tiles} tiles ({tiles / sms:.2f} waves)")
                print("  " + "; ".join(parts))


if __name__ == "__main__":
    main()
