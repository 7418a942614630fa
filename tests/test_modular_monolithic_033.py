"""vLLM 0.33's monolithic interface and support oracle in the reference: ``apply_monolithic``'s keywords (routing
sink, hash routing), deferred finalize on the monolithic path, routed-expert capture on the modular router,
``ExpertTokensMetadata``'s new fields and the four new ``is_supported_config`` conditions (vLLM 0.33.0
``fused_moe/modular_kernel.py``, ``routed_experts_capturer.py``, ``router/base_router.py``).

Oracles: the reduced monolithic output (a float64 reduction of the unfinalized rows must give it back), routing
computed separately by ``select_experts`` / ``fused_topk`` + ``eplb_logical_to_physical``, and the reasons and order
of vLLM's ``is_supported_config`` as read from the source."""

from __future__ import annotations

import pytest
import torch

from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, FusedMoEParallelConfig
from reference.experts import ReferenceExperts
from reference.modular import ExpertTokensMetadata, FusedMoEActivationFormat, FusedMoEKernel
from reference.moe_output import UnfinalizedMoEOutput
from reference.monolithic import MoEPrepareAndFinalizeNoEPMonolithic, ReferenceMonolithicExperts
from reference.routing import RoutedExpertsSink, eplb_logical_to_physical, fused_topk, route, select_experts
from reference.semantics import SemanticsError, use_semantics

CFG = FusedMoEConfig(8, 2, 64, 48, 8, in_dtype=torch.float32, max_num_tokens=32)
QC = FUSED_MOE_UNQUANTIZED_CONFIG


def make(M=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, 64, generator=g), torch.randn(8, 96, 64, generator=g) / 8,
            torch.randn(8, 64, 48, generator=g) / 7, torch.randn(M, 8, generator=g))


def mono(semantics="0.33", **kw):
    return FusedMoEKernel(MoEPrepareAndFinalizeNoEPMonolithic(), ReferenceMonolithicExperts(CFG, QC, top_k=2, **kw),
                          semantics=semantics)


def run(k, x, w1, w2, logits, **kw):
    from reference.activation import MoEActivation

    return k.apply_monolithic(x, w1, w2, logits, MoEActivation.SILU, 8, None, False, **kw)


def test_routing_sink_captures_the_routed_ids():
    x, w1, w2, logits = make()
    got = []
    sink = RoutedExpertsSink(CFG, got.append)
    assert sink.buffer.shape == (32, 2) and sink.buffer.dtype == torch.int16
    out = run(mono(), x, w1, w2, logits, routing_sink=sink)
    _, ids, _ = select_experts(x, logits, 2, False, True)
    assert len(got) == 1 and got[0].shape == (11, 2) and got[0].dtype == torch.int16
    assert got[0].data_ptr() == sink.buffer.data_ptr()  # the leading rows of the layer's buffer
    assert torch.equal(got[0].long(), ids.long())
    assert torch.equal(out, run(mono(), x, w1, w2, logits, routing_sink=None))


def test_routing_sink_needs_capturing_experts_and_033():
    x, w1, w2, logits = make()

    class NoCapture(ReferenceMonolithicExperts):
        def supports_routing_replay_capture(self):
            return False

    k = FusedMoEKernel(MoEPrepareAndFinalizeNoEPMonolithic(), NoCapture(CFG, QC, top_k=2), semantics="0.33")
    with pytest.raises(ValueError, match="Routed-experts capture is not supported"):
        run(k, x, w1, w2, logits, routing_sink=RoutedExpertsSink(CFG, print))
    with pytest.raises(SemanticsError):
        run(mono("0.17"), x, w1, w2, logits, routing_sink=RoutedExpertsSink(CFG, print))
    with pytest.raises(SemanticsError):
        run(mono("0.17"), x, w1, w2, logits, hash_indices_table=torch.zeros(4, 2, dtype=torch.int32))


def test_hash_arguments_reach_the_experts_only_with_a_table():
    x, w1, w2, logits = make()
    seen = []

    class Spy(ReferenceMonolithicExperts):
        def apply(self, *a, **kw):
            seen.append(sorted(k for k in kw if k in ("input_ids", "hash_indices_table")))
            kw.pop("input_ids", None), kw.pop("hash_indices_table", None)
            return super().apply(*a, **kw)

    k = FusedMoEKernel(MoEPrepareAndFinalizeNoEPMonolithic(), Spy(CFG, QC, top_k=2), semantics="0.33")
    run(k, x, w1, w2, logits, input_ids=torch.arange(11))
    run(k, x, w1, w2, logits, input_ids=torch.arange(11), hash_indices_table=torch.zeros(16, 2, dtype=torch.int32))
    assert seen == [[], ["hash_indices_table", "input_ids"]]


def test_monolithic_deferred_finalize_passes_through():
    x, w1, w2, logits = make()
    out = run(mono(defer_finalize=True), x, w1, w2, logits)
    assert isinstance(out, UnfinalizedMoEOutput)
    out.validate()
    reduced = run(mono(), x, w1, w2, logits)
    # Oracle: the reduced output of the same kernel; the consumer's reduction of the unfinalized rows gives it back.
    torch.testing.assert_close(out.finalize(dtype=torch.float32), reduced, rtol=1e-5, atol=1e-5)

    class NoDefer(MoEPrepareAndFinalizeNoEPMonolithic):
        def supports_deferred_moe_finalize(self):
            return False

    k = FusedMoEKernel(NoDefer(), ReferenceMonolithicExperts(CFG, QC, top_k=2, defer_finalize=True), semantics="0.33")
    with pytest.raises(ValueError, match="deferred"):
        run(k, x, w1, w2, logits)
    with pytest.raises(SemanticsError):
        run(mono("0.17", defer_finalize=True), x, w1, w2, logits)


@pytest.mark.parametrize("semantics", ["0.17", "0.33"])
def test_router_capture_fn_sees_logical_ids_before_eplb(semantics):
    x, _, _, logits = make()
    l2p = torch.tensor([[0, 8], [1, -1], [2, -1], [3, 9], [4, -1], [5, -1], [6, -1], [7, -1]])
    count = torch.tensor([2, 1, 1, 2, 1, 1, 1, 1])
    got = []
    with use_semantics(semantics):
        w, ids = route(x, logits, 2, capture_fn=got.append, eplb=(l2p, count))
        _, logical = fused_topk(x, logits, 2, True)
        assert torch.equal(got[0], logical)
        assert torch.equal(ids, eplb_logical_to_physical(logical, l2p, count))


def test_expert_tokens_metadata_033_fields():
    m = ExpertTokensMetadata(torch.tensor([1, 2], dtype=torch.int32), None)
    assert m.psum_recv_per_rank is None and m.rank_expert_offset is None and m.num_valid_tokens() is None
    m = ExpertTokensMetadata(None, None, psum_recv_per_rank=torch.tensor([3, 3, 7], dtype=torch.int32),
                             rank_expert_offset=16)
    assert m.num_valid_tokens().tolist() == [7] and m.rank_expert_offset == 16


class _Mono(ReferenceMonolithicExperts):
    support = None

    @staticmethod
    def _supports_current_device():
        return True

    @staticmethod
    def _supports_no_act_and_mul():
        return True

    @staticmethod
    def _supports_quant_scheme(w, a):
        return True

    @staticmethod
    def _supports_activation(act):
        return True

    @staticmethod
    def _supports_parallel_config(pc):
        return True

    @staticmethod
    def _supports_routing_method(rm, w, a):
        return True

    @staticmethod
    def _supports_router_logits_dtype(d, rm):
        return True


class _Modular(ReferenceExperts):
    support = None
    _supports_current_device = _Mono._supports_current_device
    _supports_no_act_and_mul = _Mono._supports_no_act_and_mul
    _supports_quant_scheme = _Mono._supports_quant_scheme
    _supports_activation = _Mono._supports_activation
    _supports_parallel_config = _Mono._supports_parallel_config


@pytest.mark.parametrize("field,cls,env,reason", [
    ("has_hash_routing", _Mono, None, "kernel does not support hash routing"),
    ("has_hash_routing", _Modular, None, None),  # modular experts get routed ids: the table is the router's
    ("require_decomposed_backend", _Mono, None, "kernel does not support routes adjusted after routing"),
    ("require_decomposed_backend", _Modular, None, None),
    (None, _Mono, "1", "kernel does not support batch invariance"),
    (None, _Modular, "1", "kernel does not support batch invariance"),
    (None, _Modular, "0", None),
    ("is_lora_enabled", _Mono, None, "kernel does not support LoRA"),
    ("is_lora_enabled", _Modular, None, "kernel does not support LoRA"),
])
def test_is_supported_config_033_conditions(monkeypatch, field, cls, env, reason):
    import dataclasses

    cfg = dataclasses.replace(CFG, **({field: True} if field else {}))
    if env is not None:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", env)
    fmt = FusedMoEActivationFormat.Standard
    with use_semantics("0.33"):
        assert cls.is_supported_config(cls, cfg, None, None, fmt) == (reason is None, reason)
    with use_semantics("0.17"):  # none of these conditions exists in 0.17
        assert cls.is_supported_config(cls, cfg, None, None, fmt) == (True, None)


def test_is_supported_config_033_order():
    """vLLM checks hash routing before the routing method, and the activation format before batch invariance."""
    import dataclasses

    class BadRouting(_Mono):
        @staticmethod
        def _supports_routing_method(rm, w, a):
            return False

    cfg = dataclasses.replace(CFG, has_hash_routing=True, is_lora_enabled=True)
    with use_semantics("0.33"):
        assert BadRouting.is_supported_config(BadRouting, cfg, None, None, FusedMoEActivationFormat.Standard)[1] \
            == "kernel does not support hash routing"
        assert _Mono.is_supported_config(_Mono, dataclasses.replace(CFG, is_lora_enabled=True), None, None,
                                         FusedMoEActivationFormat.BatchedExperts)[1] \
            == "kernel does not support ('batched_experts',) activation format"  # vLLM formats the enum's value


def test_parallel_config_sizes_the_sink():
    cfg = FusedMoEConfig(8, 2, 64, 48, 4, max_num_tokens=10,
                         moe_parallel_config=FusedMoEParallelConfig(dp_size=3, ep_size=2, use_ep=True))
    assert RoutedExpertsSink(cfg, print).buffer.shape == (20, 2)
    cfg = FusedMoEConfig(8, 2, 64, 48, 8, max_num_tokens=10, moe_parallel_config=FusedMoEParallelConfig(dp_size=3))
    assert RoutedExpertsSink(cfg, print).buffer.shape == (30, 2)


def test_consumes_expert_mask_picks_the_map_per_version():
    """0.33: the experts class decides (consumes_expert_mask, AITER); 0.17: the global AITER switch decides."""
    import torch

    from reference.modular import FusedMoEExperts, layer_expert_map
    from reference.routing import determine_expert_map

    _, emap, mask = determine_expert_map(4, 1, 16, return_expert_mask=True)
    assert mask.tolist() == [0] * 4 + [1] * 4 + [0] * 8 + [0]
    assert FusedMoEExperts.consumes_expert_mask is False

    class Aiter:  # stands for a class with vLLM's consumes_expert_mask = True (rocm_aiter_moe.py)
        consumes_expert_mask = True

    class Plain:
        consumes_expert_mask = False

    assert torch.equal(layer_expert_map(Aiter, emap, mask, semantics="0.33"), mask)
    assert torch.equal(layer_expert_map(Plain, emap, mask, rocm_aiter_fmoe_enabled=True, semantics="0.33"), emap)
    assert torch.equal(layer_expert_map(Aiter, emap, mask, semantics="0.17"), emap)
    assert torch.equal(layer_expert_map(Plain, emap, mask, rocm_aiter_fmoe_enabled=True, semantics="0.17"), mask)


def test_expert_substitution_like_vllms_test():
    """vLLM 0.33 test_expert_substitution.py::test_constant_substitution_transforms_routes_and_computes_side_output
    and ::test_constant_substitution_preserves_router_weight_precision, re-derived (5 experts, 1 and 3 substituted)."""
    import torch

    from reference.expert_substitution import add_constant_output, expert_substitution_routes, transform_routes

    routes = expert_substitution_routes(5, (3, 1))
    assert routes.tolist() == [0, -1, 1, -2, 2]
    values = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    for M, D in ((0, 2), (7, 4)):
        rows = torch.arange(M) % 3
        ids = torch.tensor([[1, 2], [4, 3], [99, -1]])[rows]
        w = torch.tensor([[0.25, 0.75], [0.6, 0.4], [0.5, 0.5]])[rows]
        const = transform_routes(torch.zeros(M, D), w, ids, routes, values)
        torch.testing.assert_close(w, torch.tensor([[0.0, 0.75], [0.6, 0.0], [0.0, 0.0]])[rows])
        assert torch.equal(ids, torch.tensor([[0, 1], [2, 0], [0, 0]])[rows])
        exp = torch.zeros(M, D)
        exp[:, :2] = torch.tensor([[2.5, 5.0], [12.0, 16.0], [0.0, 0.0]])[rows]
        torch.testing.assert_close(const, exp)
    for dtype in (torch.float16, torch.bfloat16):
        vals = torch.tensor([[60000.0], [-60000.0]], dtype=dtype)
        w = torch.tensor([[0.5001, 0.4999]])
        got = transform_routes(torch.zeros(1, 1, dtype=dtype), w.clone(), torch.tensor([[1, 3]]), routes, vals)
        assert torch.equal(got, (w.double() @ vals.double()).to(dtype))
    out = torch.ones(1, 2)
    assert add_constant_output(out.clone(), torch.tensor([[2.5, 5.0, 9.0]]), tp_rank=1).tolist() == [[1.0, 1.0]]
    assert add_constant_output(out, torch.tensor([[2.5, 5.0, 9.0]])).tolist() == [[3.5, 6.0]]
    with pytest.raises(ValueError, match="retain"):
        expert_substitution_routes(2, (0, 1))
