"""Quantizer conformance: the backend's quantizers against the reference, bit-exactly (codes and scales), under the
recipe the backend declares (``Backend.recipes``). A mismatch report gives the count, the first coordinates, both
codes and the value before rounding.

Inputs are N(0, 1) scaled per row over six decades, with planted edge rows: an all-zero row, a row whose groups
have a power-of-two amax (448 * 2^k: the scale is exact and UE8M0 rounding must not move it), and a row of
values just below a rounding boundary of the scale. Non-finite inputs are a separate case (``-nonfinite``): the
reference poisons the whole group (NaN scale and codes); a backend that saturates instead lists it as a known
failure in ``specs/xfail``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conformance.cases import seed_of
from conformance.metrics import assert_exact
from reference import quant as rq
from specs import load_cases

_SPEC = load_cases()["quant"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _input(M: int, K: int, dtype: torch.dtype, seed: int, nonfinite: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.pow(10.0, torch.randint(-3, 3, (M, 1), generator=g).float())
    if M >= 3:
        x[0] = 0.0  # all-zero row: the amax floor decides the scale
        x[1, ::64] = 448.0 * 2.0 ** torch.randint(-8, 4, (len(range(0, K, 64)),), generator=g).float()
        x[2] = x[2].sign() * torch.linspace(0.999, 1.0, K)  # amax just below 1: scale not a power of two
    if nonfinite and M >= 5:
        x[3, 5] = float("nan")
        x[4, -1] = float("inf")
    return x.to(dtype)


def _cases():
    for (M, K), dt in itertools.product(_SPEC["shapes"], _SPEC["dtypes"]):
        for gs, ue8m0, col in itertools.product(_SPEC["group_sizes"], (False, True), (False, True)):
            if K % gs or (dt != "bfloat16" and (gs != 128 or col)):
                continue
            yield pytest.param(("per_token_group_quant_fp8", M, K, dt, dict(group_size=gs, use_ue8m0=ue8m0,
                                                                             column_major_scales=col)),
                               id=f"per_token_group_quant_fp8-{dt}-M{M}-K{K}-g{gs}" + "-ue8m0" * ue8m0
                               + "-colmajor" * col)
        for mode in ("tensor", "token", "static"):
            yield pytest.param(("scaled_fp8_quant", M, K, dt, dict(mode=mode)),
                               id=f"scaled_fp8_quant-{dt}-M{M}-K{K}-{mode}")
        yield pytest.param(("int8_quant_per_token", M, K, dt, {}), id=f"int8_quant_per_token-{dt}-M{M}-K{K}")
    yield pytest.param(("per_token_group_quant_fp8", 16, 2048, "bfloat16", dict(group_size=128, nonfinite=True)),
                       id="per_token_group_quant_fp8-bfloat16-M16-K2048-g128-nonfinite")
    yield pytest.param(("scaled_fp8_quant", 16, 2048, "bfloat16", dict(mode="token", nonfinite=True)),
                       id="scaled_fp8_quant-bfloat16-M16-K2048-token-nonfinite")


def _call(op_name, fn, x, kw, reference: bool, recipe: str):
    kw = {k: v for k, v in kw.items() if k != "nonfinite"}
    if op_name == "per_token_group_quant_fp8":
        return fn(x, **kw, **({"recipe": recipe} if reference else {}))
    if op_name == "scaled_fp8_quant":
        mode = kw["mode"]
        if mode == "static":
            return fn(x, torch.tensor([0.0125], device=x.device))
        return fn(x, use_per_token_if_dynamic=mode == "token")
    return fn(x)


@pytest.mark.parametrize("case", list(_cases()))
def test_quantizer(backend, case, repro, record):
    op_name, M, K, dt, kw = case
    op = backend.ops.get(op_name)
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement {op_name}")
    recipe = backend.recipe(op_name)
    record(component="quant", scheme=op_name, tokens=M, recipe=recipe)
    cid = f"quant[{op_name}-{dt}-M{M}-K{K}]"
    x = _input(M, K, DTYPES[dt], seed_of(cid + repr(sorted(kw.items()))), kw.get("nonfinite", False))
    if op_name == "int8_quant_per_token" and kw.get("nonfinite"):
        pytest.skip("int8 has no representation for NaN/inf (the reference raises)")
    ref_q, ref_s = _call(op_name, getattr(rq, op_name), x, kw, True, recipe)
    out_q, out_s = _call(op_name, op, x.to(backend.device), kw, False, recipe)
    if kw.get("column_major_scales"):
        if out_s.stride() != ref_s.stride():
            raise AssertionError(f"{cid}: column-major scales have strides {out_s.stride()}, expected "
                                 f"{ref_s.stride()} (MN-major layout)\n  reproduce: {repro}")
    assert_exact(out_s.contiguous(), ref_s.contiguous(), case=cid, what=f"{op_name} scales (recipe {recipe})",
                 repro=repro)
    pre = None
    if ref_s.numel() and op_name == "per_token_group_quant_fp8":
        pre = x.float() / ref_s.contiguous().repeat_interleave(kw["group_size"], dim=-1)
    elif ref_s.numel():
        pre = x.float() / ref_s
    assert_exact(out_q, ref_q, case=cid, what=f"{op_name} codes (recipe {recipe})", repro=repro, pre_rounding=pre)


# ---------------------------------------------------------------------------------------------------------------
# Fused gated activation + FP8 quantization, one op each (reference.fused_act_quant), bitwise
# ---------------------------------------------------------------------------------------------------------------

_COLMAJOR = [  # (M, N, kwargs)
    (16, 512, {}), (64, 1536, dict(use_ue8m0=True)), (32, 512, dict(clamp_limit=7.0)),
    (32, 512, dict(clamp_limit=7.0, alpha=1.702, beta=1.0)), (16, 256, dict(group_size=64)),
    (64, 512, dict(expert_ends=(5, 32 + 17, 64), expert_alignment=16)),
]


@pytest.mark.parametrize("M,N,kw", _COLMAJOR, ids=lambda v: "-".join(f"{k}{w}" for k, w in v.items())
                         if isinstance(v, dict) else str(v))
def test_silu_mul_per_token_group_quant_fp8_colmajor(backend, M, N, kw, repro, record):
    """vLLM's ``silu_mul_per_token_group_quant_fp8_colmajor``: codes and column-major scales bitwise; with
    ``expert_ends`` (DeepGEMM psum layout) the dead rows of the output stay untouched."""
    from reference.fused_act_quant import silu_mul_per_token_group_quant_fp8_colmajor as ref
    from reference.semantics import SemanticsVersion, current_semantics

    op = backend.ops.get("silu_mul_per_token_group_quant_fp8_colmajor")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement silu_mul_per_token_group_quant_fp8_colmajor")
    if current_semantics() < SemanticsVersion.V0_33 and set(kw) - {"use_ue8m0"}:
        pytest.skip(f"{sorted(set(kw) - {'use_ue8m0'})} are vLLM 0.33 arguments")
    cid = f"silu_mul_colmajor[M{M}-N{N}-{kw}]"
    record(component="quant", scheme="silu_mul_fp8_colmajor", tokens=M)
    g = torch.Generator().manual_seed(seed_of(cid))
    x = (torch.randn(M, N, generator=g) * 8).to(torch.bfloat16)
    kw = dict(kw)
    if "expert_ends" in kw:
        kw["expert_ends"] = torch.tensor(kw["expert_ends"], dtype=torch.int32)
    poison = torch.full((M, N // 2), 3.0).to(torch.float8_e4m3fn)
    rq_, rs_ = ref(x, poison.clone(), **kw)
    dev = backend.device
    okw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    q, s = op(x.to(dev), poison.clone().to(dev), **okw)
    assert_exact(q.cpu().view(torch.uint8), rq_.view(torch.uint8), case=cid, what="fp8 codes (dead rows untouched)",
                 repro=repro)
    live = ~torch.isnan(rs_[:, 0])
    assert_exact(s.cpu()[live], rs_[live], case=cid, what="fp32 scales (live rows)", repro=repro)
    if s.stride() != (1, M):
        raise AssertionError(f"{cid}: scales must be column-major (strides (1, {M})), got {s.stride()}")


@pytest.mark.parametrize("fmt", ["FLOAT32", "FLOAT32_CEIL_UE8M0", "UE8M0"])
@pytest.mark.parametrize("E,T,H", [(4, 16, 256), (8, 33, 640)])
def test_persistent_masked_m_silu_mul_quant(backend, fmt, E, T, H, repro, record):
    """vLLM's masked batched SiLU-mul + FP8 (DeepGEMM batched experts): valid rows' codes and scales bitwise in the
    requested scale format (MN-major, packed UE8M0 words); rows past ``tokens_per_expert`` hold zero scales."""
    from reference.fused_act_quant import DeepGemmQuantScaleFMT, persistent_masked_m_silu_mul_quant as ref

    op = backend.ops.get("persistent_masked_m_silu_mul_quant")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement persistent_masked_m_silu_mul_quant")
    cid = f"persistent_masked_silu_mul_quant[{fmt}-E{E}-T{T}-H{H}]"
    record(component="quant", scheme=f"masked_silu_mul_fp8-{fmt}", tokens=T)
    g = torch.Generator().manual_seed(seed_of(cid))
    counts = torch.randint(0, T + 1, (E,), generator=g, dtype=torch.int32)
    counts[0] = 0
    y = (torch.randn(E, T, 2 * H, generator=g) * torch.exp2(torch.randint(0, 12, (E, T, 1), generator=g))).to(
        torch.bfloat16)
    f = DeepGemmQuantScaleFMT[fmt]
    rq_, rs_ = ref(y, counts, quant_scale_fmt=f)
    q, s = op(y.to(backend.device), counts.to(backend.device), quant_scale_fmt=f)
    valid = torch.arange(T)[None, :] < counts[:, None]
    assert_exact(q.cpu().view(torch.uint8)[valid], rq_.view(torch.uint8)[valid], case=cid, what="fp8 codes (valid)",
                 repro=repro)
    assert_exact(s.cpu(), rs_, case=cid, what=f"scales ({fmt}; zero past the counts)", repro=repro)
