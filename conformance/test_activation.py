"""Activation conformance: the backend's ``apply_moe_activation`` against the reference, within 1 ulp of the
output dtype (both compute in fp32 and round once), plus, for the GELU family, the absolute error that the fp32
formula's cancellation allows (``[activation] gelu_cancellation`` in specs/tolerances.toml).

vLLM 0.33's out-parameter form (``apply_moe_activation_into``, the body of ``FusedMoEExpertsModular.activation(...,
topk_ids, expert_map, valid_token_counts)``, point ``activation.experts_signature``): on masked batched
``(E, T, N)`` inputs (and a masked 2-D one, and the pad-aware SILU limit with ``topk_ids`` + ``expert_map``) the
written rows match the reference within the same ulps, the padded input rows (poisoned with NaN / inf) never reach
the output, and every row past a count (or of a -1 / non-local route) is bitwise the poison the output held."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import ActivationCase, activation_cases
from conformance.inputs import _gen
from conformance.metrics import ConformanceFailure, assert_ulps, gelu_cancellation_atol
from reference.activation import (
    SITU_KIMI_K3_BETA,
    SITU_KIMI_K3_LINEAR_BETA,
    ApplyMoEActivationConfig,
    MoEActivation,
    activation_defined,
    apply_moe_activation,
    apply_moe_activation_into,
)
from reference.modular import ACTIVATION_PARAMS
from reference.routing import determine_expert_map
from reference.semantics import SemanticsVersion, current_semantics


@pytest.mark.parametrize("case", activation_cases(), ids=lambda c: c.id)
def test_activation(backend, case: ActivationCase, tolerances, repro, record):
    op = backend.ops.get("apply_moe_activation")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement apply_moe_activation")
    _skip_unclaimed(backend, case.activation, [p for p, v in case.params if p in ACTIVATION_PARAMS and v is not None])
    record(component="activation", scheme=case.activation.value, tokens=case.tokens)
    g = _gen(case.seed)
    # Spread over [-12, 12] so clamps (limit 7) and saturation regions are exercised.
    x = (torch.randn(case.tokens, case.width, generator=g) * 4).to(case.dtype)
    params = dict(case.params)
    expected = apply_moe_activation(case.activation, x, **params)
    out = op(case.activation, x.to(backend.device), **params)
    tol = tolerances["activation"]
    assert_ulps(out, expected, tol["ulps"][str(case.dtype).removeprefix("torch.")], case=f"activation[{case.id}]",
                what="activation output", repro=repro,
                atol=gelu_cancellation_atol(case.activation, x, tol["gelu_cancellation"]))


def _skip_unclaimed(backend, activation, variant):
    # The op is the experts' activation: it owes what some experts class of the backend claims, variants included
    # (``SupportRecord.activation_params``: a clamp limit, alpha, beta); a class without a SupportRecord claims all.
    records = [getattr(cls, "support", None) for cls in backend.experts]
    if records and not any(r is None or r.claims_activation(activation) for r in records):
        pytest.skip(f"no experts class of backend {backend.name} claims {activation.name}, so its "
                    "apply_moe_activation need not implement it")
    if records and not any(r is None or (r.claims_activation(activation)
                                         and r.claims_activation_params(activation, variant)) for r in records):
        pytest.skip(f"unclaimed variant: no experts class of backend {backend.name} claims {activation.name} "
                    f"with {', '.join(variant)} (SupportRecord.activation_params)")


# ---------------------------------------------------------------------------------------------------------------
# vLLM 0.33: FusedMoEExpertsModular.activation(..., topk_ids, expert_map, valid_token_counts)
# ---------------------------------------------------------------------------------------------------------------

_E, _T, _D = 5, 16, 128
# Per expert: empty, partial, full, a count past T (clamped to T), a negative count (clamped to 0).
_COUNTS_3D = (0, 5, _T, _T + 7, -3)
_COUNTS_2D = (9,)


def _masked_configs():
    """(activation, config variant id, ApplyMoEActivationConfig) of the semantics in force."""
    A = MoEActivation
    situ = dict(activation_situ_beta=SITU_KIMI_K3_BETA, activation_situ_linear_beta=SITU_KIMI_K3_LINEAR_BETA)
    for act in A:
        if act is A.RELU2 or not activation_defined(act):
            continue
        if act is A.SWIGLUOAI_UNINTERLEAVE:
            yield act, "limit7-a1.702-b1", ApplyMoEActivationConfig(clamp_limit=7.0, alpha=1.702, beta=1.0)
            continue
        yield act, "plain", ApplyMoEActivationConfig(**(situ if act is A.SITU else {}))
        if act is A.SILU:  # masked "silu_with_clamp" reads the config's alpha and beta
            yield act, "limit7-a1.702-b1", ApplyMoEActivationConfig(clamp_limit=7.0, alpha=1.702, beta=1.0)
        if act is A.SWIGLUOAI:  # the config is not read: 1.702 / 7.0 regardless
            yield act, "limit3-a2", ApplyMoEActivationConfig(clamp_limit=3.0, alpha=2.0)


def _variant(cfg: ApplyMoEActivationConfig) -> list[str]:
    return [p for p, v in (("limit", cfg.clamp_limit), ("alpha", cfg.alpha if cfg.alpha != 1.0 else None),
                           ("beta", cfg.beta if cfg.beta != 0.0 else None)) if v is not None]


def _needs_033():
    if current_semantics() < SemanticsVersion.V0_33:
        pytest.skip("FusedMoEExpertsModular.activation(..., topk_ids, expert_map, valid_token_counts) is vLLM 0.33's "
                    "(under --vllm-semantics 0.17 the seed signature, checked by test_activation)")


def _poisoned_io(act, shape_lead, seed, dtype=torch.bfloat16):
    g = _gen(seed)
    width = 2 * _D if act.is_gated else _D
    x = (torch.randn(*shape_lead, width, generator=g) * 4).to(dtype)
    out = torch.full((*shape_lead, _D), float("nan"), dtype=dtype)
    return x, out


def _check_into(backend, act, cfg, x, out_poison, written, *, case, tolerances, repro, **kw):
    """Run the op on poisoned buffers; compare written rows (ulps) and unwritten rows (bitwise the poison)."""
    op = backend.ops["apply_moe_activation_into"]
    dev = backend.device
    expected = apply_moe_activation_into(act, out_poison.clone(), x.clone(), activation_config=cfg, **kw)
    got = op(act, out_poison.clone().to(dev), x.clone().to(dev), activation_config=cfg,
             **{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}).cpu()
    tol = tolerances["activation"]
    xw = x[written]
    atol = gelu_cancellation_atol(act, xw, tol["gelu_cancellation"])
    assert_ulps(got[written], expected[written], tol["ulps"]["bfloat16"], case=case,
                what="activation output on the valid rows", repro=repro, atol=atol)
    untouched = got[~written].view(torch.int16)
    poison = out_poison[~written].view(torch.int16)
    if not torch.equal(untouched, poison):
        n = int((untouched != poison).any(-1).sum())
        raise ConformanceFailure(f"{n} rows past valid_token_counts / of skipped routes were written; vLLM 0.33 "
                                 f"leaves them untouched (case {case}; reproduce: {repro})")


def _masked_params():
    for act, vid, cfg in _masked_configs():
        for layout in ("3d", "2d"):
            yield pytest.param(act, cfg, layout, id=f"{act.value}-{vid}-{layout}")


@pytest.mark.parametrize("act,cfg,layout", list(_masked_params()))
def test_activation_masked_batched(backend, act, cfg, layout, tolerances, repro, record):
    """Masked batched ``(E, T, N)`` (and 2-D ``(T, N)``) inputs: rows past ``valid_token_counts`` are poisoned
    (NaN, +-inf) in the input, must not matter, and stay bitwise untouched in the output."""
    _needs_033()
    if "apply_moe_activation_into" not in backend.ops:
        pytest.skip(f"backend {backend.name} does not implement apply_moe_activation_into (vLLM 0.33's "
                    "FusedMoEExpertsModular.activation)")
    _skip_unclaimed(backend, act, _variant(cfg))
    record(component="activation", scheme=f"{act.value}-masked-{layout}", tokens=_T)
    counts = _COUNTS_3D if layout == "3d" else _COUNTS_2D
    lead = (_E, _T) if layout == "3d" else (_T,)
    x, out = _poisoned_io(act, lead, seed=len(counts) * 1000 + list(MoEActivation).index(act))
    x3 = x if layout == "3d" else x.unsqueeze(0)
    written = torch.zeros(lead, dtype=torch.bool)
    w3 = written if layout == "3d" else written.unsqueeze(0)
    for e, c in enumerate(counts):
        n = max(0, min(c, _T))
        w3[e, :n] = True
        x3[e, n:, 0::3] = float("nan")  # padding: garbage the kernel must not read into valid rows
        x3[e, n:, 1::3] = float("inf")
    vtc = torch.tensor(counts, dtype=torch.int32)
    _check_into(backend, act, cfg, x, out, written, case=f"activation_masked[{act.value}-{layout}]",
                tolerances=tolerances, repro=repro, valid_token_counts=vtc)


@pytest.mark.parametrize("limit", [7.0, 0.0], ids=["limit7", "limit0"])
def test_activation_pad_aware_limit(backend, limit, tolerances, repro, record):
    """SILU with a clamp limit, ``topk_ids`` and ``expert_map`` (``swiglu_limit_func``'s pad-aware kernel): row r is
    flat route r; rows of -1 and non-local routes stay untouched; limit 0 means no clamp on this path."""
    _needs_033()
    if "apply_moe_activation_into" not in backend.ops:
        pytest.skip(f"backend {backend.name} does not implement apply_moe_activation_into")
    cfg = ApplyMoEActivationConfig(clamp_limit=limit)
    _skip_unclaimed(backend, MoEActivation.SILU, ["limit"])
    record(component="activation", scheme=f"silu-pad_aware-limit{limit:g}", tokens=_T)
    E, topk, M = 16, 4, _T
    _, emap, _ = determine_expert_map(4, 1, E)
    g = _gen(4242)
    ids = torch.randint(-1, E, (M, topk), generator=g, dtype=torch.int32)
    x, out = _poisoned_io(MoEActivation.SILU, (M * topk,), seed=4243)
    flat = ids.reshape(-1).long()
    written = (flat >= 0) & (emap.long()[flat.clamp(min=0)] != -1)
    x[~written, 0::2] = float("nan")
    _check_into(backend, MoEActivation.SILU, cfg, x, out, written, case=f"activation_pad_aware[limit{limit:g}]",
                tolerances=tolerances, repro=repro, topk_ids=ids, expert_map=emap)
