"""Every tuned launch configuration of the triton backend compiles for sm_90 (H100 / H200), checked on a CPU.

``tools.triton.sm90`` swaps Triton's driver for one that compiles for ``cuda:90`` with Triton's bundled ptxas and
launches nothing, then runs the real experts step (host code, JIT specialization, every kernel launch) on CPU
tensors for each entry of the H200 and H100 tables. This catches what the interpreter subset cannot: a tile code
path that does not compile for the GPU (a ``CompilationError`` only some configurations reach), a shared-memory
request above the SM's 227 KiB, a TMA box Triton rejects. It checks compilation only, not numerics or speed. On the
H200 the registers, spill flag, shared memory and warps it reports matched the driver's for all 97 (shape, M,
kernel) groups compared (docs/notes/triton.md).

Runs in subprocesses (one per GPU's tables, in parallel) because it replaces process-wide Triton state.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUS = ["NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"]
# the grouped GEMMs: the Triton kernel, the Gluon block-FP8 one (entries with GLUON) and the warp-specialized Gluon
# one (PINGPONG / COOPERATIVE)
GEMMS = ("fused_moe_kernel", "fp8_block_moe_gemm_kernel", "ws_moe_gemm_kernel")

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed (pip install -e .[triton])"),
              pytest.mark.slow]  # minutes of sm_90 compilation on the CPU: nox -s slow


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = {g: subprocess.Popen([sys.executable, "-m", "tools.triton.sm90", "--gpus", g, "--json"], cwd=ROOT,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for g in GPUS}
    out = {}
    for g, p in procs.items():
        stdout, stderr = p.communicate(timeout=1800)
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        out[g] = (p.returncode, rows, stderr)
    return out


def _table_entries(gpu):
    """(shape, M) of every entry of ``gpu``'s tables for the bench shapes, read from the JSON files directly."""
    from backends.triton import configs as C
    from tools.triton.common import shapes
    SHAPES = shapes()

    entries = set()
    for sh in SHAPES:
        table = C.load_table(sh.E, sh.I, *sh.table_key, gpu)
        entries |= {(sh.name, M) for M in (table or {})}
    return entries


@pytest.mark.parametrize("gpu", GPUS)
def test_every_table_entry_compiles_for_sm90(compiled, gpu):
    rc, rows, stderr = compiled[gpu]
    errors = [r for r in rows if "error" in r]
    assert not errors, f"{gpu}: entries that do not compile for sm_90: {errors}"
    assert rc == 0, f"tools.triton.sm90 --gpus {gpu} exited {rc}:\n{stderr[-3000:]}"
    expected = _table_entries(gpu)
    assert expected, f"no tuned tables found for {gpu}"
    seen = {(r["shape"], r["M"]) for r in rows if r.get("kernel") in GEMMS}
    assert seen == expected, f"{gpu}: entries without a compiled GEMM: {sorted(expected - seen)}"


@pytest.mark.parametrize("gpu", GPUS)
def test_no_kernel_of_the_step_spills(compiled, gpu):
    """Alignment, permutation, activation / quantization and reduction kernels fit their registers too (a spill is
    local-memory traffic on a latency-bound path: the scan of the route layout spilled 144-192 bytes before its tile
    was cut to a quarter and given 8 warps)."""
    spills = [(r["shape"], r["M"], r["kernel"], r["regs"], r["stack"]) for r in compiled[gpu][1]
              if "kernel" in r and r["stack"] > 0]
    assert not spills, f"{gpu}: kernels spilling to local memory (shape, M, kernel, regs, stack bytes): {spills}"


@pytest.mark.parametrize("gpu", GPUS)
def test_gemms_use_the_hopper_paths_and_do_not_spill(compiled, gpu):
    """The GEMMs of every entry fit the SM's registers without spilling to local memory and its shared memory;
    those of the prefill entries (M >= 1024: 64- and 128-row tiles) compile to wgmma (HGMMA / QGMMA), the Hopper
    tensor-core path, not mma.sync."""
    from tools.triton.sm90 import SM90

    gemms = [r for r in compiled[gpu][1] if r.get("kernel") in GEMMS]
    assert gemms
    spills = [(r["shape"], r["M"], r["regs"], r["stack"]) for r in gemms if r["stack"] > 0]
    assert not spills, f"{gpu}: GEMMs spilling to local memory (shape, M, regs, stack bytes): {spills}"
    assert all(r["shared"] <= SM90["max_shared_mem"] for r in gemms)
    no_wgmma = [(r["shape"], r["M"], r["ops"]) for r in gemms
                if r["M"] >= 1024 and not {"HGMMA", "QGMMA", "IGMMA"} & set(r["ops"])]
    assert not no_wgmma, f"{gpu}: prefill GEMMs without wgmma: {no_wgmma}"


def _gluon_fp8(r):
    """A block-FP8 GEMM of a Gluon kernel (the promotion of one K tile overlapping the next K tile's wgmma)."""
    return r.get("kernel") == "fp8_block_moe_gemm_kernel" or (r.get("kernel") == "ws_moe_gemm_kernel"
                                                              and "QGMMA" in r.get("ops", {}))


def test_gluon_gemm_overlaps_the_scale_promotion_with_the_mmas(compiled):
    """The Gluon block-FP8 GEMMs exist to keep one K tile's wgmma in flight while the previous tile's result is
    scaled into the accumulator: their SASS must wait with one group outstanding (``WARPGROUP.DEPBAR.LE gsb0, 0x1``).
    ptxas drops those waits and serializes every wgmma when a non-wgmma instruction touches an in-flight
    accumulator (a register copy between the wgmmas of a tile, e.g. from a loop-carried swap of the two register
    sets, or the promotion sunk past the next MMA), which would silently turn the kernel back into the Triton
    kernel's schedule."""
    rows = [r for r in compiled["NVIDIA_H200"][1] if _gluon_fp8(r)]
    if not rows:
        pytest.skip("no NVIDIA_H200 table entry runs block FP8 on a Gluon GEMM (GLUON, PINGPONG, COOPERATIVE)")
    # (N_HALVES entries serialize the promotion by design: one MMA register set a consumer, DeepGEMM's schedule)
    serialized = [(r["shape"], r["M"], r["kernel"], r["ops"]) for r in rows
                  if not r["ops"].get("DEPBAR_LE_1") and not r.get("n_halves")]
    assert not serialized, f"Gluon GEMMs whose wgmmas ptxas serialized: {serialized}"


def test_warp_specialized_entries_run_their_partitions(compiled):
    """A ``PINGPONG`` / ``COOPERATIVE`` GEMM compiles to the three partitions: 12 warps (two consumer warpgroups and
    the producer's warp rounded up to a warpgroup) within the 64K registers of an SM at launch (168 per thread,
    rebalanced by setmaxnreg), with TMA loads and wgmma."""
    rows = [r for r in compiled["NVIDIA_H200"][1] if r.get("kernel") == "ws_moe_gemm_kernel"]
    if not rows:
        pytest.skip("no NVIDIA_H200 table entry uses the warp-specialized GEMM")
    bad = [(r["shape"], r["M"], r["num_warps"], r["regs"], r["ops"]) for r in rows
           if r["num_warps"] != 12 or r["regs"] * 12 * 32 > 65536 or "UTMALDG" not in r["ops"]
           or not {"HGMMA", "QGMMA"} & set(r["ops"])]
    assert not bad, f"warp-specialized GEMMs off their partition layout: {bad}"


def test_warp_specialized_epilogues_convert_two_values_per_instruction(compiled):
    """The warp-specialized GEMMs' epilogues round to bf16 with packed conversions only (``F2FP ... PACK_AB``: two
    values an instruction; ``gluon_ws._rounded``): a gated epilogue's gate / up roundings as one ``F2F.BF16.F32`` a
    value put it on the 16-lane conversion pipe beside SiLU's two ``MUFU`` per value, while both consumers' tensor
    cores wait (GEMM1 2-3.6% slower on the H200's FP8 prefill entries, twenty-sixth session)."""
    rows = [r for g in GPUS for r in compiled[g][1] if r.get("kernel") == "ws_moe_gemm_kernel"]
    if not rows:
        pytest.skip("no table entry uses the warp-specialized GEMM")
    unpacked = [(r["shape"], r["M"], r["ops"]["F2F_BF16"]) for r in rows if r["ops"].get("F2F_BF16")]
    assert not unpacked, f"warp-specialized GEMMs rounding one value per conversion: {unpacked}"


def test_eight_warp_fused_epilogues_convert_two_values_per_instruction(compiled):
    """``fused_moe_kernel`` on 8-warp tiles rounds gate and up to bf16 with packed conversions only
    (``experts._pack_round``, ``jit.act_rounded``: the three 8-warp prefill GEMM1s 1.0-1.2% faster on the H200,
    twenty-eighth session); its 4-warp tiles keep one conversion a value (packing slowed them)."""
    rows = [r for g in GPUS for r in compiled[g][1] if r.get("kernel") == "fused_moe_kernel" and r["num_warps"] == 8]
    if not rows:
        pytest.skip("no table entry runs fused_moe_kernel on 8 warps")
    unpacked = [(r["shape"], r["M"], r["ops"]["F2F_BF16"]) for r in rows if r["ops"].get("F2F_BF16")]
    assert not unpacked, f"8-warp fused_moe_kernel tiles rounding one value per conversion: {unpacked}"


GLUON_VARIANTS = r"""
import json, sys, torch
from backends.triton import configs as C
from tools.triton import sm90, tune
from tools.triton.common import make_routing, shapes
SHAPES = shapes()
from backends.triton.experts import fused_experts

sh = next(s for s in SHAPES if s.name == "qwen3_30b_fp8blk")
w1, w2, qc, act = sm90._weights(sh)
x = torch.empty(1024, sh.K, dtype=torch.bfloat16)
w, ids = make_routing(1024, sh.E, sh.topk, torch.device("cpu"), seed=1024)
g = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
for name, g1, g2 in tune._gluon_variants(g, g):
    with sm90.compile_only() as log:
        fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc, config={"gemm1": g1, "gemm2": g2})
    for k in log:
        if k.name == "fp8_block_moe_gemm_kernel":
            print(json.dumps(dict(variant=name, shared=k.shared, **k.resources())), flush=True)
"""


def _compile_script(code: str) -> list[dict]:
    """Run a compile-only script in its own process (it swaps process-wide Triton state); its JSON lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_every_gluon_variant_compiles_with_overlapped_mmas():
    """Every Gluon variant the tuner tries (plain and gated epilogues, 64- and 128-row tiles, persistent) compiles for
    sm_90 without spills, within the SM's shared memory, with one wgmma group left in flight during the promotion:
    also the variants no committed table uses today."""
    from tools.triton.sm90 import SM90

    rows = _compile_script(GLUON_VARIANTS)
    assert {r["variant"] for r in rows} >= {"gluon1act-bm64", "gluon12-bm128", "gluon12act-bm128+persist"}, rows
    bad = [r for r in rows if r["stack"] > 0 or r["shared"] > SM90["max_shared_mem"] or not r["ops"].get("DEPBAR_LE_1")]
    assert not bad, f"Gluon variants spilling, over shared memory or with serialized wgmmas: {bad}"


WS_VARIANTS = r"""
import json, torch
from backends.triton import configs as C
from tools.triton import sm90, tune
from tools.triton.common import make_routing, shapes
SHAPES = shapes()
from backends.triton.experts import fused_experts, strict_kernels

for name, M in (("qwen3_30b_bf16", 1024), ("qwen3_30b_bf16", 4096), ("qwen3_30b_fp8blk", 1024),
                ("dsv3_ep8_fp8blk", 4096), ("mixtral_tp2_fp8_tensor", 4096), ("qwen3_30b_fp8_channel_token", 1024),
                ("gpt_oss_120b_bf16", 4096)):
    sh = next(s for s in SHAPES if s.name == name)
    w1, w2, qc, act = sm90._weights(sh)
    x = torch.empty(M, sh.K, dtype=torch.bfloat16)
    w, ids = make_routing(M, sh.E, sh.topk, torch.device("cpu"), seed=M)
    fp8 = sh.scheme.startswith("fp8")  # block, per-tensor or per-channel: the FP8 tile list (tune --variants ws)
    bm = 64 if M == 1024 else 128
    g = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128 if fp8 else 64, GROUP_SIZE_M=8,
             num_warps=bm // 16, num_stages=3)
    for variant, g1, g2 in tune._ws_variants(dict(g, HALF_TAIL=int(bm == 128)), g, g, fp8):
        with sm90.compile_only() as log, strict_kernels():
            fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc, config={"gemm1": g1, "gemm2": g2})
        for k in log:
            if k.name == "ws_moe_gemm_kernel":
                print(json.dumps(dict(shape=name, variant=variant, warps=k.num_warps, shared=k.shared,
                                      n_halves=k.constexprs.get("N_HALVES", 0), **k.resources())), flush=True)
# an entry the kernel does not cover: ValueError with the reason under strict_kernels, else fused_moe_kernel
sh = next(s for s in SHAPES if s.name == "qwen3_30b_bf16")
w1, w2, qc, act = sm90._weights(sh)
x = torch.empty(256, sh.K, dtype=torch.bfloat16)
w, ids = make_routing(256, sh.E, sh.topk, torch.device("cpu"), seed=256)
g = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=4, PINGPONG=1)
bad = {"gemm1": dict(g, BLOCK_SIZE_N=64, PINGPONG=0, HALF_TAIL=1), "gemm2": g}  # 32-row tails: not ping-pong
try:
    with sm90.compile_only(), strict_kernels():
        fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc, config=bad)
    print(json.dumps(dict(strict="no error")))
except ValueError as exc:
    print(json.dumps(dict(strict=str(exc))))
with sm90.compile_only() as log:
    fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc, config=bad)
print(json.dumps(dict(fallback=[k.name for k in log])))
"""


def test_every_warp_specialized_variant_compiles():
    """Every warp-specialized variant the tuner tries (ping-pong and cooperative; bf16, block FP8 and FP8 per-tensor /
    per-channel; GEMM1 with SiLU-and-mul and GEMM2, over PERMUTE_A's copy or gathering, GATHER_A; 64- and 128-row
    tiles, HALF_TAIL) compiles for sm_90 to 12 warps without spills, within
    the SM's shared memory, on wgmma, the block-FP8 ones with their promotion overlapped; and an entry the kernel
    does not cover names why under ``strict_kernels`` (as the tuner runs) and falls back to ``fused_moe_kernel``
    otherwise."""
    from tools.triton.sm90 import SM90

    rows = _compile_script(WS_VARIANTS)
    kernels = [r for r in rows if "variant" in r]
    names = {r["variant"] for r in kernels}
    assert {"ws2-pingpong", "ws12-coop-bm128+half_tail", "ws12-pingpong-bm64", "ws1-coop+ws2-pingpong"} <= names, names
    # GATHER_A twins of the GEMM1 variants (the producer a warpgroup gathering by route), block FP8 included
    assert {"ws12-coop-bm128+gather", "ws12-halves-coop-bm128+half_tail+gather"} <= names, names
    assert any(r["variant"].endswith("+gather") and r["shape"] == "dsv3_ep8_fp8blk" for r in kernels)
    # gpt-oss (interleaved SWIGLUOAI, expert biases, I = 2880: a last, partial N tile): GEMM1 and GEMM2 on the kernel
    gpt = {r["variant"] for r in kernels if r["shape"] == "gpt_oss_120b_bf16"}
    assert {"ws12-coop-bm128", "ws12-pingpong-bm64+gather", "ws2-pingpong"} <= gpt, gpt
    # FP8 per-tensor / per-channel (issue 44): every variant of the FP8 tile list runs on the kernel (strict_kernels
    # raised for none), GEMM1 and GEMM2 both where the variant puts both there
    for shape in ("mixtral_tp2_fp8_tensor", "qwen3_30b_fp8_channel_token"):
        got = [r["variant"] for r in kernels if r["shape"] == shape]
        assert {"ws12-coop-bm128", "ws12-pingpong-bm64", "ws12-coop-bm128-unfused"} <= set(got), (shape, got)
        assert got.count("ws12-coop-bm128") == 2, (shape, got)
    # (N_HALVES variants wait for every MMA by design, their promotion serialized: no wait leaving one in flight)
    bad = [r for r in kernels if r["stack"] > 0 or r["shared"] > SM90["max_shared_mem"] or r["warps"] != 12
           or not {"HGMMA", "QGMMA"} & set(r["ops"])
           or ("QGMMA" in r["ops"] and not r["n_halves"] and not r["ops"].get("DEPBAR_LE_1"))]
    assert not bad, f"warp-specialized variants spilling, over shared memory, or with serialized wgmmas: {bad}"
    halves = {(r["shape"], r["variant"]) for r in kernels if r["n_halves"]}
    for shape, kt in (("mixtral_tp2_fp8_tensor", 2), ("qwen3_30b_fp8_channel_token", 2), ("dsv3_ep8_fp8blk", 1)):
        assert (shape, "ws12-halves-coop-bm128") in halves, (shape, sorted(halves))
        # per-tensor / per-channel: promoted every PROMOTE_K = 256 K elements (two K tiles); block: every K tile
        assert {r["n_halves"] for r in kernels if r["shape"] == shape and r["n_halves"]} == {kt}, shape
    strict = next(r["strict"] for r in rows if "strict" in r)
    assert "not covered by gluon_ws" in strict and "HALF_TAIL" in strict, strict
    fallback = next(r["fallback"] for r in rows if "fallback" in r)
    assert "fused_moe_kernel" in fallback and "ws_moe_gemm_kernel" not in fallback, fallback


FP8_PROMOTED = r"""
import json, torch
from backends.triton import configs as C
from tools.triton import sm90
from tools.triton.common import make_routing
from backends.triton.experts import fused_experts, plan_quant, promotion_tiles, strict_kernels
from tools.triton.fp8_accum import timing_shapes

GEMMS = ("fused_moe_kernel", "ws_moe_gemm_kernel")
# one GPU's tables: a kernel compiled once is served from the JIT's cache, and the H100's FP8 per-tensor /
# per-channel tables hold the H200's entries (test_triton_configs checks that they are the same)
for gpu in ("NVIDIA_H200",):
    for sh in timing_shapes():
        w1, w2, qc, act = sm90._weights(sh)
        plan = plan_quant(qc)
        for M in (64, 1024, 4096):
            x = torch.empty(M, sh.K, dtype=torch.bfloat16)
            w, ids = make_routing(M, sh.E, sh.topk, torch.device("cpu"), seed=M)
            with sm90.compile_only(gpu) as log, strict_kernels():
                cfg = C.get_config(M, sh.E, sh.I, sh.K, sh.topk, plan.cfg_dtype, None)
                fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc)
            gemms = [k for k in log if k.name in GEMMS]
            for g, k, a_mode in zip(("gemm1", "gemm2"), gemms, (plan.a1_mode, plan.a2_mode)):
                print(json.dumps(dict(gpu=gpu, shape=sh.name, M=M, gemm=g, kernel=k.name, bm=cfg[g]["BLOCK_SIZE_M"],
                                      promote=promotion_tiles(cfg[g], a_mode=a_mode), warps=k.num_warps,
                                      shared=k.shared, n_halves=k.constexprs.get("N_HALVES", 0),
                                      **k.resources())), flush=True)
"""


def test_fp8_per_tensor_and_channel_gemms_compile_promoted():
    """The FP8 per-tensor (Mixtral TP2) and per-channel x per-token (Qwen3-30B) experts steps, on the configurations
    the launch picks on the H200 (decode: the defaults on ``fused_moe_kernel``; prefill: the committed
    tables' warp-specialized Gluon entries, which their kernel must cover: ``strict_kernels``), compile for sm_90
    with the accumulator promoted without spills, within shared memory, the prefill GEMMs on wgmma (QGMMA).
    ``fused_moe_kernel``: ``PROMOTE`` > 0, and where an interval holds several K tiles on wgmma the chain inside it
    stays asynchronous (a wait that leaves one or two groups in flight). ``ws_moe_gemm_kernel``: its three
    partitions (12 warps), each K tile promoted while the next one's wgmma runs (a wait for <= 1 group)."""
    from tools.triton.sm90 import SM90

    rows = _compile_script(FP8_PROMOTED)
    assert len(rows) == 2 * 3 * 2, rows
    bad = [r for r in rows if r["stack"] > 0 or r["shared"] > SM90["max_shared_mem"]
           or (r["M"] >= 1024 and r["bm"] >= 64 and "QGMMA" not in r["ops"])
           or (r["kernel"] == "fused_moe_kernel" and r["promote"] < 1)]
    assert not bad, f"FP8 GEMMs not promoted, spilling, over shared memory or off wgmma: {bad}"
    serialized = [r for r in rows if "QGMMA" in r["ops"] and r["promote"] > 1 and r["kernel"] == "fused_moe_kernel"
                  and not (r["ops"].get("DEPBAR_LE_1") or r["ops"].get("DEPBAR_LE_2"))]
    assert not serialized, f"promoted FP8 GEMMs whose wgmma chain ptxas serialized: {serialized}"
    ws = [r for r in rows if r["kernel"] == "ws_moe_gemm_kernel"]
    assert {(r["shape"], r["M"]) for r in ws} >= {(s, M) for s in ("qwen3_30b_fp8_channel_token",
                                                                     "mixtral_tp2_fp8_tensor") for M in (1024, 4096)}
    off = [r for r in ws if r["warps"] != 12 or "UTMALDG" not in r["ops"]
           or not (r["n_halves"] or r["ops"].get("DEPBAR_LE_1"))]
    assert not off, f"warp-specialized FP8 GEMMs off their partitions or with serialized promotion: {off}"


ROUTE_TILES_M1 = r"""
import json
import backends.triton.experts as tx
from tools.triton.sm90 import compile_tables
tx.ROUTE_TILES_MAX = 16  # the default, whatever the environment says: every M = 1 step (M * topk <= E) runs without a route layout
for r in compile_tables("NVIDIA_H200", Ms=[1], progress=lambda *_: None):
    print(json.dumps(r), flush=True)
"""


def test_decode_without_a_route_layout_compiles():
    """``ROUTE_TILES`` (on by default; ``MOE_TRITON_ROUTE_TILES=0`` turns it off): every M = 1 entry of the H200
    tables compiles for sm_90 with it on, without spills, and its step launches no route-layout kernel."""
    rows = _compile_script(ROUTE_TILES_M1)
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    assert rows and {r["M"] for r in rows} == {1}
    bad = [r for r in rows if r["stack"] > 0 or r["kernel"].startswith("_align")]
    assert not bad, f"spilling kernels, or a layout kernel in a step without a layout: {bad}"
    assert any(r["kernel"] == "fused_moe_kernel" for r in rows)


WS_AMAX_SLOTS = r"""
import json, os, shutil, tempfile
d = tempfile.mkdtemp()
src = os.path.join("backends", "triton", "configs")
for f in os.listdir(src):
    shutil.copy(os.path.join(src, f), d)
name = "E=8,N=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
t = json.load(open(os.path.join(d, name)))
t["1024"]["gemm1"]["AMAX_EPILOGUE"] = 3  # the prefill entry: GEMM1 on gluon_ws (COOPERATIVE)
json.dump(t, open(os.path.join(d, name), "w"))
os.environ["MOE_TRITON_CONFIG_DIR"] = d  # read when backends.triton.configs is imported
from tools.triton.sm90 import compile_tables
for r in compile_tables("NVIDIA_H200", shapes=["mixtral_tp2_fp8_tensor"], Ms=[1024], progress=lambda *_: None):
    print(json.dumps(r), flush=True)
"""


def test_warp_specialized_gemm1_writes_amax_slots():
    """``AMAX_EPILOGUE`` 3 with GEMM1 on ``gluon_ws`` (Mixtral TP2 fp8_tensor's prefill entry, committed in the
    fifteenth session): its consumers write the amax slots, so the step compiles for sm_90 under strict kernels (gluon_ws
    covers the GEMM, no fallback), without spills, and one requantization kernel (the slots pass) runs between the
    two GEMMs instead of the amax pass and the quant pass."""
    rows = _compile_script(WS_AMAX_SLOTS)
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    kernels = [r["kernel"] for r in rows]
    ws = [i for i, k in enumerate(kernels) if k == "ws_moe_gemm_kernel"]
    assert len(ws) == 2, kernels
    assert kernels[ws[0] + 1:ws[1]] == ["act_quant_kernel"], kernels
    assert all(rows[i]["stack"] == 0 for i in ws), [rows[i] for i in ws]


WS_AMAX_FORMS = r"""
import json, torch
from tools.triton.sm90 import compile_only
from backends.triton.experts import fused_experts, strict_kernels
from reference.config import fp8_w8a8_moe_quant_config

E, K, I, topk, M = 8, 1024, 512, 2, 700
w1 = torch.empty(E, 2 * I, K, dtype=torch.float8_e4m3fn)
w2 = torch.empty(E, K, I, dtype=torch.float8_e4m3fn)
qc = fp8_w8a8_moe_quant_config(torch.ones(E), torch.ones(E))  # dynamic per-tensor activations
x = torch.empty(M, K, dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
w = torch.rand(M, topk)
g2 = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=4, USE_TMA=1,
          COOPERATIVE=1)
for sched, bm, bn in (("PINGPONG", 64, 64), ("PINGPONG", 128, 32), ("COOPERATIVE", 128, 64)):
    for half_tail in ((0, 1) if bm == 128 else (0,)):
        g1 = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=4,
                  USE_TMA=1, PERMUTE_A=1, FUSE_QUANT=0, HALF_TAIL=half_tail, AMAX_EPILOGUE=3, **{sched: 1})
        form = f"{sched.lower()}-bm{bm}" + ("+half_tail" if half_tail else "")
        with compile_only("NVIDIA_H200") as log, strict_kernels():
            try:
                g2b = dict(g2, BLOCK_SIZE_M=bm) if bm == 128 else dict(g2, BLOCK_SIZE_M=64, COOPERATIVE=0, PINGPONG=1)
                fused_experts(x, w1, w2, w, ids, quant_config=qc, config={"gemm1": g1, "gemm2": g2b})
            except Exception as exc:
                print(json.dumps({"form": form, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"}), flush=True)
                continue
        for k in log:
            if k.name == "ws_moe_gemm_kernel":
                print(json.dumps({"form": form, "stack": k.resources()["stack"]}), flush=True)
"""


def test_every_warp_specialized_amax_form_compiles():
    """``AMAX_EPILOGUE`` 3 on ``gluon_ws`` in every schedule the tuner can draw (ping-pong 64- and 128-row tiles, the
    latter with ``HALF_TAIL``'s 64-row tails, whose per-row maxima are folded into the running ones as one value;
    cooperative with and without tails) compiles for sm_90 under strict kernels, without spills (a ping-pong tail's
    maxima once had another shape than the full tile's in the same branch, which did not compile)."""
    rows = _compile_script(WS_AMAX_FORMS)
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    forms = {r["form"] for r in rows}
    assert forms == {"pingpong-bm64", "pingpong-bm128", "pingpong-bm128+half_tail", "cooperative-bm128",
                     "cooperative-bm128+half_tail"}, forms
    assert all(r["stack"] == 0 for r in rows), rows


@pytest.mark.parametrize("what", [
    pytest.param(["--gpus", "NVIDIA_H200", "--shapes", "qwen3_30b_fp8blk,mixtral_tp2_fp8_tensor", "--ms", "64,1024"],
                 id="triton-tables"),
    pytest.param(["--glue"], id="deep_gemm-glue")])
def test_fp_fusion_is_pinned_whatever_the_environment(what):
    """The kernels' numerics were checked on the GPU with FMA contraction on, Triton 3.6 - 3.9's default; Triton 3.10
    turns the default off (``TRITON_DEFAULT_FP_FUSION``), which rounds the FP8 promotion, the epilogue scales, the
    activations and the top-k weighted sum differently (FMUL + FADD for FFMA). Every floating-point launch of the
    triton backend and of the deep_gemm backend's Triton glue pins it (``backends._triton_launch.FP_FUSION``):
    compiled with the default turned off, every kernel's instructions are those of the default build (without the
    pin, 106 of 280 H200 table kernels and the glue's activation-and-requantization kernels change)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "tools.triton.sm90", *what, "--json"]
    runs = {}
    for fusion in ("1", "0"):
        p = subprocess.run(cmd, cwd=ROOT, env=dict(env, TRITON_DEFAULT_FP_FUSION=fusion), capture_output=True,
                           text=True, timeout=1200)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[fusion] = [(r["shape"], r["M"], r["kernel"], r["ops"]) for r in map(json.loads, p.stdout.splitlines())
                        if "kernel" in r]
    assert any(ops.get("FFMA") for *_, ops in runs["1"]), "no contracted multiply-add at all: nothing was checked"
    changed = [(a[:3], a[3], b[3]) for a, b in zip(runs["1"], runs["0"]) if a != b]
    assert len(runs["1"]) == len(runs["0"]) and not changed, \
        f"kernels compiled differently with TRITON_DEFAULT_FP_FUSION=0 (entry, default, off): {changed}"
