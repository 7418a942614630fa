"""The triton backend's kernels under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), against the
reference: quantizers and layouts bit-exactly, the experts step within the spec tolerances (in practice exactly).

The kernels run in one subprocess started with ``TRITON_INTERPRET=1`` (``@triton.jit`` picks interpreter or GPU
compilation when the kernels are defined, so the mode cannot be switched inside a process that may already have
imported them); each check reports a JSON line and becomes one test here. Skipped when triton is not installed.

What the interpreter cannot cover (``python -m benchmarks --backend triton`` and the GPU conformance run check it on the H100/H200):
- real FP8 / INT8 / BF16 tensor-core numerics (wgmma / mma accumulation order and FP8 accumulator precision);
  the interpreter multiplies in numpy fp32, and it mishandles bf16 dots and float casts, so the kernels upcast
  operands and round bf16 explicitly when ``EMU`` is set: the GPU takes the hardware paths instead;
- TMA descriptors' hardware behaviour (the interpreter emulates descriptor loads), software pipelining
  (``num_stages``), warp counts, register / shared-memory limits, compilation for sm_90;
- races and cross-program ordering (programs run one after another), atomics' concurrency;
- timing, and int32/int64 offset overflow at > 2^31 elements (needs tens of GB).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Minutes in the interpreter (one worker process runs every check): nox -s slow.
pytestmark = pytest.mark.slow

CHECKS = [
    "ptgq_bf16", "ptgq_fp16", "ptgq_fp32", "ptgq_layouts", "ptgq_ue8m0_fp32_near_pow2", "ptgq_nonfinite",
    "scaled_fp8_quant", "int8_quant_per_token", "ptgq_errors",
    "align_basic", "align_expert_map", "align_errors", "count_expert_num_tokens",
    "fused_topk",
    "experts_bf16_silu", "experts_bf16_unfused", "experts_bf16_tma", "experts_fp16_ep", "experts_fp32",
    "experts_swigluoai_bias", "experts_swigluoai_uninterleave", "experts_relu2_no_mul", "experts_gelu",
    "experts_router_weight_on_input",
    "experts_fp8_block", "experts_fp8_block_swap_ab", "experts_fp8_nonblock_swap_ab", "experts_fp8_block_unfused", "experts_fp8_block_ue8m0", "experts_fp8_tensor", "experts_fp8_tensor_amax_in_gemm1",
    "experts_fp8_channel_token", "experts_int8", "fp8_promotion_order", "experts_fp8_promotion",
    "experts_permute_a", "align_tiles", "align_one_launch", "experts_half_tail", "experts_n_tiles", "experts_split_k",
    "experts_joint_gate_up", "act_quant_tensor_amax_sorted", "act_quant_routes", "act_quant_skip_pad", "experts_route_tiles",
    "experts_stages",
    "modular_kernel_chunked_ep", "modular_kernel_m0", "modular_kernel_quantized", "support_claims", "deterministic",
]

WORKER = r'''
import dataclasses, json, os, sys, traceback, warnings
warnings.filterwarnings("ignore")
assert os.environ.get("TRITON_INTERPRET") == "1"
import torch
from reference import quant as rq
from reference.activation import MoEActivation as A
from reference.align import moe_align_block_size as ref_align
from reference.config import (FusedMoEConfig, FusedMoEQuantConfig, biased_moe_quant_config,
                              fp8_w8a8_moe_quant_config, int8_w8a8_moe_quant_config)
from reference.experts import ReferenceExperts, fused_experts as ref_fe
from reference.routing import determine_expert_map, fused_topk as ref_topk
from backends.triton import align as T_align, quant as T_quant, routing as T_routing
from backends.triton import experts as tx
from backends.triton.host import OUT_AMAX, OUT_AMAX_SLOTS, ScaleMode
from backends.triton.experts import TritonExperts, fused_experts as tri_fe
from reference.error_model import Accumulation
from specs import load_tolerances
from tests.harness_util import experts_bound

G = torch.Generator().manual_seed(1234)
only = set(sys.argv[1:])


def report(name, ok, detail=""):
    print(json.dumps({"name": name, "ok": bool(ok), "detail": str(detail)[:1500]}), flush=True)


def check(name):
    def deco(fn):
        if only and name not in only:
            return fn
        try:
            r = fn()
            report(name, r is None or r is True, "" if r in (None, True) else r)
        except Exception as exc:
            report(name, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}")
        return fn
    return deco


def same_codes(a, b):
    if a.dtype == torch.float8_e4m3fn:
        an, bn = torch.isnan(a.float()), torch.isnan(b.float())
        return torch.equal(an, bn) and torch.equal(a.view(torch.uint8)[~an], b.view(torch.uint8)[~bn])
    return torch.equal(a, b)


def same_scales(a, b):
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(torch.nan_to_num(a, 1.5e38),
                                                                           torch.nan_to_num(b, 1.5e38))


def quant_input(M, K, dt):
    x = torch.randn(M, K, generator=G) * torch.pow(10.0, torch.randint(-3, 3, (M, 1), generator=G).float())
    x[0] = 0.0
    x[1, ::64] = 448.0 * 2.0 ** torch.randint(-8, 4, (len(range(0, K, 64)),), generator=G).float()
    x[2] = x[2].sign() * torch.linspace(0.999, 1.0, K)
    return x.to(dt)


def ptgq_cases(dt, groups=(128,), layouts=((False, False),)):
    x = quant_input(9, 256, dt)
    bad = []
    for rec in ("vllm", "deepgemm"):
        for ue in (False, True):
            for gs in groups:
                for cm, tma in layouts:
                    kw = dict(column_major_scales=cm, tma_aligned_scales=tma, use_ue8m0=ue, recipe=rec)
                    q1, s1 = T_quant.per_token_group_quant_fp8(x, gs, **kw)
                    q2, s2 = rq.per_token_group_quant_fp8(x, gs, **kw)
                    if not (same_codes(q1, q2) and same_scales(s1, s2)):
                        bad.append((rec, ue, gs, cm, tma, int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum())))
    return bad or None


check("ptgq_bf16")(lambda: ptgq_cases(torch.bfloat16, groups=(128, 64)))
check("ptgq_fp16")(lambda: ptgq_cases(torch.float16))
check("ptgq_fp32")(lambda: ptgq_cases(torch.float32))
check("ptgq_layouts")(lambda: ptgq_cases(torch.bfloat16, layouts=((True, False), (True, True))))


@check("ptgq_ue8m0_fp32_near_pow2")
def _():
    # fp32 scales a few ULPs above a power of two: vLLM's exp2(ceil(log2(s))) keeps them one binade low
    bits = torch.tensor([((127 + k) << 23) + m for k in range(-34, 8, 3) for m in range(0, 48, 3)], dtype=torch.int32)
    amax = bits.view(torch.float32) * 448
    x = torch.randn(len(amax), 128, generator=G) * amax[:, None] / 8
    x[:, 0] = amax
    bad = []
    for rec in ("vllm", "deepgemm"):
        q1, s1 = T_quant.per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe=rec)
        q2, s2 = rq.per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe=rec)
        if not (same_codes(q1, q2) and same_scales(s1, s2)):
            bad.append((rec, int((s1 != s2).sum())))
    return bad or None


@check("ptgq_nonfinite")
def _():
    x = torch.randn(6, 256, generator=G).to(torch.bfloat16)
    x[3, 5] = float("nan")
    x[4, 255] = float("inf")
    x[5, 0] = -float("inf")
    q1, s1 = T_quant.per_token_group_quant_fp8(x, 128)
    q2, s2 = rq.per_token_group_quant_fp8(x, 128)
    return (same_codes(q1, q2) and same_scales(s1, s2)) or "poisoned groups differ"


@check("scaled_fp8_quant")
def _():
    bad = []
    for dt in (torch.bfloat16, torch.float32):
        x = quant_input(7, 512, dt)
        for mode in ("tensor", "token", "static"):
            args = (torch.tensor([0.0125]),) if mode == "static" else ()
            q1, s1 = T_quant.scaled_fp8_quant(x, *args, use_per_token_if_dynamic=mode == "token")
            q2, s2 = rq.scaled_fp8_quant(x, *args, use_per_token_if_dynamic=mode == "token")
            if not (same_codes(q1, q2) and same_scales(s1, s2)):
                bad.append((str(dt), mode))
    # rows longer than one tile (the interpreter takes the GPU's tiles: a whole row up to 4096 columns, then 1024-column
    # chunks): the per-token modes' two passes, the per-tensor amax over many column chunks
    x = quant_input(3, 8192, torch.bfloat16)
    for mode in ("tensor", "token"):
        q1, s1 = T_quant.scaled_fp8_quant(x, use_per_token_if_dynamic=mode == "token")
        q2, s2 = rq.scaled_fp8_quant(x, use_per_token_if_dynamic=mode == "token")
        if not (same_codes(q1, q2) and same_scales(s1, s2)):
            bad.append(("K 8192", mode))
    z = torch.zeros(3, 128)
    q1, s1 = T_quant.scaled_fp8_quant(z)
    q2, s2 = rq.scaled_fp8_quant(z)
    if not (same_codes(q1, q2) and torch.equal(s1, s2)):
        bad.append("all-zero per-tensor")
    return bad or None


@check("int8_quant_per_token")
def _():
    bad = []
    # one pass (a row in one tile) and two (8192 columns: over 1024-column chunks)
    for dt, K in ((torch.bfloat16, 2048), (torch.float16, 2048), (torch.float32, 2048), (torch.bfloat16, 8192)):
        x = quant_input(16, K, dt)
        q1, s1 = T_quant.int8_quant_per_token(x)
        q2, s2 = rq.int8_quant_per_token(x)
        if not (torch.equal(q1, q2) and same_scales(s1, s2)):
            bad.append((str(dt), K, int((q1 != q2).sum())))
    try:
        T_quant.int8_quant_per_token(torch.tensor([[1.0, float("nan")]]))
        bad.append("NaN did not raise")
    except ValueError:
        pass
    return bad or None


@check("ptgq_errors")
def _():
    x = torch.randn(4, 256)
    for call, exc in ((lambda: T_quant.per_token_group_quant_fp8(x, 100), ValueError),
                      (lambda: T_quant.per_token_group_quant_fp8(x.int(), 128), TypeError),
                      (lambda: T_quant.per_token_group_quant_fp8(x.t(), 2), ValueError),
                      (lambda: T_quant.per_token_group_quant_fp8(x, 128, tma_aligned_scales=True), ValueError),
                      (lambda: T_quant.per_token_group_quant_fp8(x, 128, recipe="nope"), ValueError)):
        try:
            call()
            return f"no {exc.__name__} raised"
        except exc:
            pass


def align_cases(cases):
    bad = []
    for M, topk, E, bs, ep, pad in cases:
        ids = (torch.stack([torch.randperm(E, generator=G)[:topk] for _ in range(M)]) if M
               else torch.empty(0, topk, dtype=torch.int64)).to(torch.int32)
        emap = determine_expert_map(ep, ep - 1, E)[1] if ep else None
        r = ref_align(ids, bs, E, emap, pad, ignore_invalid_experts=True)  # the Triton op is that mode
        o = T_align.moe_align_block_size(ids, bs, E, emap, pad)
        if not all(torch.equal(a, b) for a, b in zip(r, o)):
            bad.append((M, topk, E, bs, ep, pad))
    return bad or None


check("align_basic")(lambda: align_cases([(1, 8, 128, 16, None, False), (40, 4, 8, 16, None, True),
                                          (33, 8, 64, 64, None, False), (300, 8, 128, 16, None, False),
                                          (5, 1, 3, 128, None, False), (0, 2, 4, 16, None, False)]))
check("align_expert_map")(lambda: align_cases([(7, 8, 32, 16, 4, False), (64, 2, 8, 4, 2, True),
                                               (9, 8, 256, 32, 32, False)]))


@check("count_expert_num_tokens")
def _():
    from reference.align import count_expert_num_tokens as ref_count
    bad = []
    for M, topk, E, ep in ((1, 8, 128, None), (40, 4, 8, 2), (300, 8, 64, 4), (0, 2, 4, None)):
        ids = (torch.stack([torch.randperm(E, generator=G)[:topk] for _ in range(M)]) if M
               else torch.empty(0, topk, dtype=torch.int64)).to(torch.int32)
        emap = determine_expert_map(ep, 0, E)[1] if ep else None
        nl = E // ep if ep else E
        if not torch.equal(T_align.count_expert_num_tokens(ids, nl, emap), ref_count(ids, nl, emap)):
            bad.append((M, topk, E, ep))
    try:
        T_align.count_expert_num_tokens(torch.tensor([[0, 9]]), 4)
        bad.append("out-of-range id did not raise")
    except ValueError:
        pass
    return bad or None


@check("align_errors")
def _():
    ids = torch.tensor([[0, -1], [5, 2]], dtype=torch.int32)
    try:
        T_align.moe_align_block_size(ids, 4, 4)
        return "out-of-range id did not raise"
    except ValueError:
        pass
    r = ref_align(ids, 4, 4, drop_out_of_range_ids=True)
    o = T_align.moe_align_block_size(ids, 4, 4, drop_out_of_range_ids=True)
    if not all(torch.equal(a, b) for a, b in zip(r, o)):
        return "drop_out_of_range_ids layout differs"
    try:
        T_align.moe_align_block_size(ids.float(), 4, 8)
        return "float ids did not raise"
    except ValueError:
        pass


@check("fused_topk")
def _():
    bad = []
    for M, E, k in ((1, 8, 2), (33, 128, 8), (5, 60, 4), (17, 256, 8)):
        for sf in ("softmax", "sigmoid"):
            for rn in (True, False):
                x = torch.randn(M, E, generator=G)
                w1, i1 = T_routing.fused_topk(None, x, k, rn, scoring_func=sf)
                w2, i2 = ref_topk(None, x, k, rn, scoring_func=sf)
                if not (torch.equal(i1, i2) and torch.allclose(w1, w2, atol=1e-6, rtol=1e-6)):
                    bad.append((M, E, k, sf, rn))
    x = torch.randn(4, 16, generator=G)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    for sem in ("0.17", "0.33"):  # 0.17: NaN ranks lowest; 0.33: the row's scores clamp to 0, lower index first
        w1, i1 = T_routing.fused_topk(None, x, 4, True, check_finite=False, semantics=sem)
        w2, i2 = ref_topk(None, x, 4, True, check_finite=False, semantics=sem)
        if not (torch.equal(i1, i2) and bool(((i1 >= 0) & (i1 < 16)).all())):
            bad.append(f"non-finite ranking ({sem}): {i1.tolist()} vs reference {i2.tolist()}")
        if sem == "0.33" and not (torch.isfinite(w1).all() and torch.allclose(w1, w2, atol=1e-6, rtol=1e-6)):
            bad.append(f"0.33 clamp weights differ: {w1.tolist()} vs reference {w2.tolist()}")
    try:
        T_routing.fused_topk(None, x, 4, True, semantics="0.17")
        bad.append("non-finite logits did not raise under 0.17")
    except ValueError:
        pass
    w1, i1 = T_routing.fused_topk(None, x, 4, True, semantics="0.33")  # 0.33's default: clamp, no raise
    w2, i2 = ref_topk(None, x, 4, True, semantics="0.33")
    if not (torch.equal(i1, i2) and torch.allclose(w1, w2, atol=1e-6, rtol=1e-6)):
        bad.append("0.33 default (clamp) differs from the reference")
    return bad or None


def make(M, E, K, I, topk, dtype, act=A.SILU, ep=None):
    N = 2 * I if act.is_gated else I
    x = torch.randn(M, K, generator=G).to(dtype)
    Eg = E if ep is None else E * ep
    w1 = (torch.randn(E, N, K, generator=G) * K ** -0.5).to(dtype)
    w2 = (torch.randn(E, K, I, generator=G) * I ** -0.5).to(dtype)
    w, ids = ref_topk(None, torch.randn(M, Eg, generator=G), topk, True)
    emap = determine_expert_map(ep, 0, Eg)[1] if ep else None
    return x, w1, w2, w, ids, emap, Eg


def CFG(bm=16, bn1=32, bk1=64, bn2=32, bk2=64, fuse=1, fq=1, tma=0, half=0):
    return {"gemm1": dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn1, BLOCK_SIZE_K=bk1, FUSE_ACT=fuse, FUSE_QUANT=fq,
                          USE_TMA=tma, HALF_TAIL=half),
            "gemm2": dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn2, BLOCK_SIZE_K=bk2, USE_TMA=tma)}


def close(out, ref, key, tol):
    o, r = out.double(), ref.double()
    d = o - r
    st = dict(max_norm=(d.abs().max() / r.abs().max()).item(),
              rms_norm=(d.pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item(),
              calc_diff=(1 - 2 * (o * r).sum() / (o * o + r * r).sum()).item())
    ok = not bool(torch.isnan(out).any()) and all(st[k] <= tol[k] for k in st)
    return True if ok else f"{key}: {st} vs {tol}"


def experts(x, w1, w2, w, ids, emap, Eg, key, act=A.SILU, qc=None, cfg=None, arw=False):
    kw = dict(activation=act, global_num_experts=Eg, expert_map=emap, quant_config=qc,
              apply_router_weight_on_input=arw)
    # The error model's bound for this call: the in-place FAST_ACCUM opt-in is judged as the fast accumulation it is
    # (``Accumulation.fast``), everything else as what every kernel is allowed.
    fast = cfg is not None and any(c.get("FAST_ACCUM") for c in cfg.values())
    acc = Accumulation.fast(load_tolerances()["error_model"]["mma_mantissa_bits"]) if fast else None
    tol = experts_bound(x, w1, ids, quant_config=qc, expert_map=emap, activation=act, accumulation=acc)
    return close(tri_fe(x, w1, w2, w, ids, config=cfg, **kw), ref_fe(x, w1, w2, w, ids, **kw), key, tol)


D = make(19, 4, 128, 64, 2, torch.bfloat16)
check("experts_bf16_silu")(lambda: experts(*D, "bfloat16", cfg=CFG()))
check("experts_bf16_unfused")(lambda: experts(*D, "bfloat16", cfg=CFG(fuse=0)))
check("experts_bf16_tma")(lambda: experts(*D, "bfloat16", cfg=CFG(tma=1, bn1=64, bk2=32)))
check("experts_fp16_ep")(lambda: experts(*make(7, 8, 128, 64, 4, torch.float16, ep=2), "float16", cfg=CFG(bk1=32)))
check("experts_fp32")(lambda: experts(*make(5, 4, 64, 32, 2, torch.float32), "float32",
                                      cfg=CFG(bn1=16, bn2=16, bk1=32, bk2=32)))
DB = make(9, 4, 128, 64, 2, torch.bfloat16)
_b = biased_moe_quant_config((torch.randn(4, 128, generator=G) * 0.1).bfloat16(),
                             (torch.randn(4, 128, generator=G) * 0.1).bfloat16())
QB = FusedMoEQuantConfig(w1=_b.w1, w2=_b.w2, gemm1_alpha=1.702, gemm1_clamp_limit=7.0)


@check("experts_swigluoai_bias")
def _():
    r1 = experts(*DB, "bfloat16", act=A.SWIGLUOAI, qc=QB, cfg=CFG())
    r2 = experts(*DB, "bfloat16", act=A.SWIGLUOAI, qc=QB, cfg=CFG(fuse=0))
    return r1 if r1 is not True else r2


check("experts_swigluoai_uninterleave")(lambda: experts(*DB, "bfloat16", act=A.SWIGLUOAI_UNINTERLEAVE, cfg=CFG(),
    qc=FusedMoEQuantConfig(gemm1_alpha=1.702, gemm1_beta=1.0, gemm1_clamp_limit=7.0)))
check("experts_relu2_no_mul")(lambda: experts(*make(9, 4, 128, 64, 2, torch.bfloat16, act=A.RELU2_NO_MUL),
                                              "bfloat16", act=A.RELU2_NO_MUL, cfg=CFG()))
check("experts_gelu")(lambda: experts(*DB, "bfloat16", act=A.GELU, cfg=CFG()))
check("experts_router_weight_on_input")(lambda: experts(*make(6, 4, 128, 64, 1, torch.bfloat16), "bfloat16",
                                                        cfg=CFG(), arw=True))

DQ = make(13, 4, 256, 128, 2, torch.bfloat16)
x, w1, w2 = DQ[0], DQ[1], DQ[2]
rest = DQ[3:]


def block(ue8m0=False, recipe="vllm"):
    q1, s1 = rq.per_block_quant_fp8(w1, (128, 128), use_ue8m0=ue8m0)
    q2, s2 = rq.per_block_quant_fp8(w2, (128, 128), use_ue8m0=ue8m0)
    return q1, q2, fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128], use_ue8m0=ue8m0, recipe=recipe)


@check("experts_fp8_block")
def _():
    q1, q2, qc = block()
    return experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=CFG(bn1=128, bk1=64, bk2=128))


@check("experts_fp8_block_swap_ab")
def _():
    """SWAP_AB (W_tile @ A_tile^T, the accumulator transposed back for the epilogue) on both GEMMs of block FP8:
    separate gate / up chains with one weight scale per K tile, the joint gate / up tile, 256-column tiles (two
    weight-scale blocks: a scale per column), the fused and the separate requantization, and an expert map."""
    q1, q2, qc = block()

    def swap(c, joint=0):
        for g in ("gemm1", "gemm2"):
            c[g]["SWAP_AB"] = 1
        c["gemm1"]["JOINT_GATE_UP"] = joint
        return c

    r = [experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=swap(CFG(bn1=128, bk1=64, bk2=128))),
         experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=swap(CFG(bn1=64, bk1=128, bk2=128), joint=1)),
         experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=swap(CFG(bn1=256, bk1=128, bn2=256, bk2=128, fq=0))),
         experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=swap(CFG(bm=32, bn1=128, bk1=128, bk2=128)))]
    xe, w1e, w2e, we, idse, emap, Eg = make(21, 8, 256, 128, 2, torch.bfloat16, ep=2)
    p1, s1 = rq.per_block_quant_fp8(w1e, (128, 128))
    p2, s2 = rq.per_block_quant_fp8(w2e, (128, 128))
    qe = fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128])
    r.append(experts(xe, p1, p2, we, idse, emap, Eg, "fp8", qc=qe, cfg=swap(CFG(bn1=128, bk1=128, bk2=128))))
    bad = [v for v in r if v is not True]
    return bad or None


@check("experts_fp8_block_unfused")
def _():
    q1, q2, qc = block()
    r1 = experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=CFG(bn1=32, bk1=128, bk2=64))
    r2 = experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=CFG(fuse=0))
    return r1 if r1 is not True else r2


@check("experts_fp8_block_ue8m0")
def _():
    q1, q2, qc = block(True, "deepgemm")
    return experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=CFG(bn1=128, bk1=64, bk2=128))


def per_expert(fn, w):
    outs = [fn(w[e]) for e in range(w.shape[0])]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


@check("experts_fp8_tensor")
def _():
    (q1, s1), (q2, s2) = per_expert(rq.scaled_fp8_quant, w1), per_expert(rq.scaled_fp8_quant, w2)
    s1, s2 = s1.reshape(-1), s2.reshape(-1)
    r1 = experts(x, q1, q2, *rest, "fp8", qc=fp8_w8a8_moe_quant_config(s1, s2), cfg=CFG())
    static = fp8_w8a8_moe_quant_config(s1, s2, a1_scale=torch.tensor([0.02]), a2_scale=torch.tensor([0.005]))
    r2 = experts(x, q1, q2, *rest, "fp8", qc=static, cfg=CFG(fuse=0))
    return r1 if r1 is not True else r2


@check("experts_fp8_nonblock_swap_ab")
def _():
    """SWAP_AB on FP8 per-tensor and per-channel x per-token GEMMs: promoted every K tile and every two K tiles (the
    partial chain transposed), in place (the FAST_ACCUM opt-in), the separate requantization and static scales."""
    (q1, s1), (q2, s2) = per_expert(rq.scaled_fp8_quant, w1), per_expert(rq.scaled_fp8_quant, w2)
    s1, s2 = s1.reshape(-1), s2.reshape(-1)
    f = lambda w: rq.scaled_fp8_quant(w, use_per_token_if_dynamic=True)  # noqa: E731
    (c1, t1), (c2, t2) = per_expert(f, w1), per_expert(f, w2)
    qch = fp8_w8a8_moe_quant_config(t1, t2, per_act_token_quant=True, per_out_ch_quant=True)
    static = fp8_w8a8_moe_quant_config(s1, s2, a1_scale=torch.tensor([0.02]), a2_scale=torch.tensor([0.005]))

    def swap(c, **keys):
        for g in ("gemm1", "gemm2"):
            c[g].update(SWAP_AB=1, **keys)
        return c

    r = [experts(x, q1, q2, *rest, "fp8", qc=fp8_w8a8_moe_quant_config(s1, s2), cfg=swap(CFG(bn1=64, bn2=64))),
         experts(x, q1, q2, *rest, "fp8", qc=fp8_w8a8_moe_quant_config(s1, s2),
                 cfg=swap(CFG(bn1=64, bn2=64), PROMOTE_K=128)),
         experts(x, c1, c2, *rest, "fp8", qc=qch, cfg=swap(CFG(bn1=64, bn2=64, bk1=128, bk2=128), PROMOTE_K=128)),
         experts(x, c1, c2, *rest, "fp8", qc=qch, cfg=swap(CFG(bn1=64, bn2=64), FAST_ACCUM=1)),
         experts(x, q1, q2, *rest, "fp8", qc=static, cfg=swap(CFG(fuse=0, bn1=64, bn2=64)))]
    bad = [v for v in r if v is not True]
    return bad or None


@check("experts_fp8_channel_token")
def _():
    f = lambda w: rq.scaled_fp8_quant(w, use_per_token_if_dynamic=True)  # noqa: E731
    (q1, s1), (q2, s2) = per_expert(f, w1), per_expert(f, w2)
    qc = fp8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=True, per_out_ch_quant=True)
    r1 = experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=CFG())
    r2 = experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=CFG(tma=1))
    return r1 if r1 is not True else r2


@check("experts_int8")
def _():
    (q1, s1), (q2, s2) = rq.int8_quant_per_channel(w1), rq.int8_quant_per_channel(w2)
    qc = int8_w8a8_moe_quant_config(s1, s2)
    r1 = experts(x, q1, q2, *rest, "int8", qc=qc, cfg=CFG())
    r2 = experts(x, q1, q2, *rest, "int8", qc=qc, cfg=CFG(fuse=0))
    return r1 if r1 is not True else r2


@check("fp8_promotion_order")
def _():
    """FP8 per-tensor / per-channel GEMMs promote the MMA accumulator into an fp32 accumulator every PROMOTE_K K
    elements (FAST_ACCUM: in place). Operands are FP8 integers whose K-tile sums are exact in fp32 (< 2^24) while
    the running sums pass 2^24, so the only roundings are the fp32 additions whose order the promotion fixes: the
    kernel's output must equal, bit for bit, a float64-of-fp32 emulation of that order (in place: acc += tile;
    promoted: part += tile, acc += part every PROMOTE_K // BLOCK_K tiles and after the last, partial interval), for
    per-tensor and per-row / per-channel (power-of-two) scales; the orders must differ somewhere, so the check sees
    which one ran."""
    import numpy as np
    from tools.triton.fp8_accum import single_expert_gemm
    M, N, BK, K = 16, 16, 64, 960  # 15 K tiles: the last interval is partial for 2 and 4 tiles per interval
    vals = torch.tensor([448.0, 416.0, 384.0, 320.0, 1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0])
    a = vals[torch.randint(0, len(vals), (M, K), generator=G)]
    w = vals[torch.randint(0, len(vals), (N, K), generator=G)]
    aq, wq = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    assert torch.equal(aq.float(), a) and torch.equal(wq.float(), w)
    tiles = [(a[:, k:k + BK].double() @ w[:, k:k + BK].double().T).numpy() for k in range(0, K, BK)]
    assert all(np.abs(t).max() < 2 ** 24 for t in tiles)  # each tile's dot is exact in fp32

    def emulate(per):
        acc = np.zeros((M, N), np.float32)
        part = np.zeros((M, N), np.float32)
        for i, t in enumerate(tiles):
            if per == 0:
                acc = acc + t.astype(np.float32)
            else:
                part = part + t.astype(np.float32)
                if i % per == per - 1:
                    acc, part = acc + part, np.zeros_like(part)
        return torch.from_numpy(acc + part)

    g = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=BK, num_stages=1)
    sa_row = 2.0 ** torch.randint(-3, 3, (M, 1), generator=G).float()
    sw_col = 2.0 ** torch.randint(-3, 3, (N,), generator=G).float()
    bad, outs = [], {}
    for keys, per in ((dict(FAST_ACCUM=1), 0), (dict(PROMOTE_K=64), 1), (dict(PROMOTE_K=128), 2),
                      (dict(PROMOTE_K=256), 4), (dict(), 4)):
        want = emulate(per)
        out = single_expert_gemm(aq, torch.tensor([1.0]), wq, torch.tensor([1.0]), dict(g, **keys))
        if not torch.equal(out, want):
            bad.append(f"per-tensor {keys}: {int((out != want).sum())} of {out.numel()} differ from the emulation")
        out2 = single_expert_gemm(aq, sa_row, wq, sw_col, dict(g, **keys), a_mode=2, b_mode=2)
        if not torch.equal(out2, want * sa_row * sw_col[None, :]):
            bad.append(f"per-row / per-channel {keys}: differs from the emulation")
        outs[per] = out
    if torch.equal(outs[0], outs[4]) or torch.equal(outs[1], outs[4]):
        bad.append("in-place and promoted orders agree everywhere: the data does not tell them apart")
    return bad or None


@check("experts_fp8_promotion")
def _():
    """The experts step with FP8 per-channel / per-tensor scales: the default (promoted every 256 K) is bitwise equal
    to the in-place FAST_ACCUM form when each GEMM's K fits one interval (K = 256, I = 128: the order is the same),
    and every interval (one 64-wide K tile: gate / up chains of FUSE 1; two: GEMM1 on the joint gate / up tile, which
    a promoted FP8 GEMM1 always uses) stays within the FP8 tolerance of the reference."""
    f = lambda w: rq.scaled_fp8_quant(w, use_per_token_if_dynamic=True)  # noqa: E731
    (q1, s1), (q2, s2) = per_expert(f, w1), per_expert(f, w2)
    qc = fp8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=True, per_out_ch_quant=True)
    (t1, u1), (t2, u2) = per_expert(rq.scaled_fp8_quant, w1), per_expert(rq.scaled_fp8_quant, w2)
    qt = fp8_w8a8_moe_quant_config(u1.reshape(-1), u2.reshape(-1))

    def acc_cfg(base=None, **keys):
        c = base or CFG()
        for g_ in ("gemm1", "gemm2"):
            c[g_].update(keys)
        return c

    bad = []
    kw = dict(activation=A.SILU, global_num_experts=rest[3])
    for qq1, qq2, q in ((q1, q2, qc), (t1, t2, qt)):
        base = tri_fe(x, qq1, qq2, *rest[:2], quant_config=q, config=CFG(), **kw)
        fast = tri_fe(x, qq1, qq2, *rest[:2], quant_config=q, config=acc_cfg(FAST_ACCUM=1), **kw)
        if not torch.equal(base.view(torch.int16), fast.view(torch.int16)):
            bad.append(f"one interval: promoted != in place at {int((base != fast).sum())} elements")
        for pk in (64, 128):
            r = experts(x, qq1, qq2, *rest, "fp8", qc=q, cfg=acc_cfg(PROMOTE_K=pk))
            if r is not True:
                bad.append(f"PROMOTE_K={pk}: {r}")
        j = acc_cfg(PROMOTE_K=64)
        j["gemm1"]["JOINT_GATE_UP"] = 1
        r = experts(x, qq1, qq2, *rest, "fp8", qc=q, cfg=j)
        if r is not True:
            bad.append(f"PROMOTE_K=64 JOINT_GATE_UP: {r}")
    return bad or None


def permuted_a(x_, w1_, w2_, w_, ids_, emap_, Eg_, key, qc=None, **cfg):
    """PERMUTE_A (GEMM1 reads its input rows pre-permuted into sorted order, with and without TMA) changes where
    GEMM1's rows come from, never the arithmetic: bitwise equal to the gathering GEMM, and close to the reference."""
    kw = dict(activation=A.SILU, global_num_experts=Eg_, expert_map=emap_, quant_config=qc)
    base = tri_fe(x_, w1_, w2_, w_, ids_, config=CFG(**cfg), **kw)
    for tma in (0, 1):
        c = CFG(**dict(cfg, tma=tma))
        c["gemm1"]["PERMUTE_A"] = 1
        out = tri_fe(x_, w1_, w2_, w_, ids_, config=c, **kw)
        if not torch.equal(out.view(torch.int16), base.view(torch.int16)):
            return f"PERMUTE_A tma={tma}: differs from the gathering GEMM at {int((out != base).sum())} elements"
    return close(base, ref_fe(x_, w1_, w2_, w_, ids_, **kw), key,
                 experts_bound(x_, w1_, ids_, quant_config=qc, expert_map=emap_))


@check("experts_permute_a")
def _():
    DP = make(23, 4, 128, 64, 2, torch.bfloat16, ep=2)  # EP: routes to other ranks' experts are dropped
    r = [permuted_a(*DP, "bfloat16")]
    q1, q2, qc = block()
    r.append(permuted_a(x, q1, q2, *rest, "fp8", qc=qc, bn1=128, bk1=64, bk2=128))  # 1x128 group scales
    f = lambda w: rq.scaled_fp8_quant(w, use_per_token_if_dynamic=True)  # noqa: E731
    (c1, t1), (c2, t2) = per_expert(f, w1), per_expert(f, w2)
    r.append(permuted_a(x, c1, c2, *rest, "fp8", qc=fp8_w8a8_moe_quant_config(
        t1, t2, per_act_token_quant=True, per_out_ch_quant=True)))  # per-token scales
    (i1, u1), (i2, u2) = rq.int8_quant_per_channel(w1), rq.int8_quant_per_channel(w2)
    r.append(permuted_a(x, i1, i2, *rest, "int8", qc=int8_w8a8_moe_quant_config(u1, u2)))
    bad = [v for v in r if v is not True]
    return bad[0] if bad else True


@check("align_tiles")
def _():
    """The HALF_TAIL tile list against one built here from the reference layout's expert_ids: each expert's run of
    blocks cut into pairs, an odd last block alone."""
    from backends.triton.experts import layout_rows
    bad = []
    for M, topk, E, bs, ep in ((70, 2, 4, 16, None), (300, 8, 128, 16, None), (33, 8, 64, 32, 4), (1, 8, 16, 16, None),
                               (0, 2, 4, 16, None), (64, 1, 2, 16, None)):
        ids = (torch.stack([torch.randperm(E, generator=G)[:topk] for _ in range(M)]) if M
               else torch.empty(0, topk, dtype=torch.int64)).to(torch.int32)
        emap = determine_expert_map(ep, ep - 1, E)[1] if ep else None
        nl = E // ep if ep else E
        _, r_eids, r_ntpp = ref_align(ids, bs, E, emap, ignore_invalid_experts=True)
        want, nb = [], int(r_ntpp) // bs
        j = 0
        while j < nb:
            k = j
            while k < nb and r_eids[k] == r_eids[j]:
                k += 1
            want += [b * 2 + int(b + 1 < k) for b in range(j, k, 2)]
            j = k
        lay = T_align.align_routes(ids, bs, nl, emap.to(torch.int32) if emap is not None else None,
                                   E if ep else nl, layout_rows(ids.numel(), nl, bs), tiles=True)
        n = int(lay.num_tiles)
        if n != len(want) or lay.tiles[:n].tolist() != want or n > lay.tiles.numel():
            bad.append((M, topk, E, bs, ep, n, len(want)))
    return bad or None


@check("align_one_launch")
def _():
    """The one-launch layout (``_align_one_kernel``, up to ``ONE_LAUNCH_MAX_ROUTES`` routes) equals the four-launch
    one and the reference's, field by field (sorted ids, expert ids, num_tokens_post_padded, local ids, the
    HALF_TAIL tile list): several chunks carried in one program (E = 128: 16-route chunks here), an expert map
    with dropped routes, -1 and out-of-range ids, block sizes 16 / 64, one route and the threshold itself."""
    from backends.triton.experts import layout_rows
    bad = []
    saved = T_align.ONE_LAUNCH_MAX_ROUTES
    for M, topk, E, bs, ep, tiles in ((1, 8, 128, 16, None, False), (13, 8, 128, 16, None, True),
                                      (100, 8, 128, 16, 4, True), (64, 2, 8, 64, None, True), (1, 1, 4, 16, None, False),
                                      (128, 8, 128, 16, None, False), (37, 4, 16, 16, 2, False)):
        ids = torch.stack([torch.randperm(E, generator=G)[:topk] for _ in range(M)]).to(torch.int32)
        if M > 10:  # no-route sentinels and ids outside the id space (dropped)
            ids[3, 0], ids[5, topk - 1] = -1, E + 3
        emap = determine_expert_map(ep, ep - 1, E)[1].to(torch.int32) if ep else None
        nl = E // ep if ep else E
        rows = layout_rows(ids.numel(), nl, bs)
        lays = []
        saved_work = T_align.ONE_LAUNCH_MAX_WORK
        for limit in (saved, 0):  # one launch (whatever the E x routes work), four launches
            T_align.ONE_LAUNCH_MAX_ROUTES, T_align.ONE_LAUNCH_MAX_WORK = limit, 1 << 30
            try:
                lays.append(T_align.align_routes(ids, bs, nl, emap, E if ep else nl, rows, tiles=tiles))
            finally:
                T_align.ONE_LAUNCH_MAX_ROUTES, T_align.ONE_LAUNCH_MAX_WORK = saved, saved_work
        one, four = lays
        if ids.numel() > saved:
            bad.append(f"case M={M} topk={topk} has {ids.numel()} routes, above the one-launch limit {saved}")
        n = int(four.num_tiles) if tiles else 0
        same = [torch.equal(a, b) for a, b in zip(one[:4], four[:4])]
        if tiles:
            same.append(int(one.num_tiles) == n and torch.equal(one.tiles[:n], four.tiles[:n]))
        if not all(same):
            bad.append((M, topk, E, bs, ep, tiles, same))
        for name, lay in (("one", one), ("four", four)):  # inv_permuted_idx: each held route's row of the layout
            held = (lay.local_ids >= 0).nonzero().flatten()
            if not torch.equal(lay.sorted_token_ids[lay.inv_permuted_idx[held].long()], held.to(torch.int32)):
                bad.append(("inv_permuted_idx", name, M, topk, E, bs, ep))
        # the reference on the local ids the layout sorts by (align_routes' slots are the nl local experts; the
        # reference's expert_map form lays out all E global slots instead): global -> local, dropped -> -1
        ok_id = (ids >= 0) & (ids < E)
        loc = torch.where(ok_id, ids.clamp(0, E - 1), torch.full_like(ids, -1))
        if emap is not None:
            loc = torch.where(ok_id, emap.long()[loc.clamp(min=0).long()].to(torch.int32), loc)
        r_sorted, r_eids, r_ntpp = ref_align(loc, bs, nl)
        n_pad = int(r_ntpp)
        if int(one[2]) != n_pad or not torch.equal(one[0][:n_pad], r_sorted[:n_pad]) \
                or not torch.equal(one[1][:n_pad // bs], r_eids[:n_pad // bs]):
            bad.append(("reference", M, topk, E, bs, ep))
    return bad or None


@check("experts_half_tail")
def _():
    """HALF_TAIL (experts padded to BLOCK_M / 2, full tiles plus one half-height tail tile per expert in one
    launch) is close to the reference, on its own and with TMA A tiles (GEMM2; GEMM1 with PERMUTE_A), with GEMM2 on
    the layout's half blocks (its BLOCK_M half of GEMM1's), for bf16 with EP, block-FP8 with the fused
    requantization, and INT8."""
    DH = make(70, 4, 128, 64, 2, torch.bfloat16, ep=2)
    r = []
    for tma, perm, bm2 in ((0, 0, 32), (1, 0, 32), (1, 1, 32), (1, 1, 16)):
        c = CFG(bm=32, tma=tma, half=1)
        c["gemm1"]["PERMUTE_A"] = perm
        c["gemm2"]["BLOCK_SIZE_M"] = bm2
        r.append(experts(*DH, "bfloat16", cfg=c))
    xh = torch.randn(70, 256, generator=G).bfloat16()
    q1, q2, qc = block()
    r.append(experts(xh, q1, q2, *make(70, 4, 256, 128, 2, torch.bfloat16)[3:], "fp8", qc=qc,
                     cfg=CFG(bm=32, bn1=128, bk1=64, bk2=128, tma=1, half=1)))
    (i1, u1), (i2, u2) = rq.int8_quant_per_channel(w1), rq.int8_quant_per_channel(w2)
    r.append(experts(xh, i1, i2, *make(70, 4, 256, 128, 2, torch.bfloat16)[3:], "int8",
                     qc=int8_w8a8_moe_quant_config(u1, u2), cfg=CFG(bm=32, half=1)))
    bad = [v for v in r if v is not True]
    return bad[0] if bad else True


@check("experts_n_tiles")
def _():
    """N_TILES (a program computes several N tiles of its rows in turn; FLATTEN pipelines them as one loop) only
    regroups programs: bitwise equal to one tile per program, including a last group that runs past N (wrapped
    columns, nothing stored: for the fused FP8 requantization also no scale), with HALF_TAIL, the interleaved
    SWIGLUOAI epilogue and block FP8."""
    DH = make(70, 4, 128, 64, 2, torch.bfloat16, ep=2)

    def nt(c, n, flat):
        for g in ("gemm1", "gemm2"):
            c[g].update(N_TILES=n, FLATTEN=flat)
        return c

    cases = [(D[:5], dict(global_num_experts=D[6]), dict()),
             (DB[:5], dict(global_num_experts=DB[6], activation=A.SWIGLUOAI, quant_config=QB), dict()),
             (DH[:5], dict(global_num_experts=DH[6], expert_map=DH[5]), dict(bm=32, half=1))]
    xb = torch.randn(9, 256, generator=G).bfloat16()
    q1, q2, qc = block()
    cases.append(((xb, q1, q2) + make(9, 4, 256, 128, 2, torch.bfloat16)[3:5], dict(quant_config=qc),
                  dict(bn1=128, bk1=64, bk2=128)))
    bad = []
    for args, kw, c in cases:
        base = tri_fe(*args, config=CFG(**c), **kw)
        for n, flat in ((2, 0), (3, 1), (4, 1)):
            out = tri_fe(*args, config=nt(CFG(**c), n, flat), **kw)
            if not torch.equal(out.view(torch.int16), base.view(torch.int16)):
                bad.append(f"{c} N_TILES={n} FLATTEN={flat}: {int((out != base).sum())} elements differ")
    return bad or None


@check("experts_split_k")
def _():
    """SPLIT_K (programs per output tile over shares of K; the last sums the fp32 partials in split order, then the
    epilogue) is close to the reference: bf16 with the joint gate / up tile, SPLIT_K 2 / 3 (an empty last share:
    4 K tiles over 3 programs of 2) on GEMM1 and GEMM2; block FP8 with SWAP_AB, and GEMM1 tiles of one whole
    128-column group that requantize in their epilogue (plain and swapped); FP8
    per-channel weights promoted every 2 K tiles (shares of whole intervals); HALF_TAIL with an expert map. The
    counters are left at zero; gate / up as two chains is refused."""
    from backends.triton.experts import _SCRATCH

    def sk(c, n1, n2=1, **g1):
        c["gemm1"].update(SPLIT_K=n1, JOINT_GATE_UP=1, **g1)
        c["gemm2"].update(SPLIT_K=n2)
        return c

    q1, q2, qc = block()
    f = lambda w: rq.scaled_fp8_quant(w, use_per_token_if_dynamic=True)  # noqa: E731
    (c1, t1), (c2, t2) = per_expert(f, w1), per_expert(f, w2)
    qch = fp8_w8a8_moe_quant_config(t1, t2, per_act_token_quant=True, per_out_ch_quant=True)
    r = [experts(*D, "bfloat16", cfg=sk(CFG(), 2, 3)), experts(*D, "bfloat16", cfg=sk(CFG(), 3)),
         experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=sk(CFG(bn1=32, bk1=128, bk2=128), 2, 2, SWAP_AB=1,
                                                        num_warps=4)),
         experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=sk(CFG(bn1=64, bk1=64, bk2=128), 3)),
         # a tile of one whole 128-column group requantizing in its epilogue (FUSE_QUANT), plain and swapped
         experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=sk(CFG(bn1=128, bk1=128, bk2=128), 2)),
         experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=sk(CFG(bn1=128, bk1=128, bk2=128), 2, SWAP_AB=1, num_warps=4)),
         experts(x, c1, c2, *rest, "fp8", qc=qch, cfg=sk(CFG(bk1=32), 3, PROMOTE_K=64)),
         experts(*make(70, 4, 128, 64, 2, torch.bfloat16, ep=2), "bfloat16", cfg=sk(CFG(bm=32, half=1), 2, 2))]
    # several N tiles per program, each tile's split counted on its own; GEMM2's 128 columns in 16-column tiles by
    # threes: the last group runs past N (a wrapped tile whose slot must not be the next row tile's)
    nt = sk(CFG(bn2=16), 2, 2)
    nt["gemm1"]["N_TILES"] = 2
    nt["gemm2"]["N_TILES"] = 3
    r.append(experts(*D, "bfloat16", cfg=nt))
    bad = [v for v in r if v is not True]
    if not _SCRATCH or any(int(cnt.abs().sum()) for _, cnt in _SCRATCH.values()):
        bad.append(f"counters not left at zero (or never allocated): {list(_SCRATCH)}")
    c = CFG()
    c["gemm1"]["SPLIT_K"] = 2
    try:
        tri_fe(*D[:5], global_num_experts=D[6], config=c)
        bad.append("SPLIT_K with gate / up as two chains was not refused")
    except ValueError:
        pass
    return bad or None


@check("experts_joint_gate_up")
def _():
    """JOINT_GATE_UP (an N tile's gate and up rows as one weight tile, split in the epilogue) is close to the
    reference: bf16 with and without TMA (a rank-3 weight box), bias, EP with HALF_TAIL, block FP8 with the fused
    requantization, per-channel FP8 weight scales and INT8."""
    def joint(c):
        c["gemm1"]["JOINT_GATE_UP"] = 1
        return c

    r = [experts(*D, "bfloat16", cfg=joint(CFG())), experts(*D, "bfloat16", cfg=joint(CFG(tma=1, bn1=64, bk2=32))),
         experts(*DB, "bfloat16", qc=QB, cfg=joint(CFG())),
         experts(*make(70, 4, 128, 64, 2, torch.bfloat16, ep=2), "bfloat16", cfg=joint(CFG(bm=32, tma=1, half=1)))]
    q1, q2, qc = block()
    r.append(experts(x, q1, q2, *rest, "fp8", qc=qc, cfg=joint(CFG(bn1=128, bk1=64, bk2=128))))
    f = lambda w: rq.scaled_fp8_quant(w, use_per_token_if_dynamic=True)  # noqa: E731
    (c1, t1), (c2, t2) = per_expert(f, w1), per_expert(f, w2)
    r.append(experts(x, c1, c2, *rest, "fp8", qc=fp8_w8a8_moe_quant_config(
        t1, t2, per_act_token_quant=True, per_out_ch_quant=True), cfg=joint(CFG())))
    (i1, u1), (i2, u2) = rq.int8_quant_per_channel(w1), rq.int8_quant_per_channel(w2)
    r.append(experts(x, i1, i2, *rest, "int8", qc=int8_w8a8_moe_quant_config(u1, u2), cfg=joint(CFG())))
    bad = [v for v in r if v is not True]
    return bad or None


def modular(M, chunk, ep):
    from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP
    from reference.config import FusedMoEParallelConfig
    xx, ww1, ww2, w, ids, emap, Eg = make(M, 4, 128, 64, 2, torch.bfloat16, ep=ep)
    mc = FusedMoEConfig(num_experts=Eg, experts_per_token=2, hidden_dim=128, intermediate_size_per_partition=64,
                        num_local_experts=4, moe_parallel_config=FusedMoEParallelConfig.make_ep(ep or 1, 0))
    ex = TritonExperts(mc, FusedMoEQuantConfig(), config=CFG())
    ok, why = TritonExperts.is_supported_config(TritonExperts, mc, None, None, ex.activation_format())
    if not ok:
        return why
    kern = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ex, chunk_size=chunk, poison=float("nan"),
                          semantics="0.17")  # chunking is the 0.17 modular kernel's
    out = kern.apply(xx, ww1, ww2, w, ids, global_num_experts=Eg, expert_map=emap)
    if M == 0:
        return out.shape == (0, 128) or f"M=0 output shape {tuple(out.shape)}"
    return close(out, ref_fe(xx, ww1, ww2, w, ids, global_num_experts=Eg, expert_map=emap), "bfloat16",
                 experts_bound(xx, ww1, ids, expert_map=emap))


check("modular_kernel_chunked_ep")(lambda: modular(21, 8, 2))


@check("modular_kernel_quantized")
def _():
    # the conformance path: prepare quantizes a1 with the reference, the experts get codes + scales
    from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP
    mc = FusedMoEConfig(num_experts=4, experts_per_token=2, hidden_dim=256, intermediate_size_per_partition=128,
                        num_local_experts=4)
    bad = []
    (qt1, st1), (qt2, st2) = per_expert(rq.scaled_fp8_quant, w1), per_expert(rq.scaled_fp8_quant, w2)
    (qi1, si1), (qi2, si2) = rq.int8_quant_per_channel(w1), rq.int8_quant_per_channel(w2)
    schemes = [("fp8", block()), ("fp8", (qt1, qt2, fp8_w8a8_moe_quant_config(st1.reshape(-1), st2.reshape(-1)))),
               ("int8", (qi1, qi2, int8_w8a8_moe_quant_config(si1, si2)))]
    for key, (q1, q2, qc) in schemes:
        ok, why = TritonExperts.is_supported_config(TritonExperts, mc, qc.weight_key, qc.activation_key,
                                                    TritonExperts.activation_format())
        if not ok:
            bad.append(why)
            continue
        kern = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(mc, qc, config=CFG(bn1=128, bk2=128)),
                              chunk_size=5, poison=float("nan"), semantics="0.17")
        out = kern.apply(x, q1, q2, rest[0], rest[1])
        # a dynamic per-tensor a2 scale is per chunk: compare with the reference experts under the same chunking
        rkern = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(mc, qc), chunk_size=5, semantics="0.17")
        r = close(out, rkern.apply(x, q1, q2, rest[0], rest[1]), key, experts_bound(x, q1, rest[1], quant_config=qc))
        if r is not True:
            bad.append(r)
    return bad or None
check("modular_kernel_m0")(lambda: modular(0, 8, None))


@check("support_claims")
def _():
    from reference.quant import keys as K
    from reference.config import mxfp4_moe_quant_config
    claims = [(None, None), (K.kFp8Static128BlockSym, K.kFp8Dynamic128Sym), (K.kFp8StaticTensorSym,
              K.kFp8DynamicTensorSym), (K.kFp8StaticChannelSym, K.kFp8DynamicTokenSym),
              (K.kInt8StaticChannelSym, K.kInt8DynamicTokenSym)]
    refuse = [(K.kMxfp4Static, None), (K.kNvfp4Static, K.kNvfp4Dynamic), (K.kInt4W4A8StaticGroup128Sym,
              K.kFp8DynamicTokenSym), (K.kMxfp4Static, K.kMxfp8Dynamic)]
    bad = [c for c in claims if not TritonExperts._supports_quant_scheme(*c)]
    bad += [c for c in refuse if TritonExperts._supports_quant_scheme(*c)]
    if TritonExperts._supports_activation(A.RELU2):
        bad.append("claims gated RELU2")
    mc = FusedMoEConfig(num_experts=4, experts_per_token=2, hidden_dim=128, intermediate_size_per_partition=64,
                        num_local_experts=4)
    w = torch.zeros(4, 128, 4, dtype=torch.uint8)
    try:
        TritonExperts(mc, mxfp4_moe_quant_config(w, w))
        bad.append("mxfp4 config constructed without error")
    except (NotImplementedError, ValueError):
        pass
    return bad or None


@check("act_quant_tensor_amax_sorted")
def _():
    """Over the sorted layout the dynamic per-tensor amax (pass 1 of the per-tensor requantization) covers the routed
    rows only: padding positions (ids >= num_valid) hold larger values here and must not raise it."""
    from backends.triton.kernels import QMODE_FP8_TENSOR_AMAX
    R, NC, nv, bm = 32, 64, 20, 16
    ids = torch.arange(R, dtype=torch.int32)
    ids[[5, 6, 21, 22, 23]] = nv  # padding positions
    x = torch.randn(R, NC, generator=G).bfloat16()
    x[ids >= nv] = 100.0
    stat = torch.zeros(2, dtype=torch.float32)
    T_quant.launch_act_quant(x=x, y=torch.empty(R, NC, dtype=torch.uint8), stat=stat, sorted_ids=ids,
                             expert_ids=torch.zeros(R // bm, dtype=torch.int32),
                             ntpp=torch.tensor([R], dtype=torch.int32), rows=R, nc=NC, num_valid=nv, block_m=bm,
                             act=0, split=0, qmode=QMODE_FP8_TENSOR_AMAX, act_dtype=torch.bfloat16)
    want = x.float()[ids < nv].abs().max()
    return bool(stat[0] == want) or f"amax {stat[0].item()} != {want.item()} over the routed rows"


@check("act_quant_routes")
def _():
    """The requantization between the GEMMs over the routes (``ROUTES``: decode layouts, mostly padding rows) writes
    every held route's row with the same bits as the pass over the layout's rows, in every mode (FP8 groups,
    per-token FP8 / INT8, static FP8 / INT8, dynamic per-tensor's amax and quantization passes, and the unquantized
    activation), with an expert map dropping routes; and it is the path taken (padding rows stay unwritten)."""
    from backends.triton import kernels as K_
    from backends.triton.experts import layout_rows
    bad = []
    M, topk, E, bs, NC = 3, 4, 16, 16, 256
    ids = torch.stack([torch.randperm(E, generator=G)[:topk] for _ in range(M)]).to(torch.int32)
    emap = determine_expert_map(2, 1, E)[1].to(torch.int32)
    nl, numel = E // 2, M * topk
    rows = layout_rows(numel, nl, bs)
    lay = T_align.align_routes(ids, bs, nl, emap, E, rows)
    x = torch.randn(rows, 2 * NC, generator=G).bfloat16()
    held = (lay.local_ids >= 0).nonzero().flatten()
    hrows = lay.inv_permuted_idx[held].long()
    for qmode, act, split, dt, scols in ((K_.QMODE_FP8_GROUP, 0, 0, torch.uint8, NC // 128),
                                         (K_.QMODE_FP8_TOKEN, tx.activation_code(A.SILU), 1, torch.uint8, 1),
                                         (K_.QMODE_INT8_TOKEN, 0, 0, torch.int8, 1),
                                         (K_.QMODE_FP8_STATIC, 0, 0, torch.uint8, 0),
                                         (K_.QMODE_INT8_STATIC, 0, 0, torch.int8, 0),
                                         (K_.QMODE_FP8_TENSOR_QUANT, 0, 0, torch.uint8, 1),
                                         (K_.QMODE_NONE, tx.activation_code(A.SILU), 1, torch.bfloat16, 0)):
        outs = []
        for routes in (True, False):
            y = torch.full((rows, NC), 7, dtype=dt)
            ys = torch.full((rows, max(scols, 1)), -5.0) if scols else None
            stat = torch.zeros(2, dtype=torch.float32)
            kw = dict(x=x, y=y, ys=ys, sorted_ids=lay.sorted_token_ids, expert_ids=lay.expert_ids,
                      ntpp=lay.num_tokens_post_padded, rows=rows, nc=NC, num_valid=numel, up_off=NC if split else 0,
                      block_m=bs, act=act, split=split, act_dtype=torch.bfloat16, local_ids=lay.local_ids,
                      inv_permuted_idx=lay.inv_permuted_idx)
            if qmode in (K_.QMODE_FP8_STATIC, K_.QMODE_INT8_STATIC):
                kw["a2s"] = torch.tensor([0.0125])
            saved = T_quant.QUANT_ROUTES
            T_quant.QUANT_ROUTES = routes
            try:
                if qmode == K_.QMODE_FP8_TENSOR_QUANT:
                    T_quant.launch_act_quant(qmode=K_.QMODE_FP8_TENSOR_AMAX, stat=stat, **kw)
                T_quant.launch_act_quant(qmode=qmode, stat=stat, **kw)
            finally:
                T_quant.QUANT_ROUTES = saved
            outs.append((y, ys, stat))
        (y1, s1, t1), (y0, s0, t0) = outs
        if not torch.equal(y1[hrows].view(torch.uint8), y0[hrows].view(torch.uint8)) or not torch.equal(t1, t0) or (
                scols and not torch.equal(torch.nan_to_num(s1[hrows]), torch.nan_to_num(s0[hrows]))):
            bad.append(f"qmode {qmode}: the held routes' rows differ between the route and the row passes")
        pad = torch.ones(rows, dtype=torch.bool)
        pad[hrows] = False
        if not bool((y1[pad] == 7).all()):
            bad.append(f"qmode {qmode}: a padding row was written (the route pass was not taken)")
    return bad or None


@check("act_quant_skip_pad")
def _():
    """The per-token requantization over a prefill layout's rows wider than 256 columns (``ROW_CHUNKS``: each row
    as chunks on a middle axis, with and without a tail tile), with and without ``SKIP_PAD``, and (the path before
    it, kept there) over the routes of a decode layout with more than 128 of them (``ROUTES``), gives every routed
    row the reference's codes and scale (``scaled_fp8_quant`` per token / ``int8_quant_per_token`` of the row), an
    FP8 NaN in the first chunk and an inf in the last poisoning only their rows, with an expert map dropping routes;
    with ``SKIP_PAD`` or ``ROUTES`` the padding rows (and rows past ``num_tokens_post_padded``) keep what they
    held."""
    from backends.triton import kernels as K_
    from backends.triton.experts import layout_rows
    bad = []
    fp8 = lambda v: rq.scaled_fp8_quant(v, use_per_token_if_dynamic=True)  # noqa: E731
    # (M, topk, E): a prefill layout (rows mostly routes), and a decode one (mostly padding, 144 routes)
    for M, topk, E, want_routes in ((40, 4, 16, False), (36, 4, 128, True)):
        bs = 16
        ids = torch.stack([torch.randperm(E, generator=G)[:topk] for _ in range(M)]).to(torch.int32)
        emap = determine_expert_map(2, 1, E)[1].to(torch.int32)
        nl, numel = E // 2, M * topk
        rows = layout_rows(numel, nl, bs)
        lay = T_align.align_routes(ids, bs, nl, emap, E, rows)
        ntpp = int(lay.num_tokens_post_padded.item())
        sid = lay.sorted_token_ids[:rows].long()
        routed = (sid < numel) & (torch.arange(rows) < ntpp)
        routes = 2 * numel <= rows
        if routes != want_routes or numel <= 128 or not bool((~routed[:ntpp]).any()):
            bad.append(f"the layout ({rows} rows, {numel} routes, ntpp {ntpp}) does not exercise the path meant")
            continue
        # (rows of 3 chunks: 2 + a tail of 1 (ROW_TAIL), or 4 with one masked)
        for skip, tail, qmode, NC, dt, ref in (
                (True, True, K_.QMODE_FP8_TOKEN, 640, torch.uint8, fp8),
                (True, True, K_.QMODE_FP8_TOKEN, 300, torch.uint8, fp8),
                (True, True, K_.QMODE_INT8_TOKEN, 520, torch.int8, rq.int8_quant_per_token),
                (False, True, K_.QMODE_FP8_TOKEN, 768, torch.uint8, fp8),
                (False, False, K_.QMODE_FP8_TOKEN, 768, torch.uint8, fp8),
                (False, True, K_.QMODE_INT8_TOKEN, 300, torch.int8, rq.int8_quant_per_token)):
            x = torch.randn(rows, NC, generator=G).bfloat16()
            if dt == torch.uint8:  # (the INT8 reference rejects non-finite input); the first chunk and the last
                x[int(routed.nonzero()[3]), 5] = float("nan")
                x[int(routed.nonzero()[7]), NC - 3] = float("inf")
            y = torch.full((rows, NC), 7, dtype=dt)
            ys = torch.full((rows, 1), -5.0)
            saved = T_quant.QUANT_SKIP_PAD, T_quant.QUANT_ROW_CHUNKED, T_quant.QUANT_ROW_TAIL
            T_quant.QUANT_SKIP_PAD, T_quant.QUANT_ROW_CHUNKED, T_quant.QUANT_ROW_TAIL = skip, True, tail
            try:
                T_quant.launch_act_quant(x=x, y=y, ys=ys, sorted_ids=lay.sorted_token_ids,
                                         expert_ids=lay.expert_ids, ntpp=lay.num_tokens_post_padded, rows=rows,
                                         nc=NC, num_valid=numel, block_m=bs, act=0, split=0, qmode=qmode,
                                         act_dtype=torch.bfloat16, local_ids=lay.local_ids,
                                         inv_permuted_idx=lay.inv_permuted_idx)
            finally:
                T_quant.QUANT_SKIP_PAD, T_quant.QUANT_ROW_CHUNKED, T_quant.QUANT_ROW_TAIL = saved
            q, sc = ref(x[routed])
            got = y[routed].view(torch.uint8)
            tag = (f"routes qmode {qmode} NC {NC}" if routes else
                   f"rows qmode {qmode} NC {NC} skip_pad {skip} tail {tail}")
            if not torch.equal(got, q.view(torch.uint8)):
                bad.append(f"{tag}: {int((got != q.view(torch.uint8)).sum())} codes differ from the reference's")
            if not torch.equal(torch.nan_to_num(ys[routed], nan=-1.0),
                               torch.nan_to_num(sc.float().reshape(-1, 1), nan=-1.0)):
                bad.append(f"{tag}: scales differ from the reference's")
            if (skip or routes) and (not bool((y[~routed] == 7).all()) or not bool((ys[~routed] == -5.0).all())):
                bad.append(f"{tag}: a padding row (or a row past num_tokens_post_padded) was written")
    return bad or None


@check("experts_route_tiles")
def _():
    """Decode without a route layout (``ROUTE_TILES``: each route its own row tile, read from ``topk_ids``) gives the
    bits of the layout path (one route per expert there too, each at its block's first row), for bf16, block FP8
    (SWAP_AB, split-K), per-channel x per-token FP8, dynamic per-tensor FP8 (both requantization passes, and the one
    pass over GEMM1's amax slots) and INT8;
    with an expert map that drops routes and a -1 id; and the bound against the reference holds."""
    bad = []
    saved = tx.ROUTE_TILES_MAX
    f = lambda w: rq.scaled_fp8_quant(w, use_per_token_if_dynamic=True)  # noqa: E731
    (c1, cs1), (c2, cs2) = per_expert(f, w1), per_expert(f, w2)
    (t1, ts1), (t2, ts2) = per_expert(rq.scaled_fp8_quant, w1), per_expert(rq.scaled_fp8_quant, w2)
    (i1, is1), (i2, is2) = rq.int8_quant_per_channel(w1), rq.int8_quant_per_channel(w2)
    q1, q2, qcb = block()
    cb = CFG()
    cb["gemm1"].update(SWAP_AB=1, SPLIT_K=2, JOINT_GATE_UP=1)
    cb["gemm2"]["SWAP_AB"] = 1
    # the per-tensor requantization in one pass over GEMM1's amax slots (AMAX_EPILOGUE 3), as the H200 table's
    # Mixtral fp8_tensor M = 1 entry runs it (SWAP_AB tiles, gate and up as one); it equals AMAX_EPILOGUE 0 on the
    # layout path (experts_fp8_tensor_amax_in_gemm1), and here the route tiles equal the layout path
    ca = CFG()
    ca["gemm1"].update(AMAX_EPILOGUE=3, SWAP_AB=1, JOINT_GATE_UP=1)
    ca["gemm2"]["SWAP_AB"] = 1
    schemes = [("bf16", w1, w2, None, CFG()),
               ("fp8_block", q1, q2, qcb, cb),
               ("fp8_channel_token", c1, c2, fp8_w8a8_moe_quant_config(cs1, cs2, per_act_token_quant=True,
                                                                      per_out_ch_quant=True), CFG()),
               ("fp8_tensor", t1, t2, fp8_w8a8_moe_quant_config(ts1, ts2), CFG()),
               ("fp8_tensor AMAX_EPILOGUE 3", t1, t2, fp8_w8a8_moe_quant_config(ts1, ts2), ca),
               ("int8", i1, i2, int8_w8a8_moe_quant_config(is1, is2), CFG())]
    xs = x[:2].contiguous()
    for name, a, b, qc, cfg in schemes:
        # EP 2, rank 1: global experts 4..7 are the 4 local ones; route (0, 1) goes elsewhere, (1, 0) is a -1
        for ep, ids in ((None, torch.tensor([[0, 3]], dtype=torch.int32)),
                        (2, torch.tensor([[5, 2], [-1, 6]], dtype=torch.int32))):
            M = ids.shape[0]
            Eg = a.shape[0] * (ep or 1)
            emap = determine_expert_map(ep, 1, Eg)[1] if ep else None
            wts = torch.rand(M, 2, generator=G)
            kw = dict(activation=A.SILU, global_num_experts=Eg, expert_map=emap, quant_config=qc, config=cfg)
            outs = []
            for on in (16, 0):
                tx.ROUTE_TILES_MAX = on
                try:
                    outs.append(tri_fe(xs[:M], a, b, wts, ids, **kw))
                finally:
                    tx.ROUTE_TILES_MAX = saved
            if not torch.equal(outs[0].view(torch.int16) if outs[0].dtype == torch.bfloat16 else outs[0],
                               outs[1].view(torch.int16) if outs[1].dtype == torch.bfloat16 else outs[1]):
                bad.append(f"{name} ep={ep}: route tiles differ from the layout path "
                           f"(max |d| {(outs[0].float() - outs[1].float()).abs().max().item():.3g})")
    # the path is taken: ROUTE_TILES_MAX gates it, and a call it applies to launches no layout kernel
    tx.ROUTE_TILES_MAX = 16
    try:
        if not tx.route_tiles_apply(CFG(), 2, 4, "all", None) or tx.route_tiles_apply(CFG(), 5, 4, "all", None):
            bad.append("route_tiles_apply: on for 2 routes of 4 experts, off for 5")
        # step_layout (what the benchmark's gemms variant and the tuners pass run_experts): the route tiles where
        # the step takes them, the sorted layout elsewhere; a step given it computes the step's own bits
        E = w1.shape[0]
        ids1 = torch.tensor([[0, 3]], dtype=torch.int32)
        ids5 = torch.tensor([[0, 3], [1, 2], [3, 0]], dtype=torch.int32)
        cfg = tx._configs.sanitize_config(CFG())
        if tx.step_layout(ids1, cfg, E).route_tiles != 1 or tx.step_layout(ids5, cfg, E).route_tiles != 0:
            bad.append("step_layout: route tiles for 2 routes, the sorted layout for 6 routes of 4 experts")
        perm = tx._configs.sanitize_config(CFG())
        perm["gemm1"]["PERMUTE_A"] = 1
        if tx.step_layout(ids1, perm, E).route_tiles:
            bad.append("step_layout: route tiles with PERMUTE_A (the step runs the sorted layout there)")
        from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG
        wts = torch.rand(1, 2, generator=G)
        want = tri_fe(xs[:1], w1, w2, wts, ids1, activation=A.SILU, config=cfg)
        plan = tx.plan_quant(FUSED_MOE_UNQUANTIZED_CONFIG)
        got = tx.run_experts(out=torch.empty_like(want), a1q=xs[:1], a1q_scale=None, w1=w1, w2=w2,
                             topk_weights=wts, topk_ids=ids1, activation=A.SILU, expert_map=None, num_ids=E,
                             qc=FUSED_MOE_UNQUANTIZED_CONFIG, plan=plan, cfg=cfg, layout=tx.step_layout(ids1, cfg, E))
        if not torch.equal(got, want):
            bad.append("run_experts on step_layout's route tiles differs from the step")
        # the tuner's split stages (GEMM1, then GEMM2 alone reading what GEMM1 left in the workspaces): GEMM2's
        # per-route output on the route tiles equals the sorted layout's
        c3 = {}
        for name, lay in (("tiles", tx.step_layout(ids1, cfg, E)), ("sorted", tx.route_layout(ids1, cfg, E))):
            ws13, ws2 = torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
            kw = dict(out=torch.empty_like(want), a1q=xs[:1], a1q_scale=None, w1=w1, w2=w2, topk_weights=wts,
                      topk_ids=ids1, activation=A.SILU, expert_map=None, num_ids=E, qc=FUSED_MOE_UNQUANTIZED_CONFIG,
                      plan=plan, cfg=cfg, ws13=ws13, ws2=ws2, layout=lay)
            tx.run_experts(stages="gemm1", **kw)
            tx.run_experts(stages="gemm2", **kw)
            n = 2 * w2.shape[1] * want.element_size()  # C3: 2 routes x K at the start of ws2
            c3[name] = ws2[:n].clone()
        if not torch.equal(c3["tiles"], c3["sorted"]) or not c3["tiles"].any():
            bad.append("GEMM2 alone after GEMM1 (split stages) differs between step_layout's route tiles and the "
                       "sorted layout")
    finally:
        tx.ROUTE_TILES_MAX = saved
    return bad or None


@check("experts_fp8_tensor_amax_in_gemm1")
def _():
    """The dynamic per-tensor requantization's amax found in GEMM1's epilogue (``AMAX_EPILOGUE`` 1: ``OUT_AMAX``;
    2: ``OUT_AMAX_SLOTS`` with GEMM2 quantizing its A tiles on load; 3: ``OUT_AMAX_SLOTS`` reduced by the
    requantization kernel's one pass) gives the same bits as act_quant_kernel's own pass: routed rows only (a bias makes the padding rows' activations
    nonzero, and larger than the routed ones), over several N tiles and row tiles, with an expert map; then one
    routed NaN poisons the call on both paths."""
    from backends.triton import kernels as K_
    xe, w1e, w2e, we, ide, eme, Ege = make(11, 2, 128, 64, 2, torch.bfloat16, ep=2)
    # routed rows: x >= 0, w1 < 0, so x . w1 ~ -20 and the activation of (x . w1 + 30) ~ 10 x 10; padding rows
    # (A masked to zero) get the activation of the bias alone, silu(30) x 30 ~ 900: counted, they would set the scale
    xe = xe.abs()
    w1e = -(0.1 + 0.2 * torch.rand(w1e.shape, generator=G)).to(w1e.dtype)
    (q1, s1), (q2, s2) = per_expert(rq.scaled_fp8_quant, w1e), per_expert(rq.scaled_fp8_quant, w2e)
    b1 = torch.full((w1e.shape[0], w1e.shape[1]), 30.0).bfloat16()
    qc = fp8_w8a8_moe_quant_config(s1.reshape(-1), s2.reshape(-1))
    qc = dataclasses.replace(qc, w1=dataclasses.replace(qc.w1, bias=b1))
    xn = xe.clone()
    routed = (eme[ide.long()] >= 0).any(1).nonzero()[0, 0]
    xn[routed, 5] = float("nan")  # a token routed to an expert held here
    # AMAX_EPILOGUE 2 (slots, GEMM2 quantizing on load) also on the tilings that change the slot count or who
    # writes a slot: N_TILES 2, HALF_TAIL, SPLIT_K on GEMM1 (one chain), SWAP_AB on GEMM2
    def cfg_of(flag, variant=""):
        cfg = CFG(bm=32, half=1) if variant == "half_tail" else CFG()
        cfg["gemm1"]["AMAX_EPILOGUE"] = flag
        if variant == "n_tiles":
            cfg["gemm1"].update(N_TILES=2)
        elif variant == "split_k":
            cfg["gemm1"].update(SPLIT_K=2, JOINT_GATE_UP=1)
        elif variant == "swap":
            cfg["gemm2"].update(SWAP_AB=1)
        return cfg

    runs = {(1, ""): cfg_of(1), **{(f, v): cfg_of(f, v) for f in (2, 3) for v in ("", "n_tiles", "half_tail",
                                                                                     "split_k", "swap")}}
    # fresh workspaces full of 0x7F bytes (fp32 3.4e38): a slot no tile wrote would set a huge scale; every
    # launch's epilogue and A mode recorded, and each requantization pass's mode and whether it read slots, so that
    # AMAX_EPILOGUE 2 / 3 are seen to take their slots paths
    real_region, real_launch, real_quant, seen = tx._bytes_region, tx.launch_gemm, tx._launch_act_quant, []
    tx._bytes_region = lambda ws, nbytes, device: real_region(ws, nbytes, device).fill_(0x7F)

    def launch(ops, shape, scales, epi, cfg, **kw):
        seen.append((int(epi.out_quant), int(scales.a_mode)))
        return real_launch(ops, shape, scales, epi, cfg, **kw)

    def quant(**kw):
        seen.append(("act_quant", kw["qmode"], kw.get("slots") is not None))
        return real_quant(**kw)

    tx.launch_gemm, tx._launch_act_quant = launch, quant
    try:
        base = [tri_fe(xx, q1, q2, we, ide, global_num_experts=Ege, expert_map=eme, quant_config=qc,
                       config=cfg_of(0)) for xx in (xe, xn)]
        bad = []
        for (flag, variant), cfg in runs.items():
            seen.clear()
            out = [tri_fe(xx, q1, q2, we, ide, global_num_experts=Ege, expert_map=eme, quant_config=qc, config=cfg)
                   for xx in (xe, xn)]
            name = f"AMAX_EPILOGUE {flag} {variant}".strip()
            want = {1: [(OUT_AMAX, ScaleMode.TENSOR), ("act_quant", K_.QMODE_FP8_TENSOR_QUANT, False),
                        (0, ScaleMode.ROW)],
                    2: [(OUT_AMAX_SLOTS, ScaleMode.TENSOR), (0, ScaleMode.TENSOR_SLOTS)],
                    3: [(OUT_AMAX_SLOTS, ScaleMode.TENSOR), ("act_quant", K_.QMODE_FP8_TENSOR_QUANT, True),
                        (0, ScaleMode.ROW)]}[flag] * 2
            if seen != want:
                bad.append(f"{name}: launches (out_quant, A_SCALE) {seen}, expected {want}")
            if not torch.equal(out[0], base[0]):
                bad.append(f"{name}: outputs differ: max |diff| {(out[0].float() - base[0].float()).abs().max()}")
            if not torch.equal(out[1].isnan(), base[1].isnan()) or not out[1].isnan().any():
                bad.append(f"{name}: a routed NaN does not poison the call as the act_quant pass does")
    finally:
        tx._bytes_region, tx.launch_gemm, tx._launch_act_quant = real_region, real_launch, real_quant
    return bad or None


@check("experts_stages")
def _():
    """``TritonExperts.stages`` (the conformance diagnosis protocol): each launch path hands out the intermediates it
    materializes, by route (zeros for routes held by another EP rank), and each equals the reference's stage."""
    from types import SimpleNamespace
    from conformance.diagnose import reference_stages
    xe, w1e, w2e, we, ide, eme, Ege = make(11, 2, 128, 64, 2, torch.bfloat16, ep=2)
    (q1, s1), (q2, s2) = per_expert(rq.scaled_fp8_quant, w1), per_expert(rq.scaled_fp8_quant, w2)
    b1, b2, qb = block()
    runs = [  # (name, tensors, quant config, config, the stages this path materializes)
        ("bf16 fused, EP", (xe, w1e, w2e, we, ide, eme, Ege), None, CFG(), {"activation", "gemm2"}),
        ("bf16 unfused, EP", (xe, w1e, w2e, we, ide, eme, Ege), None, CFG(fuse=0), {"gemm1", "activation", "gemm2"}),
        ("fp8_tensor", (x, q1, q2, *rest), fp8_w8a8_moe_quant_config(s1.reshape(-1), s2.reshape(-1)), CFG(),
         {"activation", "gemm2"}),
        ("fp8_tensor unfused", (x, q1, q2, *rest), fp8_w8a8_moe_quant_config(s1.reshape(-1), s2.reshape(-1)),
         CFG(fuse=0), {"gemm1", "gemm2"}),
        ("fp8_block fused requant", (x, b1, b2, *rest), qb, CFG(bn1=128, bk1=64, bk2=128), {"gemm2"}),
    ]
    bad = []
    for name, (xx, ww1, ww2, ww, ii, em, eg), qc, cfg, want in runs:
        taps = {}
        tri_fe(xx, ww1, ww2, ww, ii, global_num_experts=eg, expert_map=em, quant_config=qc, config=cfg, taps=taps)
        if set(taps) != want:
            bad.append(f"{name}: stages {sorted(taps)}, expected {sorted(want)}")
            continue
        ref = reference_stages(SimpleNamespace(quant_config=qc or FusedMoEQuantConfig(), hidden_states=xx, w1=ww1,
                                               w2=ww2, topk_ids=ii, expert_map=em), A.SILU)
        for st, t in taps.items():
            if t.shape != ref[st].shape:
                bad.append(f"{name} {st}: shape {tuple(t.shape)} != {tuple(ref[st].shape)}")
                continue
            unheld = ref[st].abs().sum(-1) == 0
            if em is not None and not unheld.any():
                bad.append(f"{name}: every route is held here; the EP run checks nothing")
            elif em is not None and t[unheld].abs().max() > 0:
                bad.append(f"{name} {st}: non-zero rows for routes not held here")
            # a stage, judged by the error model's bound for that stage (followed up to it)
            r = close(t, ref[st], "fp8" if qc is not None else "bfloat16",
                      experts_bound(xx, ww1, ii, quant_config=qc, expert_map=em, stage=st))
            if r is not True:
                bad.append(f"{name} {st}: {r}")
    return bad or None


@check("deterministic")
def _():
    a = tri_fe(*D[:5], global_num_experts=D[6], config=CFG())
    b = tri_fe(*D[:5], global_num_experts=D[6], config=CFG())
    return torch.equal(a, b) or "two runs differ"
'''


@pytest.fixture(scope="module")
def results():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -e '.[triton]')")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", WORKER], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1200)  # the whole interpreter worker: ~7 min on 2 busy cores
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[d["name"]] = d
    if not out:
        pytest.fail(f"interpreter worker produced no results (rc={r.returncode}):\n{r.stdout[-2000:]}\n"
                    f"{r.stderr[-4000:]}")
    out["_stderr"] = r.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", CHECKS)
def test_triton_interpreter(results, name):
    if name not in results:
        pytest.fail(f"check {name} did not report (worker crashed?):\n{results['_stderr']}")
    r = results[name]
    assert r["ok"], f"{name}: {r['detail']}"
