"""The reference router against vLLM's own pure-torch routing code and torch reference functions, loaded from the
unpacked source distribution (no vLLM install): RoutingMethodType and get_routing_method_type
(``fused_moe/config.py``), the torch oracles of ``tests/kernels/moe/test_fused_topk.py`` and
``test_topk_softplus_sqrt.py``, Gemma4's torch routing (``models/gemma4.py``), the native grouped top-k
(``router/grouped_topk_router.py``), the CPU router's torch paths (``router/cpu_router.py``), the router factory
(``router/router_factory.py`` with stub router classes), the 0.17 EPLB torch mapping (``router/base_router.py``),
and two CUDA-only points checked on the kernel source (the non-finite clamp, the invalid-grouping fallback)."""

from __future__ import annotations

import ast
import inspect
import itertools
from types import SimpleNamespace

import pytest
import torch

from reference import routing as r33
from reference.routing import RoutingMethodType, fused_topk, fused_topk_bias, grouped_topk
from reference.semantics import SemanticsVersion
from tests.parity._vllm_src import load, stub_envs, stub_platform

FMOE = "vllm/model_executor/layers/fused_moe/"
MOE_TESTS = "tests/kernels/moe/"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _sorted(w, ids):
    order = ids.long().argsort(dim=-1)
    return w.gather(1, order), ids.long().gather(1, order)


def _same_routing(w, ids, ref_w, ref_ids, rtol=1e-5, atol=1e-6, key=None):
    """Equal routings as per-token sets; with ``key`` (the selection scores), tokens whose k-th and (k+1)-th scores
    tie exactly are left out (torch.topk's choice among ties is unspecified; the reference takes the lower index)."""
    if key is not None and key.shape[-1] > ids.shape[-1]:
        top = key.float().sort(dim=-1, descending=True).values
        keep = top[:, ids.shape[-1] - 1] != top[:, ids.shape[-1]]
        assert keep.float().mean() > 0.5, "too many ties to compare"
        w, ids, ref_w, ref_ids = w[keep], ids[keep], ref_w[keep], ref_ids[keep]
    a_w, a_i = _sorted(w.float(), ids)
    b_w, b_i = _sorted(ref_w.float(), ref_ids)
    assert torch.equal(a_i, b_i)
    torch.testing.assert_close(a_w, b_w, rtol=rtol, atol=atol)


def _config(tree):
    return load(tree, FMOE + "config.py", ["RoutingMethodType", "get_routing_method_type"])


# ------------------------------------------------------------------------------------------------------- enum


def test_routing_method_type_values(vllm_tree, semantics):
    up = _config(vllm_tree).RoutingMethodType
    ours = r33.routing_method_type_enum(semantics)
    assert {m.name: int(m) for m in up} == {m.name: int(m) for m in ours}


def test_get_routing_method_type(vllm_tree, semantics):
    up = _config(vllm_tree).get_routing_method_type
    funcs = ["softmax", "sigmoid"] + (["sqrtsoftplus"] if semantics >= SemanticsVersion.V0_33 else [])
    for sf, k, rn, g, bias in itertools.product(funcs, [1, 8], [True, False], [None, 0, 1, 8], [True, False]):
        assert up(sf, k, rn, g, bias).name == r33.get_routing_method_type(sf, k, rn, g, bias,
                                                                          semantics=semantics).name, (sf, k, rn, g, bias)


# ------------------------------------------------------------------------------------------------------- torch oracles


def test_fused_topk_against_vllm_torch_topk(vllm_tree, semantics):
    torch_topk = load(vllm_tree, MOE_TESTS + "test_fused_topk.py", ["torch_topk"]).torch_topk
    g = _gen(1)
    for M, E, k, sf, rn, dtype in itertools.product([1, 33], [6, 16, 352], [3, 4], ["softmax", "sigmoid"],
                                                     [True, False], [torch.float32, torch.bfloat16]):
        logits = torch.randn(M, E, generator=g).to(dtype)
        s = logits.float().softmax(-1) if sf == "softmax" else logits.float().sigmoid()
        w, ids = torch_topk(logits, k, rn, scoring_func=sf)
        _same_routing(*fused_topk(None, logits, k, rn, scoring_func=sf, semantics=semantics), w, ids, key=s)
        bias = torch.randn(E, generator=g)
        w, ids = torch_topk(logits, k, rn, e_score_correction_bias=bias, scoring_func=sf)
        _same_routing(*fused_topk_bias(None, logits, bias, k, rn, scoring_func=sf, semantics=semantics), w, ids,
                      key=s + bias)


def _softplus_oracle(tree):
    return load(tree, MOE_TESTS + "test_topk_softplus_sqrt.py", ["_torch_topk_softplus_sqrt"],
                extra={}).namespace["_torch_topk_softplus_sqrt"]


def test_sqrtsoftplus_hash_and_image_bias_against_vllm_torch_oracle(vllm_tree, semantics):
    if semantics < SemanticsVersion.V0_33:
        pytest.skip(f"sqrtsoftplus is not in vLLM {semantics.value}")
    oracle = _softplus_oracle(vllm_tree)
    g = _gen(2)
    M, vocab = 64, 128
    lo = vocab - 8
    for E, k, rn, rsf in [(256, 6, True, 1.5), (384, 8, False, 2.5), (128, 6, True, 1.0)]:
        logits = torch.randn(M, E, generator=g) * 3
        bias, bias_vl = torch.randn(E, generator=g), torch.randn(E, generator=g)
        ids_in = torch.randint(0, lo, (M,), generator=g)
        ids_in[::3] = lo + torch.arange(0, M, 3) // 3 % 5
        ids_in[3::6] = lo + 5
        table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)]).to(torch.int32)
        cases = [
            dict(e_score_correction_bias=bias),
            dict(e_score_correction_bias=bias, input_ids=ids_in, bias_vl=bias_vl, image_sentinel_lo=lo),
            dict(input_ids=ids_in, hash_indices_table=table),
            dict(input_ids=ids_in, hash_indices_table=table, bias_vl=bias_vl, image_sentinel_lo=lo),
        ]
        for kw in cases:
            ref_w, ref_ids = oracle(logits, k, rn, rsf, **kw)
            if "input_ids" in kw:  # the oracle's name; vLLM's fused_topk_bias (and the reference) say input_tokens
                kw["input_tokens"] = kw.pop("input_ids")
            w, ids = fused_topk_bias(None, logits, kw.pop("e_score_correction_bias", None), k, rn,
                                     scoring_func="sqrtsoftplus", routed_scaling_factor=rsf, semantics=semantics,
                                     **kw)
            _same_routing(w, ids, ref_w, ref_ids)


def test_gemma4_against_vllm_torch_routing(vllm_tree, semantics):
    if semantics < SemanticsVersion.V0_33:
        pytest.skip(f"no Gemma4 in vLLM {semantics.value}")
    fn = load(vllm_tree, "vllm/model_executor/models/gemma4.py",
              ["gemma4_routing_function_torch"]).gemma4_routing_function_torch
    g = _gen(3)
    for M in (1, 2, 257):
        logits, scale = torch.randn(M, 128, generator=g), torch.rand(128, generator=g)
        _same_routing(*r33.gemma4_routing(logits, 8, scale, semantics=semantics), *fn(logits, 8, scale))


# ------------------------------------------------------------------------------------------------------- grouped, CPU


def test_grouped_topk_against_vllm_native(vllm_tree, semantics):
    ns = load(vllm_tree, FMOE + "router/grouped_topk_router.py", ["grouped_topk"],
              extra=dict(envs=stub_envs(), current_platform=stub_platform(),
                         vllm_is_batch_invariant=lambda: True))
    g = _gen(4)
    for E, G, tg, k, sf, use_bias, rsf in [(256, 8, 4, 8, "sigmoid", True, 2.5), (64, 8, 3, 6, "softmax", False, 1.0),
                                           (160, 8, 3, 6, "softmax", False, 16.0), (32, 4, 2, 4, "sigmoid", False, 1.0)]:
        logits = torch.randn(37, E, generator=g)
        bias = torch.randn(E, generator=g) * 0.1 if use_bias else None
        w, ids = ns.grouped_topk(logits, logits, k, True, G, tg, sf, rsf, bias)
        _same_routing(*grouped_topk(None, logits, k, True, G, tg, scoring_func=sf, routed_scaling_factor=rsf,
                                    e_score_correction_bias=bias), w, ids)


def test_cpu_router_torch_paths(vllm_tree, semantics):
    ns = load(vllm_tree, FMOE + "router/cpu_router.py", ["_grouped_topk", "_softmax_topk"])
    g = _gen(5)
    logits, bias = torch.randn(19, 64, generator=g), torch.randn(64, generator=g) * 0.1
    w, ids = ns._grouped_topk(logits, 6, True, 8, 4, "sigmoid", 2.5, bias)
    _same_routing(*grouped_topk(None, logits, 6, True, 8, 4, scoring_func="sigmoid", routed_scaling_factor=2.5,
                                e_score_correction_bias=bias), w, ids)
    for rn in (True, False):
        _same_routing(*fused_topk(None, logits, 6, rn, semantics=semantics), *ns._softmax_topk(logits, 6, rn))


# ------------------------------------------------------------------------------------------------------- factory


def _factory(tree, platform_cpu=False, simulation="", aiter_shared=False):
    cfg = _config(tree)
    rmt = cfg.get_routing_method_type

    def stub(name):
        class Router:
            def __init__(self, **kw):
                self.kind, self.kw = name, kw

            @property
            def routing_method_type(self):
                kw = self.kw
                return rmt(kw.get("scoring_func", "softmax"), kw["top_k"], kw.get("renormalize", True),
                           kw.get("num_expert_group"), kw.get("e_score_correction_bias") is not None)

        Router.__name__ = name
        return Router

    names = ["ZeroExpertRouter", "CPURouter", "GroupedTopKRouter", "CustomRoutingRouter", "FusedTopKBiasRouter",
             "AiterSharedRoutedFusedMoERouter", "FusedTopKRouter", "RoutingSimulatorRouter"]
    extra = {n: stub(n) for n in names}
    extra.update(envs=stub_envs(VLLM_MOE_ROUTING_SIMULATION_STRATEGY=simulation),
                 current_platform=stub_platform(cpu=platform_cpu), RoutingMethodType=cfg.RoutingMethodType,
                 get_routing_method_type=rmt, Callable=object, EplbLayerState=object, FusedMoERouter=object,
                 EMPTY_EPLB_STATE=None,
                 rocm_aiter_ops=SimpleNamespace(is_fusion_moe_shared_experts_enabled=lambda: aiter_shared))
    return load(tree, FMOE + "router/router_factory.py", ["create_fused_moe_router"],
                extra=extra).create_fused_moe_router


FACTORY_GRID = [
    dict(use_grouped_topk=True, num_expert_group=1, topk_group=1),
    dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, routed_scaling_factor=2.5),
    dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, scoring_func="sigmoid", renormalize=False),
    dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, scoring_func="sigmoid", bias=True),
    dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, scoring_func="sigmoid", top_k=1),
    dict(use_grouped_topk=True, num_expert_group=8, topk_group=4, scoring_func="sigmoid", bias=True),
    dict(use_grouped_topk=True, num_expert_group=2, topk_group=1),
    dict(custom=True),
    dict(bias=True, scoring_func="sigmoid"),
    dict(bias=True, scoring_func="softmax", routed_scaling_factor=2.0),
    dict(),
    dict(scoring_func="sigmoid"),
    dict(hash=True, scoring_func="sqrtsoftplus"),
    dict(zero=True, bias=True),
    dict(zero=True, bias=True, scoring_func="sigmoid", renormalize=False, routed_scaling_factor=6.0),
    # the zero-expert and CPU branches come before the grouped branch's checks (vLLM asserts only there)
    dict(zero=True, bias=True, use_grouped_topk=True, custom=True),
    dict(use_grouped_topk=True, num_expert_group=8, topk_group=4, custom=True),
    dict(shared=2),
]


@pytest.mark.parametrize("platform_cpu,simulation,aiter_shared", [(False, "", False), (True, "", False),
                                                                  (False, "uniform_random", False),
                                                                  (False, "", True)])
def test_router_factory_dispatch(vllm_tree, semantics, platform_cpu, simulation, aiter_shared):
    create = _factory(vllm_tree, platform_cpu, simulation, aiter_shared)
    params = inspect.signature(create).parameters
    for case in FACTORY_GRID:
        case = dict(case)
        top_k = case.pop("top_k", 8)
        bias, custom, hsh = case.pop("bias", False), case.pop("custom", False), case.pop("hash", False)
        zero, shared = case.pop("zero", False), case.pop("shared", 0)
        up_kw = dict(top_k=top_k, global_num_experts=64, **case)
        if bias:
            up_kw["e_score_correction_bias"] = torch.zeros(64)
        if custom:
            up_kw["custom_routing_function"] = lambda *a, **k: None
        if hsh:
            up_kw["hash_indices_table"] = torch.zeros(4, top_k, dtype=torch.int32)
        if zero:
            up_kw.update(zero_expert_type="identity", num_logical_experts=60)
        if shared:
            up_kw["num_fused_shared_experts"] = shared
        for p in ("enable_eplb", "indices_type_getter", "eplb_state"):
            if p in params and params[p].default is inspect.Parameter.empty:
                up_kw[p] = None if p != "enable_eplb" else False
        unsupported = [k for k in up_kw if k not in params]
        ours_kw = dict(top_k=top_k, has_e_score_correction_bias=bias, custom_routing_function=custom,
                       has_hash_indices_table=hsh, zero_expert_type="identity" if zero else None,
                       num_fused_shared_experts=shared, is_cpu=platform_cpu, aiter_shared_experts_enabled=aiter_shared,
                       routing_simulation_strategy=simulation,
                       **{k: v for k, v in case.items()})
        if unsupported:  # an input this release's factory does not take: the reference rejects it too
            with pytest.raises(Exception):
                r33.router_kind(semantics=semantics, **ours_kw)
            continue
        try:
            up = create(**up_kw).kind
        except AssertionError:
            continue  # vLLM asserts (e.g. a scoring_func its chain does not take)
        if semantics < SemanticsVersion.V0_33 and (platform_cpu or shared or zero or hsh):
            # 0.17.0 has no CPU / zero-expert / hash / shared-slot routers: the reference raises
            with pytest.raises(Exception):
                r33.router_kind(semantics=semantics, **ours_kw)
            continue
        assert r33.router_kind(semantics=semantics, **ours_kw) == up, (case, up)


# ------------------------------------------------------------------------------------------------------- EPLB


def test_eplb_mapping_torch(vllm_tree, semantics):
    src = (vllm_tree / FMOE / "router/base_router.py").read_text()
    if "_eplb_map_and_record_i32_kernel" in src:
        assert "KNUTH_MULTIPLIER = 2654435769" in src and "replica_idx = hashed % replica_count" in src
        assert semantics >= SemanticsVersion.V0_33
        pytest.skip(f"vLLM {semantics.value}'s EPLB mapping is a Triton kernel (no torch path); its hash rule was "
                    "checked on the source")
    fn = load(vllm_tree, FMOE + "router/base_router.py", ["eplb_map_to_physical_and_record"]
              ).eplb_map_to_physical_and_record
    g = _gen(6)
    L, R = 16, 3
    count = torch.randint(1, R + 1, (L,), generator=g)
    l2p = torch.randperm(L * R, generator=g).reshape(L, R)
    ids = torch.randint(0, L, (33, 8), generator=g)
    load_up, load_ref = torch.zeros(L * R, dtype=torch.int64), torch.zeros(L * R, dtype=torch.int64)
    up = fn(ids, load_up, l2p, count)
    ours = r33.eplb_logical_to_physical(ids, l2p, count, expert_load_view=load_ref, semantics=semantics)
    assert torch.equal(up.long(), ours.long()) and torch.equal(load_up, load_ref)


# ------------------------------------------------------------------------------------------------------- CUDA-only points


def test_nonfinite_clamp_matches_the_kernel_source(vllm_tree, semantics):
    """No torch implementation exists (CUDA kernel): the clamp is present in the source exactly under 0.33."""
    src = (vllm_tree / "csrc/moe/topk_softmax_kernels.cu").read_text()
    clamps = "if (isnan(softmax_val) || isinf(softmax_val)) softmax_val = 0.f;" in src
    assert clamps == (semantics >= SemanticsVersion.V0_33)
    logits = torch.tensor([[float("nan"), 1.0, 2.0]])
    if clamps:
        w, ids = fused_topk(None, logits, 2, True, semantics=semantics)
        assert torch.isfinite(w).all()
    else:
        with pytest.raises(ValueError):
            fused_topk(None, logits, 2, True, semantics=semantics)


def test_invalid_grouping_fallback_matches_the_router_source(vllm_tree, semantics):
    """GroupedTopKRouter's fallback calls CUDA ops; check which scoring function it passes, from its AST."""
    mod = ast.parse((vllm_tree / FMOE / "router/grouped_topk_router.py").read_text())
    cls = next(n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == "GroupedTopKRouter")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_routing")
    calls = {c.func.id: {k.arg for k in c.keywords} for c in ast.walk(fn)
             if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in ("fused_topk", "fused_topk_bias")}
    assert "scoring_func" not in calls["fused_topk"]  # softmax, both versions
    assert ("scoring_func" in calls["fused_topk_bias"]) == (semantics >= SemanticsVersion.V0_33)
    assert "routed_scaling_factor" not in calls["fused_topk"]


# ------------------------------------------------------------------------------------------------------- 0.33 routers


class _BaseRouterStub:
    """Stands in for ``router/base_router.py::BaseRouter`` (only its constructor's fields are read)."""

    def __init__(self, top_k, global_num_experts, eplb_state=None, **_):
        self.top_k, self.global_num_experts, self.eplb_state = top_k, global_num_experts, eplb_state


def _need_033(semantics, what):
    if semantics < SemanticsVersion.V0_33:
        pytest.skip(f"{what} is not in vLLM {semantics.value}")


def test_cohere2_token_choice_with_bias_against_vllm(vllm_tree, semantics):
    """``models/cohere2_moe.py::token_choice_with_bias`` (its ``@torch.compile`` dropped) vs the reference."""
    _need_033(semantics, "Cohere2-MoE")
    fn = load(vllm_tree, "vllm/model_executor/models/cohere2_moe.py", ["token_choice_with_bias"]).token_choice_with_bias
    g = _gen(11)
    for M, E, k, rn, dtype in itertools.product([1, 37], [8, 64, 128], [1, 2, 8], [True, False],
                                                [torch.float32, torch.bfloat16]):
        if k > E:
            continue
        logits = (torch.randn(M, E, generator=g) * 2).to(dtype)
        h = torch.zeros(M, 4)
        w, ids = fn(hidden_states=h, gating_output=logits, topk=k, renormalize=rn)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32
        _same_routing(*r33.token_choice_with_bias(h, logits, k, rn, semantics=semantics), w, ids,
                      key=logits.float().sigmoid())
    with pytest.raises(AssertionError):
        fn(hidden_states=torch.zeros(2, 4), gating_output=torch.zeros(3, 8), topk=2, renormalize=True)
    with pytest.raises(ValueError, match="mismatch"):
        r33.token_choice_with_bias(torch.zeros(2, 4), torch.zeros(3, 8), 2, True, semantics=semantics)


def _muse_router_cls(tree, cfg):
    def no_kernel(*a, **k):
        raise AssertionError("the CPU tensors must take _compute_routing_native, not the Triton kernel")

    return load(tree, "vllm/models/muse_spark/common/moe.py", ["MuseSpark1xRouter"],
                extra=dict(BaseRouter=_BaseRouterStub, RoutingMethodType=cfg.RoutingMethodType,
                           get_routing_method_type=cfg.get_routing_method_type,
                           fused_musespark1x_routing=no_kernel)).MuseSpark1xRouter


def test_musespark1x_routing_against_vllm_router_and_its_test_oracle(vllm_tree, semantics):
    """``MuseSpark1xRouter._compute_routing_native`` (``vllm/models/muse_spark/common/moe.py``: the kernel's torch
    reference and the CPU path) and the oracle ``_expected`` of ``tests/kernels/moe/test_muse_spark_router.py`` vs
    ``reference.routing.musespark1x_routing``, fp32 logits (where the native path and the kernel agree), the test
    file's grid (sigmoid with multiplier and eps, softmax without) plus the NVIDIA model's eps 1e-15; also the
    router's ``routing_method_type`` and its rejection of other normalizations."""
    _need_033(semantics, "MuseSpark")
    cfg = _config(vllm_tree)
    Router = _muse_router_cls(vllm_tree, cfg)
    oracle = load(vllm_tree, MOE_TESTS + "test_muse_spark_router.py", ["_expected"]).namespace["_expected"]
    g = _gen(12)
    grid = [("sigmoid", 2.5, 1e-9), ("softmax", None, None), ("sigmoid", None, r33.MUSESPARK_DIVISION_EPS),
            ("sigmoid", 0.5, 0.0), ("softmax", 1.7, 1e-5)]
    for (norm, mult, eps), (M, E, k) in itertools.product(grid, [(1, 32, 8), (77, 384, 6), (129, 256, 8), (5, 8, 1)]):
        logits, bias = torch.randn(M, E, generator=g), torch.randn(E, generator=g)
        router = Router(top_k=k, num_experts=E, expert_bias=bias, route_scale=2.0, router_output_multiplier=mult,
                        router_score_normalization=norm, router_score_division_eps=eps)
        ours = r33.musespark1x_routing(logits, bias, k, 2.0, mult, norm, eps, semantics=semantics)
        x = logits if mult is None else logits * mult
        s = x.sigmoid() if norm == "sigmoid" else x.softmax(-1)
        up_w, up_ids = router._compute_routing(None, logits, None)
        assert up_w.dtype == torch.float32 and up_ids.dtype == torch.int32
        _same_routing(*ours, up_w, up_ids, key=s + bias)
        _same_routing(*ours, *oracle(logits, bias, k, 2.0, mult, norm, eps), key=s + bias)
        assert router.routing_method_type.name == r33.get_routing_method_type(norm, k, True, None, True,
                                                                              semantics=semantics).name
    with pytest.raises(ValueError, match="router_score_normalization"):
        Router(top_k=2, num_experts=4, expert_bias=torch.zeros(4), route_scale=1.0, router_score_normalization="tanh")
    with pytest.raises(ValueError, match="router_score_normalization"):
        r33.musespark1x_routing(torch.zeros(2, 4), torch.zeros(4), 2, 1.0, router_score_normalization="tanh",
                                semantics=semantics)


def test_musespark_kernel_source_facts(vllm_tree, semantics):
    """The reference follows the Triton kernel (``common/ops/fused_routing.py``) where it and the native path may
    differ: fp32 scores, ``w * (route_scale / (sum + eps))``, ``tl.argmax`` per round (lowest index on ties), -1 /
    0 for ``is_padding`` rows. Checked on the kernel source (no GPU here)."""
    _need_033(semantics, "MuseSpark")
    src = (vllm_tree / "vllm/models/muse_spark/common/ops/fused_routing.py").read_text()
    for needle in ("inv_sum_scaled = route_scale / score_sum", "scores * inv_sum_scaled",
                   "max_idx = tl.argmax(masked_scores, axis=0)", "ids = tl.where(padding, -1, ids)",
                   "inv_sum_scaled = tl.where(padding, 0.0, inv_sum_scaled)", "score_sum = score_sum + division_eps"):
        assert needle in src, needle
    w, ids = r33.musespark1x_routing(torch.zeros(3, 8), torch.zeros(8), 2, 1.0, is_padding=torch.tensor(
        [False, True, False]), semantics=semantics)
    assert ids.tolist() == [[0, 1], [-1, -1], [0, 1]] and w[1].tolist() == [0.0, 0.0]


def _cpu_router(tree, cfg, calls):
    def rec(name, fn=None):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k) if fn is not None else (torch.zeros(1), torch.zeros(1, dtype=torch.int32))
        return wrapped

    ns = load(tree, FMOE + "router/cpu_router.py", ["CPURouter", "_grouped_topk", "_sqrtsoftplus_bias_topk",
                                                    "_softmax_topk"],
              extra=dict(BaseRouter=_BaseRouterStub, RoutingMethodType=cfg.RoutingMethodType,
                         get_routing_method_type=cfg.get_routing_method_type, Callable=object, EplbLayerState=object,
                         biased_topk_cpu=rec("_sqrtsoftplus_bias_topk:bias"),
                         hash_topk_cpu=rec("_sqrtsoftplus_bias_topk:hash"))).namespace
    ns["_grouped_topk"] = rec("_grouped_topk", ns["_grouped_topk"])
    ns["_softmax_topk"] = rec("_softmax_topk", ns["_softmax_topk"])
    return ns["CPURouter"]


CPU_GRID = [
    dict(), dict(renormalize=False), dict(bias=True), dict(rsf=2.5), dict(scoring_func="sigmoid"),
    dict(scoring_func="sigmoid", bias=True), dict(custom=True), dict(custom=True, scoring_func="sigmoid"),
    dict(grouped=True, G=8, tg=4, scoring_func="sigmoid", bias=True, rsf=2.5), dict(grouped=True, G=8, tg=4),
    dict(grouped=True, G=8, tg=4, custom=True), dict(grouped=True, G=None, tg=None),
    dict(grouped=True, G=8, tg=4, scoring_func="sqrtsoftplus", bias=True),
    dict(scoring_func="sqrtsoftplus", bias=True), dict(scoring_func="sqrtsoftplus", bias=True, custom=True),
    dict(scoring_func="sqrtsoftplus", hash=True), dict(scoring_func="sqrtsoftplus", hash=True, bias=True),
    dict(scoring_func="sqrtsoftplus", hash=True, input_ids=False), dict(scoring_func="sqrtsoftplus"),
    dict(scoring_func="sqrtsoftplus", bias=True, renormalize=False),
]


def test_cpu_router_dispatch_against_vllm(vllm_tree, semantics):
    """``CPURouter._compute_routing`` (``router/cpu_router.py``, its SGLang C++ ops replaced by recorders) takes the
    path ``reference.routing.cpu_router_path`` names, or fails (assert / ValueError) where the reference raises;
    on the torch paths ``reference.routing.cpu_route`` gives vLLM's routing; ``routing_method_type`` matches."""
    _need_033(semantics, "CPURouter")
    cfg = _config(vllm_tree)
    calls: list[str] = []
    CPURouter = _cpu_router(vllm_tree, cfg, calls)
    g = _gen(13)
    E, k, M = 64, 6, 9
    logits = torch.randn(M, E, generator=g)

    def custom(hidden_states, gating_output, topk, renormalize):
        calls.append("custom_routing_function")
        return r33.fused_topk(hidden_states, gating_output, topk, renormalize, semantics=semantics)

    hit: set[str] = set()
    errors = 0
    for case in CPU_GRID:
        c = dict(case)
        sf, rn, rsf = c.get("scoring_func", "softmax"), c.get("renormalize", True), c.get("rsf", 1.0)
        bias = torch.randn(E, generator=g) * 0.1 if c.get("bias") else None
        table = torch.randint(0, E, (32, k), generator=g).int() if c.get("hash") else None
        input_ids = torch.randint(0, 32, (M,), generator=g) if c.get("input_ids", True) else None
        kw = dict(use_grouped_topk=c.get("grouped", False), num_expert_group=c.get("G", 8 if c.get("grouped") else None),
                  topk_group=c.get("tg", 4 if c.get("grouped") else None), renormalize=rn, scoring_func=sf,
                  routed_scaling_factor=rsf, e_score_correction_bias=bias,
                  custom_routing_function=custom if c.get("custom") else None, hash_indices_table=table)
        if "G" in c:
            kw.update(num_expert_group=c["G"], topk_group=c["tg"])
        router = CPURouter(top_k=k, global_num_experts=E, **kw)
        calls.clear()
        try:
            up = router._compute_routing(None, logits, None, input_ids=input_ids)
            up_err = None
        except (AssertionError, ValueError) as e:
            up, up_err = None, e
        ref_kw = dict(use_grouped_topk=kw["use_grouped_topk"], scoring_func=sf, renormalize=rn,
                      num_expert_group=kw["num_expert_group"], topk_group=kw["topk_group"],
                      has_e_score_correction_bias=bias is not None, has_hash_indices_table=table is not None,
                      custom_routing_function=bool(c.get("custom")), has_input_ids=input_ids is not None)
        if up_err is not None:
            errors += 1
            with pytest.raises(ValueError):
                r33.cpu_router_path(semantics=semantics, **ref_kw)
            continue
        path = r33.cpu_router_path(semantics=semantics, **ref_kw)
        assert calls and calls[-1] == path, (case, calls, path)
        hit.add(path)
        if not path.startswith("_sqrtsoftplus"):  # the SGLang C++ kernels are not run here
            calls.clear()
            ours = r33.cpu_route(None, logits, k, input_ids=input_ids, semantics=semantics, **kw)
            _same_routing(*ours, *up)
        assert router.routing_method_type.name == r33.get_routing_method_type(
            sf, k, rn, kw["num_expert_group"], bias is not None, semantics=semantics).name
    assert hit == set(r33.CPU_ROUTER_PATHS) and errors == 7, (hit, errors)


def test_custom_routing_router_method_type_against_vllm(vllm_tree, semantics, monkeypatch):
    """``CustomRoutingRouter.routing_method_type`` (``router/custom_routing_router.py``) with vLLM's Llama-4 and
    Cohere2-MoE functions (its in-property imports served by stub modules holding the functions read from the
    sdist) and another function, renormalize on and off, vs ``reference.routing.custom_routing_method_type``."""
    import sys
    from types import ModuleType

    cfg = _config(vllm_tree)
    Router = load(vllm_tree, FMOE + "router/custom_routing_router.py", ["CustomRoutingRouter"],
                  extra=dict(BaseRouter=_BaseRouterStub, RoutingMethodType=cfg.RoutingMethodType,
                             Callable=object, EplbLayerState=object)).CustomRoutingRouter
    llama4_fn = lambda **kw: None  # noqa: E731  (identity is all the router compares)
    mods = {"vllm": ModuleType("vllm"), "vllm.model_executor": ModuleType("vllm.model_executor"),
            "vllm.model_executor.models": ModuleType("vllm.model_executor.models"),
            "vllm.model_executor.models.llama4": ModuleType("vllm.model_executor.models.llama4")}
    mods["vllm.model_executor.models.llama4"].Llama4MoE = SimpleNamespace(custom_routing_function=llama4_fn)
    cohere_fn = None
    if (vllm_tree / "vllm/model_executor/models/cohere2_moe.py").exists():
        cohere_fn = load(vllm_tree, "vllm/model_executor/models/cohere2_moe.py",
                         ["token_choice_with_bias"]).token_choice_with_bias
        mods["vllm.model_executor.models.cohere2_moe"] = ModuleType("vllm.model_executor.models.cohere2_moe")
        mods["vllm.model_executor.models.cohere2_moe"].token_choice_with_bias = cohere_fn
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    other = lambda **kw: None  # noqa: E731
    cases = [(llama4_fn, r33.llama4_routing), (other, other)]
    if cohere_fn is not None:
        cases.append((cohere_fn, r33.token_choice_with_bias))
    for (up_fn, ref_fn), rn in itertools.product(cases, [True, False]):
        router = Router(top_k=2, global_num_experts=8, custom_routing_function=up_fn, renormalize=rn, eplb_state=None)
        assert router.routing_method_type.name == r33.custom_routing_method_type(ref_fn, rn,
                                                                                 semantics=semantics).name, (ref_fn, rn)


def test_zero_expert_router_against_vllm(vllm_tree, semantics):
    """``ZeroExpertRouter._compute_routing`` (``router/zero_expert_router.py``) with vLLM's torch top-k oracle
    (``tests/kernels/moe/test_fused_topk.py::torch_topk``) for ``fused_topk_bias`` and a recorder for the Triton
    ``zero_experts_compute_triton``: the masked ids / weights and the (pre-mask) ids / scales it hands the
    zero-expert computation equal the reference's; the reference's identity output is the sum, over those slots,
    of scale x hidden. The Triton identity kernel itself is checked on its source (BLOCK_SIZE 256 grid)."""
    _need_033(semantics, "ZeroExpertRouter")
    cfg = _config(vllm_tree)
    torch_topk = load(vllm_tree, MOE_TESTS + "test_fused_topk.py", ["torch_topk"]).torch_topk
    seen = {}

    def fused_topk_bias_oracle(hidden_states, gating_output, e_score_correction_bias, topk, renormalize,
                               scoring_func="softmax", indices_type=None):
        w, ids = torch_topk(gating_output, topk, renormalize, e_score_correction_bias=e_score_correction_bias,
                            scoring_func=scoring_func)
        return w.float(), ids.to(indices_type or torch.int32)

    def recorder(expert_indices, expert_scales, num_experts, zero_expert_type, hidden_states):
        seen.update(ids=expert_indices, scales=expert_scales, n=num_experts, type=zero_expert_type)
        return torch.zeros_like(hidden_states)

    Router = load(vllm_tree, FMOE + "router/zero_expert_router.py", ["ZeroExpertRouter"],
                  extra=dict(BaseRouter=_BaseRouterStub, RoutingMethodType=cfg.RoutingMethodType,
                             EplbLayerState=object, fused_topk_bias=fused_topk_bias_oracle,
                             zero_experts_compute_triton=recorder)).ZeroExpertRouter
    g = _gen(14)
    for (E, Z, k), sf, rn, rsf in itertools.product([(16, 8, 4), (64, 32, 12)], ["softmax", "sigmoid"],
                                                     [False, True], [1.0, 6.0]):
        logits, bias = torch.randn(33, E + Z, generator=g), torch.randn(E + Z, generator=g) * 0.1
        h = torch.randn(33, 512, generator=g)
        router = Router(top_k=k, global_num_experts=E + Z, e_score_correction_bias=bias, num_logical_experts=E,
                        zero_expert_type="identity", scoring_func=sf, renormalize=rn, routed_scaling_factor=rsf)
        assert router.routing_method_type == cfg.RoutingMethodType.Unspecified
        up_w, up_ids = router._compute_routing(h, logits, None)
        w, ids, out = r33.zero_expert_router(h, logits, k, bias, E, scoring_func=sf, renormalize=rn,
                                             routed_scaling_factor=rsf, semantics=semantics)
        key = (logits.softmax(-1) if sf == "softmax" else logits.sigmoid()) + bias
        _same_routing(w, ids, up_w, up_ids, key=key)
        assert seen["n"] == E and seen["type"] == "identity"
        zs = torch.where(seen["ids"] >= E, seen["scales"], torch.zeros_like(seen["scales"]))
        torch.testing.assert_close(out, zs.sum(-1, keepdim=True) * h, rtol=1e-5, atol=1e-6)
    src = (vllm_tree / FMOE / "fused_moe.py").read_text()
    assert "grid = lambda meta: (num_tokens * (hidden_dim // meta[\"BLOCK_SIZE\"]),)" in src
    assert "BLOCK_SIZE=256" in src and r33.ZERO_EXPERT_BLOCK == 256
