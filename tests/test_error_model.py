"""The error model (reference/error_model.py) against what it must classify (issue 22, item 3).

- It accepts the reference computed with float64 accumulation on every model x scheme of the specs, inside the bound
  for a single fp32 accumulation difference (2^-1/4 of the two-sided bound).
- It accepts an emulated conforming kernel (a 14-bit MMA partial promoted every 128 K elements, as DeepGEMM) and
  rejects an emulated reduced-precision accumulator (13 bits every 32 products, never promoted), an extra rounding of
  every element (split-K with bf16 partials) and a dropped router weight (tests/emulated_backends.py).
- It classifies the GPU measurements of issue 22 (an H200, tree 4fab0a7): the six in-place FP8 accumulation cases
  fail, DeepGEMM's short-reduction UE8M0 flip passes.
- The accumulation probe (conformance/test_accumulation.py) goes red for the reduced-precision accumulator and stays
  green for the promoted one and the torch backend.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from conformance.cases import ExpertsCase
from reference.experts import fused_experts_with_heavy
from conformance.inputs import make_experts_inputs
from reference.activation import MoEActivation
from reference.error_model import Accumulation, acc_rel, emulate_mma16, experts_error_bound, mma16_rel
from reference.experts import experts_unreduced, fused_experts
from reference.metrics import error_stats
from reference.modular import moe_kernel_quantize_input
from reference.routing import fused_topk
from reference.schemes import quantize_weights
from specs import load_models
from tests.emulated_backends import (A2FlipCodeExperts, A2FlipExperts, DroppedWeightExperts, ExtraRoundingExperts, HFlipExperts,
                                     InplaceExperts, Mma16Experts, PromotedExperts)
from tests.harness_util import run_conformance


def _qc(scheme: str, K: int = 256, I: int = 128):
    w1 = torch.randn(1, 2 * I, K).bfloat16()
    w2 = torch.randn(1, K, I).bfloat16()
    return quantize_weights(scheme, w1, w2)[2]


def test_accumulation_term_follows_the_derivation():
    fp32, prom, fast = Accumulation.fp32(), Accumulation.promoted(14, 256), Accumulation.fast(14)
    assert fp32.relative_error(7168, fp8_mma=True) == pytest.approx(2.0**-24 * math.sqrt(7168 / 6))
    # A promoted partial stops growing at the interval; a fast one grows as sqrt(K).
    assert prom.relative_error(1024, True) == pytest.approx(prom.relative_error(16384, True), rel=1e-3)
    assert fast.relative_error(16384, True) / fast.relative_error(1024, True) == pytest.approx(4.0, rel=1e-3)
    # An FP8 recipe says nothing of other operands: without mma16 they accumulate as fp32 (step 1b: Accumulation.allowed).
    assert fast.relative_error(7168, fp8_mma=False) == fp32.relative_error(7168, fp8_mma=False)
    assert acc_rel(6, 0.5) == pytest.approx(0.5)


@pytest.mark.parametrize("n", [1024, 4096])
def test_mma16_term_bounds_the_emulated_tensor_core(n):
    """Step 1b against a bit-level emulation of the 16-bit MMA on random dot products: the formula is an upper bound
    (as ``acc`` is for fp32), not a loose one, and it grows linearly in n where fp32's grows as sqrt(n)."""
    g = torch.Generator().manual_seed(n)
    a = torch.randn(256, n, generator=g).bfloat16()
    w = (torch.randn(1, n, generator=g) * n**-0.5).bfloat16()
    exact = a.double() @ w.double().T
    got = emulate_mma16(a, w).double()
    measured = ((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    formula = mma16_rel(n, 16, 24)
    assert measured <= formula <= 3 * measured, (measured, formula)
    assert formula > acc_rel(n, 2.0**-24)  # the normalization toward zero dominates fp32's round to nearest
    assert mma16_rel(4 * n, 16, 24) / formula > 3.5  # linear in n (sqrt(n) growth would give 2)
    allowed = Accumulation.allowed({"mma_mantissa_bits": 14, "promote_every": 256, "mma16_block": 16,
                                    "mma16_align_bits": 24})
    assert allowed.relative_error(n, fp8_mma=False, mma16=True) == formula
    assert allowed.relative_error(n, fp8_mma=False, mma16=False) == acc_rel(n, 2.0**-24)  # fp32 operands


def test_few_flip_events_widen_the_bound():
    qc = _qc("bf16")
    many = experts_error_bound(qc, act_dtype=torch.bfloat16, K=2880, I=8, routed_rows=10**6)
    few = experts_error_bound(qc, act_dtype=torch.bfloat16, K=2880, I=8, routed_rows=33)
    unknown = experts_error_bound(qc, act_dtype=torch.bfloat16, K=2880, I=8)
    assert unknown.rms_norm == pytest.approx(many.rms_norm, rel=0.05)
    assert few.rms_norm > 3 * many.rms_norm and few.expected_rms == pytest.approx(many.expected_rms)


def test_bound_orders_schemes_and_recipes():
    bf16 = experts_error_bound(_qc("bf16"), act_dtype=torch.bfloat16, K=7168, I=2048)
    fp32 = experts_error_bound(_qc("bf16"), act_dtype=torch.float32, K=7168, I=2048)
    fp8 = experts_error_bound(_qc("fp8_tensor"), act_dtype=torch.bfloat16, K=7168, I=2048)
    fast = experts_error_bound(_qc("fp8_tensor"), act_dtype=torch.bfloat16, K=7168, I=2048,
                               accumulation=Accumulation.fast(14))
    assert fp32.rms_norm < bf16.rms_norm < fp8.rms_norm < fast.rms_norm
    # calc_diff is rms_norm^2 / 2, not an independent constant.
    assert fp8.calc_diff == pytest.approx(fp8.rms_norm**2 / 2)
    # A single requantized code flip weighs more on a short reduction.
    short = experts_error_bound(_qc("fp8_tensor"), act_dtype=torch.bfloat16, K=7168, I=128)
    assert short.max_norm > fp8.max_norm
    with pytest.raises(ValueError, match="activation dtype"):
        experts_error_bound(_qc("bf16"), act_dtype=torch.int8, K=128, I=128)


# Every model x scheme of the specs at 8 tokens: the float64-accumulated reference against the fp32 one. The two
# smallest models run in nox -s tests; the sweep over the others (minutes of CPU: DeepSeek-V3's and gpt-oss's
# weights) in nox -s slow.
_FAST_MODELS = ("qwen3_30b_a3b", "nemotron_3_nano")
_PAIRS = [pytest.param(m.name, s, id=f"{m.name}-{s}", marks=() if m.name in _FAST_MODELS else pytest.mark.slow)
          for m in load_models().values() for s in m.schemes]


@pytest.mark.parametrize(("model", "scheme"), _PAIRS)
def test_float64_reference_sits_well_inside(model, scheme):
    m = load_models()[model]
    case = ExpertsCase(m, scheme, 8, m.cpu_ep_size, 0)
    inp = make_experts_inputs(case, "cpu")
    kw = dict(activation=case.activation, global_num_experts=inp.global_num_experts, expert_map=inp.expert_map,
              apply_router_weight_on_input=m.apply_router_weight_on_input, quant_config=inp.quant_config)
    args = (inp.hidden_states, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    ref = fused_experts(*args, **kw)
    exact = fused_experts(*args, accumulate_dtype=torch.float64, **kw)
    local = int((inp.topk_ids >= 0).sum()) if inp.expert_map is None else \
        int((inp.expert_map[inp.topk_ids.long().clamp(min=0)] >= 0).sum())
    bound = experts_error_bound(inp.quant_config, act_dtype=case.dtype, K=m.hidden_size, I=m.intermediate_size,
                                activation=case.activation, routed_rows=local,
                                routes_per_row=max(local / max(case.tokens, 1), 1.0))
    s = error_stats(exact, ref)
    # The model bounds two fp32 accumulations (each order's error); float64 against fp32 is one of them, so the
    # flip-driven rms is 2^-1/4 of the model's (it grows as the square root of the accumulation difference).
    one_sided = 2.0**-0.25
    assert s.rms_norm <= one_sided * bound.rms_norm and s.max_norm <= one_sided * bound.max_norm, (s, bound)


def _emulated(cls, x, w1q, w2q, w, ids, qc):
    out = torch.empty_like(x)
    a1q, a1s = moe_kernel_quantize_input(x, None, qc, "a1")
    y = experts_unreduced(a1q, a1s, w1q, w2q, ids, None, qc, MoEActivation.SILU, x.dtype,
                           gemm=getattr(cls, "gemm", None))
    impl = cls.finalize_weight_and_reduce_impl(cls.__new__(cls))
    impl.apply(out, y, w, ids, False)
    return out


@pytest.mark.parametrize(("E", "topk", "K", "I", "M", "scheme"), [
    (2, 2, 4096, 64, 100, "fp8_tensor"),          # issue 22's second in-place example (H200: rms 0.0155)
    (1, 1, 7168, 128, 64, "fp8_channel_token"),   # long K per-channel
    (2, 2, 2048, 256, 64, "bf16"),
    (8, 8, 1024, 256, 64, "bf16"),  # eight local routes: step 6's spread over them still rejects an extra rounding
])
def test_emulated_kernels_are_classified(E, topk, K, I, M, scheme):
    g = torch.Generator().manual_seed(E * K + M)
    w1 = (torch.randn(E, 2 * I, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) * I**-0.5).bfloat16()
    w1q, w2q, qc = quantize_weights(scheme, w1, w2)
    x = torch.randn(M, K, generator=g).bfloat16()
    w, ids = fused_topk(x, torch.randn(M, E, generator=g), topk, True)[:2]
    ref, heavy = fused_experts_with_heavy(x, w1q, w2q, w, ids, quant_config=qc)  # the planted bugs fail on the call's
    bound = experts_error_bound(qc, act_dtype=torch.bfloat16, K=K, I=I, routed_rows=M * topk,  # own heavy event too
                                routes_per_row=topk, heavy=heavy).as_tolerance()

    def inside(out):
        s = error_stats(out, ref)
        return s.rms_norm <= bound["rms_norm"] and s.max_norm <= bound["max_norm"]

    if scheme != "bf16":  # a 14-bit FP8 partial is not a bf16 kernel
        assert inside(_emulated(PromotedExperts, x, w1q, w2q, w, ids, qc))
    else:  # the SM90 bf16 tensor core (aligned, normalized toward zero every 16 products) conforms
        assert inside(_emulated(Mma16Experts, x, w1q, w2q, w, ids, qc))
    if K >= 7168:  # below (and for per-tensor scales at any K), what a 13-bit accumulator adds is less than the
        # conforming roundings' own scatter at the output; the accumulation probe (exact-grid inputs, K = 16384) is
        # the instrument that catches it there
        assert not inside(_emulated(InplaceExperts, x, w1q, w2q, w, ids, qc))
    if scheme == "bf16":  # one extra bf16 rounding per element is below an FP8 requantization's own flips
        assert not inside(_emulated(ExtraRoundingExperts, x, w1q, w2q, w, ids, qc))
    assert not inside(_emulated(DroppedWeightExperts, x, w1q, w2q, w, ids, qc))


# Issue 22's H200 measurements (tree 4fab0a7): (E, topk, K, I, M, scheme, max_norm, rms_norm, inside the bound?).
# The first six are Triton's in-place FP8 accumulation (fast accumulation, not conforming). The per-token cases fall
# outside. The per-tensor ones fall inside: a dynamic per-tensor scale follows the call's largest element, and where
# two conforming kernels differ there by one bf16 step (GEMM1's legal accumulation differences make that likely: the
# H200's Mixtral fp8_tensor M512 EP4, amax 13.1875 against the reference's 13.25) every element is rounded on a grid
# moved by that fraction, which outweighs what in-place accumulation adds (step 4). For those the accumulation probe
# (conformance/test_accumulation.py: exact-grid inputs, K = 16384) is what rejects the kernel: see
# test_accumulation_probe_classifies.
_H200 = [
    (1, 1, 7168, 1408, 4099, "fp8_channel_token", 0.032, 0.0196, False),
    (2, 2, 4096, 64, 100, "fp8_tensor", 0.036, 0.0155, True),      # the probe's to reject
    (8, 3, 2880, 64, 1000, "fp8_tensor", 0.059, 0.0137, True),     # the probe's to reject
    (60, 9, 1024, 128, 1000, "fp8_tensor", 0.030, 0.0094, True),   # the probe's to reject
    (1, 1, 2048, 64, 257, "fp8_tensor", 0.042, 0.0113, True),      # the probe's to reject
    (64, 3, 2048, 256, 1000, "fp8_channel_token", 0.026, 0.0131, False),
    (1, 1, 256, 128, 2049, "fp8_block128_ue8m0", 0.038, 0.0044, True),  # DeepGEMM: one requantization flip
]


@pytest.mark.parametrize("row", _H200, ids=[f"{r[5]}-K{r[2]}-I{r[3]}" for r in _H200])
def test_issue_22_measurements_are_classified(row):
    E, topk, K, I, M, scheme, max_norm, rms_norm, conforming = row  # conforming: inside the bound
    qc = _qc(scheme, 256, 128)
    ep = {8: 4, 64: 2}.get(E, 1)  # the EP cases of the table: E=8 at EP 4, E=64 at EP 2
    b = experts_error_bound(qc, act_dtype=torch.bfloat16, K=K, I=I, routed_rows=M * topk / ep,
                            routes_per_row=max(topk / ep, 1.0))
    inside = rms_norm <= b.rms_norm and max_norm <= b.max_norm
    assert inside == conforming, (row, b)


@pytest.mark.slow  # the K = 16384 probe through the suite, in a subprocess
@pytest.mark.parametrize(("backend", "selection", "passes"), [
    ("torch", "fp8_tensor or bf16", True),
    # The emulation applies its 14-bit partial to every GEMM; only FP8 MMAs are allowed one.
    ("tests.emulated_backends:promoted", "fp8_tensor", True),
    ("tests.emulated_backends:inplace_13bit", "fp8_tensor", False),
])
def test_accumulation_probe_classifies(backend, selection, passes, tmp_path):
    r = run_conformance(backend, "-k", f"test_accumulation_probe and ({selection})", tmp_path=tmp_path)
    if passes:
        assert r.returncode == 0, r.stdout[-3000:]
        assert " passed" in r.stdout
    else:
        assert r.returncode == 1, r.stdout[-3000:]
        assert "accumulates in reduced precision" in r.stdout


# vLLM 0.33's schemes (specs/schemes.toml since = "0.33" and the FP8 tensor pairs): each format has its step in the
# model (a finite bound), and the float64-accumulated reference sits inside it on the generic model of the claims.
_SCHEMES_033 = ["fp8_tensor_static", "fp8_tensor_token", "fp8_block64", "fp8_w8a16", "int8_tensor", "int4_w4a16",
                "int4_w4a16_zp", "int4_w4a16_g32", "int8_w8a16", "mxfp8", "mxfp4_w4a4", "nvfp4_token", "w4a8"]


@pytest.mark.parametrize("scheme", _SCHEMES_033)
def test_schemes_of_033_have_bounds_and_the_reference_sits_inside(scheme):
    from reference.schemes import get_scheme

    get_scheme(scheme)  # a scheme of the specs
    test_float64_reference_sits_well_inside("qwen3_30b_a3b", scheme)


# The microscaling cross pairs of vLLM 0.33 (issue 41 item 5): every bound derives from the formats' existing steps
# (FP8, MXFP8, MXFP4 and the MXFP6 mantissas; no per-scheme constant), and the float64 reference sits inside it.
_SCHEMES_MX_CROSS = ["mxfp4_fp8_static", "mxfp4_fp8_block128", "mxfp4_fp8_token", "mxfp8_w8a16", "mxfp8_fp8_token",
                     "nvfp4_w4a16", "nvfp4_mxfp8", "nvfp4_fp8_token", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_mxfp6_e3m2",
                     "mxfp4_mxfp6_e2m3"]


@pytest.mark.parametrize("scheme", _SCHEMES_MX_CROSS)
def test_microscaling_cross_pairs_have_bounds_and_the_reference_sits_inside(scheme):
    from reference.schemes import get_scheme

    get_scheme(scheme)
    test_float64_reference_sits_well_inside("qwen3_30b_a3b", scheme)


def test_mxfp6_bounds_derive_from_the_mantissa_bits_and_the_emulated_bf16_mma():
    """No per-scheme constant: under the same accumulation, MXFP6 E2M3 activations (3 mantissa bits, E8M0 scales) get
    exactly the bound of MXFP8 E4M3 ones (3 bits, E8M0 scales), E3M2 (2 bits) another; with the allowed accumulation
    the MXFP6 pairs add the 16-bit MMA term of the bf16 GEMM vLLM's emulation runs (step 1b), the MXFP8 pair the FP8
    MMA's."""
    from reference.schemes import quantize_weights

    w1, w2 = torch.randn(2, 256, 128, dtype=torch.bfloat16), torch.randn(2, 128, 128, dtype=torch.bfloat16)

    def rms(scheme, acc=None):
        qc = quantize_weights(scheme, w1, w2)[2]
        return experts_error_bound(qc, act_dtype=torch.bfloat16, K=128, I=128, accumulation=acc).rms_norm

    fp32 = Accumulation.fp32()
    assert rms("mxfp4_mxfp6_e2m3", fp32) == rms("mxfp4_mxfp8", fp32)
    assert rms("mxfp4_mxfp6_e3m2", fp32) != rms("mxfp4_mxfp6_e2m3", fp32)
    for scheme in ("mxfp4_mxfp6_e3m2", "mxfp4_mxfp6_e2m3", "mxfp6_e3m2", "mxfp6_e2m3"):
        assert rms(scheme) > rms(scheme, fp32)


def test_int8_per_tensor_step_spans_the_routed_rows():
    """A dynamic per-tensor INT8 scale is the amax over every routed row: a wider step than per token."""
    tok, ten = _qc("int8_channel_token"), _qc("int8_tensor")
    b_tok = experts_error_bound(tok, act_dtype=torch.bfloat16, K=2048, I=768, routed_rows=512)
    b_ten = experts_error_bound(ten, act_dtype=torch.bfloat16, K=2048, I=768, routed_rows=512)
    # The wider step shows in the max bound and in the requantization's own rounding; the rms at the output is set by
    # GEMM2's output rounding in both (and per token, by the rows whose amax moves: step 4's expectation).
    assert b_ten.max_norm > b_tok.max_norm
    a2 = [next(float(t.split("rms ")[1].split()[0]) for t in b.derivation if t.startswith("a2 requantized"))
          for b in (b_ten, b_tok)]
    assert a2[0] > a2[1], a2
    weight_only = experts_error_bound(_qc("int4_w4a16"), act_dtype=torch.bfloat16, K=2048, I=768)
    bf16 = experts_error_bound(_qc("bf16"), act_dtype=torch.bfloat16, K=2048, I=768)
    assert weight_only.rms_norm == pytest.approx(bf16.rms_norm)  # no activation requantized


def _run_class(cls, cfg, x, w1q, w2q, w, ids, emap, qc, act, E):
    from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP

    return FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(cfg, qc)).apply(
        x, w1q, w2q, w, ids, activation=act, global_num_experts=E, expert_map=emap)


def _one_heavy_event(cls, E, topk, K, I, M, scheme, act, ep_size=1, ep_rank=0, placement="linear", nc=False):
    """(stats, bound, bound without step 7b) of ``cls``'s output on a fuzz case (``conformance.fuzz``: its inputs
    are seeded from the case id, so a regression's fields give its inputs)."""
    from conformance.fuzz import FuzzCase, case_bound, make_inputs

    fc = FuzzCase(E=E, topk=topk, K=K, I=I, M=M, scheme=scheme, activation=act, dtype="bfloat16", ep_size=ep_size,
                  ep_rank=ep_rank, placement=placement, noncontiguous=nc, pad=0)
    x, w1q, w2q, w, ids, emap, qc, cfg = make_inputs(fc, "cpu")
    ref, heavy = fused_experts_with_heavy(x, w1q, w2q, w, ids, activation=fc.act, global_num_experts=E,
                                      expert_map=emap, quant_config=qc)
    out = _run_class(cls, cfg, x, w1q, w2q, w, ids, emap, qc, fc.act, E)
    local = (ids.long() >= 0) & (emap[ids.long()] >= 0) if emap is not None else ids.long() >= 0
    with mock.patch("reference.error_model._heavy_event", lambda *a, **k: (0.0, 0.0)):  # step 7b off
        without = experts_error_bound(qc, act_dtype=torch.bfloat16, K=K, I=I, activation=fc.act,
                                      routed_rows=int(local.sum()), routes_per_row=max(int(local.sum()) / M, 1.0))
    return error_stats(out, ref), case_bound(fc, qc, ids, emap, heavy=heavy), without


@pytest.mark.parametrize("cls", [A2FlipCodeExperts, A2FlipExperts])
def test_one_requantization_flip_at_the_largest_code(cls):
    """The fp8_tensor_static gelu_tanh regression (specs/regressions.toml, E8 k5 K96 I192 M157 EP8 rank 5): one FP8
    a2 code one step off at the call's largest |code| (whatever its route's weight), and at the largest |code| x
    router weight, which gives what the H100 and H200 measured (1.39e-2, 1.57x the bound without step 7b): both are
    step 7b's heavy event on the call's own weighted values (``heavy_values``), inside the bound."""
    s, b, without = _one_heavy_event(cls, 8, 5, 96, 192, 157, "fp8_tensor_static", "gelu_tanh", 8, 5,
                                     "round_robin", True)
    if cls is A2FlipExperts:
        assert s.rms_norm > 1.2 * without.rms_norm, (s, without)  # the mechanism of the known failure
    assert s.rms_norm <= b.rms_norm and s.max_norm <= b.max_norm, (s, b)


@pytest.mark.parametrize(("K", "I", "M"), [
    (1024, 2048, 1),
    pytest.param(4096, 14336, 1, marks=pytest.mark.slow),  # Mixtral's geometry
])
def test_one_activation_flip_at_the_largest_product(K, I, M):
    """Mixtral bf16 M1's heavy event (one GEMM1 output rounded the other way under the call's largest gated product;
    the GPU's 1.841e-3 against 1.70e-3 without step 7b): the flip carried through the activation plus the step of
    GEMM2's input grid it tips, at the call's own largest product, is inside the bound."""
    s, b, without = _one_heavy_event(HFlipExperts, 1, 1, K, I, M, "bf16", "silu")
    assert s.rms_norm <= b.rms_norm and s.max_norm <= b.max_norm, (s, b)
