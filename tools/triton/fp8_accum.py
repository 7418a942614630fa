"""FP8 accumulation of ``fused_moe_kernel``: the error of in-place accumulation against promotion into fp32, and
what the promotion costs (issue 22, item 5). One process on one H100 / H200, under 6 minutes on an H200:

    python3 -m tools.triton.fp8_accum                  # accuracy, then timing, then the table
    python3 -m tools.triton.fp8_accum --no-timing      # accuracy only (~20 s)
    python3 -m tools.triton.fp8_accum --ms 4096 --json out.json

(a) Accuracy: one FP8 per-tensor GEMM ``C = (A * s_a) @ (W * s_w)^T`` (``M = N = 1024``, ``K`` in {1024, 4096, 7168,
    16384}, ``A, W ~ N(0, 1)`` quantized per tensor with ``reference.quant.scaled_fp8_quant``) through the kernel's
    own launch path (``experts.launch_gemm`` on a single expert with every token routed to it, fp32 output, so
    nothing is rounded after the accumulator), for each variant of :data:`ACC_VARIANTS` on each tile of :data:`ACC_CFGS`
    (a 64-row tile on wgmma, a 16-row one on mma.sync): relative RMS error against the
    float64 product of the dequantized operands, and its ratio to the error of plain fp32 accumulation (``torch``
    float32 matmul of the dequantized operands, TF32 off). On sm_90 the in-place FP8 wgmma accumulator keeps about 14
    mantissa bits (DeepSeek-V3 technical report 3.3.2): its error grows with K, the promoted ones stay near fp32's.
(b) Timing: the whole experts step (``fused_experts``: input quantization, align, both GEMMs, requantization, top-k
    sum) of Qwen3-30B-A3B ``fp8_channel_token`` (E=128, topk 8, K=2048, I=768) and Mixtral-8x7B TP2 ``fp8_tensor``
    (E=8, topk 2, K=4096, I=7168) at M in {64, 1024, 4096}, each variant on the default launch configuration
    (``configs.default_config``, what these schemes ran before they had tuned tables) with the variant's keys set;
    ``table``: the committed table's entry (``configs.get_config``), where one applies. Inputs from
    ``tools.triton.common.draw_inputs`` (rotating routings), timed by ``benchmarks.timing.measure``
    (CUDA graphs, median of rounds), variants interleaved and repeated; before a variant's time counts, its output on
    the first input set is checked against ``reference.experts.fused_experts`` with the error model's bound for its
    accumulation (``reference.error_model``: the in-place form under the opt-in ``Accumulation.fast``; a failing
    variant is reported, not timed).

The table is printed last: ``variant | shape | M | us | ratio to old`` (old = ``FAST_ACCUM``, the in-place form of
vLLM's ``fused_moe_kernel`` and of this kernel before the promotion).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

# variant name -> the accumulation keys set on both GEMMs' config entries ("old": the in-place form)
VARIANTS = {
    "old (FAST_ACCUM, in place)": dict(FAST_ACCUM=1),
    "promote every 256 K (default)": dict(PROMOTE_K=256),
    "promote every 128 K": dict(PROMOTE_K=128),
    # The promoted form holds two accumulators: on 128-row 8-warp prefill tiles that halves the CTAs per SM. The
    # same promotion on 64-row 4-warp tiles keeps the register file's occupancy (a candidate table entry).
    "promote 256, BM64 4 warps": dict(PROMOTE_K=256, _tile=dict(BLOCK_SIZE_M=64, num_warps=4, num_stages=4)),
    "promote 256, BM64 BN128 4 warps": dict(PROMOTE_K=256, _tile=dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128,
                                                                      num_warps=4, num_stages=3)),
    # the warp-specialized Gluon GEMMs (gluon_ws: one TMA warp, two consumer warpgroups with setmaxnreg's registers):
    # each K tile's wgmma promoted while the next one runs (two register sets), the scales in the epilogue
    "gluon_ws cooperative BM128": dict(_tile={
        "gemm1": dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, num_warps=4, num_stages=4, USE_TMA=1,
                      PERMUTE_A=1, COOPERATIVE=1),
        "gemm2": dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, num_warps=4, num_stages=4, USE_TMA=1,
                      COOPERATIVE=1)}),
    "gluon_ws ping-pong BM64": dict(_tile={
        "gemm1": dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, num_warps=4, num_stages=5, USE_TMA=1,
                      PERMUTE_A=1, PINGPONG=1),
        "gemm2": dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, num_warps=4, num_stages=5, USE_TMA=1,
                      PINGPONG=1)}),
    # the committed tuned table of this GPU (configs/), where one exists: what the backend runs
    "table": dict(_base="table"),
}
OLD = "old (FAST_ACCUM, in place)"
# the accuracy GEMM's variants: the accumulation forms alone. The others only change the whole step's prefill tiles
# or kernel (a gathered single-expert GEMM on ACC_CFGS' tiles would run one of these forms under their names)
ACC_VARIANTS = {n: k for n, k in VARIANTS.items() if "_tile" not in k and "_base" not in k}
ACC_KS = (1024, 4096, 7168, 16384)
TIME_MS = (64, 1024, 4096)
# the accuracy GEMM's launch configurations (BLOCK_K 128 so that both intervals apply): a prefill tile on wgmma
# (QGMMA, the ~14-bit FP8 accumulator), and a decode tile of 16 rows, which Triton runs on mma.sync (FP8 converted
# to fp16, HMMA with an fp32 accumulator): whether in-place accumulation loses anything there too
ACC_CFGS = {
    "wgmma BM64": dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=3),
    "mma.sync BM16": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4,
                          num_stages=4),
}
BUDGET_S = 330.0  # stop starting new timings after this (the whole run must stay < 6 minutes)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def timing_shapes():
    """The two timed shapes (``tools.triton.common.Shape``): Qwen3-30B-A3B FP8 per-channel weights x per-token activations, and
    Mixtral-8x7B at TP2 with FP8 per-tensor weights and activations (``specs/models.toml`` dimensions)."""
    from tools.triton.common import Shape

    return [Shape("qwen3_30b_fp8_channel_token", 128, 8, 2048, 768, "fp8_channel_token"),
            Shape("mixtral_tp2_fp8_tensor", 8, 2, 4096, 7168, "fp8_tensor")]


def with_variant(cfg: dict, keys: dict) -> dict:
    """A copy of a ``{"gemm1", "gemm2"}`` launch config with a variant's accumulation keys on both GEMMs (and
    ``BLOCK_SIZE_K`` lowered to ``PROMOTE_K`` where it was longer: the decode defaults' 256-wide FP8 K tiles)."""
    keys = {k: v for k, v in keys.items() if k != "_base"}
    tile = keys.pop("_tile", None)
    out = {g: dict(cfg[g], **keys) for g in ("gemm1", "gemm2")}
    prefill = cfg["gemm1"].get("BLOCK_SIZE_M", 0) > 64
    for name, g in out.items():
        if tile is not None and prefill:  # prefill tiles only; a tile per GEMM or one for both
            g.update(tile.get(name, {}) if "gemm1" in tile else tile)
        if "PROMOTE_K" in keys:
            g["BLOCK_SIZE_K"] = min(g["BLOCK_SIZE_K"], keys["PROMOTE_K"])
    return out


def single_expert_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, g: dict,
                       *, a_mode: int = 1, b_mode: int = 1, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(a_q * a_scale) @ (w_q * w_scale)^T`` through ``fused_moe_kernel``'s launch path: one expert, every one of
    the ``M`` tokens routed to it (top-1), plain epilogue (no activation), output in ``out_dtype`` (fp32: the
    accumulator times the scales, unrounded).

    Args:
        a_q: ``(M, K)`` FP8 e4m3 codes; a_scale: fp32, one element (``a_mode`` 1) or ``(M, 1)`` (``a_mode`` 2).
        w_q: ``(N, K)`` FP8 e4m3 codes; w_scale: fp32, one element (``b_mode`` 1) or ``(N,)`` (``b_mode`` 2).
        g: one GEMM's launch config (``BLOCK_SIZE_M``, ..., and the accumulation keys ``PROMOTE_K`` /
            ``FAST_ACCUM``); sanitized here.
    Returns: ``(M, N)`` ``out_dtype``.
    """
    from backends.triton import configs as C
    from backends.triton.host import GemmEpilogue, GemmOperands, GemmScales, GemmShape, ScaleMode
    from backends.triton.experts import launch_gemm, layout_block, layout_rows, route_layout

    M, K = a_q.shape
    N = w_q.shape[0]
    cfg = C.sanitize_config({"gemm1": dict(g), "gemm2": dict(g)})
    ids = torch.zeros(M, 1, dtype=torch.int32, device=a_q.device)
    lay = route_layout(ids, cfg, 1)
    rows = layout_rows(M, 1, layout_block(cfg))
    c = torch.empty(M, N, dtype=out_dtype, device=a_q.device)
    a_s = a_scale.reshape(1).float() if a_mode == 1 else a_scale.reshape(M, 1).float()
    w_s = w_scale.reshape(1).float() if b_mode == 1 else w_scale.reshape(1, N).float()
    launch_gemm(GemmOperands(a_q, w_q.reshape(1, N, K), c, a_scale=a_s, w_scale=w_s),
                 GemmShape(lay, rows, num_valid=M, top_k=1, n_out=N, a_gather=True, c_sorted=False),
                 GemmScales(a_mode=ScaleMode(a_mode), b_mode=ScaleMode(b_mode)), GemmEpilogue(act_dtype=out_dtype),
                 cfg["gemm1"])
    return c


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    d = x.double() - ref
    return (d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def accuracy(dev, Ks=ACC_KS, M=1024, N=1024, seed=0) -> list[dict]:
    """Part (a): one row per (K, variant) with the relative RMS errors of the kernel and of fp32 accumulation."""
    from reference.quant import scaled_fp8_quant

    rows = []
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for K in Ks:
            g = torch.Generator().manual_seed(seed + K)
            a, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            (aq, sa), (wq, sw) = scaled_fp8_quant(a), scaled_fp8_quant(w)  # bit-exact scales on the CPU
            aq, sa, wq, sw = aq.to(dev), sa.to(dev), wq.to(dev), sw.to(dev)
            ad, wd = aq.double() * sa.double(), wq.double() * sw.double()
            exact = ad @ wd.T
            e32 = rel_rms(ad.float() @ wd.float().T, exact)
            for tile, g in ACC_CFGS.items():
                for name, keys in ACC_VARIANTS.items():
                    out = single_expert_gemm(aq, sa, wq, sw, dict(g, **keys))
                    e = rel_rms(out, exact)
                    rows.append(dict(K=K, tile=tile, variant=name, rel_rms=e, fp32_rel_rms=e32, ratio_to_fp32=e / e32))
                    log(f"accuracy K={K:6d} {tile:13s} {name:30s} rel rms {e:.3e}  fp32 {e32:.3e}  "
                        f"x{e / e32:.2f} of fp32")
            del ad, wd, exact
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return rows


def _median_call_us(call, n_sets, dev, budget_s):
    """Median per-call device time (us) of ``call(i)`` over ``benchmarks.timing.measure`` rounds (CUDA graph)."""
    from benchmarks.timing import Settings, measure

    m = measure(call, n_sets, dev, Settings(budget_s=budget_s, min_rounds=10, max_rounds=60))
    return m.us, m.method


def timing(dev, Ms=TIME_MS, repeats=2, budget_s=0.25, variants=None, shapes=None) -> list[dict]:
    """Part (b): one row per (variant, shape, M): median us of the whole experts step (best of ``repeats``
    interleaved repeats), or the reason it was not timed. ``variants``: a subset of :data:`VARIANTS` in the order
    they are timed (default: all); ``shapes``: of :func:`timing_shapes` (default: both)."""
    variants = VARIANTS if variants is None else variants
    from backends.triton import configs as C
    from tools.triton.common import draw_inputs, make_weights
    from benchmarks.check import reference_output, verdict
    from backends.triton.experts import fused_experts, plan_quant
    from reference.error_model import Accumulation, experts_error_bound
    from reference.experts import fused_experts as ref_fused_experts

    rows = []
    for sh in timing_shapes() if shapes is None else shapes:
        w1, w2, qc, act, dt = make_weights(sh, sh.scheme, dev)
        plan = plan_quant(qc)

        def bound(keys):
            # each variant against the error model's bound for its own accumulation: the in-place form is the
            # opt-in fast-accumulation recipe (its own, wider bound), the promoted ones the default
            acc = Accumulation.fast(14) if keys.get("FAST_ACCUM") else None
            return experts_error_bound(qc, act_dtype=dt, K=sh.K, I=sh.I, activation=act,
                                       accumulation=acc).as_tolerance()
        for M in Ms:
            if time.time() - T0 > BUDGET_S:
                log(f"time budget reached: skipping {sh.name} M={M}")
                continue
            R = 10 if M <= 64 else 4
            xs, routes, _ = draw_inputs(sh, M, dev, plan, qc, dt, R, seed=1000 * M)
            # the defaults (what these schemes ran before they had a table), and the committed table if any
            default = C.sanitize_config(C.default_config(M, sh.E, sh.I, sh.K, sh.topk, plan.cfg_dtype,
                                                         plan.block_shape))
            table = C.get_config(M, sh.E, sh.I, sh.K, sh.topk, plan.cfg_dtype, plan.block_shape)
            # the reference on the GPU (its FP8 scales may differ from the CPU's in the last bit: within tolerance),
            # on the CPU if it cannot run there (slow at M = 4096)
            try:
                ref = ref_fused_experts(xs[0], w1, w2, routes[0][0], routes[0][1], activation=act, quant_config=qc)
            except Exception as exc:  # noqa: BLE001
                log(f"reference on the GPU failed ({type(exc).__name__}: {exc}); computing it on the CPU")
                ref = reference_output(xs[0], w1, w2, routes[0][0], routes[0][1], qc, activation=act).to(dev)
            ok = {}
            for name, keys in variants.items():
                if keys.get("_base") == "table" and table == default:
                    continue  # no table entry for this M: the same as the default
                cfg = with_variant(table if keys.get("_base") == "table" else default, keys)
                try:
                    out = fused_experts(xs[0], w1, w2, routes[0][0], routes[0][1], activation=act, quant_config=qc,
                                        config=cfg)
                    c = verdict(out, ref, bound(keys))
                    good = c.ok
                    ok[name] = (cfg, None if good else f"outside its bound: {c.text}", True)
                    log(f"check {sh.name} M={M} {name:32s} {'OK' if good else 'FAIL'} {c.text}"
                        + (f" rms={c.stats.rms_norm:.2e} max={c.stats.max_norm:.2e}" if c.stats else ""))
                except Exception as exc:  # noqa: BLE001 - reported in the table, the run goes on
                    ok[name] = (cfg, f"{type(exc).__name__}: {exc}", False)
                    log(f"check {sh.name} M={M} {name} FAILED: {ok[name][1]}")
            times = {name: [] for name in ok}
            for _ in range(repeats):
                for name, (cfg, why, ran) in ok.items():
                    if not ran:  # raised: nothing to time (a variant outside its bound is still timed)
                        continue

                    def call(i, cfg=cfg):
                        fused_experts(xs[i], w1, w2, routes[i][0], routes[i][1], activation=act, quant_config=qc,
                                      config=cfg)

                    us, method = _median_call_us(call, R, dev, budget_s)
                    times[name].append(us)
            for name, (cfg, why, ran) in ok.items():
                us = min(times[name]) if times[name] else float("nan")
                rows.append(dict(variant=name, shape=sh.name, M=M, us=us, repeats=times[name], error=why,
                                 config=cfg))
                if times[name]:
                    reps = ", ".join(f"{t:.1f}" for t in times[name])
                    log(f"time {sh.name} M={M:5d} {name:32s} {us:9.2f} us  (repeats {reps})")
            xs = routes = ref = None  # frees the GPU memory (rebound, not del: the closures name them)
            torch.cuda.empty_cache()
        w1 = w2 = qc = None
        torch.cuda.empty_cache()
    return rows


def print_tables(acc_rows, time_rows):
    if acc_rows:
        print()
        print("| K | tile | variant | rel rms vs float64 | fp32 accumulation rel rms | ratio to fp32 |")
        print("|---|---|---|---|---|---|")
        for r in acc_rows:
            print(f"| {r['K']} | {r['tile']} | {r['variant']} | {r['rel_rms']:.3e} | {r['fp32_rel_rms']:.3e} | "
                  f"{r['ratio_to_fp32']:.2f} |")
    if time_rows:
        old = {(r["shape"], r["M"]): r["us"] for r in time_rows if r["variant"] == OLD}  # ratio "-" without it
        print()
        print("| variant | shape | M | us | ratio to old | check against its error-model bound |")
        print("|---|---|---|---|---|---|")
        for r in time_rows:
            o = old.get((r["shape"], r["M"]))
            ratio = f"{r['us'] / o:.3f}" if o and not math.isnan(o) and not math.isnan(r["us"]) else "-"
            check = "ok" if r["error"] is None else r["error"][:90]
            print(f"| {r['variant']} | {r['shape']} | {r['M']} | {r['us']:.2f} | {ratio} | {check} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default=",".join(map(str, ACC_KS)), help="K of the accuracy GEMM")
    ap.add_argument("--ms", default=",".join(map(str, TIME_MS)), help="token counts to time")
    ap.add_argument("--no-timing", action="store_true", help="accuracy only")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved timing repeats per variant (best is kept)")
    ap.add_argument("--variants", default=None, help="semicolon-separated variant names to time, in this order "
                                                     f"(default: all of {'; '.join(VARIANTS)})")
    ap.add_argument("--shapes", default=None, help="comma-separated timing shape names (default: both)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fp8_accum.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this script needs an H100 / H200 (tests/test_triton_interpret.py checks the promotion "
              "on CPU)")
        return 2
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    import triton

    dev = torch.device("cuda")
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    acc_rows = accuracy(dev, [int(k) for k in args.ks.split(",")])
    variants = VARIANTS
    if args.variants:
        names = [v.strip() for v in args.variants.split(";") if v.strip()]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        variants = {v: VARIANTS[v] for v in names}
    shapes = [s for s in timing_shapes() if not args.shapes or s.name in args.shapes.split(",")]
    time_rows = [] if args.no_timing else timing(dev, [int(m) for m in args.ms.split(",")], repeats=args.repeats,
                                                 variants=variants, shapes=shapes)
    try:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), accuracy=acc_rows, timing=time_rows), f, indent=1,
                      default=str)
    except OSError as exc:
        log(f"could not write {args.json}: {exc}")
    print_tables(acc_rows, time_rows)
    log("done")
    return 1 if any(r["error"] for r in time_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
