"""GPU diagnostics of the ``deep_gemm`` backend: layout probe, the Triton kernels against the torch ops, the grouped
GEMM at DeepGEMM's published shapes. One run, < 3 min. (The experts step against vLLM's figures is
``python -m benchmarks --backend deep_gemm``; its conformance on model shapes is ``nox -s conformance``.)

    # on the GPU machine, from the repository root, after installing the wheels (nothing is installed here);
    # .whl/ must hold tokenspeed_deepgemm-2.5.0.post20260604-cp312-cp312-manylinux_2_28_x86_64.whl and NOT
    # sgl_deep_gemm-0.2.0 (both provide the module deep_gemm; sgl-deep-gemm 0.2.0 is ABI-broken on torch 2.11):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 -m tools.deep_gemm.probe [--sections env,probe,kernels,gemm] [--json results.json]

Sections (each survives the failure of the others; a global deadline skips what would overrun):

- env: versions, GPU, the backend's availability reason, DeepGEMM's alignment and the GEMM's signature.
- probe: ``m_grouped_fp8_gemm_nt_contiguous`` on a small problem (G=2, N=512, K=256) with the documented
  alternatives in sequence - canonical row-major SFA, ``disable_ue8m0_cast``, MN-major TMA-aligned SFA (this
  backend's call), explicit ``recipe=(1, 128, 128)``, psum layout - printing each exact error or its calc_diff
  against an fp32 dequantized reference; first the ABI check (``get_mn_major_tma_aligned_tensor``).
- kernels: the Triton act+quant / reduction against the torch-op paths (code and scale mismatches, times).
- gemm: the grouped GEMM alone at DeepGEMM's published shapes (``benchmarks/peers.toml [peers.deepgemm_h800]``:
  contiguous 4 x 8192 rows), TFLOP/s and ratio to the published figure.

Timings: ``benchmarks.timing.median_time`` (CUDA events, median of repeated calls after warm-up).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

if __package__ in (None, ""):  # allow `python3 tools/deep_gemm/probe.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from benchmarks.timing import median_time
from reference.metrics import calc_diff

T0 = time.time()
DEADLINE_S = 170.0
ROWS: list[tuple[str, str, str, str]] = []  # (section, item, result, note)
RESULTS: dict = {}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def row(section: str, item: str, result: str, note: str = "") -> None:
    ROWS.append((section, item, result, note))
    log(f"{section} | {item} | {result} | {note}")


def time_left() -> float:
    return DEADLINE_S - (time.time() - T0)


def cuda_time_us(fn, warmup: int = 3, iters: int = 10) -> float:
    return median_time(fn, "cuda", reps=iters, warmup=warmup) * 1e6


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
    # the masked layout (slots of 128 rows) and the fused input quantization + permutation, both scale layouts
    for (Ml, tk_, El, slot) in ((64, 8, 32, 128), (1, 8, 32, 128), (127, 8, 128, 128), (4096, 8, 32, None)):
        ids = torch.rand(Ml, El, device="cuda", generator=gen).topk(tk_, -1).indices.to(torch.int32)
        rows, al = (El * slot, slot) if slot else compute_aligned_M_and_alignment(Ml, tk_, El, 128)
        l1, _ = triton_kernels.build_contiguous_layout(ids, El, rows, al, slot_rows=slot)
        l2, _ = layout.build_contiguous_layout(ids, El, rows, al, slot_rows=slot)
        same = all(torch.equal(getattr(l1, f), getattr(l2, f)) for f in ("inv_perm", "counts", "masked_m")) and (
            slot is not None or torch.equal(l1.m_indices, l2.m_indices))
        K = 7168
        xin = (torch.randn(Ml, K, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        q1 = torch.zeros(rows, K, dtype=torch.float8_e4m3fn, device="cuda")
        q2 = q1.clone()
        s1 = layout.sf_empty(rows, K // 128, "cuda", slot).fill_(0)
        s2 = layout.sf_empty(rows, K // 128, "cuda", slot).fill_(0)
        for recipe, ue in (("vllm", True), ("vllm", False), ("deepgemm", True)):
            kw = dict(use_ue8m0=ue, recipe=recipe)
            triton_kernels.quantize_scatter(xin, l1.inv_perm, q1, s1, **kw)
            layout.quantize_scatter(xin, l1.inv_perm, q2, s2, **kw)
            dq = int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum())
            ds = int((s1 != s2).sum())
            row("kernels", f"quantize_scatter M={Ml} E={El} {'masked' if slot else 'contiguous'} {recipe} "
                f"ue8m0={ue}", "EXACT" if same and dq == ds == 0 else "DIFF",
                f"layout equal: {same}; {dq} codes, {ds} scales differ")
        t_q = cuda_time_us(lambda: triton_kernels.quantize_scatter(xin, l1.inv_perm, q1, s1, use_ue8m0=True,
                                                                   recipe="vllm"))
        h = (torch.randn(rows, 4096, device="cuda", generator=gen)).to(torch.bfloat16)
        akw = dict(alpha=None, beta=None, limit=None, group_size=128, use_ue8m0=True, recipe="vllm")
        sa = layout.sf_empty(rows, 16, "cuda", slot)
        qa, sa = triton_kernels.act_mul_quant(h, A.SILU, out_s=sa, routes=l1.inv_perm, **akw)
        qb, sb = act_quant.act_mul_quant(h, A.SILU, out_s=layout.sf_empty(rows, 16, "cuda", slot), **akw)
        used = torch.zeros(rows, dtype=torch.bool, device="cuda")
        used[l1.inv_perm[l1.inv_perm >= 0]] = True
        flat = (lambda t: t.contiguous().view(-1, 16)) if slot else (lambda t: t)
        dq = int((qa.view(torch.uint8)[used] != qb.view(torch.uint8)[used]).sum())
        ds = int((flat(sa)[used] != flat(sb)[used]).sum())
        t_a = cuda_time_us(lambda: triton_kernels.act_mul_quant(h, A.SILU, out_s=sa, routes=l1.inv_perm, **akw))
        row("kernels", f"act+quant expert rows M={Ml} E={El} {'masked' if slot else 'contiguous'}",
            "EXACT" if dq == ds == 0 else "DIFF", f"{dq} codes, {ds} scales differ; {t_q:.0f} us quantize_scatter, "
            f"{t_a:.0f} us act+quant ({int(used.sum())} of {rows} rows)")
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

    from benchmarks.suites import peer

    published = peer("deepgemm_h800")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for key, by_m in published.figures.items():
        n, k = (int(t[1:]) for t in key.split("-"))
        pub = by_m[4 * 8192]
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



def section_tune() -> None:
    """Launch shapes of the act+quant and quantize_scatter kernels at DeepSeek-V3 EP8 / Qwen3-30B M = 4096 (the
    rows, groups per program and warps of ``triton_kernels.ACT_QUANT_CONFIG`` / ``QUANT_SCATTER_CONFIG``),
    timed in CUDA graphs by ``benchmarks.timing``; each candidate's output is checked equal to the default's."""
    from backends.deep_gemm import layout, triton_kernels
    from benchmarks import timing
    from reference.activation import MoEActivation as A

    gen = torch.Generator(device="cuda").manual_seed(5)
    cands = [dict(rows=r, groups=g, num_warps=w) for r in (16, 32, 64) for g in (1, 4) for w in (4, 8)]
    for (M, topk, E, K, I) in ((4096, 8, 32, 7168, 2048), (4096, 8, 128, 2048, 768)):
        ids = torch.rand(M, E, device="cuda", generator=gen).topk(topk, -1).indices.to(torch.int32)
        rows = M * topk + E * 128
        lay, _ = triton_kernels.build_contiguous_layout(ids, E, rows, 128)
        h = torch.randn(rows, 2 * I, device="cuda", generator=gen).to(torch.bfloat16)
        x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        q = torch.empty(rows, max(I, K), dtype=torch.float8_e4m3fn, device="cuda")
        akw = dict(alpha=None, beta=None, limit=None, group_size=128, use_ue8m0=True, recipe="vllm")
        for kind in ("act+quant", "quantize_scatter"):
            outs, cells = None, []
            for c in cands:
                sf = layout.sf_empty(rows, (I if kind == "act+quant" else K) // 128, "cuda")
                if kind == "act+quant":
                    qq = q[:, :I]
                    fn = lambda i, c=c, sf=sf, qq=qq: triton_kernels.act_mul_quant(  # noqa: E731
                        h, A.SILU, out_q=qq, out_s=sf, routes=lay.inv_perm, config=c, **akw)
                else:
                    qq = q[:, :K]
                    fn = lambda i, c=c, sf=sf, qq=qq: triton_kernels.quantize_scatter(  # noqa: E731
                        x, lay.inv_perm, qq, sf, use_ue8m0=True, recipe="vllm", config=c)
                try:
                    us = timing.measure(fn, 1, torch.device("cuda")).seconds * 1e6
                    fn(0)
                    used = lay.inv_perm[lay.inv_perm >= 0]
                    got = (qq[used].view(torch.uint8).clone(), sf[used].clone())
                    same = outs is None or (torch.equal(got[0], outs[0]) and torch.equal(got[1], outs[1]))
                    outs = outs or got
                    cells.append(f"r{c['rows']}g{c['groups']}w{c['num_warps']} {us:.1f}{'' if same else ' DIFF'}")
                except Exception as exc:  # noqa: BLE001
                    cells.append(f"r{c['rows']}g{c['groups']}w{c['num_warps']} {type(exc).__name__}")
            row("tune", f"{kind} M={M} E={E} K={K} I={I}", "us", "; ".join(cells))


SECTIONS = {"env": section_env, "probe": section_probe, "kernels": section_kernels, "gemm": section_gemm,
            "tune": section_tune}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: probe.py needs one (torch.cuda.is_available() is False)")
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
    print(f"deep_gemm backend probe on {torch.cuda.get_device_name()} ({time.time() - T0:.0f} s)")
    w = max(len(r[1]) for r in ROWS) if ROWS else 10
    for sec, item, result, note in ROWS:
        print(f"{sec:8} {item[:w]:{w}}  {result:26}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
