"""Triton backend behaviour that only a GPU shows: SPLIT_K's cross-program arrival counters under concurrency and
CUDA-graph replay (the interpreter runs programs one after another, tests/test_triton_interpret.py), and the hardware
FP8 encoder the quantizers use on the GPU (the interpreter runs the software one).

Run on an SM90 machine: ``python -m pytest tests/test_triton_gpu.py`` (``tools/gpu/gpu_session.sh tests-triton_gpu``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="these kernels run on an SM90 GPU (none here)"),
]


def _case(split_k: int, M: int = 3, n_tiles: int = 1):
    from reference import quant as rq
    from reference.config import fp8_w8a8_moe_quant_config
    from reference.routing import fused_topk

    g = torch.Generator().manual_seed(7)
    E, K, I, topk = 16, 2048, 256, 4
    w1 = (torch.randn(E, 2 * I, K, generator=g) * K ** -0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) * I ** -0.5).bfloat16()
    q1, s1 = rq.per_block_quant_fp8(w1, (128, 128))
    q2, s2 = rq.per_block_quant_fp8(w2, (128, 128))
    x = torch.randn(M, K, generator=g).bfloat16()
    w, ids = fused_topk(None, torch.randn(M, E, generator=g), topk, True)[:2]
    dev = "cuda"
    qc = fp8_w8a8_moe_quant_config(s1.to(dev), s2.to(dev), block_shape=[128, 128])
    cfg = {"gemm1": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, num_warps=4, num_stages=4,
                         FUSE_QUANT=0, JOINT_GATE_UP=1, SPLIT_K=split_k),
           "gemm2": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, num_warps=4, num_stages=3,
                         SPLIT_K=min(split_k, 2), N_TILES=n_tiles)}
    return (x.to(dev), q1.to(dev), q2.to(dev), w.to(dev), ids.to(dev)), qc, cfg


@pytest.mark.parametrize("M, n_tiles", [(3, 1), (64, 3)], ids=["decode", "n_tiles3-wrapped"])
def test_split_k_is_deterministic_and_replays_from_a_cuda_graph(M, n_tiles):
    """SPLIT_K 4 / 2 (GEMM1 / GEMM2): eager calls are bitwise equal to each other whichever program arrives last; a
    captured CUDA graph replayed three times gives the eager bits (the counters left zero by every launch); and the
    output is within the tuner's 1e-2 of the unsplit one (another order of the fp32 partial sums). The second case
    runs GEMM2's 32 N tiles three per program over many row tiles at once, its last group running past N (a wrapped
    tile counts in a slot of its own row tile). A planted slot stride without the wrapped tile, which lands that
    tile's slot on the next row tile's first, still passed here on the H100 (the two never run at the same time in
    this grid order): the stride is right by construction, not by this test."""
    from backends.triton.experts import fused_experts

    args, qc, cfg = _case(4, M, n_tiles)
    run = lambda: fused_experts(*args, quant_config=qc, config=cfg)  # noqa: E731
    eager = run()
    for _ in range(3):
        assert torch.equal(run().view(torch.int16), eager.view(torch.int16)), "eager SPLIT_K runs differ"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.view(torch.int16), eager.view(torch.int16)), "graph replay differs from eager"
    args1, qc1, cfg1 = _case(1, M, n_tiles)
    one = fused_experts(*args1, quant_config=qc1, config=cfg1)
    d = ((eager.double() - one.double()).abs().max() / one.double().abs().max()).item()
    assert d <= 1e-2, f"SPLIT_K output {d:.2e} (max_norm) from the unsplit one"


def test_hardware_e4m3_encoder_equals_the_software_one_on_every_fp32():
    """``jit.fp8e4m3_code`` on the GPU (``cvt.rn.satfinite.e4m3x2.f32``) against ``fp8e4m3_code_soft`` (the
    interpreter's encoder, whose codes tests/test_triton_interpret.py compares bit for bit with ``reference.quant``)
    over all 2^32 fp32 bit patterns, NaNs and infinities included; and against torch's CUDA cast after the clamp
    (RNE, an oracle independent of both) on the chunk that holds the subnormal and small normal codes."""
    import triton
    import triton.language as tl

    from backends.triton.jit import fp8e4m3_code, fp8e4m3_code_soft

    @triton.jit
    def both(base, y_ptr, z_ptr, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        q = (base + o).to(tl.int32).to(tl.float32, bitcast=True)  # low 32 bits: the pattern
        tl.store(y_ptr + o, fp8e4m3_code(q))
        tl.store(z_ptr + o, fp8e4m3_code_soft(q))

    chunk, block = 1 << 28, 1024
    y = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    z = torch.empty_like(y)
    for c in range(16):
        base = c * chunk  # patterns [base, base + 2^28); an int64 above 2^31, truncated in the kernel
        both[(chunk // block,)](base, y, z, BLOCK=block)
        bad = (y != z).nonzero()
        assert bad.numel() == 0, (
            f"{bad.numel()} codes differ, first input bits {base + int(bad[0]):#010x}: "
            f"hardware {int(y[bad[0]]):#04x}, software {int(z[bad[0]]):#04x}")
        if c == 3:  # [0x30000000, 0x40000000): |q| in [4.7e-10, 2): the subnormal and normal E4M3 codes
            q = (torch.arange(chunk, device="cuda", dtype=torch.int64) + base).to(torch.int32).view(torch.float32)
            ref = q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(y, ref), "hardware encoder differs from torch's RNE cast"


def _ws_case(nan_expert: int | None, local: int | None):
    """Mixtral-like FP8 per-tensor weights (dynamic per-tensor activations) small enough for a test, for the H200
    table's prefill form: both GEMMs on ``gluon_ws`` (cooperative 128-row tiles, GEMM1 gate / up as one tile after
    ``PERMUTE_A``). ``nan_expert``: one weight code of that expert's gate rows is NaN (0x7F), so GEMM1's output is NaN
    on that expert's routes alone (a NaN input row would poison the per-tensor input scale, and with it every
    output, whatever the slots hold); ``local``: the first ``local`` of 8 experts are this rank's (an
    ``expert_map``). Returns ``(fused_experts args, quant_config, expert_map)``."""
    from reference.routing import fused_topk
    from reference.schemes import quantize_weights

    g = torch.Generator().manual_seed(11)
    E, K, I, topk, M = 8, 1024, 512, 2, 700
    w1 = (torch.randn(E, 2 * I, K, generator=g) * K ** -0.5).bfloat16().cuda()
    w2 = (torch.randn(E, K, I, generator=g) * I ** -0.5).bfloat16().cuda()
    x = torch.randn(M, K, generator=g).bfloat16()
    w, ids = fused_topk(None, torch.randn(M, E, generator=g), topk, True)[:2]
    emap = None
    if local is not None:
        emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
        emap[:local] = torch.arange(local, dtype=torch.int32)
        w1, w2 = w1[:local].contiguous(), w2[:local].contiguous()
    q1, q2, qc = quantize_weights("fp8_tensor", w1, w2)
    if nan_expert is not None:
        q1.view(torch.uint8)[nan_expert, 3, 5] = 0x7F  # E4M3's NaN, in a gate row
    return (x.cuda(), q1, q2, w.cuda(), ids.cuda()), qc, emap


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="gluon_ws is sm_90 only (strict kernels raise elsewhere)")
@pytest.mark.parametrize("sched, nan_expert, local", [("COOPERATIVE", None, None), ("COOPERATIVE", 2, None),
                                                     ("COOPERATIVE", None, 5), ("PINGPONG", None, None)],
                         ids=["plain", "nan-expert", "expert-map", "pingpong"])
def test_warp_specialized_amax_slots_equal_the_amax_pass(sched, nan_expert, local):
    """``AMAX_EPILOGUE`` 3 on ``gluon_ws`` (each consumer's largest |value| of GEMM1's stored output in a slot of its
    own, reduced by the requantization's one pass) against 0 (the requantization's own amax pass over the whole
    intermediate): the same per-tensor scale, so the outputs are bitwise equal; with a NaN in one expert's GEMM1
    output (the slots must flag it: the scale, and so every output, is then NaN, where slots that missed it would
    leave the other experts' routes finite) and with an expert map (routes of non-local experts never stored, their
    tiles skipped); cooperative (the committed form) and ping-pong (64-row tiles, one consumer a tile). The
    interpreter cannot run Gluon: this is the slots' only numeric check."""
    from backends.triton.experts import fused_experts, strict_kernels

    args, qc, emap = _ws_case(nan_expert, local)
    bm = 128 if sched == "COOPERATIVE" else 64
    g1 = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=5,
              USE_TMA=1, PERMUTE_A=1, FUSE_QUANT=0, **{sched: 1})
    g2 = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=5,
              USE_TMA=1, **{sched: 1})
    outs = {}
    with strict_kernels():  # gluon_ws must cover both GEMMs: a fallback to fused_moe_kernel raises
        for amax in (0, 3):
            cfg = {"gemm1": dict(g1, AMAX_EPILOGUE=amax), "gemm2": g2}
            outs[amax] = fused_experts(*args, quant_config=qc, config=cfg, expert_map=emap, global_num_experts=8)
    a, b = outs[0], outs[3]
    if nan_expert is not None:
        assert a.isnan().all(), "the amax pass did not poison the per-tensor scale (the test's NaN did not land)"
        assert b.isnan().all(), "the amax slots missed the NaN of one expert's GEMM1 output"
        return
    assert a.isfinite().all() and b.isfinite().all(), "non-finite output from finite inputs"
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
        f"AMAX_EPILOGUE 3 on gluon_ws differs from 0 at {(a != b).sum().item()} elements")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="gluon_ws is sm_90 only (strict kernels raise elsewhere)")
@pytest.mark.parametrize("sched, half_tail, other", [
    ("COOPERATIVE", 0, "two-sets"), ("COOPERATIVE", 1, "two-sets"), ("PINGPONG", 0, "two-sets"),
    ("COOPERATIVE", 0, "fused_moe_kernel"), ("COOPERATIVE", 1, "fused_moe_kernel")],
    ids=["coop", "coop-tail", "pingpong", "coop-vs-fused", "coop-tail-vs-fused"])
@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_channel_token", "fp8_block128"])
def test_n_halves_equal_the_other_promoted_forms(scheme, sched, half_tail, other):
    """``N_HALVES`` on ``gluon_ws`` (a consumer's MMA columns as two halves through one register set, the promotion
    serialized: GEMM1's gate, then up; GEMM2's first, then last ``BLOCK_N / 2`` columns) against another kernel
    with the same promotion points, bitwise: each output element is the same MMA partials added in K order to an fp32
    accumulator, times the same factors, rounded by the same epilogue. ``two-sets``: the two-register-set schedule
    (64 x 128 MMA columns a consumer, promoted every K tile; the halves with ``PROMOTE_K`` = ``BLOCK_K``);
    ``fused_moe_kernel``: the non-Gluon kernel with ``PROMOTE_K`` 256 (per-tensor / per-channel partials over two K
    tiles of 128, the halves' default interval; block scales every K tile). Strict kernels (a fallback raises), an
    expert map (tiles of non-local experts skipped) and, per-tensor, GEMM1's amax slots (``AMAX_EPILOGUE`` 3: the
    halves' gated epilogue folds its own row maxima). The bench checks the tables' forms against the reference;
    this pins the schedule to the other forms bit for bit."""
    from backends.triton.experts import fused_experts, strict_kernels
    from reference.routing import fused_topk
    from reference.schemes import quantize_weights

    g = torch.Generator().manual_seed(5)
    E, K, I, topk, M, local = 8, 1024, 512, 2, 700, 6
    w1 = (torch.randn(local, 2 * I, K, generator=g) * K ** -0.5).bfloat16().cuda()
    w2 = (torch.randn(local, K, I, generator=g) * I ** -0.5).bfloat16().cuda()
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w, ids = fused_topk(None, torch.randn(M, E, generator=g), topk, True)[:2]
    emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    emap[:local] = torch.arange(local, dtype=torch.int32)
    q1, q2, qc = quantize_weights(scheme, w1, w2)
    bm = 128 if sched == "COOPERATIVE" else 64
    common = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=3, USE_TMA=1)
    extra1 = dict(PERMUTE_A=1, FUSE_QUANT=0, HALF_TAIL=half_tail, AMAX_EPILOGUE=3 if scheme == "fp8_tensor" else 0)
    pk = 128 if other == "two-sets" else 256
    halves = {"gemm1": dict(common, BLOCK_SIZE_N=128, N_HALVES=1, PROMOTE_K=pk, **{sched: 1}, **extra1),
              "gemm2": dict(common, BLOCK_SIZE_N=256, N_HALVES=1, PROMOTE_K=pk, **{sched: 1})}
    if other == "two-sets":  # 64 x 128 MMA columns a consumer (GEMM1: 64 gate + 64 up), promoted every K tile
        ref = {"gemm1": dict(common, BLOCK_SIZE_N=64, **{sched: 1}, **extra1),
               "gemm2": dict(common, BLOCK_SIZE_N=128, **{sched: 1})}
    else:
        ref = {"gemm1": dict(common, BLOCK_SIZE_N=128, PROMOTE_K=pk, num_warps=8, **extra1),
               "gemm2": dict(common, BLOCK_SIZE_N=128, PROMOTE_K=pk, num_warps=8)}
    outs = []
    with strict_kernels():
        for cfg in (ref, halves):
            outs.append(fused_experts(x, q1, q2, w.cuda(), ids.cuda(), quant_config=qc, config=cfg,
                                      expert_map=emap, global_num_experts=E))
    a, b = outs
    assert a.isfinite().all() and b.isfinite().all(), "non-finite output from finite inputs"
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
        f"N_HALVES differs from {other} at {(a != b).sum().item()} of {a.numel()} elements, max |diff| "
        f"{(a.float() - b.float()).abs().max().item():.3g}")


_GATHER_CASES = {  # GEMM1 entries of the tables' prefill forms on gluon_ws (GEMM2 the matching gluon_ws tile)
    "bf16-pingpong": ("bf16", dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, PINGPONG=1)),
    "bf16-coop-tail": ("bf16", dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, COOPERATIVE=1, HALF_TAIL=1)),
    "fp8_tensor-halves": ("fp8_tensor", dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, COOPERATIVE=1,
                                             N_HALVES=1, AMAX_EPILOGUE=3, FUSE_QUANT=0)),
    "fp8_tensor-halves-tail": ("fp8_tensor", dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128,
                                                  COOPERATIVE=1, N_HALVES=1, AMAX_EPILOGUE=3, FUSE_QUANT=0,
                                                  HALF_TAIL=1)),
    # per-token and block scales: read by each row's token in the consumers
    "fp8_channel_token-halves-pingpong": ("fp8_channel_token", dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128,
                                                                    BLOCK_SIZE_K=128, PINGPONG=1, N_HALVES=1,
                                                                    FUSE_QUANT=0)),
    "fp8_block128-halves-tail": ("fp8_block128", dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128,
                                                      COOPERATIVE=1, N_HALVES=1, HALF_TAIL=1, FUSE_QUANT=0)),
    "fp8_block128-coop": ("fp8_block128", dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, COOPERATIVE=1,
                                               FUSE_QUANT=0)),
}


def _gather_cfgs(g1: dict) -> tuple[dict, dict]:
    """``(PERMUTE_A, GATHER_A)`` configs of one GEMM1 form (4 stages; GEMM2 on the same schedule)."""
    from backends.triton import configs as C

    sched = "PINGPONG" if g1.get("PINGPONG") else "COOPERATIVE"
    g2 = dict(BLOCK_SIZE_M=g1["BLOCK_SIZE_M"], BLOCK_SIZE_N=128, BLOCK_SIZE_K=g1["BLOCK_SIZE_K"], num_stages=4,
              num_warps=4, USE_TMA=1, **{sched: 1})
    base = dict(g1, num_stages=4, num_warps=4, USE_TMA=1, GROUP_SIZE_M=8)
    return tuple(C.sanitize_config({"gemm1": dict(base, **extra), "gemm2": g2})
                 for extra in (dict(PERMUTE_A=1), dict(GATHER_A=1)))


_GATHER_SIZES = dict(E=8, K=1024, I=512, topk=2, M=1000)


def _gather_inputs(seed: int, n: int):
    """Random bf16 ``w1 (n, 2 I, K)``, ``w2 (n, K, I)`` for ``n`` local experts, ``x (M, K)`` and a top-k routing
    over all ``E`` experts, on the GPU, at ``_GATHER_SIZES``: ``(w1, w2, x, topk_weights, topk_ids)``."""
    from reference.routing import fused_topk

    E, K, I, topk, M = (_GATHER_SIZES[k] for k in ("E", "K", "I", "topk", "M"))
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(n, 2 * I, K, generator=g) * K ** -0.5).bfloat16().cuda()
    w2 = (torch.randn(n, K, I, generator=g) * I ** -0.5).bfloat16().cuda()
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w, ids = fused_topk(None, torch.randn(M, E, generator=g), topk, True)[:2]
    return w1, w2, x, w.cuda(), ids.cuda()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="gluon_ws is sm_90 only (strict kernels raise elsewhere)")
@pytest.mark.parametrize("case", list(_GATHER_CASES))
@pytest.mark.parametrize("local", [None, 6], ids=["all-experts", "expert-map"])
def test_gather_a_equals_permute_a(case, local):
    """``GATHER_A`` (gluon_ws's producer warpgroup gathering GEMM1's rows by route with asynchronous copies) against
    ``PERMUTE_A`` (the rows copied into sorted order first, loaded by TMA): the same A tiles reach the same MMAs, so
    the layer's outputs are bitwise equal; per-tensor FP8 with GEMM1's amax slots (a padding row gathered as
    anything but zeros would move the requantization's scale), per-token and block scales (read by token, not by
    sorted row: a row given another's scale changes its output), ping-pong and cooperative, half-height tails, an
    expert map (routes of non-local experts are padding-like: never gathered), strict kernels (a fallback to
    ``fused_moe_kernel`` raises). Three calls each (the copies' arrivals on the stage barriers are a race if
    miscounted)."""
    from backends.triton.experts import fused_experts, strict_kernels
    from reference.schemes import quantize_weights

    scheme, g1 = _GATHER_CASES[case]
    E = _GATHER_SIZES["E"]
    w1, w2, x, w, ids = _gather_inputs(17, local or E)
    emap = None
    if local is not None:
        emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
        emap[:local] = torch.arange(local, dtype=torch.int32)
    if scheme == "bf16":
        from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG as qc
        q1, q2 = w1, w2
    else:
        q1, q2, qc = quantize_weights(scheme, w1, w2)
    permute, gather = _gather_cfgs(g1)
    args = (x, q1, q2, w, ids)
    with strict_kernels():
        want = fused_experts(*args, quant_config=qc, config=permute, expert_map=emap, global_num_experts=E)
        for call in range(3):
            got = fused_experts(*args, quant_config=qc, config=gather, expert_map=emap, global_num_experts=E)
            assert got.isfinite().all(), f"call {call}: non-finite output from finite inputs"
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                f"call {call}: GATHER_A differs from PERMUTE_A at {(got != want).sum().item()} of {got.numel()} "
                f"elements, max |diff| {(got.float() - want.float()).abs().max().item():.3g}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="gluon_ws is sm_90 only")
@pytest.mark.parametrize("case", ["bf16-pingpong", "bf16-coop-tail"])
def test_gather_a_zero_fills_the_padding_rows(case):
    """GEMM1 alone (``run_experts(stages="gemm1")``) into a workspace poisoned with NaN bytes: with ``GATHER_A`` every
    row of the layout below ``num_tokens_post_padded`` is written, the routed rows equal ``PERMUTE_A``'s bit for bit
    and the padding rows are exactly zero (SiLU-and-mul of zero rows; a stage's padding rows not zero-filled would
    hold an earlier tile's rows and store their products)."""
    from backends.triton import experts as tx
    from reference.activation import MoEActivation
    from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG as qc

    _, g1 = _GATHER_CASES[case]
    E, K, I, topk, M = (_GATHER_SIZES[k] for k in ("E", "K", "I", "topk", "M"))
    w1, w2, x, w, ids = _gather_inputs(23, E)
    ids = ids.to(torch.int32)
    c2 = {}
    for name, cfg in zip(("permute", "gather"), _gather_cfgs(g1)):
        lay = tx.route_layout(ids, cfg, E)
        rows = tx.layout_rows(M * topk, E, tx.layout_block(cfg))
        ws13 = torch.full((rows * I * 2 + (1 << 16),), 0xFF, dtype=torch.uint8, device="cuda")
        ws2 = torch.full((rows * 2 * I * 2 + (1 << 16),), 0xFF, dtype=torch.uint8, device="cuda")
        with tx.strict_kernels():
            tx.run_experts(out=torch.empty(M, K, dtype=torch.bfloat16, device="cuda"), a1q=x, a1q_scale=None,
                           w1=w1, w2=w2, topk_weights=w, topk_ids=ids, activation=MoEActivation.SILU,
                           expert_map=None, num_ids=E, qc=qc, plan=tx.plan_quant(qc), cfg=cfg, ws13=ws13, ws2=ws2,
                           layout=lay, stages="gemm1")
        ntpp = int(lay.num_tokens_post_padded[0])
        sorted_ids = lay.sorted_token_ids[:ntpp].long()
        c2[name] = (ws13[:rows * I * 2].view(torch.bfloat16).view(rows, I)[:ntpp].clone(), sorted_ids)
    (a, ids_a), (b, ids_b) = c2["permute"], c2["gather"]
    assert torch.equal(ids_a, ids_b), "the two configs' layouts differ (the test compares rows by position)"
    pad = ids_b >= M * topk
    assert pad.any(), "no padding rows in the layout: the test checks nothing"
    assert not b.isnan().any(), f"{int(b.isnan().any(1).sum())} rows below num_tokens_post_padded left unwritten"
    assert (b[pad] == 0).all(), f"{int((b[pad] != 0).any(1).sum())} padding rows not zero (stale stage rows)"
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
        f"GATHER_A's GEMM1 output differs from PERMUTE_A's at {int((a != b).sum())} elements")


def _requant_inputs(seed: int, M: int, topk: int, E: int, bs: int, NC: int):
    """A route layout of ``M`` tokens' random top-``topk`` of ``E`` experts (block ``bs``, on the GPU) and GEMM1-like
    bf16 rows over it (CPU, rows of varied magnitude): ``(layout, rows, routes, x, routed)``, ``routed`` the rows that
    hold a route below ``num_tokens_post_padded``."""
    from backends.triton.align import align_routes
    from backends.triton.experts import layout_rows

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32).cuda()
    numel = M * topk
    rows = layout_rows(numel, E, bs)
    lay = align_routes(ids, bs, E, None, E, rows)
    x = (torch.randn(rows, NC, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()
    sid = lay.sorted_token_ids.cpu()[:rows].long()
    routed = (sid < numel) & (torch.arange(rows) < int(lay.num_tokens_post_padded.item()))
    return lay, rows, numel, x, routed


@pytest.mark.parametrize("chunked, tail", [(0, 1), (1, 0), (1, 1)], ids=["rows", "chunks-padded", "chunks-tail"])
@pytest.mark.parametrize("qmode_name", ["QMODE_FP8_TOKEN", "QMODE_INT8_TOKEN"])
def test_per_token_requantization_tiles_equal_the_reference(monkeypatch, chunked, tail, qmode_name):
    """The per-token requantization over a prefill layout (768 columns, Qwen3-30B's intermediate size), in each tile
    form the GPU may take (``[rows, 1024]`` with a row over several warps, ``ROW_CHUNKS`` padded to four chunks,
    ``ROW_CHUNKS`` of two plus a ``ROW_TAIL`` of one), against the reference's per-token quantizers on the CPU:
    every routed row's codes and scale bit for bit, a NaN row and an inf row (FP8; in the first chunk, in the tail)
    poisoning only themselves. The hardware reductions
    and layouts differ from the interpreter's; this is their check."""
    from backends.triton import kernels as K_, quant as T_quant
    from reference import quant as rq

    monkeypatch.setattr(T_quant, "QUANT_ROW_CHUNKED", chunked)
    monkeypatch.setattr(T_quant, "QUANT_ROW_TAIL", bool(tail))
    qmode = getattr(K_, qmode_name)
    M, topk, E, bs, NC = 2048, 8, 128, 64, 768  # prefill: fewer padding rows than routes (no ROUTES)
    lay, rows, numel, x, routed = _requant_inputs(11, M, topk, E, bs, NC)
    if qmode == K_.QMODE_FP8_TOKEN:  # in the first chunk and in the tail
        x[int(routed.nonzero()[10]), 100] = float("nan")
        x[int(routed.nonzero()[20]), 700] = float("inf")
    int8 = qmode == K_.QMODE_INT8_TOKEN
    y = torch.zeros(rows, NC, dtype=torch.int8 if int8 else torch.uint8, device="cuda")
    ys = torch.zeros(rows, 1, dtype=torch.float32, device="cuda")
    T_quant.launch_act_quant(x=x.cuda(), y=y, ys=ys, sorted_ids=lay.sorted_token_ids, expert_ids=lay.expert_ids,
                             ntpp=lay.num_tokens_post_padded, rows=rows, nc=NC, num_valid=numel, block_m=bs, act=0,
                             split=0, qmode=qmode, act_dtype=torch.bfloat16, local_ids=lay.local_ids,
                             inv_permuted_idx=lay.inv_permuted_idx)
    q, s = (rq.int8_quant_per_token if int8 else
            (lambda v: rq.scaled_fp8_quant(v, use_per_token_if_dynamic=True)))(x[routed])
    got = y.cpu()[routed].view(torch.uint8)
    assert torch.equal(got, q.view(torch.uint8)), f"{int((got != q.view(torch.uint8)).sum())} codes differ"
    assert torch.equal(torch.nan_to_num(ys.cpu()[routed], nan=-1.0), torch.nan_to_num(s.float().reshape(-1, 1),
                                                                                       nan=-1.0)), "scales differ"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="these kernels run on an SM90 GPU (none here)")
@pytest.mark.parametrize("regime, tile, cols, warps", [
    ("decode", 4096, 1024, 4), ("decode", 4096, 2048, 4), ("decode", 4096, 4096, 4),
    ("prefill", 4096, 1024, 4), ("prefill", 8192, 2048, 8), ("prefill", 16384, 1024, 16)],
    ids=["decode-1024", "decode-2048", "decode-4096", "prefill-4096x1024", "prefill-8192x2048", "prefill-16384x1024"])
def test_per_tensor_requantization_tiles_equal_the_reference(monkeypatch, regime, tile, cols, warps):
    """The dynamic per-tensor requantization between the GEMMs (the amax pass, then the quantization pass, as
    ``run_experts`` launches them without GEMM1's amax slots) in each tiling ``host.QUANT_TENSOR_*`` allows, over the
    routes (decode: a route a program, ``QUANT_TENSOR_ROUTE_COLS`` columns) and over a prefill layout's rows
    (``QUANT_TENSOR_TILE`` elements of ``QUANT_TENSOR_COLS`` columns on ``QUANT_TENSOR_WARPS`` warps), at Mixtral
    TP2's I = 7168 (chunks masked at the row's end): every routed row's codes and the scale, bit for bit, against
    the reference's ``scaled_fp8_quant`` (dynamic per-tensor) of the routed rows on the CPU; padding rows count in
    neither amax."""
    from backends.triton import kernels as K_, quant as T_quant
    from reference import quant as rq

    monkeypatch.setattr(T_quant, "QUANT_TENSOR_TILE", tile)
    monkeypatch.setattr(T_quant, "QUANT_TENSOR_COLS", cols)
    monkeypatch.setattr(T_quant, "QUANT_TENSOR_ROUTE_COLS", cols)
    monkeypatch.setattr(T_quant, "QUANT_TENSOR_WARPS", warps)
    M, bs = (64, 64) if regime == "decode" else (2048, 128)
    lay, rows, numel, x, routed = _requant_inputs(13, M, 2, 8, bs, 7168)
    NC = x.shape[1]
    x[~routed] = 1000.0  # a padding row counted in the amax would move the scale
    y = torch.zeros(rows, NC, dtype=torch.uint8, device="cuda")
    ys = torch.zeros(rows, 1, dtype=torch.float32, device="cuda")
    stat = torch.zeros(2, dtype=torch.float32, device="cuda")
    kw = dict(x=x.cuda(), y=y, stat=stat, sorted_ids=lay.sorted_token_ids, expert_ids=lay.expert_ids,
              ntpp=lay.num_tokens_post_padded, rows=rows, nc=NC, num_valid=numel, block_m=bs, act=0, split=0,
              act_dtype=torch.bfloat16, local_ids=lay.local_ids, inv_permuted_idx=lay.inv_permuted_idx)
    T_quant.launch_act_quant(qmode=K_.QMODE_FP8_TENSOR_AMAX, **kw)
    T_quant.launch_act_quant(qmode=K_.QMODE_FP8_TENSOR_QUANT, ys=ys, **kw)
    q, s = rq.scaled_fp8_quant(x[routed])
    got = y.cpu()[routed]
    assert torch.equal(got, q.view(torch.uint8)), f"{int((got != q.view(torch.uint8)).sum())} codes differ"
    assert torch.equal(ys.cpu()[routed].view(torch.int32), s.float().expand(int(routed.sum()), 1).contiguous().view(
        torch.int32)), f"scales differ: {ys.cpu()[routed][:2].flatten().tolist()} against {s.item()}"


if importlib.util.find_spec("triton") is not None:  # (the kernel is defined at import: names resolve globally)
    import triton
    import triton.language as tl

    from backends.triton.jit import div_rn_by_scale, fp8e4m3_code

    @triton.jit
    def _div_probe_kernel(xs_ptr, min_scale, stats_ptr, BLOCK: tl.constexpr):
        """Program (i, j): amax = xs[i], the x of block j up to it; counts the FP8 codes of the FAST quotient that
        differ from the IEEE quotient's (stats[0]) and the fp32 quotients that differ (stats[1]), and keeps the
        largest of those quotients' bits (stats[2]; positive floats order as their bits)."""
        i = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if tl.program_id(1) * BLOCK > i:
            return
        amax = tl.load(xs_ptr + i)
        s = tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)
        r = tl.math.div_rn(1.0, s)
        ok = offs <= i
        x = tl.load(xs_ptr + offs, mask=ok, other=0.0)
        sb = tl.full([BLOCK], 1.0, tl.float32) * s
        rb = tl.full([BLOCK], 1.0, tl.float32) * r
        want = tl.math.div_rn(x, sb)
        got = div_rn_by_scale(x, sb, rb, False, True)
        bad8 = ok & (fp8e4m3_code(got) != fp8e4m3_code(want))
        bad32 = ok & (got != want)
        tl.atomic_add(stats_ptr, tl.sum(bad8.to(tl.int32), axis=0))
        tl.atomic_add(stats_ptr + 1, tl.sum(bad32.to(tl.int32), axis=0))
        tl.atomic_max(stats_ptr + 2, tl.max(tl.where(bad32, tl.abs(want), 0.0).to(tl.int32, bitcast=True), axis=0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_division_codes_equal_the_division_on_every_pair(dtype):
    """``jit.div_rn_by_scale``'s FAST form (``MOE_TRITON_FAST_DIV``) on the GPU's own FMA and multiply, over every
    (x, amax) pair of the dtype with 0 < x <= amax (about 5.3e8): the FP8 codes equal the IEEE division's
    (``div.rn.f32``), the fp32 quotients differ only below 2^-64 (tests/test_exact_division.py enumerates the same
    pairs on the CPU with an exact FMA)."""
    from backends.triton.quant import _MIN_TOKEN_SCALE

    top = 0x7C00 if dtype == torch.float16 else 0x7F80
    xs = torch.arange(1, top, dtype=torch.int32).to(torch.int16).view(dtype).float().cuda()
    stats = torch.zeros(3, dtype=torch.int32, device="cuda")
    block = 1024
    _div_probe_kernel[(xs.numel(), -(-xs.numel() // block))](xs, _MIN_TOKEN_SCALE, stats, BLOCK=block)
    bad8, bad32, worst_bits = stats.tolist()
    worst = torch.tensor([worst_bits], dtype=torch.int32).view(torch.float32).item()
    assert bad8 == 0, f"{bad8} FP8 codes of the FAST quotient differ from the IEEE division's"
    assert worst < 2.0 ** -64, f"{bad32} fp32 quotients differ, the largest {worst} (only those near underflow may)"


@pytest.mark.parametrize("act_name, warps", [("SILU", 8), ("SILU", 4), ("SWIGLUOAI", 8)])
def test_packed_gate_up_rounding_equals_the_per_value_one(monkeypatch, act_name, warps):
    """``fused_moe_kernel``'s gated epilogue with gate and up rounded to bf16 two values an instruction
    (``jit.act_rounded``'s ``PACKED`` form, ``cvt.rn.bf16x2.f32``) against one value an instruction, on the same
    tiles: the activations (``taps``) and the output are equal bit for bit, NaN rows included (a token of NaN input,
    a token of inf input), in gated SiLU and interleaved SwiGLU-OAI, on the 8-warp 128 x 128 tiles the rule packs
    and on a 4-warp tile it leaves alone (forced here). The halves' order in the packed register is the point: a
    swapped pair would put each column's neighbour's value in it."""
    from backends.triton import experts as tx
    from reference.activation import MoEActivation

    g = torch.Generator().manual_seed(11)
    E, K, I, topk, M = 8, 1024, 384, 2, 300
    act = getattr(MoEActivation, act_name)
    w1 = (torch.randn(E, 2 * I, K, generator=g) * K ** -0.5).bfloat16().cuda()
    w2 = (torch.randn(E, K, I, generator=g) * I ** -0.5).bfloat16().cuda()
    x = (torch.randn(M, K, generator=g) * 3).bfloat16()
    x[5], x[77, :7] = float("nan"), float("inf")
    w, ids = torch.rand(M, topk, generator=g), torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)])
    bm = 128 if warps == 8 else 64
    cfg = {"gemm1": dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=warps,
                         num_stages=3),
           "gemm2": dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, num_warps=4, num_stages=3)}
    runs = {}
    for packed in (False, True):
        monkeypatch.setattr(tx, "_pack_round", lambda cfg, packed=packed: packed)
        taps = {}
        with tx.strict_kernels():
            out = tx.fused_experts(x.cuda(), w1, w2, w.cuda(), ids.to(torch.int32).cuda(), activation=act,
                                   config=cfg, taps=taps)
        runs[packed] = (taps["activation"], out)
    for i, name in enumerate(("activation", "output")):
        a, b = runs[False][i], runs[True][i]
        assert a.isnan().any(), f"no NaN in the {name}: the NaN rows were not exercised"
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
            f"packed rounding changes the {name} at {int((a.view(torch.int16) != b.view(torch.int16)).sum())} "
            f"elements")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="gluon_ws is sm_90 only (strict kernels raise elsewhere)")
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor"])
def test_gemm2_on_the_half_blocks_equals_the_tile_list(scheme):
    """With GEMM1's ``HALF_TAIL`` and GEMM2's ``BLOCK_SIZE_M`` half of GEMM1's, GEMM2 runs the layout's half blocks
    (ping-pong, a consumer's own 64-row tile) instead of the tile list (cooperative 128-row tiles and 64-row tails):
    the same rows, each output element the same K products in the same order (FP8: the same promotion intervals,
    ``N_HALVES``), so the layer's output is equal bit for bit. An expert map; strict kernels."""
    from backends.triton.experts import fused_experts, strict_kernels
    from reference.schemes import quantize_weights

    w1, w2, x, w, ids = _gather_inputs(31, 6)
    E = _GATHER_SIZES["E"]
    emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    emap[:6] = torch.arange(6, dtype=torch.int32)
    if scheme == "bf16":  # (a cooperative 128 x 256 bf16 ring fits 3 stages of 64 K)
        from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG as qc
        q1, q2, bk, stages, fp8 = w1, w2, 64, 3, {}
    else:
        q1, q2, qc = quantize_weights(scheme, w1, w2)
        bk, stages, fp8 = 128, 4, dict(N_HALVES=1)
    g1 = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=4, num_stages=stages,
              USE_TMA=1, PERMUTE_A=1, FUSE_QUANT=0, HALF_TAIL=1, COOPERATIVE=1, **fp8)
    g2 = dict(BLOCK_SIZE_N=256, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=4, num_stages=stages, USE_TMA=1, **fp8)
    outs = []
    with strict_kernels():
        for g2x in (dict(g2, BLOCK_SIZE_M=128, COOPERATIVE=1), dict(g2, BLOCK_SIZE_M=64, PINGPONG=1)):
            outs.append(fused_experts(x, q1, q2, w, ids, quant_config=qc, config={"gemm1": g1, "gemm2": g2x},
                                      expert_map=emap, global_num_experts=E))
    a, b = outs
    assert a.isfinite().all() and a.abs().amax() > 0, "degenerate output"
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
        f"GEMM2 on the half blocks differs from the tile list at {int((a != b).sum())} of {a.numel()} elements, max "
        f"|diff| {(a.float() - b.float()).abs().max().item():.3g}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="gluon_ws is sm_90 only (strict kernels raise elsewhere)")
@pytest.mark.parametrize("act, case", [("swigluoai", "pingpong"), ("swigluoai", "coop-tail-gather"),
                                       ("swigluoai", "coop-gather-map"), ("silu", "pingpong"),
                                       ("silu", "coop-tail-gather")])
def test_biases_and_partial_n_tiles_on_gluon_ws_equal_fused_moe_kernel(act, case):
    """gpt-oss's layer (interleaved SWIGLUOAI gate / up rows, alpha 1.702, limit 7, expert biases on both GEMMs) on
    ``gluon_ws`` (thirty-third session: W viewed ``(E * I, 2 K)`` so that the gate and up rows load as the halves' two
    TMA boxes, the biases added to the fp32 accumulator before the rounding, the clamped activation operation for
    operation ``jit.apply_act``'s), and SiLU's gate / up halves with biases, against ``fused_moe_kernel``'s FUSE 2 /
    FUSE 1 epilogues: the same sums in the same K order and the same epilogue arithmetic, so bitwise equal, at an I
    and a K that are not multiples of BLOCK_N (a last, partial N tile on both GEMMs, whose columns past N are not
    stored and whose bias loads are masked), with gathered rows, half-height tails and an expert map; strict kernels
    (a fallback to ``fused_moe_kernel`` raises). Three calls."""
    from backends.triton import configs as C
    from backends.triton.experts import fused_experts, strict_kernels
    from benchmarks.harness import draw_routing, make_weights
    from reference.activation import MoEActivation

    E, topk, K, I, M = 8, 4, 576, 320, 300  # N tiles of 128 / 256: I = 2.5, K = 2.25 of them
    local = 6 if case.endswith("map") else None
    g = torch.Generator(device="cuda").manual_seed(33)
    oai = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0) if act == "swigluoai" else {}
    w1, w2, qc = make_weights(local or E, 2 * I, K, I, "bf16", torch.bfloat16, "cuda", g, bias=True, **oai)
    assert qc.w1_bias is not None and qc.w2_bias is not None
    x = (torch.randn(M, K, device="cuda", generator=g) * 2).bfloat16()
    w, ids = draw_routing(M, E, topk, "cuda", g)
    emap = None
    if local is not None:
        emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
        emap[:local] = torch.arange(local, dtype=torch.int32)
    base = dict(BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=4, USE_TMA=1)
    ref_cfg = {"gemm1": dict(base, BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, USE_TMA=0),
               "gemm2": dict(base, BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, USE_TMA=0)}
    if case == "pingpong":
        cfg = {"gemm1": dict(base, BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, PINGPONG=1, PERMUTE_A=1),
               "gemm2": dict(base, BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, PINGPONG=1)}
    else:
        ref_cfg = {k: dict(v, BLOCK_SIZE_M=128) for k, v in ref_cfg.items()}
        cfg = {"gemm1": dict(base, BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, COOPERATIVE=1, GATHER_A=1,
                             HALF_TAIL=int(case == "coop-tail-gather"), num_stages=3),
               "gemm2": dict(base, BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, COOPERATIVE=1, num_stages=3)}
    ref_cfg, cfg = C.sanitize_config(ref_cfg), C.sanitize_config(cfg)
    args = (x, w1, w2, w, ids)
    kw = dict(activation=MoEActivation.from_str(act), quant_config=qc, expert_map=emap, global_num_experts=E)
    with strict_kernels():
        want = fused_experts(*args, config=ref_cfg, **kw)
        for call in range(3):
            got = fused_experts(*args, config=cfg, **kw)
            assert got.isfinite().all(), f"call {call}: non-finite output from finite inputs"
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                f"call {call}: gluon_ws differs from fused_moe_kernel at {(got != want).sum().item()} of "
                f"{got.numel()} elements, max |diff| {(got.float() - want.float()).abs().max().item():.3g}")
