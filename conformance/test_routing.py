"""Routing conformance: the backend's routing ops against the reference router, with each real model's settings.

Ids compare as per-token sets (ties accepted either way), weights with fp32 tolerances.

The reference routes under the vLLM semantics version chosen by ``--vllm-semantics`` (else ``$MOE_VLLM_SEMANTICS``,
else the newest); ``_vllm_semantics`` applies it to every test of this module. Under 0.33 the non-finite rule of
``fused_topk`` / ``fused_topk_bias`` is vLLM 0.33.0's clamp (``csrc/moe/topk_softmax_kernels.cu``), under 0.17 the
seed-era raise (``reference.routing`` module doc)."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import RoutingCase, routing_cases
from conformance.inputs import _gen, route, router_logits, routing_bias
from conformance.metrics import assert_routing
from reference import routing as reference_routing
from reference.routing import valid_grouping
from reference.semantics import SemanticsVersion, resolve_semantics, use_semantics


@pytest.fixture(autouse=True)
def _vllm_semantics(request):
    """Route the reference under ``--vllm-semantics`` (the conftest's option; ``None``: env var or newest)."""
    try:
        chosen = request.config.getoption("--vllm-semantics")
    except ValueError:  # the option is not registered (module run outside the conformance conftest)
        chosen = None
    with use_semantics(resolve_semantics(chosen)) as v:
        yield v


def _op_and_call(model, logits, bias):
    """(op name, callable(op) -> (w, ids)) for the model's routing method."""
    k = model.top_k
    if model.scoring_func == "topk_softmax":
        return "topk_softmax", lambda op: op(None, logits, k, True)
    if model.scoring_func == "llama4":
        return "llama4_routing", lambda op: op(None, logits, k, False)
    if model.use_grouped_topk and valid_grouping(model.num_experts, model.num_expert_group):
        return "grouped_topk", lambda op: op(
            None, logits, k, model.renormalize, model.num_expert_group, model.topk_group,
            scoring_func=model.scoring_func, routed_scaling_factor=model.routed_scaling_factor,
            e_score_correction_bias=bias)
    if bias is not None:
        return "fused_topk_bias", lambda op: op(
            None, logits, bias, k, model.renormalize, scoring_func=model.scoring_func,
            routed_scaling_factor=model.routed_scaling_factor)
    return "fused_topk", lambda op: op(None, logits, k, model.renormalize, scoring_func=model.scoring_func)


def _selection_key(model, logits, bias):
    x = logits.float()
    if model.scoring_func in ("topk_softmax", "llama4"):
        return x
    s = x.softmax(-1) if model.scoring_func == "softmax" else x.sigmoid()
    return s if bias is None else s + bias


@pytest.mark.parametrize("case", routing_cases(), ids=lambda c: c.id)
def test_routing(backend, case: RoutingCase, tolerances, repro, record):
    g = _gen(case.seed)
    m = case.model
    logits = router_logits(m, case.tokens, g)
    bias = routing_bias(m, g)
    name, call = _op_and_call(m, logits, bias)
    op = backend.ops.get(name)
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement {name}")
    record(model=m.name, component="routing", scheme=name, tokens=case.tokens)
    ref_w, ref_ids = route(m, logits, bias)
    dev = backend.device
    out_w, out_ids = call_on_device(call, op, dev)
    assert_routing(out_w, out_ids, ref_w, ref_ids, _selection_key(m, logits, bias), tolerances["routing"],
                   case=f"routing[{case.id}] via {name}", repro=repro)


def call_on_device(call, op, device):
    """Run ``call(op)`` on inputs moved to ``device`` by wrapping the op (inputs are built on the CPU)."""
    if device == "cpu":
        return call(op)

    def moved(*args, **kwargs):
        mv = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return op(*[mv(a) for a in args], **{k: mv(v) for k, v in kwargs.items()})

    return call(moved)


NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


CLAMPED_033 = ("fused_topk", "fused_topk_bias")  # vLLM 0.33.0's topk_softmax / topk_sigmoid kernels clamp


ONLY_033 = ("token_choice_with_bias", "musespark1x_routing")  # no clamp upstream either: the raise rule


@pytest.mark.parametrize("op_name", ["fused_topk", "grouped_topk", "fused_topk_bias", "topk_softmax",
                                     "llama4_routing", *ONLY_033])
@pytest.mark.parametrize("bad", list(NONFINITE))
def test_routing_nonfinite_logits_never_give_out_of_range_ids(backend, op_name, bad, repro, record, tolerances,
                                                              _vllm_semantics):
    """vLLM #39391: NaN/inf router logits (CUDA-graph padding rows) must not yield ids outside [0, E).

    0.17 semantics (and, under 0.33, the ops vLLM does not clamp): by default the op raises ValueError (the
    reference's definition); with ``check_finite=False`` it returns in-range ids.
    0.33 semantics, ``fused_topk`` / ``fused_topk_bias``: the scores are clamped (NaN/inf -> 0): with
    ``check_finite=False`` every token has unique in-range ids and finite weights, as vLLM 0.33.0's
    ``tests/kernels/moe/test_fused_topk.py::test_fused_topk*_nan_inf_clamp`` require, and the finite rows route as
    the reference does."""
    op = backend.ops.get(op_name)
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement {op_name}")
    v = _vllm_semantics
    if op_name in ONLY_033 and v < SemanticsVersion.V0_33:
        pytest.skip(f"{op_name} is not defined under vLLM {v.value} semantics (SemanticsError)")
    record(component="routing", scheme=f"{op_name}-nonfinite", vllm_semantics=v.value)
    E, k = 64, 4 if op_name != "llama4_routing" else 1
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(7))
    logits[1, 5] = NONFINITE[bad]
    logits[3] = NONFINITE[bad]  # a whole padding row
    args = {"fused_topk": (None, logits, k, True), "grouped_topk": (None, logits, k, True, 8, 4),
            "fused_topk_bias": (None, logits, torch.zeros(E), k, True), "topk_softmax": (None, logits, k, True),
            "llama4_routing": (None, logits, k, False), "token_choice_with_bias": (None, logits, k, True),
            "musespark1x_routing": (logits, torch.zeros(E), k, 1.0)}[op_name]
    dev = backend.device
    dev_args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    clamped = v >= SemanticsVersion.V0_33 and op_name in CLAMPED_033
    if not clamped:
        with pytest.raises(ValueError):
            op(*dev_args)
    w, ids = op(*dev_args, check_finite=False)
    w, ids = w.cpu(), ids.cpu()
    if not bool(((ids >= 0) & (ids < E)).all()):
        raise AssertionError(f"{op_name} with {bad} logits returned ids {ids.tolist()} outside [0, {E})"
                             f"\n  reproduce: {repro}")
    if clamped:
        dup = [t for t in range(ids.shape[0]) if ids[t].unique().numel() != k]
        nonfinite = [t for t in range(w.shape[0]) if not bool(torch.isfinite(w[t]).all())]
        if dup or nonfinite:
            raise AssertionError(
                f"{op_name} with {bad} logits under vLLM 0.33 semantics (clamp NaN/inf scores to 0): tokens {dup} "
                f"have duplicate ids, tokens {nonfinite} non-finite weights {w[nonfinite].tolist()}"
                f"\n  reproduce: {repro} --vllm-semantics {v.value}")
        ref_w, ref_ids = getattr(reference_routing, op_name)(*args)  # the reference under the same semantics
        finite = torch.isfinite(logits).all(dim=1)
        key = logits.float().softmax(-1) if op_name == "fused_topk" else logits.float().sigmoid()
        assert_routing(w[finite], ids[finite], ref_w[finite], ref_ids[finite], key[finite], tolerances["routing"],
                       case=f"routing-nonfinite[{op_name}-{bad}] finite rows", repro=repro)


# ------------------------------------------------------------------------------------------------------------------
# vLLM 0.33's routing pieces as ops a backend may offer (each skipped where the backend does not offer it, and
# under the 0.17 semantics, which has none of them). Shapes are the real models' routing settings; sources:
# - DeepSeek-V4: E=256, k=6, routed_scaling_factor 1.5, sqrtsoftplus + correction bias, renormalize, hash routing in
#   the first layers (NeMo AutoModel ``DeepseekV4Config`` defaults; vLLM 0.33.0 ``router/dsv4_topk.py``:
#   ``_TOPK = 6``, E in (256, 384)). Image sentinel block and vocabulary are drawn (no public value read).
# - Gemma-4 26B-A4B: E=128, k=8, per-expert scale (Megatron-Bridge ``gemma4_provider``: "128 experts, top-k=8";
#   vLLM 0.33.0 ``models/gemma4.py``).
# - MiniMax-M2, DeepSeek-V3: specs/models.toml.
ROUTING_033_TOKENS = (1, 7, 64)
DSV4 = dict(E=256, k=6, rsf=1.5)
GEMMA4 = dict(E=128, k=8)


def _need_033():
    from reference.semantics import current_semantics

    if current_semantics() < SemanticsVersion.V0_33:
        pytest.skip("vLLM 0.17 semantics: the 0.33 routing pieces are not defined (SemanticsError)")


def _op(backend, name, *params):
    op = backend.ops.get(name)
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement {name}")
    import inspect

    try:
        sig = inspect.signature(op).parameters
    except (TypeError, ValueError):
        return op
    lacking = [p for p in params if p not in sig and not any(v.kind is v.VAR_KEYWORD for v in sig.values())]
    if lacking:
        pytest.skip(f"backend {backend.name}'s {name} takes no {', '.join(lacking)}")
    return op


def _ref_fused_topk_bias(*args, **kw):
    return reference_routing.fused_topk_bias(*args, **kw)


def _dev(backend, *ts):
    return [t.to(backend.device) if isinstance(t, torch.Tensor) else t for t in ts]


def _same_rows(out_w, out_ids, ref_w, ref_ids, tol, case):
    """Exact ids per token as sets (order free), weights matched by id within the routing tolerances; ids may be
    -1 (padding) or >= E (shared slots) here, so the set compare replaces assert_routing's range check."""
    ow, oi = out_w.detach().cpu().float(), out_ids.detach().cpu().long()
    rw, ri = ref_w.float(), ref_ids.long()
    assert oi.shape == ri.shape and ow.shape == rw.shape, f"{case}: shapes {tuple(oi.shape)} vs {tuple(ri.shape)}"
    assert out_w.dtype == torch.float32, f"{case}: weights must be float32, got {out_w.dtype}"
    so, po = oi.sort(-1)
    sr, pr = ri.sort(-1)
    bad = (so != sr).any(-1)
    assert not bool(bad.any()), f"{case}: token {int(bad.nonzero()[0])} ids {oi[bad][0].tolist()} != {ri[bad][0].tolist()}"
    torch.testing.assert_close(ow.gather(1, po), rw.gather(1, pr), atol=tol["weights_atol"], rtol=tol["weights_rtol"],
                               msg=lambda m: f"{case}: {m}")


def _dsv4_inputs(M, g, *, hash_table=False, image=False):
    E, k = DSV4["E"], DSV4["k"]
    logits = torch.randn(M, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    vocab = 1024
    tokens = torch.randint(0, vocab, (M,), generator=g)
    kw = {}
    if hash_table:
        # a hash table of distinct experts per token id (DeepSeek-V4's tid2eid)
        kw["hash_indices_table"] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)]).int()
    if image:
        lo = 1000
        tokens[::3] = lo + torch.arange(0, M, 3) % 5  # every third token an image sentinel
        kw.update(bias_vl=torch.randn(E, generator=g) * 0.1, image_sentinel_lo=lo)
    return logits, bias, tokens, kw


@pytest.mark.parametrize("variant", ["sqrtsoftplus", "hash", "bias_vl", "hash_bias_vl", "padding"])
@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_deepseek_v4_fused_topk_bias(backend, variant, M, tolerances, repro, record):
    """DeepSeek-V4's router (vLLM 0.33 ``fused_topk_bias(scoring_func="sqrtsoftplus", ...)``): sqrtsoftplus scores,
    hash routing (``input_tokens``, ``hash_indices_table``), the image-token bias (``bias_vl``) and padding rows."""
    _need_033()
    params = {"sqrtsoftplus": (), "hash": ("input_tokens", "hash_indices_table"),
              "bias_vl": ("input_tokens", "bias_vl", "image_sentinel_lo"),
              "hash_bias_vl": ("input_tokens", "hash_indices_table", "bias_vl"), "padding": ("is_padding",)}[variant]
    op = _op(backend, "fused_topk_bias", *params)
    g = _gen(seed_of_033(f"dsv4-{variant}-M{M}"))
    logits, bias, tokens, kw = _dsv4_inputs(M, g, hash_table="hash" in variant, image="bias_vl" in variant)
    if variant == "padding":
        kw["is_padding"] = torch.arange(M) % 4 == 3
    if "input_tokens" in params:
        kw["input_tokens"] = tokens
    record(model="deepseek_v4", component="routing", scheme=f"fused_topk_bias[{variant}]", tokens=M)
    args = (None, logits, bias, DSV4["k"], True)
    common = dict(scoring_func="sqrtsoftplus", routed_scaling_factor=DSV4["rsf"])
    ref_w, ref_ids = _ref_fused_topk_bias(*args, **common, **kw)
    dev_kw = dict(zip(kw, _dev(backend, *kw.values())))
    out_w, out_ids = op(*_dev(backend, *args), **common, **dev_kw)
    _same_rows(out_w, out_ids, ref_w, ref_ids, tolerances["routing"], f"routing[deepseek_v4-{variant}-M{M}]")


def seed_of_033(name: str) -> int:
    from conformance.cases import seed_of

    return seed_of("routing033-" + name)


@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_gemma4_per_expert_scale(backend, M, tolerances, record):
    _need_033()
    op = _op(backend, "gemma4_routing")
    g = _gen(seed_of_033(f"gemma4-M{M}"))
    logits = torch.randn(M, GEMMA4["E"], generator=g)
    scale = 0.5 + torch.rand(GEMMA4["E"], generator=g)  # a learned parameter (ones at init)
    record(model="gemma4_26b_a4b", component="routing", scheme="gemma4_routing", tokens=M)
    ref = reference_routing.gemma4_routing(logits, GEMMA4["k"], scale)
    out = op(*_dev(backend, logits), GEMMA4["k"], *_dev(backend, scale))
    _same_rows(*out, *ref, tolerances["routing"], f"routing[gemma4-M{M}]")


@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_minimax2_epsilon(backend, M, tolerances, record):
    """MiniMax-M2's shapes (specs/models.toml); every third token has logits near -40 so that the epsilon 1e-20 of
    ``RoutingMethodType.MiniMax2`` decides the weights (they stay tiny instead of summing to the scale)."""
    _need_033()
    from conformance.cases import load_models

    m = load_models()["minimax_m2"]
    op = _op(backend, "minimax2_routing")
    g = _gen(seed_of_033(f"minimax2-M{M}"))
    logits = torch.randn(M, m.num_experts, generator=g)
    logits[::3] -= 40.0
    bias = torch.randn(m.num_experts, generator=g) * 0.01
    record(model=m.name, component="routing", scheme="minimax2_routing", tokens=M)
    ref = reference_routing.minimax2_routing(logits, bias, m.top_k, m.routed_scaling_factor)
    out = op(*_dev(backend, logits, bias), m.top_k, m.routed_scaling_factor)
    tol = dict(tolerances["routing"])
    _same_rows(*out, *ref, tol, f"routing[minimax2-M{M}]")


@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_padding_shared_slots_and_eplb(backend, M, tolerances, record):
    """DeepSeek-V3's routing (specs/models.toml) through the 0.33 router's tail: padding rows (id -1, weight 0),
    one fused shared-expert slot (id E, weight 1), then EPLB with 32 redundant experts (two replicas of experts
    0..31), compared with the reference piece by piece on the reference's own routing."""
    _need_033()
    from conformance.cases import load_models

    m = load_models()["deepseek_v3"]
    pad_op = _op(backend, "apply_padding_rows")
    shared_op = _op(backend, "append_fused_shared_experts")
    eplb_op = _op(backend, "eplb_logical_to_physical")
    g = _gen(seed_of_033(f"tail-M{M}"))
    logits = router_logits(m, M, g)
    bias = routing_bias(m, g)
    w, ids = route(m, logits, bias)
    is_padding = torch.arange(M) % 5 == 4
    record(model=m.name, component="routing", scheme="padding+shared+eplb", tokens=M)
    tol = tolerances["routing"]
    padded = reference_routing.apply_padding_rows(w, ids, is_padding)
    out = pad_op(*_dev(backend, w, ids, is_padding))
    _same_rows(*out, *padded, tol, f"routing[{m.name}-padding-M{M}]")
    ref = reference_routing.append_fused_shared_experts(*padded, m.num_experts, 1, 1.0)
    out = shared_op(*_dev(backend, *padded), m.num_experts, 1, 1.0)
    _same_rows(*out, *ref, tol, f"routing[{m.name}-shared-M{M}]")
    E, R = m.num_experts, 32
    l2p = torch.full((E, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.arange(E)
    l2p[:R, 1] = E + torch.arange(R)
    count = torch.ones(E, dtype=torch.int64)
    count[:R] = 2
    padded_ids = padded[1]
    load_ref = torch.zeros(E + R, dtype=torch.int64)
    ref_phys = reference_routing.eplb_logical_to_physical(padded_ids, l2p, count, expert_load_view=load_ref,
                                                          num_unpadded_tokens=M - 1)
    load_out = torch.zeros(E + R, dtype=torch.int64, device=backend.device)
    out_phys = eplb_op(*_dev(backend, padded_ids, l2p, count), expert_load_view=load_out, num_unpadded_tokens=M - 1)
    assert torch.equal(out_phys.cpu().long(), ref_phys.long()), f"routing[{m.name}-eplb-M{M}]: physical ids differ"
    assert torch.equal(load_out.cpu(), load_ref), f"routing[{m.name}-eplb-M{M}]: expert_load_view differs"


@pytest.mark.parametrize("model_name", ["kimi_k2", "nemotron_3_nano"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_grouped_topk_single_group_nonfinite(backend, model_name, renormalize, tolerances, repro, record,
                                                     _vllm_semantics):
    """The single-group fused grouped top-k's non-finite rule (point ``routing.grouped_topk_nonfinite``; vLLM 0.33.0
    ``csrc/moe/grouped_topk_kernels.cu`` ``single_group_topk``, ``tests/kernels/moe/test_grouped_topk.py::
    test_grouped_topk_single_group_nonfinite_scores``) on the models that run it (one group, a correction bias):
    NaN / +-inf logits and a NaN bias entry make those experts invalid (weight 0, ranked after the valid ones); a
    token with no valid expert gets ids 0..k-1 and weights 1/k (renormalize) or 0. Under 0.17 the op raises."""
    from conformance.cases import load_models

    m = load_models()[model_name]
    op = _op(backend, "grouped_topk")
    g = _gen(seed_of_033(f"sg-nonfinite-{model_name}-{renormalize}"))
    E, k = m.num_experts, m.top_k
    logits = torch.randn(8, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.05
    logits[1, 5] = float("nan")
    logits[2, :3] = float("inf")
    logits[3, 7] = -float("inf")
    logits[4] = float("nan")  # a CUDA-graph padding row: no valid expert
    logits[5, : E - k + 2] = float("nan")  # fewer valid experts than k
    bias[11] = float("nan")  # invalid in every row
    args = (None, logits, k, renormalize, 1, 1)
    kw = dict(scoring_func=m.scoring_func, routed_scaling_factor=m.routed_scaling_factor, e_score_correction_bias=bias)
    record(model=m.name, component="routing", scheme="grouped_topk-single-group-nonfinite",
           vllm_semantics=_vllm_semantics.value)
    dev_args = _dev(backend, *args)
    dev_kw = dict(zip(kw, _dev(backend, *kw.values())))
    if _vllm_semantics < SemanticsVersion.V0_33:
        with pytest.raises(ValueError):
            op(*dev_args, **dev_kw)
        return
    ref_w, ref_ids = reference_routing.grouped_topk(*args, **kw)
    out_w, out_ids = op(*dev_args, **dev_kw)
    _same_rows(out_w, out_ids, ref_w, ref_ids, tolerances["routing"],
               f"routing[{m.name}-single-group-nonfinite-renorm{renormalize}]\n  reproduce: {repro}")


# ------------------------------------------------------------------------------------------------------------------
# The 0.33 routers of issue 41 item 4 as ops a backend may offer (skipped where it does not):
# - Cohere2-MoE ``token_choice_with_bias`` (vLLM 0.33.0 ``models/cohere2_moe.py``). No Cohere2-MoE configuration is
#   citable here (the sdist names only the checkpoint ``CohereLabs/North-Mini-Code-1.0``, no config.json values), so
#   the cases run on Qwen3-30B-A3B's routing shape (E=128, k=8; specs/models.toml), with and without
#   renormalization (``config.norm_topk_prob``).
# - MuseSpark1x's router (``vllm/models/muse_spark/common/ops/fused_routing.py``): the grid of vLLM's own
#   ``tests/kernels/moe/test_muse_spark_router.py::test_fused_routing_matches_reference`` (E=384, k=6 and E=256, k=8;
#   sigmoid with multiplier 2.5 and eps 1e-9, softmax without), the NVIDIA model's setting (sigmoid, eps 1e-15,
#   multiplier folded into the weight) and the kernel's ``is_padding`` rows. No MuseSpark1x config values are in
#   the sdist (``transformers_utils/configs/muse_spark.py`` has defaults only).
# - ``ZeroExpertRouter`` (LongCat-Flash zero experts, ``router/zero_expert_router.py``): LongCat-Flash's config is not
#   in the sdist or specs/models.toml, so the cases take Qwen3-30B-A3B's shape (H=2048, E=128 real experts, k=8)
#   plus 64 identity zero experts, softmax + correction bias, no renormalization (as LongcatMoe builds it), a routed
#   scaling factor 6.0, bf16 hidden states.
MUSESPARK_GRID = {"multiplier": dict(E=384, k=6, norm="sigmoid", mult=2.5, eps=1e-9),
                  "softmax": dict(E=256, k=8, norm="softmax", mult=None, eps=None),
                  "nvidia": dict(E=256, k=8, norm="sigmoid", mult=None, eps=1e-15),
                  "padding": dict(E=256, k=8, norm="sigmoid", mult=None, eps=1e-15)}


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_cohere2_token_choice_with_bias(backend, M, renormalize, tolerances, record):
    _need_033()
    from conformance.cases import load_models

    m = load_models()["qwen3_30b_a3b"]
    op = _op(backend, "token_choice_with_bias")
    g = _gen(seed_of_033(f"cohere2-M{M}-{renormalize}"))
    logits = torch.randn(M, m.num_experts, generator=g) * 2
    record(model=m.name, component="routing", scheme="token_choice_with_bias", tokens=M)
    ref = reference_routing.token_choice_with_bias(None, logits, m.top_k, renormalize)
    out = op(None, *_dev(backend, logits), m.top_k, renormalize)
    _same_rows(*out, *ref, tolerances["routing"], f"routing[cohere2-token_choice-{m.name}-M{M}-renorm{renormalize}]")


@pytest.mark.parametrize("variant", list(MUSESPARK_GRID))
@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_musespark1x(backend, variant, M, tolerances, record):
    _need_033()
    c = MUSESPARK_GRID[variant]
    op = _op(backend, "musespark1x_routing", *(("is_padding",) if variant == "padding" else ()))
    g = _gen(seed_of_033(f"musespark-{variant}-M{M}"))
    logits, bias = torch.randn(M, c["E"], generator=g), torch.randn(c["E"], generator=g)
    kw = {"is_padding": torch.arange(M) % 4 == 3} if variant == "padding" else {}
    record(model="musespark1x", component="routing", scheme=f"musespark1x_routing[{variant}]", tokens=M)
    args = (logits, bias, c["k"], 2.0, c["mult"], c["norm"], c["eps"])
    ref = reference_routing.musespark1x_routing(*args, **kw)
    out = op(*_dev(backend, *args), **dict(zip(kw, _dev(backend, *kw.values()))))
    _same_rows(*out, *ref, tolerances["routing"], f"routing[musespark1x-{variant}-M{M}]")


@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_zero_expert_router(backend, M, tolerances, record):
    """Routed ids / weights as every routing case; the zero-expert output (bf16, fp32 accumulation of at most k
    products then one rounding) to one bf16 ulp (relative 2^-7): the order of the k fp32 additions may differ."""
    _need_033()
    from conformance.cases import load_models

    m = load_models()["qwen3_30b_a3b"]
    op = _op(backend, "zero_expert_router")
    Z = 64
    g = _gen(seed_of_033(f"zero-experts-M{M}"))
    h = torch.randn(M, m.hidden_size, generator=g).to(torch.bfloat16)
    logits = torch.randn(M, m.num_experts + Z, generator=g)
    bias = torch.randn(m.num_experts + Z, generator=g) * 0.1
    record(model=m.name, component="routing", scheme="zero_expert_router", tokens=M)
    kw = dict(scoring_func="softmax", renormalize=False, routed_scaling_factor=6.0)
    w, ids, out = reference_routing.zero_expert_router(h, logits, m.top_k, bias, m.num_experts, "identity", **kw)
    ow, oi, oo = op(*_dev(backend, h, logits), m.top_k, *_dev(backend, bias), m.num_experts, "identity", **kw)
    case = f"routing[zero-experts-{m.name}+{Z}-M{M}]"
    _same_rows(ow, oi, w, ids, tolerances["routing"], case)
    assert oo.dtype == h.dtype and oo.shape == h.shape, f"{case}: output {oo.dtype} {tuple(oo.shape)}"
    torch.testing.assert_close(oo.cpu().float(), out.float(), rtol=2 ** -7, atol=0.0, msg=lambda s: f"{case}: {s}")


# GroupedTopKRouter (``router/grouped_topk_router.py::GroupedTopKRouter._compute_routing``) as an op: on an invalid
# grouping (E <= G or G not dividing E) it falls back to ``fused_topk`` (softmax, unscaled) without a bias, or to
# ``fused_topk_bias`` then the scale with one - with softmax under 0.17 and the layer's scoring under 0.33 (point
# ``routing.invalid_grouping_fallback``). Shapes: the issue-41 example E=60, G=8 (no released model pairs them; the
# fallback exists for such configurations), E == G, and DeepSeek-V3 (specs/models.toml) with padding rows
# (``skip_padding``, 0.33).
GROUPED_ROUTER_CASES = {
    "invalid-sigmoid-bias": dict(E=60, G=8, tg=4, k=4, sf="sigmoid", bias=True, rsf=2.5),
    "invalid-softmax": dict(E=60, G=8, tg=4, k=4, sf="softmax", bias=False, rsf=2.5),
    "invalid-sigmoid-nobias": dict(E=60, G=8, tg=4, k=4, sf="sigmoid", bias=False, rsf=1.0),
    "e-equals-g": dict(E=8, G=8, tg=4, k=2, sf="sigmoid", bias=True, rsf=1.5),
    "deepseek_v3-skip_padding": dict(model="deepseek_v3"),
}


@pytest.mark.parametrize("variant", list(GROUPED_ROUTER_CASES))
@pytest.mark.parametrize("M", ROUTING_033_TOKENS)
def test_routing_grouped_topk_router(backend, variant, M, tolerances, record, _vllm_semantics):
    c = dict(GROUPED_ROUTER_CASES[variant])
    kw = {}
    if "model" in c:
        _need_033()
        from conformance.cases import load_models

        m = load_models()[c["model"]]
        c = dict(E=m.num_experts, G=m.num_expert_group, tg=m.topk_group, k=m.top_k, sf=m.scoring_func,
                 bias=m.e_score_correction_bias, rsf=m.routed_scaling_factor)
        kw = dict(is_padding=torch.arange(M) % 4 == 3, skip_padding=True)
    op = _op(backend, "grouped_topk_router", *kw)
    g = _gen(seed_of_033(f"grouped-router-{variant}-M{M}"))
    logits = torch.randn(M, c["E"], generator=g)
    bias = torch.randn(c["E"], generator=g) * 0.1 if c["bias"] else None
    record(component="routing", scheme=f"grouped_topk_router[{variant}]", tokens=M,
           vllm_semantics=_vllm_semantics.value)
    args = (None, logits, c["k"], c["G"], c["tg"])
    common = dict(scoring_func=c["sf"], routed_scaling_factor=c["rsf"], e_score_correction_bias=bias)
    ref = reference_routing.grouped_topk_router(*args, **common, **kw)
    out = op(*_dev(backend, *args), **dict(zip(common, _dev(backend, *common.values()))),
             **dict(zip(kw, _dev(backend, *kw.values()))))
    _same_rows(*out, *ref, tolerances["routing"], f"routing[grouped_topk_router-{variant}-M{M}] "
                                                  f"(vLLM {_vllm_semantics.value} semantics)")
