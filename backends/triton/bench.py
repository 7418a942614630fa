"""GPU check and benchmark of the triton backend (one self-contained script; the lead runs it on the H100/H200).

    python -m backends.triton.bench                 # everything (< 8 minutes on an H200)
    python -m backends.triton.bench --quick         # correctness + M in {1, 64, 4096}
    python -m backends.triton.bench --shapes qwen3_30b_bf16 --ms 1,8,64 --json out.json

1. Correctness (on the GPU against ``reference``): quantizers bit-exact (codes and scales) against the CPU reference,
   ``moe_align_block_size`` exact, ``fused_topk`` ids/weights, and the whole experts step (``fused_experts``) against
   ``reference.experts.fused_experts`` on every benchmark shape and every claimed scheme, with the tolerances of
   ``specs/tolerances.toml``.
2. Ceilings measured in the same run: device copy bandwidth (read + write), bf16 and fp8 8192^3 matmul rates.
3. Timing (CUDA graphs of 10 calls, median over replays; decode rotates 10 routings so the experts a call touches
   are not all in L2): GEMM1 + GEMM2 (with whatever runs between them: fused activation / requantization or the
   separate kernel) and the whole experts step (input quantization, align, GEMMs, top-k sum), at M in
   {1, 8, 64, 1024, 4096}. vLLM figures are the H200 table of ``shared/facts/perf-anchors.md`` (vLLM 0.17 Triton
   ``fused_moe_kernel``, tuned H200 configs, GEMM1 + GEMM2 only): compare only on an H200.

floor = max(bytes of the experts touched / measured bandwidth, FLOPs / measured matmul peak), FLOPs =
2 M topk (K 2I + I K). A failing variant prints its error and the run goes on; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

T0 = time.time()
BUDGET_S = 450.0  # stop timing new shapes after this (the whole run must stay < 8 minutes)


@dataclass
class Shape:
    name: str
    E: int
    topk: int
    K: int
    I: int
    scheme: str
    vllm: dict = field(default_factory=dict)  # M -> us, H200 (perf-anchors.md)
    activation: str = "silu"
    bias: bool = False


SHAPES = [
    Shape("dsv3_ep8_fp8blk", 32, 8, 7168, 2048, "fp8_block128",
          {1: 94.22, 8: 294.15, 64: 365.93, 1024: 1424.56, 4096: 4993.44}),
    # DeepSeek-V3 TP8: 256 experts of I = 256 per shard; vLLM's weakest prefill row (29% of the floor at 4096)
    Shape("dsv3_tp8_fp8blk", 256, 8, 7168, 256, "fp8_block128",
          {1: 35.77, 8: 96.01, 64: 318.81, 1024: 509.44, 4096: 1150.03}),
    Shape("mixtral_tp2_bf16", 8, 2, 4096, 7168, "bf16", {1: 92.56, 8: 282.93, 64: 337.21, 1024: 816.24, 4096: 2785.32}),
    Shape("qwen3_30b_bf16", 128, 8, 2048, 768, "bf16", {1: 19.61, 8: 119.72, 64: 283.92, 1024: 364.32, 4096: 821.5}),
    Shape("qwen3_30b_fp8blk", 128, 8, 2048, 768, "fp8_block128",
          {1: 18.06, 8: 74.8, 64: 150.77, 1024: 257.75, 4096: 716.95}),
    Shape("qwen3_235b_tp4_bf16", 128, 8, 4096, 384, "bf16",
          {1: 30.27, 8: 116.35, 64: 288.58, 1024: 371.17, 4096: 886.34}),
    Shape("gpt_oss_120b_bf16", 128, 4, 2880, 2880, "bf16", {}, activation="swigluoai", bias=True),
]
# schemes checked for correctness only, on the Qwen3-30B shape
EXTRA_SCHEMES = ["fp8_tensor", "fp8_channel_token", "int8_channel_token", "fp8_block128_ue8m0", "fp16"]


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------


def make_weights(sh: Shape, scheme: str, dev, seed=0):
    """bf16 weights ~ N(0, 1/K), N(0, 1/I) (fp16 for 'fp16'), quantized per scheme like conformance does."""
    from reference.activation import MoEActivation
    from reference.config import FusedMoEQuantConfig, biased_moe_quant_config

    g = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.float16 if scheme == "fp16" else torch.bfloat16
    w1 = (torch.randn(sh.E, 2 * sh.I, sh.K, device=dev, generator=g) * sh.K ** -0.5).to(dt)
    w2 = (torch.randn(sh.E, sh.K, sh.I, device=dev, generator=g) * sh.I ** -0.5).to(dt)
    b1 = b2 = None
    if sh.bias:
        b1 = (torch.randn(sh.E, 2 * sh.I, device=dev, generator=g) * 0.1).to(dt)
        b2 = (torch.randn(sh.E, sh.K, device=dev, generator=g) * 0.1).to(dt)
    act = MoEActivation.from_str(sh.activation)
    extra = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0) if act is MoEActivation.SWIGLUOAI else {}
    if scheme in ("bf16", "fp16"):
        qc = biased_moe_quant_config(b1, b2) if b1 is not None else FusedMoEQuantConfig()
        if extra:
            qc = FusedMoEQuantConfig(a1=qc.a1, a2=qc.a2, w1=qc.w1, w2=qc.w2, **extra)
        return w1, w2, qc, act, dt
    from reference.schemes import quantize_weights

    w1q, w2q, qc = quantize_weights(scheme, w1, w2, w1_bias=b1, w2_bias=b2, **extra)
    return w1q, w2q, qc, act, dt


def make_routing(M, E, topk, dev, seed):
    from reference.routing import fused_topk

    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(M, E, device=dev, generator=g)
    return fused_topk(None, logits, topk, True)


def draw_inputs(sh: Shape, M, dev, plan, qc, dt, R, seed):
    """``R`` input sets of shape ``sh`` at ``M`` tokens (the bench, the tuner and the profiler time over several, so
    that at decode the touched experts are not all in L2): ``(xs, routes, a1s)`` with ``xs[r]`` the ``(M, K)``
    hidden states, ``routes[r] = (topk_weights, topk_ids)`` from :func:`make_routing` seeded ``seed + r``, and
    ``a1s[r] = (a1q, a1q_scale)``: ``xs[r]`` quantized per ``plan`` (``(x, None)`` unquantized)."""
    from backends.triton.experts import quantize_activation

    xs, routes, a1s = [], [], []
    for r in range(R):
        x = torch.randn(M, sh.K, device=dev, dtype=dt)
        routes.append(make_routing(M, sh.E, sh.topk, dev, seed=seed + r))
        xs.append(x)
        a1s.append((x, None) if plan.kind == "none" else quantize_activation(
            x, plan.a1_qmode, qc.a1_scale, group=plan.group_k, recipe=plan.recipe, use_ue8m0=plan.use_ue8m0))
    return xs, routes, a1s


# --------------------------------------------------------------------------------------------------------------
# correctness
# --------------------------------------------------------------------------------------------------------------


def stats(out, ref):
    """``reference.metrics.error_stats`` as the dict this script prints (``nan``: any NaN in ``out``)."""
    from reference.metrics import error_stats

    return dict(error_stats(out, ref).as_dict(), nan=bool(torch.isnan(out).any()))


def _qc_to(qc, dev):
    """A copy of a FusedMoEQuantConfig with every tensor moved to ``dev``."""
    from dataclasses import fields, replace

    def mv(v):
        return v.to(dev) if isinstance(v, torch.Tensor) else v

    descs = {f.name: replace(getattr(qc, f.name), **{g.name: mv(getattr(getattr(qc, f.name), g.name))
                                                      for g in fields(getattr(qc, f.name))})
             for f in fields(qc) if f.name in ("a1", "a2", "w1", "w2")}
    return replace(qc, **descs)


def reference_on_cpu(x, w1, w2, w, ids, qc, **kw):
    """The reference on the CPU: reference.quant divides by Python scalars (``amax / 448``), which torch's CUDA kernels
    compute as a multiplication by the reciprocal (not IEEE division), so the reference's FP8/INT8 scales are only
    bit-stable on the CPU."""
    from reference.experts import fused_experts as ref_fused_experts

    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    kw = {k: cpu(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return ref_fused_experts(cpu(x), cpu(w1), cpu(w2), cpu(w), cpu(ids), quant_config=_qc_to(qc, "cpu"), **kw)


def check_experts(sh: Shape, scheme: str, Ms, dev, results):
    from backends.triton.experts import fused_experts
    from reference.experts import fused_experts as ref_fused_experts

    from reference.schemes import scheme_tolerance_key
    from specs import experts_tolerance

    w1, w2, qc, act, dt = make_weights(sh, scheme, dev)
    tol = experts_tolerance(scheme_tolerance_key(scheme, dt))
    quantized = scheme not in ("bf16", "fp16", "fp32")
    for M in Ms:
        x = torch.randn(M, sh.K, device=dev, dtype=dt)
        w, ids = make_routing(M, sh.E, sh.topk, dev, seed=M)
        out = fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc)
        if quantized:
            ref = reference_on_cpu(x, w1, w2, w, ids, qc, activation=act).to(dev)
        else:
            ref = ref_fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc)
        s = stats(out, ref)
        ok = (not s["nan"]) and all(s[k] <= tol[k] for k in ("max_norm", "rms_norm", "calc_diff"))
        results.append(dict(kind="experts", shape=sh.name, scheme=scheme, M=M, ok=ok, **s))
        log(f"check experts {sh.name:22s} {scheme:20s} M={M:5d} {'OK ' if ok else 'FAIL'} "
            f"max_norm={s['max_norm']:.2e} rms={s['rms_norm']:.2e} calc_diff={s['calc_diff']:.1e}")
    # expert parallelism: half the experts local, routing over all of them
    if scheme == sh.scheme and sh.E >= 8:
        from reference.routing import determine_expert_map

        _, emap, _ = determine_expert_map(2, 1, sh.E)
        emap = emap.to(dev)
        loc = (emap >= 0).nonzero().flatten()
        x = torch.randn(33, sh.K, device=dev, dtype=dt)
        w, ids = make_routing(33, sh.E, sh.topk, dev, seed=7)
        sl = lambda t: None if t is None else t[loc]  # noqa: E731
        w1l, w2l = w1[loc], w2[loc]
        from dataclasses import replace

        qcl = replace(qc, w1=replace(qc.w1, scale=sl(qc.w1.scale) if qc.w1.scale is not None and qc.w1.scale.numel() > 1
                                     else qc.w1.scale, bias=sl(qc.w1.bias)),
                      w2=replace(qc.w2, scale=sl(qc.w2.scale) if qc.w2.scale is not None and qc.w2.scale.numel() > 1
                                 else qc.w2.scale, bias=sl(qc.w2.bias)))
        kw = dict(activation=act, quant_config=qcl, expert_map=emap, global_num_experts=sh.E)
        out = fused_experts(x, w1l, w2l, w, ids, **kw)
        if quantized:
            kw.pop("quant_config")
            ref = reference_on_cpu(x, w1l, w2l, w, ids, qcl, **kw).to(dev)
        else:
            ref = ref_fused_experts(x, w1l, w2l, w, ids, **kw)
        s = stats(out, ref)
        ok = (not s["nan"]) and all(s[k] <= tol[k] for k in ("max_norm", "rms_norm", "calc_diff"))
        results.append(dict(kind="experts_ep2", shape=sh.name, scheme=scheme, M=33, ok=ok, **s))
        log(f"check experts {sh.name:22s} {scheme + ' ep2r1':20s} M=   33 {'OK ' if ok else 'FAIL'} "
            f"max_norm={s['max_norm']:.2e} rms={s['rms_norm']:.2e}")
    return w1, w2, qc, act, dt


def check_ops(dev, results):
    from backends.triton import align, quant, routing
    from reference import quant as rq
    from reference.align import moe_align_block_size as ref_align
    from reference.routing import determine_expert_map
    from reference.routing import fused_topk as ref_topk

    g = torch.Generator().manual_seed(0)

    def exact(name, a, b):
        a, b = a.cpu(), b.cpu()
        if a.dtype == torch.float8_e4m3fn:
            an, bn = torch.isnan(a.float()), torch.isnan(b.float())
            ok = torch.equal(an, bn) and torch.equal(a.view(torch.uint8)[~an], b.view(torch.uint8)[~bn])
        elif a.is_floating_point():
            ok = torch.equal(torch.nan_to_num(a, 1.5e38), torch.nan_to_num(b, 1.5e38))
        else:
            ok = torch.equal(a, b)
        results.append(dict(kind="op", name=name, ok=bool(ok)))
        log(f"check op {name:60s} {'OK' if ok else 'FAIL'}")
        if not ok and a.shape == b.shape:
            av = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
            bv = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b
            bad = (av != bv) & ~(torch.isnan(a.float()) & torch.isnan(b.float()))
            idx = bad.nonzero()[:5].tolist()
            log(f"   {int(bad.sum())} mismatches of {a.numel()}; first: " + "; ".join(
                f"{tuple(i)}: ours {av[tuple(i)].item()} ({a[tuple(i)].float().item():.6g}) ref {bv[tuple(i)].item()} "
                f"({b[tuple(i)].float().item():.6g})" for i in idx))

    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(64, 7168, generator=g) * torch.logspace(-4, 3, 64)[:, None]).to(dt)
        x[0] = 0
        x[1, ::64] = 448.0 * 2.0 ** torch.randint(-8, 4, (112,), generator=g).float()
        for ue in (False, True):
            for rec in ("vllm", "deepgemm"):
                for cm in (False, True):
                    q, s = quant.per_token_group_quant_fp8(x.to(dev), 128, use_ue8m0=ue, recipe=rec,
                                                           column_major_scales=cm)
                    rq_, rs_ = rq.per_token_group_quant_fp8(x, 128, use_ue8m0=ue, recipe=rec, column_major_scales=cm)
                    exact(f"per_token_group_quant_fp8 {dt} ue8m0={ue} {rec} colmajor={cm}", q, rq_)
                    exact(f"per_token_group_quant_fp8 scales {dt} ue8m0={ue} {rec} colmajor={cm}", s.contiguous(),
                          rs_.contiguous())
        for mode in ("tensor", "token", "static"):
            args = (torch.tensor([0.0125]),) if mode == "static" else ()
            q, s = quant.scaled_fp8_quant(x.to(dev), *(a.to(dev) for a in args),
                                          use_per_token_if_dynamic=mode == "token")
            rq_, rs_ = rq.scaled_fp8_quant(x, *args, use_per_token_if_dynamic=mode == "token")
            exact(f"scaled_fp8_quant {mode} {dt}", q, rq_)
            exact(f"scaled_fp8_quant scales {mode} {dt}", s, rs_)
        q, s = quant.int8_quant_per_token(x.to(dev))
        rq_, rs_ = rq.int8_quant_per_token(x)
        exact(f"int8_quant_per_token {dt}", q, rq_)
        exact(f"int8_quant_per_token scales {dt}", s, rs_)
    # fp32 scales a few ULPs above powers of two (vLLM's exp2(ceil(log2)) keeps them one binade low)
    bits = torch.tensor([((127 + k) << 23) + m for k in range(-30, 8) for m in range(64)], dtype=torch.int32)
    amax = bits.view(torch.float32) * 448
    x = torch.randn(len(amax), 128, generator=g) * amax[:, None] / 8
    x[:, 0] = amax
    q, s = quant.per_token_group_quant_fp8(x.to(dev), 128, use_ue8m0=True)
    rq_, rs_ = rq.per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    exact("per_token_group_quant_fp8 ue8m0 fp32 near powers of two", s, rs_)
    for M, topk, E, bs, ep in ((4096, 8, 128, 64, None), (7, 8, 256, 16, 8), (1, 8, 32, 16, None),
                               (16384, 8, 256, 128, 32)):
        ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
        emap = determine_expert_map(ep, ep - 1, E)[1] if ep else None
        out = align.moe_align_block_size(ids.to(dev), bs, E, None if emap is None else emap.to(dev))
        ref = ref_align(ids, bs, E, emap)
        for i, n in enumerate(("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
            exact(f"moe_align_block_size M={M} E={E} bs={bs} ep={ep} {n}", out[i], ref[i])
    for M, E, k, sf in ((1024, 128, 8, "softmax"), (33, 256, 8, "sigmoid"), (7, 8, 2, "softmax")):
        logits = torch.randn(M, E, generator=g)
        w, ids = routing.fused_topk(None, logits.to(dev), k, True, scoring_func=sf)
        rw, rids = ref_topk(None, logits, k, True, scoring_func=sf)
        ok = torch.equal(ids.cpu(), rids) and torch.allclose(w.cpu(), rw, atol=1e-5, rtol=1e-5)
        results.append(dict(kind="op", name=f"fused_topk {sf} M={M} E={E}", ok=bool(ok)))
        log(f"check op fused_topk {sf} M={M} E={E} {'OK' if ok else 'FAIL'}")


# --------------------------------------------------------------------------------------------------------------
# ceilings and timing
# --------------------------------------------------------------------------------------------------------------


def _events_ms(fn, reps):
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def measure_ceilings(dev):
    n = 1 << 28  # 1 GiB of fp32
    a = torch.empty(n, dtype=torch.float32, device=dev).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = _events_ms(lambda: b.copy_(a), 20)
    bw = 2 * n * 4 / (ms * 1e-3)
    del a, b
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(x, y)
    ms = _events_ms(lambda: torch.mm(x, y), 20)
    bf16 = 2 * 8192 ** 3 / (ms * 1e-3)
    fp8 = float("nan")
    try:
        xf, yf = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device=dev)
        f = lambda: torch._scaled_mm(xf, yf.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        for _ in range(3):
            f()
        ms = _events_ms(f, 20)
        fp8 = 2 * 8192 ** 3 / (ms * 1e-3)
    except Exception as exc:  # noqa: BLE001
        log(f"fp8 matmul ceiling not measured: {exc}")
    return bw, bf16, fp8


def capture_graph(make_call, n_calls=10):
    """``n_calls`` calls (``make_call(i)`` runs call i) captured in one CUDA graph, after one eager warm-up pass
    (compilation happens outside the capture); replayed once before it is returned."""
    for i in range(n_calls):
        make_call(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            make_call(i)
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graph(make_call, n_calls=10, budget_s=0.4, graph=None):
    """Median time per call (us) of ``n_calls`` calls captured in one CUDA graph (``graph``: one already captured by
    :func:`capture_graph` with the same ``n_calls``)."""
    g = graph if graph is not None else capture_graph(make_call, n_calls)
    t = time.time()
    g.replay()
    torch.cuda.synchronize()
    one = max(time.time() - t, 1e-6)
    reps = int(min(50, max(5, budget_s / one)))
    ms = _events_ms(g.replay, reps)
    return ms * 1e3 / n_calls


def bench_shape(sh: Shape, Ms, dev, w1, w2, qc, act, dt, ceil, rows):
    from backends.triton import configs as C
    from backends.triton.experts import fused_experts, plan_quant, route_layout, run_experts

    bw, pk_bf16, pk_fp8 = ceil
    plan = plan_quant(qc)
    peak = pk_fp8 if plan.kind == "fp8" else pk_bf16
    wbytes = (w1[0].numel() * w1.element_size() + w2[0].numel() * w2.element_size())
    if qc.w1.scale is not None and qc.w1.scale.numel() > 1:
        wbytes += (qc.w1.scale[0].numel() + qc.w2.scale[0].numel()) * 4
    tuned = C.load_table(sh.E, sh.I, plan.cfg_dtype, plan.block_shape, C.device_name()) is not None
    for M in Ms:
        if time.time() - T0 > BUDGET_S:
            log(f"time budget reached: skipping {sh.name} M={M}")
            continue
        try:
            R = 10 if M <= 64 else 4  # prefill: 4 routings, so the figure does not hang on one draw's padding
            cfg = C.get_config(M, sh.E, sh.I, sh.K, sh.topk, plan.cfg_dtype, plan.block_shape)
            xs, routes, a1s = draw_inputs(sh, M, dev, plan, qc, dt, R, seed=1000 * M)
            lays = [route_layout(ids, cfg, sh.E) for _, ids in routes]
            touched = sum(ids.unique().numel() for _, ids in routes) / R
            outs = [torch.empty(M, sh.K, device=dev, dtype=dt) for _ in range(R)]

            def gemms(i):
                r = i % R
                run_experts(out=outs[r], a1q=a1s[r][0], a1q_scale=a1s[r][1], w1=w1, w2=w2, topk_weights=routes[r][0],
                            topk_ids=routes[r][1], activation=act, expert_map=None, num_ids=sh.E, qc=qc, plan=plan,
                            cfg=cfg, layout=lays[r], stages="gemms")

            def whole(i):
                r = i % R
                fused_experts(xs[r], w1, w2, routes[r][0], routes[r][1], activation=act, quant_config=qc)

            t_g = time_graph(gemms)
            t_w = time_graph(whole)
            flops = 2 * M * sh.topk * (sh.K * 2 * sh.I + sh.I * sh.K)
            floor = max(touched * wbytes / bw, flops / peak) * 1e6
            v = sh.vllm.get(M)
            rows.append(dict(shape=sh.name, scheme=sh.scheme, E=sh.E, topk=sh.topk, K=sh.K, I=sh.I, M=M, ours_us=t_g,
                             whole_us=t_w, vllm_h200_us=v, speedup=(v / t_g) if v else None, floor_us=floor,
                             pct_floor=100 * floor / t_g, tuned=tuned, config=cfg))
            log(f"time {sh.name:22s} M={M:5d} g1+g2 {t_g:9.2f} us  whole {t_w:9.2f} us  floor {floor:8.2f} us "
                f"({100 * floor / t_g:5.1f}%)" + (f"  vLLM {v:8.2f} us  x{v / t_g:.2f}" if v else ""))
            del xs, routes, lays, a1s, outs
        except Exception as exc:  # noqa: BLE001
            log(f"FAILED timing {sh.name} M={M}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        torch.cuda.empty_cache()


def print_table(rows, ceil, dev_name):
    bw, bf16, fp8 = ceil
    print()
    print(f"# triton backend on {dev_name}: ceilings {bw / 1e12:.2f} TB/s, bf16 {bf16 / 1e12:.0f} TFLOP/s, "
          f"fp8 {fp8 / 1e12:.0f} TFLOP/s. vLLM = H200 figures (perf-anchors.md): compare only on an H200.")
    print("| shape | M | ours g1+g2 us | vLLM H200 us | speedup | whole step us | floor us | % of floor | tuned |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        v = f"{r['vllm_h200_us']:.2f}" if r["vllm_h200_us"] else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"| {r['shape']} ({r['E']},{r['topk']},{r['K']},{r['I']}) | {r['M']} | {r['ours_us']:.2f} | {v} | {sp} "
              f"| {r['whole_us']:.2f} | {r['floor_us']:.2f} | {r['pct_floor']:.0f}% | {'y' if r['tuned'] else 'n'} |")
    pre = [r["speedup"] for r in rows if r["speedup"] and r["M"] >= 1024]
    dec = [r["pct_floor"] for r in rows if 8 <= r["M"] <= 64]
    if pre:
        print(f"prefill (M >= 1024) geometric-mean speedup vs vLLM H200: "
              f"{math.exp(sum(map(math.log, pre)) / len(pre)):.3f}x over {len(pre)} points (bar: 1.25x)")
    if dec:
        print(f"decode (M 8..64) % of floor: min {min(dec):.0f}%, mean {sum(dec) / len(dec):.0f}% (bar: 85%)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--ms", default="1,8,64,1024,4096", help="token counts to time")
    ap.add_argument("--quick", action="store_true", help="M in {1, 64, 4096}, fewer checks")
    ap.add_argument("--no-check", action="store_true", help="skip correctness checks")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "triton_bench.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark needs one (use tests/test_triton_interpret.py on CPU)")
        return 2
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    dev = torch.device("cuda")
    dev_name = torch.cuda.get_device_name()
    log(f"device {dev_name}, torch {torch.__version__}")
    import triton

    log(f"triton {triton.__version__}")
    Ms = [1, 64, 4096] if args.quick else [int(m) for m in args.ms.split(",")]
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
    results, rows = [], []
    if not args.no_check:
        try:
            check_ops(dev, results)
        except Exception as exc:  # noqa: BLE001
            log(f"FAILED op checks: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    a = torch.rand(1 << 20, device=dev) * 100
    frac = ((a / 448.0).cpu() != (a.cpu() / 448.0)).float().mean().item()
    log(f"note: torch CUDA tensor/scalar division differs from CPU (IEEE) division in {100 * frac:.1f}% of fp32 "
        "values, so the reference's FP8/INT8 scales are computed on the CPU here")
    ceil = measure_ceilings(dev)
    log(f"ceilings: {ceil[0] / 1e12:.2f} TB/s, bf16 {ceil[1] / 1e12:.0f} TFLOP/s, fp8 {ceil[2] / 1e12:.0f} TFLOP/s")
    for sh in shapes:
        try:
            if args.no_check:
                w1, w2, qc, act, dt = make_weights(sh, sh.scheme, dev)
            else:
                Mc = [1, 64] if args.quick else ([1, 64, 1024] if sh.scheme == "bf16" or sh.E > 32 else [1, 64, 256])
                w1, w2, qc, act, dt = check_experts(sh, sh.scheme, Mc, dev, results)
            bench_shape(sh, Ms, dev, w1, w2, qc, act, dt, ceil, rows)
            del w1, w2, qc
        except Exception as exc:  # noqa: BLE001
            log(f"FAILED shape {sh.name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        torch.cuda.empty_cache()
    if not args.no_check and (not args.shapes or "qwen3_30b_bf16" in args.shapes):
        base = next(s for s in SHAPES if s.name == "qwen3_30b_bf16")
        for scheme in EXTRA_SCHEMES:
            try:
                check_experts(base, scheme, [4, 64], dev, results)
            except Exception as exc:  # noqa: BLE001
                log(f"FAILED check {scheme}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            torch.cuda.empty_cache()
    fails = [r for r in results if not r["ok"]]
    try:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev_name, ceilings=ceil, checks=results, timings=rows), f, indent=1, default=str)
    except OSError as exc:
        log(f"could not write {args.json}: {exc}")
    print()
    print(f"correctness: {len(results) - len(fails)}/{len(results)} checks passed"
          + ("" if not fails else "; FAILED: " + ", ".join(
              f"{r.get('shape', r.get('name'))}/{r.get('scheme', '')}/M{r.get('M', '')}" for r in fails)))
    print_table(rows, ceil, dev_name)
    log("done")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
