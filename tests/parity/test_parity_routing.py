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
