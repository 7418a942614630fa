"""One GPU script for the ``cuda`` backend: build, check, time. Runs in a few minutes on an H100/H200 and survives a
failing variant (every check and timing is guarded; failures are listed at the end).

    python -m backends.cuda.bench [--out DIR] [--skip-timing]

1. Builds the router GEMM extension (JIT, cached) and reads the device.
2. Checks every gate tier at M = 1, 16, 17, 32, 33 on DeepSeek-V3 (7168x256 bf16), Kimi-K2 (7168x384 bf16) and
   MiniMax-M2 (3072x256 fp32 weight, bf16 and fp32 x) against ``reference.gate.gate_reference`` for the tier
   ``select_gate_tier`` picks on this device, with the fp32-accumulation bound |out - ref| <= H * 2^-24 * (|x| @ |w|^T)
   (bf16 outputs: one bf16 rounding more); then every kernel variant at every M bucket, bitwise determinism, and
   that no output element is left unwritten (the allocator is pre-filled with NaN).
3. Checks the CUTLASS experts (bf16; FP8 per-token x per-channel, static and dynamic per-tensor) against
   ``reference.experts.fused_experts`` on real shapes (Qwen3-30B-A3B EP8, Mixtral-8x7B TP2, DeepSeek-V3 EP32 with
   chunking), through ``FusedMoEKernel`` + ``MoEPrepareAndFinalizeNoEP`` with NaN-poisoned buffers, with the
   tolerances of ``specs/tolerances.toml``.
4. Times the router kernels (each variant) vs cuBLAS (tier 3) vs ``F.linear`` at M in {1, 4, 8, 16, 32}: CUDA graphs
   of 64 calls rotating over weight copies larger than L2 together (weights come from HBM, as in a model), median
   of the replays; the floor is weight bytes / measured device-to-device copy bandwidth. Then the grouped experts
   (bf16 and FP8) at a few shapes: whole ``apply`` and the two grouped GEMMs alone.
5. Prints a short table last; full results go to ``$OUT/cuda_bench.json`` (or ``--out``).
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

import torch
import torch.nn.functional as F

FAILURES: list[str] = []
RESULTS: dict = {"checks": [], "router_timings": [], "experts_timings": [], "env": {}}
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
_SHORT = {BF16: "bf16", FP32: "fp32"}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def guarded(label: str, fn, *args, **kwargs):
    """Run ``fn``; on an exception record the failure (with the last traceback line) and return None."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a bench must survive any failing variant
        tb = traceback.format_exc().strip().splitlines()
        where = next((ln.strip() for ln in reversed(tb) if ln.strip().startswith("File")), "")
        msg = f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} [{where}]"
        FAILURES.append(msg)
        log(f"  FAIL {msg}")
        return None


def check(label: str, ok: bool, detail: str = "") -> bool:
    RESULTS["checks"].append({"label": label, "ok": bool(ok), "detail": detail})
    if not ok:
        FAILURES.append(f"{label}: {detail}")
    log(f"  {'ok  ' if ok else 'FAIL'} {label} {detail}")
    return ok


def poison_allocator(nbytes: int) -> None:
    """Leave NaN-filled blocks in the caching allocator so that a kernel's torch.empty output starts as NaN."""
    blocks = [torch.full((max(nbytes // 4, 1),), float("nan"), device="cuda") for _ in range(4)]
    del blocks


# --------------------------------------------------------------------------------------------------------------
# environment, build, bandwidth
# --------------------------------------------------------------------------------------------------------------


def env_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    info = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "sms": p.multi_processor_count,
        "l2_bytes": getattr(p, "L2_cache_size", 50 << 20),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    RESULTS["env"].update(info)
    log(f"device {info['device']} sm_{info['capability'][0]}{info['capability'][1]}, {info['sms']} SMs, "
        f"L2 {info['l2_bytes'] / 2**20:.0f} MiB; torch {info['torch']} CUDA {info['cuda']}")
    return info


def build_ext():
    from backends.cuda import build

    t0 = time.time()
    ext = build.load_router_gemm_ext(verbose=False)
    dt = time.time() - t0
    RESULTS["env"]["build_s"] = dt
    log(f"router GEMM extension {build.extension_name()} ready in {dt:.1f} s ({build.build_directory()})")
    log(f"  dsv3 variants: {list(ext.dsv3_variants())}; auto (M=1,4,8,16): "
        f"{[ext.dsv3_auto_variant(m, 256) for m in (1, 4, 8, 16)]}")
    log(f"  fp32 variants: {list(ext.fp32_variants())}; auto (M=1,4,8,16,32): "
        f"{[ext.fp32_auto_variant(m) for m in (1, 4, 8, 16, 32)]}")
    return ext


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = 256 << 20  # 1 GiB of fp32
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    bw = 2 * a.numel() * 4 / statistics.median(times)
    RESULTS["env"]["copy_bw_Bps"] = bw
    log(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)")
    del a, b
    torch.cuda.empty_cache()
    return bw


# --------------------------------------------------------------------------------------------------------------
# gate checks
# --------------------------------------------------------------------------------------------------------------

GATE_SHAPES = (  # (label, H, E, weight dtype, x dtypes)
    ("DeepSeek-V3", 7168, 256, BF16, (BF16,)),
    ("Kimi-K2", 7168, 384, BF16, (BF16,)),
    ("MiniMax-M2", 3072, 256, FP32, (BF16, FP32)),
)


def _gate_inputs(M, H, E, xdt, wdt, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, H, device="cuda", generator=g).to(xdt)
    w = (torch.randn(E, H, device="cuda", generator=g) * H**-0.5).to(wdt)
    return x, w


def _fp32_acc_check(label, out, x, w, ref, H, out_dtype):
    """|out - ref| <= H * 2^-24 * (|x| @ |w|^T) (+ one rounding of out_dtype); reports the observed ratio."""
    absdot = x.double().abs() @ w.double().abs().T
    unit = 2.0**-24 * absdot
    err = (out.double() - ref.double()).abs()
    bound = H * unit
    if out_dtype == BF16:
        bound = bound + 2.0**-7 * ref.double().abs()  # the two bf16 roundings may land one ulp apart
    nonfinite = int((~torch.isfinite(out)).sum())
    ratio = float((err / unit.clamp_min(1e-30)).max()) if out.numel() else 0.0
    ok = nonfinite == 0 and bool((err <= bound).all()) and out.dtype == ref.dtype and out.shape == ref.shape
    return check(label, ok, f"max err / (2^-24 sum|xw|) = {ratio:.1f} (bound {H}); nonfinite {nonfinite}")


def gate_checks():
    from backends.cuda import gate
    from reference import gate as rg

    platform = gate.current_platform()
    log(f"gate platform: {platform}")
    seed = 0
    for label, H, E, wdt, xdts in GATE_SHAPES:
        for xdt in xdts:
            for M in (1, 16, 17, 32, 33):
                seed += 1
                x, w = _gate_inputs(M, H, E, xdt, wdt, seed)
                for out_dtype in ((FP32, BF16) if wdt == BF16 else (FP32,)):
                    tier = gate.tier_for(M, H, E, x_dtype=xdt, weight_dtype=wdt, out_dtype=out_dtype,
                                         platform=platform)
                    name = f"gate {label} x{str(xdt)[6:]} M={M} out={str(out_dtype)[6:]} tier={tier.name}"

                    def run():
                        poison_allocator(M * E * 4)
                        out = gate.gate_linear(x, w, tier=tier, out_dtype=out_dtype)
                        ref = rg.gate_reference(x, w, tier=tier, out_dtype=out_dtype)
                        eff = ref.dtype
                        _fp32_acc_check(name, out, x, w, ref, H, eff)

                    guarded(name, run)
    # contracts on the device
    x, w = _gate_inputs(17, 7168, 256, BF16, BF16, 99)
    try:
        gate.dsv3_router_gemm(x, w, FP32)
        check("dsv3 rejects M=17", False, "no error")
    except rg.GateContractError as exc:
        check("dsv3 rejects M=17", "1 <= M <= 16" in str(exc), str(exc)[:80])
    x, w = _gate_inputs(0, 3072, 256, BF16, FP32, 98)
    out = guarded("fp32 M=0", gate.fp32_router_gemm, x, w)
    if out is not None:
        check("fp32_router_gemm M=0 -> (0, 256)", tuple(out.shape) == (0, 256))


def variant_checks(ext):
    """Every variant x M bucket boundary, against the fp64 dot product; determinism; no unwritten element."""
    from backends.cuda import gate

    seed = 1000
    for E in (256, 384):
        for v, vname in enumerate(ext.dsv3_variants()):
            for M in (1, 2, 3, 4, 5, 8, 9, 16):
                seed += 1
                x, w = _gate_inputs(M, 7168, E, BF16, BF16, seed)
                name = f"dsv3[{vname}] E={E} M={M}"

                def run():
                    ref = (x.double() @ w.double().T).float()
                    poison_allocator(M * E * 4)
                    out = gate.dsv3_router_gemm(x, w, FP32, variant=v)
                    again = gate.dsv3_router_gemm(x, w, FP32, variant=v)
                    ok = _fp32_acc_check(name, out, x, w, ref, 7168, FP32)
                    if ok:
                        check(name + " deterministic", torch.equal(out, again))
                    poison_allocator(M * E * 4)
                    ob = gate.dsv3_router_gemm(x, w, BF16, variant=v)
                    check(name + " bf16 out == rne(fp32 out)", torch.equal(ob, out.to(BF16)) or
                          bool(((ob.float() - ref).abs() <= 2.0**-7 * ref.abs() + 1e-6).all()))

                guarded(name, run)
    for xdt in (BF16, FP32):
        for v, vname in enumerate(ext.fp32_variants()):
            for M in (1, 2, 3, 5, 8, 13, 16, 17, 31, 32):
                seed += 1
                x, w = _gate_inputs(M, 3072, 256, xdt, FP32, seed)
                name = f"fp32[{vname}] x{str(xdt)[6:]} M={M}"

                def run():
                    ref = (x.double() @ w.double().T).float()
                    poison_allocator(M * 256 * 4)
                    out = gate.fp32_router_gemm(x, w, variant=v)
                    again = gate.fp32_router_gemm(x, w, variant=v)
                    if _fp32_acc_check(name, out, x, w, ref, 3072, FP32):
                        check(name + " deterministic", torch.equal(out, again))

                guarded(name, run)


# --------------------------------------------------------------------------------------------------------------
# experts checks
# --------------------------------------------------------------------------------------------------------------

EXPERT_CASES = (  # label, E global, E local, topk, K, I, M, schemes, chunk, apply_on_input
    ("Qwen3-30B-A3B EP8", 128, 16, 8, 2048, 768, 64, ("bf16", "fp8-token-channel", "fp8-tensor-static",
                                                      "fp8-tensor-dynamic"), None, False),
    ("Mixtral-8x7B TP2", 8, 8, 2, 4096, 7168, 16, ("bf16", "fp8-tensor-static"), None, False),
    ("DeepSeek-V3 EP32 chunk48", 256, 8, 8, 7168, 2048, 128, ("bf16", "fp8-token-channel"), 48, False),
    ("Llama-4-like top1 on-input", 16, 16, 1, 1024, 512, 33, ("bf16",), None, True),
)


def _fp8_weights(w, per_channel):
    amax = w.float().abs().amax(dim=-1, keepdim=True) if per_channel else w.float().abs().amax(dim=(1, 2))
    s = (amax / 448.0).clamp_min(1e-12)
    q = (w.float() / (s if per_channel else s[:, None, None])).clamp(-448, 448).to(FP8)
    return q, s


def _experts_inputs(E, E_local, topk, K, I, M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(BF16)
    w1 = (torch.randn(E_local, 2 * I, K, device="cuda", generator=g) * K**-0.5).to(BF16)
    w2 = (torch.randn(E_local, K, I, device="cuda", generator=g) * I**-0.5).to(BF16)
    logits = torch.randn(M, E, device="cuda", generator=g)
    logits[:, :E_local] += 1.0  # every token reaches some local experts
    weights, ids = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    emap = None
    if E_local < E:
        emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
        emap[:E_local] = torch.arange(E_local, dtype=torch.int32, device="cuda")
    return x, w1, w2, weights.float(), ids.to(torch.int32), emap


def _qc_for(scheme, w1, w2):
    from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config

    if scheme == "bf16":
        return FUSED_MOE_UNQUANTIZED_CONFIG, w1, w2
    per_channel = scheme.endswith("channel")
    w1q, s1 = _fp8_weights(w1, per_channel)
    w2q, s2 = _fp8_weights(w2, per_channel)
    a1s = a2s = None
    if scheme == "fp8-tensor-static":
        a1s = torch.tensor(4.5 / 448, device="cuda")
        a2s = torch.tensor(8.0 / 448, device="cuda")
    qc = fp8_w8a8_moe_quant_config(s1, s2, a1s, a2s, per_act_token_quant=scheme == "fp8-token-channel",
                                   per_out_ch_quant=per_channel)
    return qc, w1q, w2q


def experts_checks():
    from backends.cuda import experts as ce
    from reference.activation import MoEActivation
    from reference.config import FusedMoEConfig
    from reference.experts import fused_experts
    from reference.metrics import error_stats
    from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP
    from specs import load_tolerances

    tols = load_tolerances()["experts"]
    STD = FusedMoEActivationFormat.Standard
    seed = 5000
    for label, E, E_local, topk, K, I, M, schemes, chunk, on_input in EXPERT_CASES:
        seed += 1
        x, w1, w2, weights, ids, emap = _experts_inputs(E, E_local, topk, K, I, M, seed)
        cfg = FusedMoEConfig(num_experts=E, experts_per_token=topk, hidden_dim=K, intermediate_size_per_partition=I,
                             num_local_experts=E_local, activation=MoEActivation.SILU, in_dtype=BF16)
        for scheme in schemes:
            name = f"experts {label} M={M} {scheme}"

            def run():
                qc, w1q, w2q = _qc_for(scheme, w1, w2)
                cls = ce.CutlassExpertsBf16 if scheme == "bf16" else ce.CutlassExpertsFp8
                claimed, why = cls.is_supported_config(cls, cfg, qc.weight_key, qc.activation_key, STD)
                check(name + " claimed", claimed, why or "")
                # dynamic per-tensor a2: one scale per call (vLLM, reference): run unchunked
                kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(cfg, qc),
                                        chunk_size=None if scheme == "fp8-tensor-dynamic" else chunk,
                                        poison=float("nan"))
                kw = dict(activation=MoEActivation.SILU, global_num_experts=E, expert_map=emap,
                          apply_router_weight_on_input=on_input)
                out = kernel.apply(x, w1q, w2q, weights, ids, **kw)
                again = kernel.apply(x, w1q, w2q, weights, ids, **kw)
                ref = fused_experts(x, w1q, w2q, weights, ids, quant_config=qc, **kw)
                tol = tols["bfloat16" if scheme == "bf16" else "fp8"]
                s = error_stats(out, ref)
                ok = (s.nonfinite == 0 and s.max_norm <= tol["max_norm"] and s.rms_norm <= tol["rms_norm"]
                      and s.calc_diff <= tol["calc_diff"])
                check(name, ok, f"max_norm {s.max_norm:.2e} rms_norm {s.rms_norm:.2e} calc_diff {s.calc_diff:.1e}")
                check(name + " deterministic", torch.equal(out, again))

            guarded(name, run)
        del x, w1, w2
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------


def time_eager(calls, reps: int = 10) -> float:
    """Median microseconds per call of ``calls`` run eagerly between two events (fallback when capture fails)."""
    for c in calls[: min(3, len(calls))]:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for c in calls:
            c()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / len(calls))
    return statistics.median(times)


def time_graph(calls, reps: int = 20) -> float:
    """Median microseconds per call of ``calls`` (zero-argument callables) captured in one CUDA graph; if capture
    fails, eager timing (recorded as a failure so that it is visible)."""
    try:
        return _time_graph(calls, reps)
    except Exception as exc:  # noqa: BLE001
        FAILURES.append(f"CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:120]}); timed eagerly")
        torch.cuda.synchronize()
        return time_eager(calls)


def _time_graph(calls, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[: min(3, len(calls))]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / len(calls))
    del g
    return statistics.median(times)


def router_timings(ext, bw: float, l2: int):
    from backends.cuda import gate

    n_calls = 64
    tiny = torch.empty(256, device="cuda")
    launch = guarded("time launch floor", time_graph, [lambda: tiny.zero_()] * n_calls)
    RESULTS["env"]["launch_floor_us"] = launch
    log(f"  launch floor (one trivial kernel per call in the same graph setup): {launch or float('nan'):.2f} us")
    for label, H, E, wdt, _ in GATE_SHAPES:
        wbytes = H * E * torch.finfo(wdt).bits // 8
        n_copies = max(2, math.ceil(2 * l2 / wbytes) + 1)
        ws = [(torch.randn(E, H, device="cuda") * H**-0.5).to(wdt) for _ in range(n_copies)]
        floor_us = wbytes / bw * 1e6
        variants = list(ext.dsv3_variants() if wdt == BF16 else ext.fp32_variants())
        for M in (1, 4, 8, 16, 32):
            xs = [torch.randn(M, H, device="cuda").to(BF16) for _ in range(n_copies)]
            row = {"shape": f"{label} {H}x{E} {_SHORT[wdt]}", "M": M, "floor_us": floor_us,
                   "variant_names": variants, "variants": [None] * len(variants)}
            pairs = [(xs[i % n_copies], ws[i % n_copies]) for i in range(n_calls)]
            for v, vname in enumerate(variants):
                if wdt == BF16 and M > 16:
                    continue
                if wdt == BF16:
                    calls = [lambda x=x, w=w, v=v: gate.dsv3_router_gemm(x, w, FP32, variant=v) for x, w in pairs]
                else:
                    calls = [lambda x=x, w=w, v=v: gate.fp32_router_gemm(x, w, variant=v) for x, w in pairs]
                t = guarded(f"time {row['shape']} M={M} {vname}", time_graph, calls)
                row["variants"][v] = t
            if wdt == BF16 and M <= 16:
                calls = [lambda x=x, w=w: gate.dsv3_router_gemm(x, w, FP32) for x, w in pairs]
                row["auto_us"] = guarded(f"time auto {row['shape']} M={M}", time_graph, calls)
            elif wdt == FP32:
                calls = [lambda x=x, w=w: gate.fp32_router_gemm(x, w) for x, w in pairs]
                row["auto_us"] = guarded(f"time auto {row['shape']} M={M}", time_graph, calls)
            if wdt == BF16:
                calls = [lambda x=x, w=w: gate.router_gemm_cublas(x, w) for x, w in pairs]
                row["cublas_us"] = guarded(f"time cuBLAS {label} M={M}", time_graph, calls)
                calls = [lambda x=x, w=w: F.linear(x, w) for x, w in pairs]
                row["flinear_us"] = guarded(f"time F.linear {label} M={M}", time_graph, calls)
            else:
                calls = [lambda x=x, w=w: F.linear(x.float(), w) for x, w in pairs]
                row["flinear_us"] = guarded(f"time F.linear(fp32) {label} M={M}", time_graph, calls)
            RESULTS["router_timings"].append(row)
            vs = ", ".join(f"{k}: {t:.2f}" if t else f"{k}: -" for k, t in zip(variants, row["variants"]))
            log(f"  {row['shape']} M={M}: floor {floor_us:.2f} us | {vs} | cuBLAS "
                f"{row.get('cublas_us') or float('nan'):.2f} | F.linear {row.get('flinear_us') or float('nan'):.2f}")
        del ws
        torch.cuda.empty_cache()


EXPERT_TIMINGS = (  # label, E, topk, K, I, Ms
    ("Qwen3-30B-A3B", 128, 8, 2048, 768, (1, 64, 1024)),
    ("DeepSeek-V3 EP8-local", 32, 8, 7168, 2048, (8, 64, 1024)),
)


def experts_timings(bw: float):
    from backends.cuda import experts as ce
    from reference.activation import MoEActivation
    from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, fp8_w8a8_moe_quant_config

    act = MoEActivation.SILU
    for label, E, topk, K, I, Ms in EXPERT_TIMINGS:
        g = torch.Generator(device="cuda").manual_seed(7)
        w1 = (torch.randn(E, 2 * I, K, device="cuda", generator=g) * K**-0.5).to(BF16)
        w2 = (torch.randn(E, K, I, device="cuda", generator=g) * I**-0.5).to(BF16)
        w1q, s1 = _fp8_weights(w1, True)
        w2q, s2 = _fp8_weights(w2, True)
        cfg = FusedMoEConfig(num_experts=E, experts_per_token=topk, hidden_dim=K, intermediate_size_per_partition=I,
                             num_local_experts=E, activation=act, in_dtype=BF16)
        qc8 = fp8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=True, per_out_ch_quant=True)
        for M in Ms:
            x = torch.randn(M, K, device="cuda", generator=g).to(BF16)
            logits = torch.randn(M, E, device="cuda", generator=g)
            weights, ids = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
            ids = ids.to(torch.int32)
            touched = int(torch.unique(ids).numel())
            row = {"shape": f"{label} (E={E}, topk={topk}, K={K}, I={I})", "M": M, "experts_touched": touched}
            flops = 2 * M * topk * (K * 2 * I + I * K)
            reps_in_graph = 2 if M >= 1024 else 8
            for dtype, cls, qc, a, b in (("bf16", ce.CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, w1, w2),
                                         ("fp8", ce.CutlassExpertsFp8, qc8, w1q, w2q)):
                ex = cls(cfg, qc)
                out = torch.empty(M, K, dtype=BF16, device="cuda")
                if dtype == "fp8":
                    xin, xs = ce.quant_fp8_per_token(x)
                    xs = xs.unsqueeze(-1)
                else:
                    xin, xs = x, None

                def apply_once(ex=ex, xin=xin, xs=xs, a=a, b=b, out=out):
                    ex.apply(out, xin, a, b, weights, ids, act, E, None, xs, None, None, None, None, False)

                t_apply = guarded(f"time experts {label} M={M} {dtype}", time_graph, [apply_once] * reps_in_graph)
                # the two grouped GEMMs alone, on pre-permuted operands
                plan = ce.route_plan(ids, E, None)
                if dtype == "bf16":
                    aa = x.index_select(0, plan.token)
                    hh = ce.grouped_mm_bf16(aa, a, plan.offs)
                    gg = ce.cuda_moe_activation(act, hh).contiguous()

                    def gemms(aa=aa, gg=gg, a=a, b=b, offs=plan.offs):
                        ce.grouped_mm_bf16(aa, a, offs)
                        ce.grouped_mm_bf16(gg, b, offs)
                else:
                    aa = xin.view(torch.uint8).index_select(0, plan.token).view(FP8)
                    sa = xs.reshape(-1).index_select(0, plan.token).contiguous()
                    sb1 = s1.reshape(E, 2 * I).contiguous()
                    sb2 = s2.reshape(E, K).contiguous()
                    hh = ce.scaled_grouped_mm_fp8(aa, a, sa, sb1, plan.offs)
                    gg, sg = ce.quant_fp8_per_token(ce.cuda_moe_activation(act, hh))

                    def gemms(aa=aa, gg=gg, sa=sa, sg=sg, sb1=sb1, sb2=sb2, a=a, b=b, offs=plan.offs):
                        ce.scaled_grouped_mm_fp8(aa, a, sa, sb1, offs)
                        ce.scaled_grouped_mm_fp8(gg, b, sg, sb2, offs)

                t_gemm = guarded(f"time grouped GEMMs {label} M={M} {dtype}", time_graph, [gemms] * reps_in_graph)
                wbytes = touched * (2 * I * K + K * I) * (2 if dtype == "bf16" else 1)
                row[dtype] = {"apply_us": t_apply, "gemms_us": t_gemm, "floor_us": wbytes / bw * 1e6,
                              "tflops_apply": flops / (t_apply * 1e-6) / 1e12 if t_apply else None}
                log(f"  {row['shape']} M={M} {dtype}: apply {t_apply or float('nan'):.1f} us, gemms "
                    f"{t_gemm or float('nan'):.1f} us, weight floor {wbytes / bw * 1e6:.1f} us "
                    f"({touched} experts touched)")
            RESULTS["experts_timings"].append(row)
        del w1, w2, w1q, w2q
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------


def _f(v, nd=2):
    return "-" if v is None else f"{v:.{nd}f}"


def print_tables():
    n_ok = sum(c["ok"] for c in RESULTS["checks"])
    log("\n" + "=" * 100)
    env = RESULTS["env"]
    log(f"cuda backend bench on {env.get('device')} (torch {env.get('torch')}), copy BW "
        f"{env.get('copy_bw_Bps', 0) / 1e12:.2f} TB/s, build {_f(env.get('build_s'), 1)} s")
    if RESULTS["router_timings"]:
        log("\nrouter GEMM, us per call (CUDA graph of 64 calls, weights rotated through > 2x L2; floor = weight "
            f"bytes / copy BW; a trivial kernel takes {_f(env.get('launch_floor_us'))} us here)")
        nv = max(len(r["variants"]) for r in RESULTS["router_timings"])
        hdr = f"{'shape':<28}{'M':>4}{'floor':>7}" + "".join(f"{'v' + str(i):>7}" for i in range(nv)) + \
            f"{'auto':>7}{'cuBLAS':>8}{'F.lin':>8}"
        log(hdr)
        legends = {}
        for r in RESULTS["router_timings"]:
            cells = "".join(f"{_f(t):>7}" for t in r["variants"]) + " " * 7 * (nv - len(r["variants"]))
            log(f"{r['shape']:<28}{r['M']:>4}{_f(r['floor_us']):>7}{cells}{_f(r.get('auto_us')):>7}"
                f"{_f(r.get('cublas_us')):>8}{_f(r.get('flinear_us')):>8}")
            legends.setdefault(r["shape"].split()[-1], r["variant_names"])
        for dt, names in legends.items():
            kernel = "dsv3_router_gemm" if dt == "bf16" else "fp32_router_gemm"
            log(f"  {kernel}: " + "; ".join(f"v{i} = {n}" for i, n in enumerate(names)))
    if RESULTS["experts_timings"]:
        log("\ngrouped experts, us per call (apply = permute + GEMM1 + act (+quant) + GEMM2 + weight/reduce; "
            "floor = touched expert weights / copy BW)")
        log(f"{'shape':<52}{'M':>6}{'bf16 apply':>11}{'gemms':>8}{'floor':>8}{'fp8 apply':>11}{'gemms':>8}"
            f"{'floor':>8}")
        for r in RESULTS["experts_timings"]:
            b, q = r.get("bf16", {}), r.get("fp8", {})
            log(f"{r['shape']:<52}{r['M']:>6}{_f(b.get('apply_us'), 1):>11}{_f(b.get('gemms_us'), 1):>8}"
                f"{_f(b.get('floor_us'), 1):>8}{_f(q.get('apply_us'), 1):>11}{_f(q.get('gemms_us'), 1):>8}"
                f"{_f(q.get('floor_us'), 1):>8}")
    log(f"\nchecks: {n_ok} passed, {len(RESULTS['checks']) - n_ok} failed; failures (incl. exceptions): "
        f"{len(FAILURES)}")
    for f in FAILURES[:25]:
        log(f"  - {f[:220]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for cuda_bench.json (default $OUT)")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("no CUDA GPU: nothing to do")
        return 2
    from backends import load_backend

    t_start = time.time()
    reason = load_backend("cuda").unavailable_reason()
    log(f"cuda backend availability: {'available' if reason is None else reason}")
    info = env_info()
    ext = guarded("build", build_ext)
    bw = guarded("copy bandwidth", copy_bandwidth) or 3.0e12
    torch.manual_seed(0)
    log("\n== CUTLASS experts vs reference.experts.fused_experts ==")
    guarded("experts checks", experts_checks)
    if ext is not None:
        log("\n== gate tiers vs reference.gate.gate_reference ==")
        guarded("gate checks", gate_checks)
        log("\n== kernel variants x M buckets ==")
        guarded("variant checks", variant_checks, ext)
    log(f"(checks done at {time.time() - t_start:.0f} s)")
    if not args.skip_timing:
        log("\n== experts timings ==")
        guarded("experts timings", experts_timings, bw)
        if ext is not None:
            log("\n== router GEMM timings ==")
            guarded("router timings", router_timings, ext, bw, info["l2_bytes"])
    RESULTS["failures"] = FAILURES
    RESULTS["wall_s"] = time.time() - t_start
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cuda_bench.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print_tables()
    log(f"total {time.time() - t_start:.0f} s")
    return 0 if not FAILURES else 1


if __name__ == "__main__":
    sys.exit(main())
