"""The ``deep_gemm`` backend on CPU: availability reasons, the seed 001 support oracle (claims and refusals),
``workspace_shapes`` against the seed's formula, the device layout against ``reference.align``, the activation +
requantization against ``reference.activation`` / ``reference.quant`` (bit-exact), and the whole
``DeepGemmExperts`` pipeline through the modular kernel with an emulated grouped GEMM against
``reference.experts.fused_experts``. The real GEMM runs in ``tools/deep_gemm/probe.py`` and ``python -m benchmarks --backend deep_gemm`` on the GPU machine."""

from __future__ import annotations

import math

import pytest
import torch

import backends.deep_gemm as dgb
from backends import load_backend
from backends.deep_gemm import act_quant, experts, layout, platform
from backends.deep_gemm.experts import BatchedDeepGemmExperts, DeepGemmExperts, DeepGemmFP4Experts
from reference import align as ref_align
from reference import quant as rq
from reference.activation import MoEActivation, apply_moe_activation
from reference.config import FusedMoEConfig, FusedMoEParallelConfig, fp8_w8a8_moe_quant_config
from reference.error_model import Accumulation
from reference.experts import fused_experts
from reference.metrics import error_stats
from reference.modular import ExpertTokensMetadata, FusedMoEActivationFormat, FusedMoEKernel, \
    MoEPrepareAndFinalizeNoEP
from tests.deep_gemm_emulation import EmulatedBatchedDeepGemmExperts, EmulatedDeepGemmExperts, small_problem
from tests.harness_util import experts_bound

FP32 = Accumulation.fp32()  # the emulated grouped GEMMs accumulate in fp32

STD = FusedMoEActivationFormat.Standard
FP8_KEYS = (rq.kFp8Static128BlockSym, rq.kFp8Dynamic128Sym)


@pytest.fixture
def sm90(monkeypatch):
    """Pretend to be an SM90 machine with a working deep_gemm (only the probes are replaced)."""
    monkeypatch.setattr(platform, "current_capability", lambda: (9, 0))
    monkeypatch.setattr(platform, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(platform, "deep_gemm_installed", lambda: True)
    monkeypatch.setattr(platform, "deep_gemm_abi_error", lambda: None)
    monkeypatch.setattr(experts, "get_mk_alignment_for_contiguous_layout", lambda: 128)


# ------------------------------------------------------------------------------------------------------------
# availability
# ------------------------------------------------------------------------------------------------------------


def test_registered_and_cuda_device():
    b = load_backend("deep_gemm")
    assert b.name == "deep_gemm" and b.device == "cuda"
    assert list(b.experts) == [DeepGemmExperts, BatchedDeepGemmExperts, DeepGemmFP4Experts]
    assert b.recipe("per_token_group_quant_fp8") == "vllm"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given on a machine without a GPU")
def test_unavailable_here_says_no_gpu():
    reason = load_backend("deep_gemm").unavailable_reason()
    assert reason is not None and "no CUDA GPU" in reason


@pytest.mark.parametrize("cap, installed, abi, expect", [
    (None, True, None, "no CUDA GPU"),
    ((8, 0), True, None, "sm_80"),
    ((10, 0), True, None, "SM90 FP8 path only"),
    ((9, 0), False, None, "deep_gemm is not installed"),
    ((9, 0), True, "deep_gemm 0.2.0 is installed but unusable with torch 2.11", "unusable"),
    ((9, 0), True, None, None),
])
def test_availability_reasons(monkeypatch, cap, installed, abi, expect):
    monkeypatch.setattr(platform, "current_capability", lambda: cap)
    monkeypatch.setattr(platform, "device_name", lambda: "GPU")
    monkeypatch.setattr(platform, "deep_gemm_installed", lambda: installed)
    monkeypatch.setattr(platform, "deep_gemm_abi_error", lambda: abi)
    reason = dgb.backend.unavailable_reason()
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and expect in reason, reason


def test_not_installed_wording_for_nox(monkeypatch):
    # nox installs the extra only when the reason contains "not installed" (and only on a GPU machine).
    monkeypatch.setattr(platform, "current_capability", lambda: (9, 0))
    monkeypatch.setattr(platform, "deep_gemm_installed", lambda: False)
    assert "not installed" in dgb.backend.unavailable_reason()
    with pytest.raises(RuntimeError, match="not installed"):
        platform.import_deep_gemm()


# ------------------------------------------------------------------------------------------------------------
# support oracle
# ------------------------------------------------------------------------------------------------------------


def moe_cfg(activation=MoEActivation.SILU, hidden=7168, parallel=None):
    return FusedMoEConfig(num_experts=256, experts_per_token=8, hidden_dim=hidden, intermediate_size_per_partition=2048,
                          num_local_experts=8, activation=activation,
                          moe_parallel_config=parallel or FusedMoEParallelConfig.make_ep(32, 0))


def supported(cls, cfg=None, keys=FP8_KEYS, fmt=STD):
    return cls.is_supported_config(cls, cfg or moe_cfg(), *keys, fmt)


@pytest.mark.parametrize("act", [MoEActivation.SILU, MoEActivation.SWIGLUSTEP, MoEActivation.SWIGLUOAI_UNINTERLEAVE])
def test_claims_fp8_block_on_sm90(sm90, act):
    assert supported(DeepGemmExperts, moe_cfg(act)) == (True, None)


@pytest.mark.parametrize("cfg, keys, fmt, words", [
    (moe_cfg(MoEActivation.SWIGLUOAI), FP8_KEYS, STD, "activation"),  # interleaved gate/up: not the packed layout
    (moe_cfg(MoEActivation.GELU), FP8_KEYS, STD, "activation"),
    (moe_cfg(MoEActivation.SILU_NO_MUL), FP8_KEYS, STD, "no act_and_mul"),
    (moe_cfg(), (None, None), STD, "quantization scheme"),
    (moe_cfg(), (rq.kFp8StaticTensorSym, rq.kFp8DynamicTensorSym), STD, "quantization scheme"),
    (moe_cfg(), (rq.kMxfp8Static, rq.kMxfp8Dynamic), STD, "quantization scheme"),  # SM100 only
    (moe_cfg(parallel=FusedMoEParallelConfig(use_fi_nvl_two_sided_kernels=True)), FP8_KEYS, STD, "parallel"),
    (moe_cfg(hidden=7000), FP8_KEYS, STD, "hidden dim"),
    (moe_cfg(), FP8_KEYS, FusedMoEActivationFormat.BatchedExperts, "activation format"),
])
def test_refusals_on_sm90(sm90, cfg, keys, fmt, words):
    ok, reason = supported(DeepGemmExperts, cfg, keys, fmt)
    assert not ok and words in reason, reason


def test_refuses_device_without_deep_gemm_or_sm90(monkeypatch):
    monkeypatch.setattr(platform, "current_capability", lambda: (10, 0))
    monkeypatch.setattr(platform, "device_name", lambda: "B200")
    ok, reason = supported(DeepGemmExperts)
    # The reason names the device and what the backend needs, not only the seed's "current device".
    assert not ok and "current device: B200 is sm_100" in reason and "SM90" in reason, reason
    # The seed's MXFP8 rule is kept as a predicate: SM100 family only.
    assert DeepGemmExperts._supports_quant_scheme(rq.kMxfp8Static, rq.kMxfp8Dynamic)
    monkeypatch.setattr(platform, "current_capability", lambda: (9, 0))
    assert not DeepGemmExperts._supports_quant_scheme(rq.kMxfp8Static, rq.kMxfp8Dynamic)


def test_fp4_experts_declared_but_not_claimed(sm90):
    ok, reason = supported(DeepGemmFP4Experts, keys=(rq.kMxfp4Static, rq.kFp8Dynamic128Sym))
    assert not ok and "current device: " in reason and "needs an SM100/SM120 GPU" in reason, reason
    assert DeepGemmFP4Experts._supports_quant_scheme(rq.kMxfp4Static, rq.kFp8Dynamic128Sym)
    assert not DeepGemmFP4Experts._supports_quant_scheme(*FP8_KEYS)
    assert DeepGemmFP4Experts._supports_activation(MoEActivation.SWIGLUSTEP)
    assert not DeepGemmFP4Experts._supports_activation(MoEActivation.SWIGLUOAI_UNINTERLEAVE)
    assert [DeepGemmFP4Experts.seed_supports_capability(c) for c in ((9, 0), (10, 0), (10, 3), (12, 0))] == \
        [False, True, True, True]
    with pytest.raises(NotImplementedError, match="SM100/SM120"):
        DeepGemmFP4Experts(moe_cfg(), fp8_w8a8_moe_quant_config(torch.ones(1), torch.ones(1), block_shape=[128, 128]))


def test_constructor_refuses_other_quant_configs():
    cfg = moe_cfg()
    with pytest.raises(ValueError, match="128x128"):
        DeepGemmExperts(cfg, fp8_w8a8_moe_quant_config(torch.ones(1), torch.ones(1)))
    with pytest.raises(ValueError, match="128x128"):
        DeepGemmExperts(cfg, fp8_w8a8_moe_quant_config(torch.ones(1), torch.ones(1), per_out_ch_quant=True,
                                                       per_act_token_quant=True))
    from reference.config import FusedMoEQuantConfig, FusedMoEQuantDesc
    mx = FusedMoEQuantConfig(a1=FusedMoEQuantDesc("mxfp8", (1, 32)), w1=FusedMoEQuantDesc("mxfp8", (1, 32)))
    with pytest.raises(NotImplementedError, match="SM100"):
        DeepGemmExperts(cfg, mx)
    DeepGemmExperts(cfg, fp8_w8a8_moe_quant_config(torch.ones(1), torch.ones(1), block_shape=[128, 128]))


def test_valid_deep_gemm_rule(monkeypatch):
    monkeypatch.setattr(platform, "deep_gemm_installed", lambda: False)
    fp8 = torch.float8_e4m3fn
    hs = torch.zeros(256, 2048, dtype=fp8)
    w1, w2 = torch.zeros(2, 1536, 2048, dtype=fp8), torch.zeros(2, 2048, 768, dtype=fp8)
    ok, reason = experts.valid_deep_gemm(hs, w1, w2)
    assert not ok and "not installed" in reason
    monkeypatch.setattr(platform, "deep_gemm_installed", lambda: True)
    # Qwen3-30B-A3B: I = 768 > 512 and a multiple of 128: DeepGEMM is valid.
    assert experts.valid_deep_gemm(hs, torch.zeros(2, 1536, 2048, dtype=fp8),
                                   torch.zeros(2, 2048, 768, dtype=fp8)) == (True, None)
    ok, reason = experts.valid_deep_gemm(hs, torch.zeros(2, 512, 2048, dtype=fp8), torch.zeros(2, 2048, 256, dtype=fp8))
    assert not ok and "512" in reason
    ok, reason = experts.valid_deep_gemm(hs[:64], torch.zeros(2, 1536, 2048, dtype=fp8),
                                         torch.zeros(2, 2048, 768, dtype=fp8))
    assert not ok and "M=64" in reason


# ------------------------------------------------------------------------------------------------------------
# workspace shapes (seed 001)
# ------------------------------------------------------------------------------------------------------------


def seed_ws(M, N, K, topk, E, counts=None, act=MoEActivation.SILU):
    a = 128
    if counts is None:
        M_sum = -(-(M * topk + min(M * topk, E) * (a - 1)) // a) * a
    else:
        M_sum = sum(-(-c // a) * a for c in counts)
    out_dim = N // 2 if act.is_gated else N
    return (M_sum, max(out_dim, K)), (M_sum, max(N, K)), (M, K)


@pytest.mark.parametrize("M, N, K, topk, E", [(1, 4096, 7168, 8, 32), (64, 4096, 7168, 8, 8), (4096, 4096, 7168, 8, 32),
                                             (300, 1536, 2048, 8, 128), (5, 3072, 3072, 8, 256), (0, 1536, 2048, 8, 4)])
def test_workspace_shapes_match_seed(M, N, K, topk, E):
    # The seed's shapes on the contiguous layout (every M with the masked layout turned off, M >= 128 by default);
    # below M = 128 the masked layout's E_local * 128 rows.
    ex = DeepGemmExperts(moe_cfg(), fp8_w8a8_moe_quant_config(torch.ones(1), torch.ones(1), block_shape=[128, 128]))
    counts = [(7 * i + M) % 300 for i in range(E)]
    meta = ExpertTokensMetadata.make_from_list(counts, "cpu")
    default = ex.workspace_shapes(M, N, K, topk, 256, E, None, MoEActivation.SILU)
    if 0 < M < 128:
        assert default == ((E * 128, max(N // 2, K)), (E * 128, max(N, K)), (M, K))
        assert ex.workspace_shapes(M, N, K, topk, 256, E, meta, MoEActivation.SILU) == default
    else:
        assert default == seed_ws(M, N, K, topk, E)
    ex.masked_below_m = 0
    assert ex.workspace_shapes(M, N, K, topk, 256, E, None, MoEActivation.SILU) == seed_ws(M, N, K, topk, E)
    assert ex.workspace_shapes(M, N, K, topk, 256, E, meta, MoEActivation.SILU) == seed_ws(M, N, K, topk, E, counts)


# ------------------------------------------------------------------------------------------------------------
# contiguous layout vs reference.align
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M, topk, E_global, E_local, use_map, with_meta", [
    (37, 4, 8, 8, False, False), (37, 4, 16, 4, True, False), (200, 8, 32, 8, True, True), (1, 8, 8, 8, False, True),
    (130, 2, 4, 4, False, False),
])
def test_layout_matches_reference_permute(M, topk, E_global, E_local, use_map, with_meta):
    g = torch.Generator().manual_seed(M * 31 + topk)
    K = 256
    ids = torch.stack([torch.randperm(E_global, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
    ids[torch.rand(M, topk, generator=g) < 0.05] = -1  # EP-masked routes
    emap = None
    if use_map:
        emap = ref_align_map = torch.full((E_global,), -1, dtype=torch.int32)
        ref_align_map[torch.randperm(E_global, generator=g)[:E_local]] = torch.arange(E_local, dtype=torch.int32)
    x = torch.randn(M, K, generator=g).to(torch.float8_e4m3fn)
    sx = torch.rand(M, K // 128, generator=g) + 0.5
    meta = None
    if with_meta:
        counts = ref_align.count_expert_num_tokens(ids, E_local, emap).tolist()
        meta = ExpertTokensMetadata.make_from_list(counts, "cpu")
    ref_x, ref_s, ref_ids, ref_inv, ref_align_used = ref_align.deepgemm_moe_permute(x, sx, ids, E_local, emap, meta)
    M_sum, a = ref_align.compute_aligned_M_and_alignment(M, topk, E_local, 128, meta)
    lay, oor = layout.build_contiguous_layout(ids, E_local, M_sum, a, emap)
    assert not oor.any() and a == ref_align_used
    assert torch.equal(lay.m_indices, ref_ids)
    assert torch.equal(lay.inv_perm.to(torch.int32), ref_inv)
    valid = lay.m_indices >= 0
    got_x = layout.gather_rows(x, lay.row_token)
    assert torch.equal(got_x.view(torch.uint8)[valid], ref_x.view(torch.uint8)[valid])
    got_s = layout.gather_scales_mn_major(sx, lay.row_token)
    assert got_s.stride() == (1, layout.tma_aligned_size(M_sum))
    assert torch.equal(got_s[valid], ref_s[valid])
    assert torch.isfinite(got_s).all()  # unused rows hold copies of token 0, never garbage


def test_layout_reports_out_of_range_ids():
    ids = torch.tensor([[0, 9], [1, -1]], dtype=torch.int32)
    lay, oor = layout.build_contiguous_layout(ids, 4, 512, 128)
    assert oor.tolist() == [False, True, False, False]
    assert lay.inv_perm.tolist() == [[0, layout.POISON_ROW], [128, -1]]


def test_unpermute_matches_reference_bitwise():
    g = torch.Generator().manual_seed(3)
    M, topk, E = 29, 4, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
    ids[0, 1] = -1
    w = torch.rand(M, topk, generator=g)
    M_sum, a = ref_align.compute_aligned_M_and_alignment(M, topk, E, 128)
    lay, _ = layout.build_contiguous_layout(ids, E, M_sum, a)
    mm2 = torch.randn(M_sum, 64, generator=g).to(torch.bfloat16)
    mm2[lay.m_indices < 0] = float("nan")  # rows no route points to must never be read
    out = layout.unpermute_and_reduce(mm2, lay.inv_perm, w, torch.empty(M, 64, dtype=torch.bfloat16))
    ref = ref_align.deepgemm_unpermute_and_reduce(mm2, ids, w, lay.inv_perm.to(torch.int32), None,
                                                  torch.empty(M, 64, dtype=torch.bfloat16))
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------------------------------
# activation + requantization vs the reference (bit-exact)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act, params", [
    (MoEActivation.SILU, {}), (MoEActivation.SILU, dict(limit=7.0)), (MoEActivation.SWIGLUSTEP, {}),
    (MoEActivation.SWIGLUOAI_UNINTERLEAVE, dict(alpha=1.702, beta=1.0, limit=7.0)),
    (MoEActivation.SWIGLUOAI_UNINTERLEAVE, {}),
])
def test_activation_matches_reference(act, params):
    x = (torch.randn(67, 512, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16)
    got = act_quant.gated_activation(x, act, **params)
    ref = apply_moe_activation(act, x, **params)
    assert torch.equal(got, ref)


def test_activation_refuses_others():
    with pytest.raises(NotImplementedError, match="SWIGLUOAI"):
        act_quant.gated_activation(torch.zeros(2, 256), MoEActivation.SWIGLUOAI)


@pytest.mark.parametrize("recipe", ["vllm", "deepgemm"])
@pytest.mark.parametrize("use_ue8m0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_matches_reference_bitwise(recipe, use_ue8m0, dtype):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(45, 512, generator=g) * torch.logspace(-6, 3, 45).unsqueeze(1)).to(dtype)
    x[3, :128] = 0  # all-zero group: the recipe's amax floor decides the scale
    x[4, 130] = float("inf")  # poisoned group
    x[5, 300] = float("nan")
    x[6, 10] = 1e6  # saturation
    q, s = act_quant.per_token_group_quant_fp8_mn_major(x, 128, use_ue8m0=use_ue8m0, recipe=recipe, rows_per_chunk=16)
    rq_, rs = rq.per_token_group_quant_fp8(x, 128, use_ue8m0=use_ue8m0, recipe=recipe)
    assert s.stride() == (1, layout.tma_aligned_size(45))
    assert torch.equal(q.view(torch.uint8), rq_.view(torch.uint8))
    assert torch.equal(s.nan_to_num(-1.0), rs.nan_to_num(-1.0))


# ------------------------------------------------------------------------------------------------------------
# the whole DeepGemmExperts pipeline through the modular kernel, with an emulated grouped GEMM
# ------------------------------------------------------------------------------------------------------------


def _metrics(out, ref):
    s = error_stats(out, ref)
    return s.max_norm, s.rms_norm


@pytest.mark.parametrize("masked", [True, False], ids=["masked_below_128", "contiguous"])
@pytest.mark.parametrize("act, params, M, topk, chunk, use_map, ue8m0, recipe, on_input", [
    (MoEActivation.SILU, {}, 37, 3, None, True, True, "vllm", False),
    (MoEActivation.SILU, {}, 53, 2, 16, False, True, "deepgemm", False),
    (MoEActivation.SILU, {}, 21, 1, None, True, False, "vllm", True),
    (MoEActivation.SILU, {}, 150, 2, None, True, True, "vllm", False),  # M >= 128: contiguous either way
    (MoEActivation.SWIGLUSTEP, {}, 19, 2, None, False, True, "vllm", False),
    (MoEActivation.SWIGLUOAI_UNINTERLEAVE, dict(gemm1_alpha=1.702, gemm1_beta=1.0, gemm1_clamp_limit=7.0), 19, 2,
     None, True, True, "vllm", False),
])
def test_pipeline_matches_reference(act, params, M, topk, chunk, use_map, ue8m0, recipe, on_input, masked):
    g = torch.Generator().manual_seed(M + topk)
    E, E_local, K, I = 8, 4 if use_map else 8, 256, 256
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E_local, 2 * I, K, generator=g) / math.sqrt(K))
    w2 = (torch.randn(E_local, K, I, generator=g) / math.sqrt(I))
    w1q, w1s = rq.per_block_quant_fp8(w1, (128, 128))
    w2q, w2s = rq.per_block_quant_fp8(w2, (128, 128))
    ids = torch.stack([torch.randperm(E if use_map else E_local, generator=g)[:topk] for _ in range(M)])
    ids = ids.to(torch.int32)
    w = torch.rand(M, topk, generator=g)
    emap = None
    if use_map:
        emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    qc = fp8_w8a8_moe_quant_config(w1s, w2s, block_shape=[128, 128], use_ue8m0=ue8m0, recipe=recipe, **params)
    kw = dict(activation=act, global_num_experts=E if use_map else E_local, expert_map=emap,
              apply_router_weight_on_input=on_input)
    ref = fused_experts(x, w1q, w2q, w, ids, quant_config=qc, **kw)
    cfg = FusedMoEConfig(E, topk, K, I, E_local, activation=act)
    experts = EmulatedDeepGemmExperts(cfg, qc)
    experts.masked_below_m = 128 if masked else 0
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts, chunk_size=chunk,
                            poison=float("nan"), semantics="0.17" if chunk else None)  # chunking: 0.17's kernel
    out = kernel.apply(x, w1q, w2q, w, ids, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    max_norm, rms = _metrics(out, ref)
    # Same rounding points and the same quantizers: only fp32 accumulation order differs (the emulated GEMM), so the
    # error model's bound with fp32 accumulation holds (tighter than what tensor-core FP8 accumulation is allowed).
    tol = experts_bound(x, w1q, ids, quant_config=qc, expert_map=emap, activation=act, accumulation=FP32)
    assert max_norm <= tol["max_norm"] and rms <= tol["rms_norm"], (max_norm, rms)


@pytest.mark.parametrize("M, topk, use_map, ue8m0", [(37, 3, True, True), (130, 2, False, False), (5, 1, False, True)])
def test_batched_pipeline_matches_batched_reference(M, topk, use_map, ue8m0):
    # The batched format (BatchedPrepareAndFinalize: slots of capacity M, quantized per slot), against the
    # batched reference; T = M is not a multiple of 128, so the GEMMs run on padded slots.
    from reference.batched import BatchedPrepareAndFinalize, BatchedReferenceExperts

    g = torch.Generator().manual_seed(M)
    E, E_local, K, I = 8, 4 if use_map else 8, 256, 256
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w1q, w1s = rq.per_block_quant_fp8(torch.randn(E_local, 2 * I, K, generator=g) / 16, (128, 128))
    w2q, w2s = rq.per_block_quant_fp8(torch.randn(E_local, K, I, generator=g) / 16, (128, 128))
    ids = torch.stack([torch.randperm(E if use_map else E_local, generator=g)[:topk] for _ in range(M)])
    ids = ids.to(torch.int32)
    w = torch.rand(M, topk, generator=g)
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32) if use_map else None
    qc = fp8_w8a8_moe_quant_config(w1s, w2s, block_shape=[128, 128], use_ue8m0=ue8m0)
    cfg = FusedMoEConfig(E, topk, K, I, E_local)
    kw = dict(activation=MoEActivation.SILU, global_num_experts=E if use_map else E_local, expert_map=emap)

    def run(cls):
        return FusedMoEKernel(BatchedPrepareAndFinalize(M, E_local), cls(cfg, qc, max_num_tokens=M, num_dispatchers=1),
                              poison=float("nan")).apply(x, w1q, w2q, w, ids, **kw)

    out, ref = run(EmulatedBatchedDeepGemmExperts), run(BatchedReferenceExperts)
    assert torch.isfinite(out).all()
    max_norm, rms = _metrics(out, ref)
    tol = experts_bound(x, w1q, ids, quant_config=qc, expert_map=emap, accumulation=FP32)
    assert max_norm <= tol["max_norm"] and rms <= tol["rms_norm"], (max_norm, rms)


def test_batched_quantizes_bf16_slots_itself():
    # A dispatch that hands over bf16 slots (no a1q_scale): the class quantizes them per 1x128 group, the same codes
    # as the batched prepare's, so the output is the same bits as from the prepared FP8 slots.
    from reference.batched import BatchedPrepareAndFinalize

    x, w1q, w2q, qc, cfg = small_problem(20, 2, 4, seed=5)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(20)]).to(torch.int32)
    w = torch.rand(20, 2)
    ex = EmulatedBatchedDeepGemmExperts(cfg, qc, max_num_tokens=20, num_dispatchers=1)
    prep = BatchedPrepareAndFinalize(20, 4)
    outs = []
    for defer in (False, True):
        a1, s1, meta, _, _ = prep.prepare(x, w, ids, 4, None, False, qc, defer_input_quant=defer)
        assert (a1.dtype == torch.bfloat16) == defer
        ws13, ws2, oshape = ex.workspace_shapes(20, w1q.size(1), 128, 2, 4, 4, meta, MoEActivation.SILU)
        out = torch.full(oshape, float("nan"), dtype=torch.bfloat16)
        ex.apply(out, a1, w1q, w2q, w, ids, MoEActivation.SILU, 4, None, s1, None, torch.empty(ws13),
                 torch.empty(ws2), meta, False)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_short_tail_chunk_falls_back_to_the_contiguous_layout():
    # 0.17's chunking sizes the workspaces for a 128-token chunk (contiguous: 16384 rows at topk 1, E 256); a 5-token
    # tail chunk would need 256 masked slots (32768 rows): it runs the contiguous layout instead of failing.
    x, w1q, w2q, qc, cfg = small_problem(133, 1, 256, seed=6)
    ids = torch.randint(0, 256, (133, 1), dtype=torch.int32)
    w = torch.rand(133, 1)
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), EmulatedDeepGemmExperts(cfg, qc), chunk_size=128,
                            semantics="0.17")
    out = kernel.apply(x, w1q, w2q, w, ids, global_num_experts=256)
    ref = fused_experts(x, w1q, w2q, w, ids, quant_config=qc, global_num_experts=256)
    max_norm, rms = _metrics(out, ref)
    tol = experts_bound(x, w1q, ids, quant_config=qc, accumulation=FP32)
    assert max_norm <= tol["max_norm"] and rms <= tol["rms_norm"], (max_norm, rms)


def test_batched_claims_and_refusals(sm90):
    cfg = moe_cfg()
    fmt = FusedMoEActivationFormat
    ok, _ = BatchedDeepGemmExperts.is_supported_config(BatchedDeepGemmExperts, cfg, *FP8_KEYS,
                                                       fmt.BatchedExperts)
    assert ok
    ok, why = BatchedDeepGemmExperts.is_supported_config(BatchedDeepGemmExperts, cfg, *FP8_KEYS,
                                                         fmt.Standard)
    assert not ok and why
    assert not BatchedDeepGemmExperts.support.chunking


def test_pipeline_refuses_bad_ids_and_stale_meta():
    g = torch.Generator().manual_seed(0)
    K, I, E = 128, 128, 2
    w1q, w1s = rq.per_block_quant_fp8(torch.randn(E, 2 * I, K, generator=g), (128, 128))
    w2q, w2s = rq.per_block_quant_fp8(torch.randn(E, K, I, generator=g), (128, 128))
    qc = fp8_w8a8_moe_quant_config(w1s, w2s, block_shape=[128, 128], use_ue8m0=True)
    ex = EmulatedDeepGemmExperts(FusedMoEConfig(E, 1, K, I, E), qc)
    ex.validate_routes = True  # (the default follows MOE_VALIDATE_ROUTES, which the conformance suite sets)
    xq, xs = rq.per_token_group_quant_fp8(torch.randn(3, K, generator=g), 128, use_ue8m0=True)
    ws13 = torch.empty(1024, 256, dtype=torch.bfloat16)
    ws2 = torch.empty(1024, 256, dtype=torch.bfloat16)
    out = torch.empty(3, K, dtype=torch.bfloat16)
    args = dict(output=out, hidden_states=xq, w1=w1q, w2=w2q, topk_weights=torch.ones(3, 1),
                activation=MoEActivation.SILU, global_num_experts=E, expert_map=None, a1q_scale=xs, a2_scale=None,
                workspace13=ws13, workspace2=ws2, apply_router_weight_on_input=False)
    with pytest.raises(ValueError, match="outside the expert id space"):
        ex.apply(topk_ids=torch.tensor([[0], [5], [1]]), expert_tokens_meta=None, **args)
    with pytest.raises(ValueError, match="20392"):
        ex.apply(topk_ids=torch.tensor([[0], [0], [1]]),
                 expert_tokens_meta=ExpertTokensMetadata.make_from_list([1, 2], "cpu"), **args)
    with pytest.raises(NotImplementedError):
        ex.apply(topk_ids=torch.tensor([[0], [0], [1]]), expert_tokens_meta=None,
                 **{**args, "activation": MoEActivation.GELU})
    with pytest.raises(ValueError, match="a2_scale"):
        ex.apply(topk_ids=torch.tensor([[0], [0], [1]]), expert_tokens_meta=None, **{**args, "a2_scale": xs})
    ex.masked_below_m = 0  # the contiguous layout: stale counts leave routes without a row
    with pytest.raises(ValueError, match="20392"):
        ex.apply(topk_ids=torch.tensor([[0], [0], [1]]),
                 expert_tokens_meta=ExpertTokensMetadata.make_from_list([1, 0], "cpu"), **args)


@pytest.mark.parametrize("masked", [True, False])
def test_unvalidated_bad_ids_poison_their_tokens(masked):
    # Without host validation (the default outside the conformance suite) nothing synchronises; a token with an id
    # outside the id space gets a NaN output row, every other token the reference's result.
    x, w1q, w2q, qc, cfg = small_problem(6, 2, 4)
    ids = torch.tensor([[0, 1], [2, 9], [3, 0], [1, -7], [2, 3], [0, 2]], dtype=torch.int32)
    w = torch.rand(6, 2)
    ex = EmulatedDeepGemmExperts(cfg, qc)
    ex.validate_routes = False
    ex.masked_below_m = 128 if masked else 0
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ex).apply(x, w1q, w2q, w, ids, global_num_experts=4)
    bad = torch.tensor([False, True, False, True, False, False])
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()
    good = ~bad
    ref = fused_experts(x[good], w1q, w2q, w[good], ids[good], quant_config=qc, global_num_experts=4)
    assert torch.equal(out[good].view(torch.int16), ref.view(torch.int16))


def test_masked_slot_overflow_is_refused_or_poisoned():
    # More than 128 routes on one expert (duplicate ids within tokens) cannot fit the masked layout's slot.
    x, w1q, w2q, qc, cfg = small_problem(100, 2, 4)
    ids = torch.zeros(100, 2, dtype=torch.int32)
    w = torch.rand(100, 2)
    ex = EmulatedDeepGemmExperts(cfg, qc)
    ex.validate_routes = True
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ex)
    with pytest.raises(ValueError, match="more than 128 routes"):
        kernel.apply(x, w1q, w2q, w, ids, global_num_experts=4)
    ex.validate_routes = False
    out = kernel.apply(x, w1q, w2q, w, ids, global_num_experts=4)
    assert torch.isnan(out[64:]).all() and torch.isfinite(out[:64]).all()  # routes 0..127 fit: tokens 0..63


# ------------------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (only where triton is installed; the GPU check is tools/probe.py's "kernels")
# ------------------------------------------------------------------------------------------------------------

_INTERPRETER_SCRIPT = r"""
import torch
from backends.deep_gemm import triton_kernels as tk, act_quant, layout
from reference.activation import MoEActivation as A
g = torch.Generator().manual_seed(0)
x = (torch.randn(21, 512, generator=g) * 3).to(torch.bfloat16)
for act, p in [(A.SILU, {}), (A.SWIGLUSTEP, {}), (A.SWIGLUOAI_UNINTERLEAVE, dict(alpha=1.702, beta=1.0, limit=7.0))]:
    kw = dict(alpha=p.get("alpha"), beta=p.get("beta"), limit=p.get("limit"), group_size=128, use_ue8m0=True,
              recipe="vllm")
    q1, s1 = tk.act_mul_quant(x, act, **kw)
    q2, s2 = act_quant.act_mul_quant(x, act, **kw)
    assert s1.stride() == s2.stride()
    # The interpreter truncates fp32 -> bf16 / fp8 conversions (the GPU rounds to nearest; tools/probe.py checks the
    # kernels bit-exactly there), so only a loose value check: it catches row / column / group mix-ups.
    d1 = q1.float().view(21, 2, 128) * s1[:, :, None]
    d2 = q2.float().view(21, 2, 128) * s2[:, :, None]
    err = ((d1 - d2).abs() / d2.abs().amax(-1, keepdim=True)).max().item()
    assert err < 0.35 and torch.isfinite(d1).all(), (act, err)
a = torch.randn(300, 200, generator=g)
inv = torch.randint(-1, 300, (17, 4), generator=g)
w = torch.rand(17, 4, generator=g)
inv[3, 1] = layout.POISON_ROW
o1 = tk.unpermute_and_reduce(a, inv, w, torch.empty(17, 200))
o2 = layout.unpermute_and_reduce(a, inv, w, torch.empty(17, 200))
torch.testing.assert_close(o1, o2, equal_nan=True)
assert torch.isnan(o1[3]).all() and torch.isfinite(o1[4:]).all()
# layouts (contiguous and masked, out-of-range ids, overflowing slots): the Triton build equals the torch one
# (700 x 3 routes: three blocks of the contiguous builder, through an expert map of 9 global ids)
for M, topk, E, slot in [(37, 4, 8, None), (37, 4, 8, 128), (100, 2, 3, 128), (700, 3, 5, None)]:
    emap = None
    ids = torch.randint(-1, E, (M, topk), generator=g, dtype=torch.int32)
    if M == 100:
        ids[:, 0] = 1  # 100 + ~33 routes on expert 1: its slot overflows
    if M == 700:
        emap = torch.tensor([3, -1, 0, 4, -1, 1, -1, 2, -1], dtype=torch.int32)
        ids = torch.randint(-1, 9, (M, topk), generator=g, dtype=torch.int32)
    ids[5, 0] = 40
    rows = E * slot if slot else 4096
    l1, ca = tk.build_contiguous_layout(ids, E, rows, slot or 128, emap, slot_rows=slot)
    l2, oor = layout.build_contiguous_layout(ids, E, rows, slot or 128, emap, slot_rows=slot)
    for f in ("m_indices", "inv_perm", "row_token", "counts", "masked_m"):
        if f != "masked_m" or slot:  # (the Triton-built masked layout has no m_indices: the GEMM reads masked_m)
            assert (getattr(l1, f) is None and slot and f == "m_indices") or torch.equal(getattr(l1, f),
                                                                                         getattr(l2, f)), (M, slot, f)
    assert int(ca[E]) == int(oor.sum()) > 0 and (l1.inv_perm == layout.POISON_ROW).any()
    # fused input quantization + permutation, into both scale layouts
    xin = (torch.randn(M, 256, generator=g) * 2).to(torch.bfloat16)
    q1 = torch.zeros(rows, 256, dtype=torch.float8_e4m3fn); q2 = q1.clone()
    s1 = layout.sf_empty(rows, 2, "cpu", slot).fill_(0); s2 = layout.sf_empty(rows, 2, "cpu", slot).fill_(0)
    tk.quantize_scatter(xin, l1.inv_perm, q1, s1, use_ue8m0=True, recipe="vllm")
    layout.quantize_scatter(xin, l1.inv_perm, q2, s2, use_ue8m0=True, recipe="vllm")
    assert torch.equal(s1, s2), (M, slot)  # power-of-two scales: exact under the interpreter too
    routed = l2.inv_perm[l2.inv_perm >= 0]
    assert routed.numel() and (q2.float()[routed] != 0).any(dim=1).all()
    err = ((q1.float() - q2.float()).abs()[routed] / q2.float()[routed].abs().amax(-1, keepdim=True)).max().item()
    assert err < 0.35, err  # (interpreter truncation, as above); a row / column / token mix-up is far beyond
    # act + quant of expert rows only, into the layout's scales
    h = (torch.randn(rows, 512, generator=g) * 3).to(torch.bfloat16)
    kw = dict(alpha=None, beta=None, limit=None, group_size=128, use_ue8m0=True, recipe="vllm")
    sa = layout.sf_empty(rows, 2, "cpu", slot).fill_(-5.0)
    qa, sa = tk.act_mul_quant(h, A.SILU, out_s=sa, routes=l1.inv_perm, **kw)
    qb, sb = act_quant.act_mul_quant(h, A.SILU, out_s=layout.sf_empty(rows, 2, "cpu", slot), **kw)
    used = torch.zeros(rows, dtype=torch.bool)
    used[l1.inv_perm[l1.inv_perm >= 0]] = True
    flat = lambda t: t.reshape(-1, 2) if t.dim() == 2 else t.contiguous().view(-1, 2)
    assert (flat(sa)[~used] == -5.0).all(), "rows of no expert must not be written"
    ratio = flat(sa)[used] / flat(sb)[used]  # power-of-two scales; interpreter truncation may move one by 2x
    assert ((ratio == 1) | (ratio == 0.5) | (ratio == 2)).all() and (ratio == 1).float().mean() > 0.9
# the whole step on the Triton path (emulated GEMMs), both layouts, against the reference (loosely: interpreter)
from tests.deep_gemm_emulation import EmulatedDeepGemmExperts, small_problem
from reference.experts import fused_experts
from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP
for masked in (True, False):
    x, w1q, w2q, qc, cfg = small_problem(40, 2, 4, seed=1)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)]).to(torch.int32)
    w = torch.rand(40, 2, generator=g)
    ex = EmulatedDeepGemmExperts(cfg, qc)
    ex.masked_below_m = 128 if masked else 0
    assert ex.use_triton and tk.available(x)
    out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ex).apply(x, w1q, w2q, w, ids, global_num_experts=4)
    ref = fused_experts(x, w1q, w2q, w, ids, quant_config=qc, global_num_experts=4)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    # (interpreter fp8 truncation: ~0.11; a row, slot or scale mix-up is ~1)
    assert torch.isfinite(out).all() and rel < 0.3, (masked, rel)
# the batched class on the Triton path (its act+quant over the slots' counted rows)
from tests.deep_gemm_emulation import EmulatedBatchedDeepGemmExperts
from reference.batched import BatchedPrepareAndFinalize, BatchedReferenceExperts
x, w1q, w2q, qc, cfg = small_problem(40, 2, 4, seed=2)
ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)]).to(torch.int32)
w = torch.rand(40, 2, generator=g)
run = lambda cls: FusedMoEKernel(BatchedPrepareAndFinalize(40, 4), cls(cfg, qc, max_num_tokens=40, num_dispatchers=1)
                                 ).apply(x, w1q, w2q, w, ids, global_num_experts=4)
out, ref = run(EmulatedBatchedDeepGemmExperts), run(BatchedReferenceExperts)
rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
assert torch.isfinite(out).all() and rel < 0.3, ("batched", rel)
print("OK")
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], cwd=root, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
