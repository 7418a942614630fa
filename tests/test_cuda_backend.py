"""The ``cuda`` backend on a CPU machine: availability reasons, the JIT build's error reporting, an nvcc
compile-only check of ``router_gemm.cu`` for sm_90a, the gate tier dispatch and contract errors, the experts'
support oracle (claims and refusals), the activation against ``reference.activation``, the routing plan, and
the whole experts pipeline through the modular kernel against ``reference.experts.fused_experts`` (bf16 through
torch's CPU ``_grouped_mm``; FP8 through an emulated ``_scaled_grouped_mm`` whose argument layout is checked by
torch's own meta kernel). The kernels themselves run in ``python -m benchmarks --backend cuda`` and conformance on the GPU machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import backends.cuda as cb
from backends import load_backend
from backends.cuda import experts, gate
from backends.cuda import build
from backends.cuda.experts import (
    FP8_SUPPORTED_W_A,
    VLLM_CUTLASS_FP8_W_A,
    CutlassExpertsBf16,
    CutlassExpertsFp4,
    CutlassExpertsFp8,
    CutlassExpertsMxfp4,
    cuda_moe_activation,
    route_plan,
)
from reference import gate as rg
from reference import quant as rq
from reference.activation import MoEActivation, apply_moe_activation
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, fp8_w8a8_moe_quant_config
from reference.experts import fused_experts
from reference.metrics import error_stats
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from tests.harness_util import experts_bound

STD = FusedMoEActivationFormat.Standard
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a machine without a GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def nvcc_job():
    """Start the nvcc compile-only check of router_gemm.cu when the module starts (it takes ~15-30 s on a loaded
    2-core machine), so it overlaps the other tests; ``test_nvcc_compiles_router_gemm_for_sm90a`` (last) waits."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        yield None
        return
    out = Path(tempfile.mkdtemp(prefix="moe_cuda_nvcc_"))
    cmd = build.standalone_nvcc_command(nvcc, out / "router_gemm.o", extra=("-Xptxas", "-v"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def sm90(monkeypatch):
    """Pretend the current device is an SM90 GPU (only the experts' capability probe is replaced)."""
    monkeypatch.setattr(experts, "_device_capability", lambda: (9, 0))


# ------------------------------------------------------------------------------------------------------------
# availability, registration, platform
# ------------------------------------------------------------------------------------------------------------


def test_registered_with_ops_and_experts():
    b = load_backend("cuda")
    assert b is cb.backend and b.name == "cuda" and b.device == "cuda" and b.deterministic
    for op in ("dsv3_router_gemm", "fp32_router_gemm", "router_gemm_cublas", "gate_linear", "gate_forward",
               "apply_moe_activation"):
        assert callable(b.ops[op]), op
    assert list(b.experts) == [CutlassExpertsBf16, CutlassExpertsFp8, CutlassExpertsFp4, CutlassExpertsMxfp4]


@CPU_ONLY
def test_unavailable_here_with_reason():
    reason = load_backend("cuda").unavailable_reason()
    assert reason is not None and "no CUDA GPU" in reason


@CPU_ONLY
def test_gate_platforms_here():
    assert cb.backend.gate_platforms() == (rg.CPU,)


def test_gate_platform_reads_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert gate.current_platform() == rg.SM90
    assert gate.gate_platforms() == (rg.CPU, rg.SM90)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 3))
    assert gate.current_platform() == rg.SM103


def test_availability_reports_toolchain(monkeypatch):
    monkeypatch.setattr(cb, "cuda_unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(build, "toolchain_unavailable_reason", lambda: "nvcc not found under CUDA_HOME=/x")
    assert cb.availability() == "nvcc not found under CUDA_HOME=/x"
    monkeypatch.setattr(build, "toolchain_unavailable_reason", lambda: None)
    assert cb.availability() is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU-only torch build")
def test_toolchain_reason_on_cpu_torch():
    reason = build.toolchain_unavailable_reason()
    assert reason is not None and "not a CUDA build" in reason
    with pytest.raises(RuntimeError, match="cannot build"):
        build.load_router_gemm_ext()


# ------------------------------------------------------------------------------------------------------------
# the JIT build
# ------------------------------------------------------------------------------------------------------------


def test_extension_name_hashes_sources(monkeypatch, tmp_path):
    name = build.extension_name()
    assert re.fullmatch(r"moe_router_gemm_[0-9a-f]{12}", name) and build.extension_name() == name
    monkeypatch.setattr(build, "NVCC_FLAGS", build.NVCC_FLAGS + ("-DX=1",))
    assert build.extension_name() != name
    monkeypatch.setenv("MOE_CUDA_BUILD_DIR", str(tmp_path))
    d = build.build_directory("abc")
    assert d == tmp_path / "abc" and d.is_dir()


def test_nvcc_flags_target_sm90a():
    assert "-gencode=arch=compute_90a,code=sm_90a" in build.NVCC_FLAGS and "-O3" in build.NVCC_FLAGS


def test_build_failure_reports_compiler_tail(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("MOE_CUDA_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_failure", None)
    monkeypatch.setattr(build, "toolchain_unavailable_reason", lambda: None)
    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("Error building extension: " + "x" * 10000 + "\nrouter_gemm.cu(42): error: boom")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    with pytest.raises(RuntimeError) as exc:
        build.load_router_gemm_ext()
    msg = str(exc.value)
    assert "router_gemm.cu(42): error: boom" in msg and str(tmp_path) in msg and len(msg) < 6000
    assert "-gencode=arch=compute_90a,code=sm_90a" in calls[0]["extra_cuda_cflags"]
    with pytest.raises(RuntimeError, match="boom"):  # remembered: no second compile
        build.load_router_gemm_ext()
    assert len(calls) == 1
    assert build.build_failure() is not None


# ------------------------------------------------------------------------------------------------------------
# gate tiers: dispatch and contracts
# ------------------------------------------------------------------------------------------------------------

PLATFORMS = (rg.CPU, rg.SM80, rg.SM90, rg.SM100, rg.SM120, rg.ROCM_MI300)
SHAPES = ((7168, 256, BF16), (7168, 384, BF16), (3072, 256, FP32), (3072, 256, BF16), (2048, 128, BF16))


@pytest.mark.parametrize("platform", PLATFORMS, ids=str)
def test_tier_for_matches_the_reference_dispatch(platform):
    for (H, E, wdt) in SHAPES:
        for M in (0, 1, 16, 17, 32, 33):
            for xdt in (BF16, FP32):
                for out in (None, FP32, BF16):
                    for bias in (False, True):
                        got = gate.tier_for(M, H, E, x_dtype=xdt, weight_dtype=wdt, out_dtype=out, bias=bias,
                                            platform=platform)
                        want = rg.select_gate_tier(M, H, E, x_dtype=xdt, weight_dtype=wdt, out_dtype=out, bias=bias,
                                                   platform=platform)
                        assert got is want


def test_model_gates_pick_the_expected_tiers_on_sm90():
    T = rg.GateTier
    kw = dict(x_dtype=BF16, out_dtype=FP32, platform=rg.SM90)
    assert gate.tier_for(16, 7168, 256, weight_dtype=BF16, **kw) is T.DSV3_ROUTER_GEMM
    assert gate.tier_for(17, 7168, 384, weight_dtype=BF16, **kw) is T.CUBLAS_BF16_FP32
    assert gate.tier_for(32, 3072, 256, weight_dtype=FP32, **kw) is T.FP32_ROUTER_GEMM
    assert gate.tier_for(33, 3072, 256, weight_dtype=FP32, **kw) is T.FP32_DISPATCH_F_LINEAR
    assert gate.tier_for(33, 2048, 128, weight_dtype=BF16, **kw) is T.CUBLAS_BF16_FP32
    assert gate.tier_for(4, 2048, 128, weight_dtype=BF16, x_dtype=BF16, out_dtype=None,
                         platform=rg.SM90) is T.F_LINEAR


@pytest.mark.parametrize("kw,match", [
    (dict(M=17), r"1 <= M <= 16"),
    (dict(M=0), r"1 <= M <= 16"),
    (dict(H=4096), r"7168"),
    (dict(E=128), r"\(256, 384\)"),
    (dict(xdt=FP32), r"x bf16"),
    (dict(out=torch.float16), r"output fp32 or bf16"),
])
def test_dsv3_contract_errors(kw, match):
    M, H, E = kw.get("M", 4), kw.get("H", 7168), kw.get("E", 256)
    x = torch.zeros(M, H, dtype=kw.get("xdt", BF16))
    w = torch.zeros(E, H, dtype=BF16)
    with pytest.raises(rg.GateContractError, match=match):
        gate.dsv3_router_gemm(x, w, kw.get("out", FP32))
    assert issubclass(rg.GateContractError, ValueError)


@pytest.mark.parametrize("kw,match", [
    (dict(M=33), r"0 <= M <= 32"),
    (dict(H=2048), r"3072"),
    (dict(E=128), r"\(256,\)"),
    (dict(wdt=BF16), r"weight fp32"),
    (dict(xdt=torch.float16), r"bf16 or fp32"),
])
def test_fp32_router_contract_errors(kw, match):
    M, H, E = kw.get("M", 4), kw.get("H", 3072), kw.get("E", 256)
    x = torch.zeros(M, H, dtype=kw.get("xdt", BF16))
    w = torch.zeros(E, H, dtype=kw.get("wdt", FP32))
    with pytest.raises(rg.GateContractError, match=match):
        gate.fp32_router_gemm(x, w)


def test_kernels_need_cuda_tensors():
    with pytest.raises(ValueError, match="CUDA device"):
        gate.dsv3_router_gemm(torch.zeros(2, 7168, dtype=BF16), torch.zeros(256, 7168, dtype=BF16), FP32)
    with pytest.raises(ValueError, match="CUDA device"):
        gate.fp32_router_gemm(torch.zeros(2, 3072), torch.zeros(256, 3072))


def test_gate_linear_contracts():
    x, w = torch.zeros(2, 64, dtype=BF16), torch.zeros(8, 64, dtype=BF16)
    with pytest.raises(TypeError):
        gate.gate_linear(x, w, tier=1, out_dtype=FP32)
    with pytest.raises(rg.GateContractError, match="no bias"):
        gate.gate_linear(x, w, tier=rg.GateTier.CUBLAS_BF16_FP32, out_dtype=FP32, bias=torch.zeros(8, dtype=BF16))
    with pytest.raises(rg.GateContractError, match="bf16 x and weight"):
        gate.gate_linear(x.float(), w, tier=rg.GateTier.CUBLAS_BF16_FP32, out_dtype=FP32)
    with pytest.raises(rg.GateContractError, match="one dtype"):
        gate.gate_linear(x.float(), w, tier=rg.GateTier.F_LINEAR, out_dtype=None)
    with pytest.raises(rg.GateContractError, match="fp32 weight"):
        gate.gate_linear(x, w, tier=rg.GateTier.FP32_DISPATCH_F_LINEAR, out_dtype=None)
    with pytest.raises(ValueError, match="hidden size"):
        gate.gate_linear(x, torch.zeros(8, 32, dtype=BF16), tier=rg.GateTier.F_LINEAR, out_dtype=None)


@pytest.mark.parametrize("wdt,xdt,out,bias", [
    (BF16, BF16, FP32, False), (BF16, FP32, FP32, True), (FP32, BF16, BF16, False), (BF16, BF16, None, True),
])
def test_gate_linear_f_linear_tier_matches_reference_on_cpu(wdt, xdt, out, bias):
    x, w = torch.randn(5, 96, dtype=xdt), torch.randn(12, 96, dtype=wdt)
    b = torch.randn(12, dtype=wdt) if bias else None
    got = gate.gate_linear(x, w, tier=rg.GateTier.F_LINEAR, out_dtype=out, bias=b)
    want = rg.gate_reference(x, w, tier=rg.GateTier.F_LINEAR, out_dtype=out, bias=b)
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(wdt).eps
    assert ((got.double() - want.double()).abs() <= 2 * ulp * want.double().abs() + 1e-6).all()


def test_gate_linear_fp32_dispatch_fallback_on_cpu():
    x, w = torch.randn(40, 3072, dtype=BF16), torch.randn(256, 3072)
    got = gate.gate_linear(x, w, tier=rg.GateTier.FP32_DISPATCH_F_LINEAR, out_dtype=BF16)
    want = rg.gate_reference(x, w, tier=rg.GateTier.FP32_DISPATCH_F_LINEAR, out_dtype=BF16)
    assert got.dtype == FP32
    bound = 3072 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - want.double()).abs() <= bound).all()


def test_strict_fp32_matmul_restores_flags():
    m = torch.backends.cuda.matmul
    before = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction)
    with gate.strict_fp32_matmul():
        assert not m.allow_tf32 and not m.allow_bf16_reduced_precision_reduction
    assert (m.allow_tf32, m.allow_bf16_reduced_precision_reduction) == before


# ------------------------------------------------------------------------------------------------------------
# experts: support oracle
# ------------------------------------------------------------------------------------------------------------


def _cfg(**kw) -> FusedMoEConfig:
    base = dict(num_experts=64, experts_per_token=4, hidden_dim=2048, intermediate_size_per_partition=768,
                num_local_experts=8, activation=MoEActivation.SILU, in_dtype=BF16)
    base.update(kw)
    return FusedMoEConfig(**base)


def _supported(cls, cfg=None, w=None, a=None):
    return cls.is_supported_config(cls, cfg or _cfg(), w, a, STD)


@CPU_ONLY
def test_no_device_no_claims():
    ok, reason = _supported(CutlassExpertsBf16)
    assert not ok and "current device: torch's CUTLASS grouped GEMMs" in reason and "not a CUDA GPU" in reason, reason


def test_bf16_claims(sm90):
    assert _supported(CutlassExpertsBf16) == (True, None)
    for act in (MoEActivation.SWIGLUOAI, MoEActivation.GELU, MoEActivation.SILU_NO_MUL, MoEActivation.RELU2_NO_MUL):
        assert _supported(CutlassExpertsBf16, _cfg(activation=act))[0], act
    assert not _supported(CutlassExpertsBf16, _cfg(activation=MoEActivation.RELU2))[0]
    assert not _supported(CutlassExpertsBf16, w=rq.kFp8StaticTensorSym, a=rq.kFp8DynamicTensorSym)[0]
    ok, reason = _supported(CutlassExpertsBf16, _cfg(has_bias=True))
    assert not ok and "bias" in reason
    ok, reason = _supported(CutlassExpertsBf16, _cfg(in_dtype=torch.float16))
    assert not ok and "bf16 only" in reason
    assert not _supported(CutlassExpertsBf16, _cfg(hidden_dim=2884))[0]
    ok, reason = _supported(CutlassExpertsBf16, _cfg(intermediate_size_per_partition=100))
    assert not ok and "multiple of 8" in reason
    ok, reason = CutlassExpertsBf16.is_supported_config(CutlassExpertsBf16, _cfg(), None, None,
                                                        FusedMoEActivationFormat.BatchedExperts)
    assert not ok


def test_fp8_claims(sm90):
    for w, a in FP8_SUPPORTED_W_A:
        assert _supported(CutlassExpertsFp8, w=w, a=a) == (True, None), (w, a)
    assert set(VLLM_CUTLASS_FP8_W_A) <= set(FP8_SUPPORTED_W_A)
    for w, a in ((rq.kFp8Static128BlockSym, rq.kFp8Dynamic128Sym), (None, None),
                 (rq.kNvfp4Static, rq.kNvfp4Dynamic), (rq.kFp8StaticChannelSym, rq.kFp8Dynamic128Sym)):
        ok, reason = _supported(CutlassExpertsFp8, w=w, a=a)
        assert not ok and "quantization scheme" in reason
    ok, reason = _supported(CutlassExpertsFp8, _cfg(intermediate_size_per_partition=776),
                            w=rq.kFp8StaticChannelSym, a=rq.kFp8DynamicTokenSym)
    assert not ok and "multiple of 16" in reason


def test_fp4_paths_declared_unsupported(sm90):
    for cls, keys in ((CutlassExpertsFp4, (rq.kNvfp4Static, rq.kNvfp4Dynamic)),
                      (CutlassExpertsMxfp4, (rq.kMxfp4Static, rq.kMxfp4Dynamic))):
        ok, reason = _supported(cls, w=keys[0], a=keys[1])
        assert not ok and "SM100" in reason and "sm_90" in reason
        assert cls._supports_quant_scheme(*keys)
        with pytest.raises(NotImplementedError, match="SM100"):
            cls(_cfg(), FUSED_MOE_UNQUANTIZED_CONFIG)


# ------------------------------------------------------------------------------------------------------------
# experts: activation, routing plan
# ------------------------------------------------------------------------------------------------------------

ACT_PARAMS = {MoEActivation.SWIGLUOAI_UNINTERLEAVE: dict(alpha=1.702, beta=1.0, limit=7.0),
              MoEActivation.SILU: dict(limit=7.0)}


# Every activation the cuda experts claim (vLLM 0.33's SITU / GELU_TANH_NO_MUL are not among them: they raise).
_CLAIMED_ACTS = sorted(experts.CutlassExpertsBf16._record().activations, key=lambda a: a.value)


@pytest.mark.parametrize("act", _CLAIMED_ACTS, ids=lambda a: a.value)
def test_activation_matches_reference(act):
    x = torch.randn(33, 256, dtype=BF16) * 4
    for params in ({}, ACT_PARAMS.get(act, {})):
        got = cuda_moe_activation(act, x, **params)
        want = apply_moe_activation(act, x, **params)
        assert got.dtype == BF16 and got.shape == want.shape
        # one fp32 formula vs another, rounded once: at most one bf16 ulp apart
        ulp = torch.finfo(BF16).eps * want.float().abs().clamp_min(torch.finfo(BF16).tiny)
        assert ((got.float() - want.float()).abs() <= ulp).all(), act


def test_gated_relu2_raises():
    with pytest.raises(ValueError, match="RELU2"):
        cuda_moe_activation(MoEActivation.RELU2, torch.zeros(2, 8, dtype=BF16))


def test_route_plan_sorts_and_never_indexes_out_of_range():
    ids = torch.tensor([[3, -1, 7], [0, 9, 3], [5, 3, 100]], dtype=torch.int32)
    expert_map = torch.full((10,), -1, dtype=torch.int32)
    expert_map[torch.tensor([3, 5, 9])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    p = route_plan(ids, 3, expert_map)
    assert p.offs.dtype == torch.int32 and p.offs.tolist() == [3, 4, 5]  # expert 3 x3, 5 x1, 9 x1
    local = [[0, -1, -1], [-1, 2, 0], [1, 0, -1]]
    assert p.valid_route.tolist() == [[v >= 0 for v in row] for row in local]
    flat = [v for row in local for v in row]
    sorted_local = [flat[i] for i in p.order.tolist()]
    assert sorted_local == [0, 0, 0, 1, 2, -1, -1, -1, -1]  # stable: token order within an expert
    assert p.order[:3].tolist() == [0, 5, 7]
    assert p.token.tolist() == [i // 3 for i in p.order.tolist()]
    assert (p.order[p.inv.reshape(-1)] == torch.arange(9)).all()
    assert p.valid_sorted.tolist() == [True] * 5 + [False] * 4
    q = route_plan(torch.tensor([[1, 0], [4, 2]]), 3, None)  # no map: ids >= E_local are not here
    assert q.offs.tolist() == [1, 2, 3] and q.valid_route.tolist() == [[True, True], [False, True]]


# ------------------------------------------------------------------------------------------------------------
# experts: the pipeline on CPU
# ------------------------------------------------------------------------------------------------------------


def _problem(M=29, K=256, I=128, E_local=6, E=12, topk=3, act=MoEActivation.SILU, dtype=BF16):
    N = 2 * I if act.is_gated else I
    x = torch.randn(M, K).to(dtype)
    w1 = (torch.randn(E_local, N, K) * K**-0.5).to(dtype)
    w2 = (torch.randn(E_local, K, I) * I**-0.5).to(dtype)
    ids = torch.randint(-1, E, (M, topk), dtype=torch.int32)
    weights = torch.rand(M, topk)
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[torch.randperm(E)[:E_local]] = torch.arange(E_local, dtype=torch.int32)
    return x, w1, w2, weights, ids, emap


def _run(cls, qc, x, w1, w2, weights, ids, emap, act, chunk=None, on_input=False):
    E_local, N, K = w1.shape
    cfg = _cfg(num_experts=emap.numel(), experts_per_token=ids.shape[1], hidden_dim=K,
               intermediate_size_per_partition=w2.shape[2], num_local_experts=E_local, activation=act)
    # chunking is the 0.17 modular kernel's (0.33 has no chunk loop)
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(cfg, qc), chunk_size=chunk, poison=float("nan"),
                            semantics="0.17" if chunk else None)
    kw = dict(activation=act, global_num_experts=emap.numel(), expert_map=emap, apply_router_weight_on_input=on_input)
    out = kernel.apply(x, w1, w2, weights, ids, **kw)
    ref = fused_experts(x, w1, w2, weights, ids, quant_config=qc, **kw)
    return out, ref


@pytest.mark.parametrize("act,chunk", [(MoEActivation.SILU, None), (MoEActivation.SWIGLUOAI, 7),
                                       (MoEActivation.GELU_NO_MUL, 16)], ids=lambda v: str(v))
def test_bf16_pipeline_matches_reference(act, chunk, sm90):
    x, w1, w2, weights, ids, emap = _problem(act=act)
    out, ref = _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap, act, chunk)
    tol = experts_bound(x, w1, ids, expert_map=emap, activation=act)
    s = error_stats(out, ref)
    assert out.dtype == BF16 and s.nonfinite == 0
    assert s.max_norm <= tol["max_norm"] and s.rms_norm <= tol["rms_norm"], s


def test_bf16_pipeline_topk1_weight_on_input_and_no_local_routes(sm90):
    x, w1, w2, weights, ids, emap = _problem(topk=1)
    out, ref = _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap,
                    MoEActivation.SILU, on_input=True)
    assert error_stats(out, ref).max_norm <= experts_bound(x, w1, ids, expert_map=emap)["max_norm"]
    far = torch.full_like(ids, 11)
    emap2 = emap.clone()
    emap2[11] = -1
    out, ref = _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, far, emap2,
                    MoEActivation.SILU)
    assert (out == 0).all() and (ref == 0).all()


def test_bad_ids_raise_when_validated_else_poison_their_tokens(monkeypatch, sm90):
    # Host validation (a device->host copy) only on request (MOE_VALIDATE_ROUTES=1, set by the conformance suite);
    # otherwise a token with an id outside [-1, E) gets a NaN row and every other token its normal result.
    x, w1, w2, weights, ids, emap = _problem()
    bad = ids.clone()
    bad[3, 1], bad[10, 0] = 12, -5
    monkeypatch.setenv("MOE_VALIDATE_ROUTES", "1")
    with pytest.raises(ValueError, match="must lie in"):
        _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, bad, emap, MoEActivation.SILU)
    monkeypatch.delenv("MOE_VALIDATE_ROUTES")
    cfg = _cfg(num_experts=12, experts_per_token=3, hidden_dim=256, intermediate_size_per_partition=128,
               num_local_experts=6)
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), CutlassExpertsBf16(cfg, FUSED_MOE_UNQUANTIZED_CONFIG))
    kw = dict(activation=MoEActivation.SILU, global_num_experts=12, expert_map=emap)
    out, good = kernel.apply(x, w1, w2, weights, bad, **kw), kernel.apply(x, w1, w2, weights, ids, **kw)
    poisoned = torch.zeros(x.shape[0], dtype=torch.bool)
    poisoned[[3, 10]] = True
    assert torch.isnan(out[poisoned]).all()
    assert torch.equal(out[~poisoned], good[~poisoned])


def test_reduction_chunks_give_the_same_bits(monkeypatch, sm90):
    # the weighted reduction runs over chunks of tokens (bounded temporaries): any chunking, the same output
    from backends.cuda import experts as ce

    x, w1, w2, weights, ids, emap = _problem()
    whole, _ = _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap, MoEActivation.SILU)
    monkeypatch.setattr(ce, "REDUCE_CHUNK_BYTES", 3 * ids.shape[1] * x.shape[1] * 4)  # 3 tokens per chunk
    chunked, _ = _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap,
                      MoEActivation.SILU)
    assert torch.equal(whole.view(torch.int16), chunked.view(torch.int16))


def test_bf16_pipeline_is_deterministic(sm90):
    x, w1, w2, weights, ids, emap = _problem()
    a, _ = _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap, MoEActivation.SILU)
    b, _ = _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap, MoEActivation.SILU)
    assert torch.equal(a, b)


def test_bf16_rejects_bad_operands(sm90):
    x, w1, w2, weights, ids, emap = _problem()
    with pytest.raises(ValueError, match="must be torch.bfloat16"):
        _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x.float(), w1.float(), w2.float(), weights, ids, emap,
             MoEActivation.SILU)
    x, w1, w2, weights, ids, emap = _problem(I=100)
    with pytest.raises(ValueError, match="multiple of 8"):
        _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap, MoEActivation.SILU)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _emulated_scaled_grouped_mm(a, w, scale_a, scale_b, offs):
    """``torch._scaled_grouped_mm`` on CPU: the layout is checked by torch's meta kernel, the values computed in
    fp32 with the CUTLASS epilogue's order (acc * scale_a * scale_b, one bf16 rounding)."""
    torch._scaled_grouped_mm(_meta(a), _meta(w).transpose(-2, -1), _meta(scale_a), _meta(scale_b), offs=_meta(offs),
                             out_dtype=BF16)
    assert a.dtype == FP8 and w.dtype == FP8 and scale_a.shape == (a.shape[0],) and scale_b.shape == w.shape[:2]
    out = torch.full((a.shape[0], w.shape[1]), float("nan"), dtype=BF16)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            acc = a[start:end].float() @ w[e].float().T
            out[start:end] = (acc * scale_a[start:end, None] * scale_b[e]).to(BF16)
        start = end
    return out


def _fp8_weights(w: torch.Tensor, per_channel: bool):
    amax = w.float().abs().amax(dim=-1, keepdim=True) if per_channel else w.float().abs().amax(dim=(1, 2))
    s = (amax / 448.0).clamp_min(1e-12)
    q = (w.float() / (s if per_channel else s[:, None, None])).clamp(-448, 448).to(FP8)
    return q, s


@pytest.mark.parametrize("scheme", ["token-channel", "tensor-static", "tensor-dynamic", "tensor-channel"])
def test_fp8_pipeline_matches_reference(monkeypatch, scheme, sm90):
    """Dynamic per-tensor a2 takes one scale over all routed rows of the call (vLLM; reference.experts too), so
    those schemes run unchunked here: each chunk of the modular kernel would take its own scale."""
    monkeypatch.setattr(experts, "scaled_grouped_mm_fp8", _emulated_scaled_grouped_mm)
    x, w1, w2, weights, ids, emap = _problem()
    per_channel = scheme.endswith("channel")
    per_token = scheme.startswith("token")
    dynamic_tensor = not per_token and scheme != "tensor-static"
    w1q, s1 = _fp8_weights(w1, per_channel)
    w2q, s2 = _fp8_weights(w2, per_channel)
    a1s = a2s = None
    if scheme == "tensor-static":
        a1s, a2s = torch.tensor(4.0 / 448), torch.tensor(8.0 / 448)
    qc = fp8_w8a8_moe_quant_config(s1, s2, a1s, a2s, per_act_token_quant=per_token, per_out_ch_quant=per_channel)
    out, ref = _run(CutlassExpertsFp8, qc, x, w1q, w2q, weights, ids, emap, MoEActivation.SILU,
                    chunk=None if dynamic_tensor else 11)
    tol = experts_bound(x, w1q, ids, quant_config=qc, expert_map=emap)
    s = error_stats(out, ref)
    assert out.dtype == BF16 and s.nonfinite == 0
    assert s.max_norm <= tol["max_norm"] and s.rms_norm <= tol["rms_norm"] and s.calc_diff <= tol["calc_diff"], s


def test_unsupported_schemes_raise_at_construction(sm90):
    """M == 0 never reaches apply, so an unclaimed scheme must fail when the experts object is built."""
    w = torch.ones(2, 8, 1)
    fp8_tensor = fp8_w8a8_moe_quant_config(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="unquantized"):
        CutlassExpertsBf16(_cfg(), fp8_tensor)
    with pytest.raises(ValueError, match="FP8 W8A8"):
        CutlassExpertsFp8(_cfg(), FUSED_MOE_UNQUANTIZED_CONFIG)
    with pytest.raises(ValueError, match="block-scaled"):
        CutlassExpertsFp8(_cfg(), fp8_w8a8_moe_quant_config(w, w, block_shape=[128, 128]))
    from reference.config import biased_moe_quant_config
    with pytest.raises(ValueError, match="biases"):
        CutlassExpertsBf16(_cfg(), biased_moe_quant_config(torch.zeros(2, 8), torch.zeros(2, 4)))
    CutlassExpertsFp8(_cfg(), fp8_tensor)  # claimed schemes construct fine


def test_fp8_rejects_block_scales_and_bf16_weights(monkeypatch, sm90):
    monkeypatch.setattr(experts, "scaled_grouped_mm_fp8", _emulated_scaled_grouped_mm)
    x, w1, w2, weights, ids, emap = _problem()
    w1q, s1 = _fp8_weights(w1, True)
    w2q, s2 = _fp8_weights(w2, True)
    block = fp8_w8a8_moe_quant_config(torch.ones(6, 2, 2), torch.ones(6, 2, 1), block_shape=[128, 128])
    with pytest.raises(ValueError, match="block-scaled"):
        _run(CutlassExpertsFp8, block, x, w1q, w2q, weights, ids, emap, MoEActivation.SILU)
    qc = fp8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=True, per_out_ch_quant=True)
    with pytest.raises(ValueError, match="weights must be"):
        _run(CutlassExpertsFp8, qc, x, w1, w2, weights, ids, emap, MoEActivation.SILU)


@CPU_ONLY
def test_apply_refuses_an_unsupported_device():
    x, w1, w2, weights, ids, emap = _problem()
    with pytest.raises(ValueError, match="SM90"):
        _run(CutlassExpertsBf16, FUSED_MOE_UNQUANTIZED_CONFIG, x, w1, w2, weights, ids, emap, MoEActivation.SILU)


def test_bf16_grouped_mm_layout_accepted_by_meta_kernel():
    a = torch.empty(40, 256, dtype=BF16)
    w = torch.empty(6, 512, 256, dtype=BF16)
    offs = torch.empty(6, dtype=torch.int32)
    out = torch._grouped_mm(_meta(a), _meta(w).transpose(-2, -1), offs=_meta(offs))
    assert out.shape == (40, 512) and out.dtype == BF16


# ------------------------------------------------------------------------------------------------------------
# nvcc compile-only check (started by the ``nvcc_job`` fixture at the beginning of the module)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # an nvcc compilation (minutes)
@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed on this machine")
def test_nvcc_compiles_router_gemm_for_sm90a(nvcc_job):
    proc, out = nvcc_job
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log[-4000:]
    assert (out / "router_gemm.o").stat().st_size > 0
    entries = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", log)
    # DSV3: 4 variants x 5 M buckets; fp32: 4 variants x 6 M buckets x 2 activation dtypes.
    assert len(entries) == 4 * 5 + 4 * 6 * 2, len(entries)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", log)]
    assert max(spills) <= 64, "a router GEMM kernel spills registers heavily"


@pytest.mark.slow  # an nvcc compilation
@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed on this machine")
def test_nvcc_compiles_moe_glue_for_sm90a(tmp_path):
    cmd = build.standalone_nvcc_command(build.find_nvcc(), tmp_path / "moe_glue.o", extra=("-Xptxas", "-v"),
                                        source="moe_glue.cu")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    entries = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", proc.stdout)
    # route plan: 2 id dtypes; scatter: 4 modes; plan + scatter fused: 2 x 4; act_quant: 9 activations x 3 outputs;
    # weight_reduce: 1.
    assert len(entries) == 2 + 4 + 2 * 4 + 9 * 3 + 1, len(entries)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", proc.stdout)]
    assert max(spills) == 0, "a glue kernel spills registers"


# ------------------------------------------------------------------------------------------------------------
# the glue kernels (moe_glue.cu): selection here, bits on the GPU
# ------------------------------------------------------------------------------------------------------------


def test_glue_covers_every_claimed_activation_with_the_torch_defaults():
    from backends.cuda.experts import _GATED, _NO_MUL, GLUE_ACT, glue_act_params

    assert set(GLUE_ACT) == set(_GATED + _NO_MUL) and len(set(GLUE_ACT.values())) == len(GLUE_ACT)
    A = MoEActivation
    assert glue_act_params(A.SILU, None, None, None)[1:] == (1.0, 0.0, -1.0)  # no clamp
    assert glue_act_params(A.SWIGLUOAI, None, None, None)[1:] == (1.702, 0.0, 7.0)
    assert glue_act_params(A.SWIGLUOAI_UNINTERLEAVE, None, None, 5.0)[1:] == (1.0, 0.0, 5.0)
    assert glue_act_params(A.SWIGLUSTEP, None, None, None)[3] == 7.0
    assert glue_act_params(A.SILU, None, None, -1.0) is None  # a negative clamp limit: the torch ops
    assert glue_act_params(A.RELU2, None, None, None) is None


def test_glue_is_not_used_off_the_gpu_or_when_disabled(monkeypatch):
    from backends.cuda.experts import GLUE_ENV, glue_kernels

    assert glue_kernels(torch.zeros(2, 16), 8, 64) is None  # CPU tensors: the torch-op glue
    monkeypatch.setenv(GLUE_ENV, "torch")
    assert glue_kernels(torch.zeros(2, 16), 8, 64) is None


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the glue kernels run on an SM90 GPU")
def test_glue_kernels_match_the_torch_glue_bit_for_bit():
    from tools.cuda.glue_check import run_checks

    failed = {name: why for name, why in run_checks().items() if why is not None}
    assert not failed, failed


def test_tier1_runs_cublas_where_the_table_says_it_is_faster(monkeypatch):
    calls = []

    def fake_cublas(x, w):
        calls.append(x.shape[0])
        return x.float() @ w.float().T

    monkeypatch.setattr(gate, "_check_cuda", lambda *a: None)
    monkeypatch.setattr(gate, "router_gemm_cublas", fake_cublas)
    x, w = torch.randn(16, 7168).to(BF16), torch.randn(384, 7168).to(BF16)
    m = gate.DSV3_CUBLAS_FROM_M[384]
    out = gate.dsv3_router_gemm(x[:m], w, BF16)
    assert calls == [m] and out.dtype == BF16 and torch.equal(out, (x[:m].float() @ w.float().T).to(BF16))
    assert 256 not in gate.DSV3_CUBLAS_FROM_M  # DeepSeek-V3's kernel beats cuBLAS at every M <= 16


def test_weighted_sum_rounds_each_product_and_sums_in_k_order():
    # A cancellation where an FMA-accumulated sum (cuBLAS bmm) gives another bf16 than rounded products do; the
    # oracle is numpy's float32 arithmetic, one operation at a time.
    import ml_dtypes
    import numpy as np

    from backends.cuda.experts import _weight_and_reduce

    w = np.array([[0.9659083485603333, 0.8033186793327332]], dtype=np.float32)
    y = torch.tensor([[4.1875] * 8, [-5.03125] * 8], dtype=BF16)
    plan = route_plan(torch.tensor([[0, 1]]), 2, None)
    out = torch.empty(1, 8, dtype=BF16)
    _weight_and_reduce(y, plan, torch.from_numpy(w), False, out)
    p = [np.float32(w[0, k]) * np.float32(y[plan.inv[0, k], 0].item()) for k in range(2)]
    want = np.float32(np.float32(0.0) + p[0]) + p[1]
    assert np.array([want]).astype(ml_dtypes.bfloat16).astype(np.float32)[0] == 0.0030517578125
    assert torch.all(out.float() == 0.0030517578125)
