"""GPU script of the ``deep_gemm`` backend: layout probe, conformance on model shapes, timings. One run, < 6 min.

    # on the GPU machine, from the repository root, after installing the wheels (nothing is installed here);
    # .whl/ must hold tokenspeed_deepgemm-2.5.0.post20260604-cp312-cp312-manylinux_2_28_x86_64.whl and NOT
    # sgl_deep_gemm-0.2.0 (both provide the module deep_gemm; sgl-deep-gemm 0.2.0 is ABI-broken on torch 2.11):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 -m backends.deep_gemm.bench [--sections env,probe,kernels,models,gemm,experts] [--json results.json]

Sections (each survives the failure of the others; a global deadline skips what would overrun):

- env: versions, GPU, the backend's availability reason, DeepGEMM's alignment and the GEMM's signature.
- probe: ``m_grouped_fp8_gemm_nt_contiguous`` on a small problem (G=2, N=512, K=256) with the documented
  alternatives in sequence - canonical row-major SFA, ``disable_ue8m0_cast``, MN-major TMA-aligned SFA (this
  backend's call), explicit ``recipe=(1, 128, 128)``, psum layout - printing each exact error or its calc_diff
  against an fp32 dequantized reference; first the ABI check (``get_mn_major_tma_aligned_tensor``).
- models: ``DeepGemmExperts`` through ``FusedMoEKernel`` vs ``reference.experts.fused_experts`` (both on the GPU)
  on DeepSeek-V3, Kimi-K2, MiniMax-M2, Qwen3-30B-A3B FP8 block shapes (8 local experts of the model's E, routing
  over all E, expert_map), plus SWIGLUSTEP / SWIGLUOAI_UNINTERLEAVE (alpha, beta, limit) and a chunked case;
  metrics against specs' ``experts.fp8`` tolerances; seed 001's ``_valid_deep_gemm`` for each shape.
- kernels: the Triton act+quant / reduction against the torch-op paths (code and scale mismatches, times).
- gemm: the grouped GEMM alone at DeepGEMM's published shapes (contiguous 4 x 8192 rows, n=4096 k=7168:
  1346 TFLOP/s on H800; n=7168 k=2048: 1214 TFLOP/s), TFLOP/s and ratio to the published figure.
- experts: the whole experts step (``DeepGemmExperts.apply``: permute, 2 GEMMs, act+quant, unpermute) and the two
  GEMMs alone at M in {64, 1024, 4096} on DeepSeek-V3 EP8-local (E=32 local experts, topk 8, K=7168, I=2048,
  routing over the 32), next to vLLM's Triton GEMM-only times from ``shared/facts/perf-anchors.md`` (H200).

The table is printed last. Timings: CUDA events, median of repeated calls after warm-up (no L2 flush: the
problems are compute- or weight-bound and larger than L2 except at M=64).
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

if __package__ in (None, ""):  # allow `python3 backends/deep_gemm/bench.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from reference.metrics import calc_diff, error_stats
from specs import experts_tolerance

T0 = time.time()
DEADLINE_S = 330.0
ROWS: list[tuple[str, str, str, str]] = []  # (section, item, result, note)
RESULTS: dict = {}
FP8_TOL = experts_tolerance("fp8")  # specs/tolerances.toml [experts.fp8]
PUBLISHED = {(4096, 7168): 1346.0, (7168, 2048): 1214.0}  # DeepGEMM README, H800, contiguous 4x8192
# vLLM Triton fused_moe_kernel GEMM1+GEMM2 launches, H200, DeepSeek-V3 EP8-local fp8 block (perf-anchors.md).
VLLM_TRITON_US = {64: 365.93, 1024: 1424.56, 4096: 4993.44}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def row(section: str, item: str, result: str, note: str = "") -> None:
    ROWS.append((section, item, result, note))
    log(f"{section} | {item} | {result} | {note}")


def time_left() -> float:
    return DEADLINE_S - (time.time() - T0)


def err_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max_norm / rms_norm / calc_diff / nonfinite of ``out`` against ``ref`` (``reference.metrics``)."""
    return error_stats(out, ref).as_dict()


def cuda_time_us(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------------------
# helpers building inputs
# ------------------------------------------------------------------------------------------------------------


def quant_weights(E: int, N: int, K: int, gen: torch.Generator, recipe: str = "vllm"):
    """bf16-valued random weights (scaled 1/sqrt(K)) quantized to FP8 with 128x128 block scales, on the GPU."""
    from reference.quant import per_block_quant_fp8

    qs, ss = [], []
    for _ in range(E):  # per expert: bounds the fp32 temporaries
        w = (torch.randn(N, K, device="cuda", generator=gen) / math.sqrt(K)).to(torch.bfloat16)
        q, s = per_block_quant_fp8(w, (128, 128), recipe=recipe)
        qs.append(q)
        ss.append(s)
    return torch.stack(qs), torch.stack(ss).contiguous()


def dequant_rows(a: torch.Tensor, sfa: torch.Tensor) -> torch.Tensor:
    return a.float() * sfa.float().repeat_interleave(128, dim=1)[:, : a.size(1)]


def dequant_blocks(b: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
    n, k = b.shape
    return b.float() * sfb.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def grouped_problem(G: int, ms: list[int], N: int, K: int, gen: torch.Generator, align: int = 128):
    """A contiguous-layout problem: per-group real rows ``ms``, each group padded to ``align``."""
    from reference.quant import per_token_group_quant_fp8

    aligned = [-(-m // align) * align for m in ms]
    M = sum(aligned)
    x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
    a, sfa = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    b, sfb = quant_weights(G, N, K, gen)
    mi = torch.full((M,), -1, dtype=torch.int32, device="cuda")
    ends = []
    s = 0
    for g, (m, am) in enumerate(zip(ms, aligned, strict=True)):
        mi[s : s + m] = g
        ends.append(s + m)
        s += am
    return a, sfa, b, sfb, mi, torch.tensor(ends, dtype=torch.int32, device="cuda")


# ------------------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------------------


def section_env() -> None:
    import backends.deep_gemm as dgb
    from backends.deep_gemm import platform

    log(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), "
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}")
    cap = platform.current_capability()
    log(f"device: {platform.device_name()} capability {cap}")
    row("env", "deep_gemm distribution", platform.deep_gemm_version())
    reason = dgb.backend.unavailable_reason()
    row("env", "backend availability", "AVAILABLE" if reason is None else "UNAVAILABLE", reason or "")
    try:
        dg = platform.import_deep_gemm()
        log(f"deep_gemm {getattr(dg, '__version__', '?')} from {dg.__file__}")
        row("env", "get_mk_alignment_for_contiguous_layout", str(dg.get_mk_alignment_for_contiguous_layout()),
            f"num_sms={dg.get_num_sms()}")
        doc = (getattr(dg.m_grouped_fp8_gemm_nt_contiguous, "__doc__", "") or "").strip().splitlines()
        if doc:
            log(f"signature: {doc[0][:400]}")
    except Exception as exc:
        row("env", "import deep_gemm", "FAIL", f"{type(exc).__name__}: {exc}"[:300])


def section_probe() -> None:
    from backends.deep_gemm import platform
    from backends.deep_gemm.layout import gather_scales_mn_major

    abi = platform.deep_gemm_abi_error()
    row("probe", "ABI: get_mn_major_tma_aligned_tensor((5,4) fp32)", "OK" if abi is None else "FAIL", abi or "")
    dg = platform.import_deep_gemm()
    gen = torch.Generator(device="cuda").manual_seed(0)
    G, N, K = 2, 512, 256
    a, sfa, b, sfb, mi, ends = grouped_problem(G, [100, 130], N, K, gen)
    M = a.size(0)
    ref = torch.zeros(M, N, device="cuda")
    A = dequant_rows(a, sfa)
    for g in range(G):
        rows = mi == g
        ref[rows] = A[rows] @ dequant_blocks(b[g], sfb[g]).T
    valid = mi >= 0
    sfa_mn = gather_scales_mn_major(sfa, torch.arange(M, device="cuda"))
    tries = [
        ("A canonical: (a, sfa row-major fp32 (M,K/128)), (b (G,N,K), sfb (G,N/128,K/128)), d bf16, m_indices "
         "int32 (M,)", lambda d: dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, mi)),
        ("B canonical + disable_ue8m0_cast=True",
         lambda d: dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, mi, disable_ue8m0_cast=True)),
        ("C sfa MN-major TMA-aligned (the backend's call)",
         lambda d: dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa_mn), (b, sfb), d, mi, disable_ue8m0_cast=False)),
        ("D recipe=(1,128,128)",
         lambda d: dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, mi, recipe=(1, 128, 128))),
        ("E psum layout: grouped_layout int32 (G,) row ends, use_psum_layout=True",
         lambda d: dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, ends, use_psum_layout=True)),
    ]
    works = []
    for name, fn in tries:
        d = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        try:
            t = time.time()
            fn(d)
            torch.cuda.synchronize()
            diff = calc_diff(d[valid].float(), ref[valid])
            ok = diff < 1e-3
            pad_nan = bool(d[~valid].isnan().all())
            row("probe", name.split(":")[0], "OK" if ok else "WRONG",
                f"calc_diff={diff:.2e} first call {time.time() - t:.1f}s; padding rows left NaN: {pad_nan}")
            if ok:
                works.append(name[0])
        except Exception as exc:
            row("probe", name.split(":")[0], "FAIL", f"{type(exc).__name__}: {str(exc).strip()}"[:400])
    RESULTS["probe_working"] = works
    row("probe", "working alternatives", ",".join(works) or "NONE")


def _model_case(name, E, E_local, topk, K, I, M, activation, gen, *, params=None, chunk=None, recipe="vllm",
                ue8m0=True, torch_ops=False):
    from backends.deep_gemm.experts import DeepGemmExperts, valid_deep_gemm
    from reference.activation import MoEActivation
    from reference.config import FusedMoEConfig, fp8_w8a8_moe_quant_config
    from reference.experts import fused_experts
    from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP

    act = MoEActivation[activation]
    w1, w1s = quant_weights(E_local, 2 * I, K, gen)
    w2, w2s = quant_weights(E_local, K, I, gen)
    x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(M, E, device="cuda", generator=gen)
    topk_w, topk_ids = torch.softmax(logits, -1).topk(topk, dim=-1)
    topk_w = (topk_w / topk_w.sum(-1, keepdim=True)).float()
    topk_ids = topk_ids.to(torch.int32)
    emap = None
    if E_local < E:
        emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
        emap[torch.randperm(E, device="cuda", generator=gen)[:E_local]] = torch.arange(E_local, dtype=torch.int32,
                                                                                         device="cuda")
    qc = fp8_w8a8_moe_quant_config(w1s, w2s, block_shape=[128, 128], use_ue8m0=ue8m0, recipe=recipe,
                                   **(params or {}))
    kw = dict(activation=act, global_num_experts=E, expert_map=emap)
    ok_valid, why = valid_deep_gemm(x, w1, w2)
    cfg = FusedMoEConfig(E, topk, K, I, E_local, activation=act)
    ex = DeepGemmExperts(cfg, qc)
    ex.use_triton = not torch_ops
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ex, chunk_size=chunk, poison=float("nan"))
    out = kernel.apply(x, w1, w2, topk_w, topk_ids, **kw)
    ref = fused_experts(x, w1, w2, topk_w, topk_ids, quant_config=qc, **kw)
    torch.cuda.synchronize()
    st = err_stats(out, ref)
    passed = st["nonfinite"] == 0 and all(st[k] <= FP8_TOL[k] for k in FP8_TOL)
    local_routes = int((emap[topk_ids.long()] >= 0).sum()) if emap is not None else M * topk
    note = (f"max_norm={st['max_norm']:.2e} rms={st['rms_norm']:.2e} calc_diff={st['calc_diff']:.2e} "
            f"local_routes={local_routes}; _valid_deep_gemm={ok_valid}" + (f" ({why})" if why else ""))
    row("models", name, "PASS" if passed else "FAIL", note)
    RESULTS.setdefault("models", {})[name] = {**st, "passed": passed, "valid_deep_gemm": ok_valid}


def section_models() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    cases = [
        ("deepseek_v3 E8/256 K7168 I2048 M256 silu", 256, 8, 8, 7168, 2048, 256, "SILU", {}),
        ("kimi_k2 E8/384 K7168 I2048 M256 silu", 384, 8, 8, 7168, 2048, 256, "SILU", {}),
        ("minimax_m2 E8/256 K3072 I1536 M256 silu", 256, 8, 8, 3072, 1536, 256, "SILU", {}),
        ("qwen3_30b E8/128 K2048 I768 M256 silu", 128, 8, 8, 2048, 768, 256, "SILU", {}),
        ("qwen3_30b ... swiglustep", 128, 8, 8, 2048, 768, 128, "SWIGLUSTEP", {}),
        ("qwen3_30b ... swigluoai_uninterleave a1.702 b1 L7", 128, 8, 8, 2048, 768, 128, "SWIGLUOAI_UNINTERLEAVE",
         dict(params=dict(gemm1_alpha=1.702, gemm1_beta=1.0, gemm1_clamp_limit=7.0))),
        ("qwen3_30b ... chunk 64, M 300, recipe deepgemm", 128, 8, 8, 2048, 768, 300, "SILU",
         dict(chunk=64, recipe="deepgemm")),
        ("qwen3_30b ... use_ue8m0=False (FLOAT32 scales)", 128, 8, 8, 2048, 768, 128, "SILU", dict(ue8m0=False)),
        ("qwen3_30b ... M 1 (decode)", 128, 8, 8, 2048, 768, 1, "SILU", {}),
        ("deepseek_v3 ... torch-op act/reduce path", 256, 8, 8, 7168, 2048, 256, "SILU", dict(torch_ops=True)),
    ]
    for name, E, E_local, topk, K, I, M, act, extra in cases:
        if time_left() < 150:
            row("models", name, "SKIPPED", "deadline")
            continue
        try:
            _model_case(name, E, E_local, topk, K, I, M, act, gen, **extra)
        except Exception as exc:
            row("models", name, "ERROR", f"{type(exc).__name__}: {str(exc).strip()}"[:400])
            traceback.print_exc()
        torch.cuda.empty_cache()


def section_kernels() -> None:
    """The Triton act+quant and reduction against the torch-op paths (the definition) on the same inputs."""
    from backends.deep_gemm import act_quant, layout, triton_kernels
    from reference.activation import MoEActivation as A

    if not triton_kernels.HAVE_TRITON:
        row("kernels", "triton", "SKIPPED", "triton is not importable")
        return
    gen = torch.Generator(device="cuda").manual_seed(4)
    R, N = 4096, 4096
    x = (torch.randn(R, N, device="cuda", generator=gen) * torch.logspace(-3, 2, R, device="cuda")[:, None])
    x = x.to(torch.bfloat16)
    x[7, :256] = 0
    for act, p in [(A.SILU, {}), (A.SILU, dict(limit=7.0)), (A.SWIGLUSTEP, {}),
                   (A.SWIGLUOAI_UNINTERLEAVE, dict(alpha=1.702, beta=1.0, limit=7.0))]:
        for recipe, ue in (("vllm", True), ("deepgemm", True), ("vllm", False)):
            kw = dict(alpha=p.get("alpha"), beta=p.get("beta"), limit=p.get("limit"), group_size=128,
                      use_ue8m0=ue, recipe=recipe)
            try:
                q1, s1 = triton_kernels.act_mul_quant(x, act, **kw)
                q2, s2 = act_quant.act_mul_quant(x, act, **kw)
                dq = int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum())
                ds = int((s1 != s2).sum())
                same_layout = s1.stride() == s2.stride()
                row("kernels", f"act+quant {act.name} {p or ''} {recipe} ue8m0={ue}", "EXACT" if dq == ds == 0 else
                    "DIFF", f"{dq} of {q1.numel()} codes, {ds} of {s1.numel()} scales differ; strides ok: "
                    f"{same_layout}")
            except Exception as exc:
                row("kernels", f"act+quant {act.name} {recipe} ue8m0={ue}", "ERROR",
                    f"{type(exc).__name__}: {str(exc).strip()}"[:400])
    t_tr = cuda_time_us(lambda: triton_kernels.act_mul_quant(x, A.SILU, alpha=None, beta=None, limit=None,
                                                             group_size=128, use_ue8m0=True, recipe="vllm"))
    t_to = cuda_time_us(lambda: act_quant.act_mul_quant(x, A.SILU, alpha=None, beta=None, limit=None,
                                                        group_size=128, use_ue8m0=True, recipe="vllm"))
    row("kernels", f"act+quant time ({R}x{N} bf16)", f"{t_tr:.0f} us triton", f"{t_to:.0f} us torch ops")
    from reference.align import compute_aligned_M_and_alignment

    for (Ml, tk_, Eg, El) in ((64, 8, 32, 32), (4096, 8, 256, 32), (3000, 8, 384, 8), (1, 8, 256, 8)):
        ids = torch.rand(Ml, Eg, device="cuda", generator=gen).topk(tk_, -1).indices.to(torch.int32)
        ids[::7, 0] = -1
        emap = None
        if El < Eg:
            emap = torch.full((Eg,), -1, dtype=torch.int32, device="cuda")
            emap[torch.randperm(Eg, device="cuda", generator=gen)[:El]] = torch.arange(El, dtype=torch.int32,
                                                                                         device="cuda")
        M_sum, al = compute_aligned_M_and_alignment(Ml, tk_, El, 128)
        l1, ca = triton_kernels.build_contiguous_layout(ids, El, M_sum, al, emap)
        l2, oor = layout.build_contiguous_layout(ids, El, M_sum, al, emap)
        fields = ("m_indices", "inv_perm", "row_token", "counts")
        same = all(torch.equal(getattr(l1, f), getattr(l2, f)) for f in fields)
        t1 = cuda_time_us(lambda: triton_kernels.build_contiguous_layout(ids, El, M_sum, al, emap))
        t2 = cuda_time_us(lambda: layout.build_contiguous_layout(ids, El, M_sum, al, emap))
        row("kernels", f"layout M={Ml} topk={tk_} E={El}/{Eg}", "EXACT" if same and int(ca[El]) == int(oor.sum())
            else "DIFF", f"{t1:.0f} us triton, {t2:.0f} us torch ops")
    M, topk, K = 4096, 8, 7168
    a = torch.randn(M * topk + 1000, K, device="cuda", generator=gen).to(torch.bfloat16)
    inv = torch.randperm(a.size(0), device="cuda", generator=gen)[: M * topk].reshape(M, topk)
    inv[::5, 3] = -1
    w = torch.rand(M, topk, device="cuda", generator=gen)
    o1 = triton_kernels.unpermute_and_reduce(a, inv, w, torch.empty(M, K, dtype=torch.bfloat16, device="cuda"))
    o2 = layout.unpermute_and_reduce(a, inv, w, torch.empty(M, K, dtype=torch.bfloat16, device="cuda"))
    nd = int((o1 != o2).sum())
    t_tr = cuda_time_us(lambda: triton_kernels.unpermute_and_reduce(a, inv, w, o1))
    t_to = cuda_time_us(lambda: layout.unpermute_and_reduce(a, inv, w, o2))
    row("kernels", f"unpermute+reduce M={M} topk={topk} K={K}", "EXACT" if nd == 0 else "DIFF",
        f"{nd} of {o1.numel()} differ (max |d| {float((o1.float() - o2.float()).abs().max()):.1e}); "
        f"{t_tr:.0f} us triton, {t_to:.0f} us torch ops")


def section_gemm() -> None:
    from backends.deep_gemm.experts import deep_gemm_m_grouped_fp8_gemm_nt_contiguous as gemm
    from backends.deep_gemm.layout import gather_scales_mn_major

    gen = torch.Generator(device="cuda").manual_seed(2)
    for (n, k), pub in PUBLISHED.items():
        if time_left() < 90:
            row("gemm", f"4x8192 n={n} k={k}", "SKIPPED", "deadline")
            continue
        try:
            a, sfa, b, sfb, mi, _ = grouped_problem(4, [8192] * 4, n, k, gen)
            sfa = gather_scales_mn_major(sfa, torch.arange(a.size(0), device="cuda"))
            d = torch.empty(a.size(0), n, dtype=torch.bfloat16, device="cuda")
            us = cuda_time_us(lambda: gemm(a, sfa, b, sfb, d, mi), warmup=3, iters=20)
            tflops = 2 * a.size(0) * n * k / (us * 1e-6) / 1e12
            ref_rows = slice(0, 256)
            ref = dequant_rows(a[ref_rows], sfa[ref_rows]) @ dequant_blocks(b[0], sfb[0]).T
            diff = calc_diff(d[ref_rows].float(), ref)
            row("gemm", f"contiguous 4x8192 n={n} k={k}", f"{tflops:.0f} TFLOP/s",
                f"{us:.0f} us; {tflops / pub:.2f}x of published {pub:.0f} (H800); calc_diff={diff:.1e}")
            RESULTS.setdefault("gemm", {})[f"{n}x{k}"] = {"us": us, "tflops": tflops, "ratio": tflops / pub}
            a = b = d = None  # free before the next shape
            torch.cuda.empty_cache()
        except Exception as exc:
            row("gemm", f"4x8192 n={n} k={k}", "ERROR", f"{type(exc).__name__}: {str(exc).strip()}"[:400])


def section_experts() -> None:
    from backends.deep_gemm import layout as L
    from backends.deep_gemm.experts import DeepGemmExperts, deep_gemm_m_grouped_fp8_gemm_nt_contiguous as gemm
    from reference.activation import MoEActivation
    from reference.align import compute_aligned_M_and_alignment
    from reference.config import FusedMoEConfig, fp8_w8a8_moe_quant_config
    from reference.quant import per_token_group_quant_fp8

    gen = torch.Generator(device="cuda").manual_seed(3)
    E, topk, K, I = 32, 8, 7168, 2048
    N = 2 * I
    w1, w1s = quant_weights(E, N, K, gen)
    w2, w2s = quant_weights(E, K, I, gen)
    qc = fp8_w8a8_moe_quant_config(w1s, w2s, block_shape=[128, 128], use_ue8m0=True)
    ex = DeepGemmExperts(FusedMoEConfig(E, topk, K, I, E), qc)
    weight_bytes = E * (N * K + K * I)
    for M in (64, 1024, 4096):
        if time_left() < 25:
            row("experts", f"DSV3 EP8-local M={M}", "SKIPPED", "deadline")
            continue
        try:
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            xq, xs = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
            topk_w, topk_ids = torch.softmax(torch.randn(M, E, device="cuda", generator=gen), -1).topk(topk, -1)
            topk_ids = topk_ids.to(torch.int32)
            ws13_shape, ws2_shape, out_shape = ex.workspace_shapes(M, N, K, topk, E, E, None, MoEActivation.SILU)
            ws13 = torch.empty(ws13_shape, dtype=torch.bfloat16, device="cuda")
            ws2 = torch.empty(ws2_shape, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(out_shape, dtype=torch.bfloat16, device="cuda")

            def step():
                ex.apply(out, xq, w1, w2, topk_w, topk_ids, MoEActivation.SILU, E, None, xs, None, ws13, ws2, None,
                         False)

            t_step = cuda_time_us(step, warmup=2, iters=10)
            ex.use_triton = False
            t_step_torch = cuda_time_us(step, warmup=1, iters=5)
            ex.use_triton = True
            # The two grouped GEMMs alone, on the same layout (what vLLM's Triton figure times).
            M_sum, al = compute_aligned_M_and_alignment(M, topk, E, 128)
            lay, _ = L.build_contiguous_layout(topk_ids, E, M_sum, al)
            a1 = L.gather_rows(xq, lay.row_token)
            s1 = L.gather_scales_mn_major(xs, lay.row_token)
            h = torch.empty(M_sum, N, dtype=torch.bfloat16, device="cuda")
            a2 = torch.zeros(M_sum, I, dtype=torch.float8_e4m3fn, device="cuda")
            s2 = L.mn_major_tma_aligned_empty(M_sum, I // 128, "cuda")
            s2.fill_(1.0)
            y = torch.empty(M_sum, K, dtype=torch.bfloat16, device="cuda")

            def gemms():
                gemm(a1, s1, w1, w1s, h, lay.m_indices)
                gemm(a2, s2, w2, w2s, y, lay.m_indices)

            t_gemm = cuda_time_us(gemms, warmup=2, iters=10)
            if M in (64, 4096):
                phases = _phase_breakdown(ex, xq, xs, w1, w2, w1s, w2s, topk_w, topk_ids, ws13, ws2, out)
                row("experts", f"  phases M={M} (ms, synced)", "", phases)
            touched = int((lay.counts > 0).sum())
            flops = 2 * M * topk * (K * N + I * K)
            floor_us = max(touched / E * weight_bytes / 4.28e12, flops / 1260e12) * 1e6  # H200 measured ceilings
            vllm = VLLM_TRITON_US.get(M)
            row("experts", f"DSV3 EP8-local M={M}", f"{t_step:.0f} us step / {t_gemm:.0f} us GEMMs",
                f"step with torch-op act/reduce {t_step_torch:.0f} us; "
                f"{flops / (t_gemm * 1e-6) / 1e12:.0f} TFLOP/s in GEMMs; floor {floor_us:.0f} us (H200 ceilings); "
                f"vLLM Triton GEMMs (H200) {vllm} us; M_sum={M_sum}, experts touched {touched}")
            RESULTS.setdefault("experts", {})[M] = {"step_us": t_step, "step_torch_ops_us": t_step_torch,
                                                     "gemm_us": t_gemm, "floor_us": floor_us,
                                                     "vllm_triton_us": vllm}
            ws13 = ws2 = h = y = a1 = a2 = None  # free before the next M
            torch.cuda.empty_cache()
        except Exception as exc:
            row("experts", f"DSV3 EP8-local M={M}", "ERROR", f"{type(exc).__name__}: {str(exc).strip()}"[:400])
            traceback.print_exc()


def _phase_breakdown(ex, xq, xs, w1, w2, w1s, w2s, topk_w, topk_ids, ws13, ws2, out) -> str:
    """Wall time of each phase of DeepGemmExperts.apply with a synchronisation around it (host + device)."""
    from backends.deep_gemm import layout as L, triton_kernels as TK
    from backends.deep_gemm.experts import BLOCK, _resize, deep_gemm_m_grouped_fp8_gemm_nt_contiguous as gemm
    from reference.activation import MoEActivation
    from reference.align import compute_aligned_M_and_alignment

    M, K = xq.shape
    E, N, _ = w1.shape
    topk = topk_ids.size(1)
    res = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        res[name] = res.get(name, 0.0) + (time.perf_counter() - t) * 1e3
        return r

    for _rep in range(3):
        res.clear()
        M_sum, al = timed("layout", lambda: compute_aligned_M_and_alignment(M, topk, E, 128))
        lay, ca = timed("layout", lambda: TK.build_contiguous_layout(topk_ids, E, M_sum, al))
        timed("validate", lambda: ex._validate(lay, ca[E], topk_ids, None, None))
        a1 = timed("permute", lambda: L.gather_rows(xq, lay.row_token,
                                                    out=_resize(ws13.view(torch.float8_e4m3fn), (M_sum, K))))
        s1 = timed("permute", lambda: L.gather_scales_mn_major(xs, lay.row_token))
        h = _resize(ws2, (M_sum, N))
        timed("gemm1", lambda: gemm(a1, s1, w1, w1s, h, lay.m_indices))
        q, s2 = timed("act+quant", lambda: TK.act_mul_quant(h, MoEActivation.SILU, alpha=None, beta=None, limit=None,
                                                           group_size=BLOCK, use_ue8m0=True, recipe="vllm",
                                                           out_q=_resize(ws13.view(torch.float8_e4m3fn),
                                                                         (M_sum, N // 2))))
        y = _resize(ws2, (M_sum, K))
        timed("gemm2", lambda: gemm(q, s2, w2, w2s, y, lay.m_indices))
        timed("reduce", lambda: TK.unpermute_and_reduce(y, lay.inv_perm, topk_w, out))
    return " ".join(f"{k}={v:.3f}" for k, v in res.items())


SECTIONS = {"env": section_env, "probe": section_probe, "kernels": section_kernels, "models": section_models,
            "gemm": section_gemm,
            "experts": section_experts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    for name in args.sections.split(","):
        if time_left() < 10:
            row(name, "section", "SKIPPED", "deadline")
            continue
        log(f"=== section {name}")
        try:
            SECTIONS[name]()
        except Exception as exc:
            row(name, "section", "ERROR", f"{type(exc).__name__}: {str(exc).strip()}"[:400])
            traceback.print_exc()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": ROWS, "results": RESULTS}, f, indent=1, default=str)
    print("\n" + "=" * 100)
    print(f"deep_gemm backend bench on {torch.cuda.get_device_name()} ({time.time() - T0:.0f} s)")
    w = max(len(r[1]) for r in ROWS) if ROWS else 10
    for sec, item, result, note in ROWS:
        print(f"{sec:8} {item[:w]:{w}}  {result:26}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
