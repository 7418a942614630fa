"""Tile variants of the requantization kernel between the GEMMs (``act_quant_kernel``), timed alone on the bench's
own inputs, on a GPU.

    python tools/diag/requant_tiles.py --shapes mixtral_tp2-fp8_tensor --ms 1024,4096 \\
        --variants 4096x1024w4,8192x1024w8,8192x2048w8,16384x2048w8

For each shape and M, GEMM1 of ``python -m benchmarks --backend triton``'s ``gemms`` call runs once (the table's
entry, ``run_experts(stages="gemm1")``, so its output is intact), the requantization launch it made is captured
(``experts._launch_act_quant``) and then replayed alone under each variant of ``host.QUANT_TENSOR_TILE`` (elements a
program) x ``QUANT_TENSOR_COLS`` and ``QUANT_TENSOR_ROUTE_COLS`` (columns a tile) w ``QUANT_TENSOR_WARPS`` (warps a
program; a table entry's ``QUANT_WARPS`` overrides it), in interleaved rounds
(``benchmarks.timing.measure``, a CUDA graph of the launch). Every variant's codes and scales must equal the
first's bit for bit (the tiling moves no rounding), or the variant is reported as differing and not timed further.
Prints, per variant, the median time and the bytes it moves per second (GEMM1's output read, the codes written).
Only the per-tensor modes (QMODE 6 / 7) read these knobs; other requantizations are reported and skipped.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _capture(shape_id: str, M: int):
    """(launch kwargs of the requantization GEMM1's call made, bytes it moves) on the bench's inputs."""
    from backends.triton import configs as C
    from backends.triton import experts as tx
    from benchmarks import harness, shapes, timing
    from benchmarks.variants.triton import quantize_a1

    shape = shapes.experts_shape(shape_id)
    dev = torch.device("cuda")
    inp = harness.experts_inputs(shape, M, dev, timing.device_info()["l2_bytes"])
    plan = tx.plan_quant(inp.weights.copies[0][2])
    cfg = C.get_config(M, shape.E, shape.I, shape.K, shape.topk, plan.cfg_dtype, plan.block_shape)
    w1, w2, qc = inp.weights.copies[0]
    h, tw, ids = inp.sets[0]
    a1q, a1s = quantize_a1(h, plan, qc)
    lay = tx.step_layout(ids, cfg, shape.E)
    out = torch.empty(M, shape.K, device=dev, dtype=shape.dtype)
    seen = []
    real = tx._launch_act_quant

    def spy(**kw):
        seen.append(kw)
        return real(**kw)

    tx._launch_act_quant = spy
    try:
        tx.run_experts(out=out, a1q=a1q, a1q_scale=a1s, w1=w1, w2=w2, topk_weights=tw, topk_ids=ids,
                       activation=shape.activation, expert_map=None, num_ids=shape.E, qc=qc, plan=plan, cfg=cfg,
                       layout=lay, stages="gemm1")
        torch.cuda.synchronize()
    finally:
        tx._launch_act_quant = real
    if not seen:
        return None, 0
    kw = seen[-1]
    if kw.get("local_ids") is not None or kw.get("route_tiles"):  # over the routes (decode)
        rows = kw["num_valid"]
    else:  # over the layout's rows below num_tokens_post_padded (padding rows included)
        rows = int(kw["ntpp"].reshape(-1)[0]) if kw.get("ntpp") is not None else kw["rows"]
    moved = rows * kw["nc"] * (kw["x"].element_size() + kw["y"].element_size())
    return kw, moved


def _variant(text: str) -> tuple[int, int, int]:
    tile, rest = text.split("x")
    cols, warps = rest.split("w")
    return int(tile), int(cols), int(warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral_tp2-fp8_tensor")
    ap.add_argument("--ms", default="1024,4096")
    ap.add_argument("--variants", default="4096x1024w4,8192x1024w8,8192x2048w8,16384x2048w8,16384x1024w16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("requant_tiles: needs a CUDA GPU", file=sys.stderr)
        return 2
    from backends.triton import quant as tq
    from backends.triton.kernels import QMODE_FP8_TENSOR_AMAX, QMODE_FP8_TENSOR_QUANT
    from benchmarks import timing

    variants = [_variant(v) for v in args.variants.split(",")]
    print(f"# requant_tiles on {torch.cuda.get_device_name()}: variants (tile x cols w warps) "
          f"{args.variants}, {args.rounds} interleaved rounds", flush=True)
    for shape_id in args.shapes.split(","):
        for M in (int(m) for m in args.ms.split(",")):
            kw, moved = _capture(shape_id, M)
            if kw is None or kw["qmode"] not in (QMODE_FP8_TENSOR_AMAX, QMODE_FP8_TENSOR_QUANT):
                print(f"{shape_id} M={M}: no per-tensor requantization launch (qmode "
                      f"{None if kw is None else kw['qmode']}): skipped", flush=True)
                continue
            ref = None
            times: dict = {v: [] for v in variants}
            bad = set()
            for rnd in range(args.rounds):
                for v in variants:
                    if v in bad:
                        continue
                    tq.QUANT_TENSOR_TILE, tq.QUANT_TENSOR_COLS, tq.QUANT_TENSOR_WARPS = v
                    tq.QUANT_TENSOR_ROUTE_COLS = v[1]
                    kw["y"].zero_()
                    tq.launch_act_quant(**kw)
                    torch.cuda.synchronize()
                    got = (kw["y"].clone(), kw["ys"].clone())
                    if ref is None:
                        ref = got
                    elif not (torch.equal(got[0], ref[0]) and torch.equal(got[1].view(torch.int32),
                                                                           ref[1].view(torch.int32))):
                        print(f"{shape_id} M={M} {v}: codes or scales differ from {variants[0]}", flush=True)
                        bad.add(v)
                        continue
                    m = timing.measure(lambda i, kw=kw: tq.launch_act_quant(**kw), 1, "cuda")
                    times[v].append(m.seconds)
            for v in variants:
                if v in bad or not times[v]:
                    continue
                t = sorted(times[v])[len(times[v]) // 2]
                print(f"{shape_id} M={M} qmode {kw['qmode']} pdl {kw.get('pdl')} rows {kw['rows']} x {kw['nc']}: "
                      f"{v[0]}x{v[1]}w{v[2]} {t * 1e6:8.2f} us  {moved / t / 1e12:5.2f} TB/s "
                      f"(rounds {', '.join(f'{x * 1e6:.2f}' for x in times[v])})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
