"""The modular kernel's formats and plumbing (seed 002): batched == standard, monolithic == route + experts,
constructor rules, per-chunk expert metadata, workspace sharing, finalize reductions."""

import pytest
import torch

from reference.schemes import quantize_weights
from reference.batched import BatchedPrepareAndFinalize, BatchedReferenceExperts, batch_by_expert
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig
from reference.experts import ReferenceExperts, fused_experts
from reference.modular import (
    ExpertsCall,
    ExpertTokensMetadata,
    FusedMoEKernel,
    MoEPrepareAndFinalizeNoEP,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
    TopKWeightAndReduceNoOP,
)
from reference.monolithic import MoEPrepareAndFinalizeNoEPMonolithic, ReferenceMonolithicExperts
from reference.routing import determine_expert_map, fused_topk, grouped_topk

CFG = FusedMoEConfig(num_experts=8, experts_per_token=2, hidden_dim=256, intermediate_size_per_partition=128,
                     num_local_experts=4)


def make(M=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 256, generator=g).bfloat16()
    w1 = (torch.randn(4, 256, 256, generator=g) / 16).bfloat16()
    w2 = (torch.randn(4, 256, 128, generator=g) / 11).bfloat16()
    w, ids = fused_topk(None, torch.randn(M, 8, generator=g), 2, True)
    return x, w1, w2, w, ids


@pytest.mark.parametrize("scheme", ["bf16", "fp8_block128", "fp8_channel_token", "int8_channel_token"])
@pytest.mark.parametrize("rank", [0, 1])
def test_batched_equals_standard(scheme, rank):
    """Equal whenever activation scales are per row (per-tensor dynamic scales are per expert slot in the
    batched format, per call in the standard one, so those schemes legitimately differ)."""
    x, w1, w2, w, ids = make()
    a, b, qc = quantize_weights(scheme, w1, w2)
    emap = determine_expert_map(2, rank, 8)[1]
    ref = fused_experts(x, a, b, w, ids, expert_map=emap, global_num_experts=8, quant_config=qc)
    kernel = FusedMoEKernel(BatchedPrepareAndFinalize(19, 4, rank=rank),
                            BatchedReferenceExperts(CFG, qc, max_num_tokens=19, num_dispatchers=1),
                            poison=float("nan"))
    out = kernel.apply(x, a, b, w, ids, global_num_experts=8)  # no map: the rank's slice is implied
    assert torch.equal(out, ref)
    out = kernel.apply(x, a, b, w, ids, expert_map=emap, global_num_experts=8)
    assert torch.equal(out, ref)


def test_batch_by_expert_layout_and_capacity():
    x = torch.arange(4.0).unsqueeze(1).repeat(1, 3)
    ids = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]])
    batched, counts, tokens = batch_by_expert(x, ids, 3, 4)
    assert counts.tolist() == [3, 2, 3]
    assert batched[0, :, 0].tolist() == [0.0, 2.0, 3.0, 0.0]  # increasing token order, zero padding
    assert batched[1, :, 0].tolist() == [1.0, 2.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="max_num_tokens"):
        batch_by_expert(x, ids, 3, 2)


def test_experts_constructor_format_rules():
    with pytest.raises(ValueError, match="must be set for BatchedExperts"):
        BatchedReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG)
    with pytest.raises(ValueError, match="should only be set for BatchedExperts"):
        ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG, max_num_tokens=4, num_dispatchers=1)
    with pytest.raises(ValueError, match="expect"):
        FusedMoEKernel(MoEPrepareAndFinalizeNoEP(),
                       BatchedReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG, max_num_tokens=4, num_dispatchers=1))
    with pytest.raises(ValueError, match="monolithic"):
        FusedMoEKernel(MoEPrepareAndFinalizeNoEPMonolithic(), ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG))


def test_monolithic_equals_route_then_experts():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 256, generator=g).bfloat16()
    w1 = (torch.randn(8, 256, 256, generator=g) / 16).bfloat16()
    w2 = (torch.randn(8, 256, 128, generator=g) / 11).bfloat16()
    logits, bias = torch.randn(11, 8, generator=g), torch.randn(8, generator=g) * 0.1
    cfg = FusedMoEConfig(8, 3, 256, 128, 8)
    experts = ReferenceMonolithicExperts(cfg, FUSED_MOE_UNQUANTIZED_CONFIG, top_k=3, scoring_func="sigmoid",
                                         use_grouped_topk=True)
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEPMonolithic(), experts)
    out = kernel.apply_monolithic(x, w1, w2, logits, experts.moe_config.activation, 8, None, False,
                                  num_expert_group=4, e_score_correction_bias=bias, routed_scaling_factor=2.5,
                                  topk_group=2)
    w, ids = grouped_topk(None, logits, 3, True, 4, 2, scoring_func="sigmoid", routed_scaling_factor=2.5,
                          e_score_correction_bias=bias)
    assert torch.equal(out, fused_experts(x, w1, w2, w, ids))
    with pytest.raises(ValueError, match="monolithic"):
        kernel.apply(x, w1, w2, w, ids)


class _MetaPrepare(MoEPrepareAndFinalizeNoEP):
    """NoEP prepare that also reports expert_num_tokens for the whole batch (as an all2all prepare does)."""

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, *args, **kwargs):
        a1q, s, _, _, _ = super().prepare(a1, topk_weights, topk_ids, num_experts, expert_map, *args, **kwargs)
        from reference.align import count_expert_num_tokens

        counts = count_expert_num_tokens(topk_ids, 4, expert_map)
        return a1q, s, ExpertTokensMetadata(counts, counts.clone()), None, None


class _Recorder(ReferenceExperts):
    seen: list

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, expert_tokens_meta, **kwargs):
        self.seen.append((topk_ids.clone(), expert_tokens_meta))
        super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, *args,
                      expert_tokens_meta=expert_tokens_meta, **kwargs)


def test_each_chunk_gets_its_own_expert_counts():
    """vLLM #20392: chunks must not reuse the whole batch's expert_num_tokens."""
    x, w1, w2, w, ids = make()
    emap = determine_expert_map(2, 0, 8)[1]
    rec = _Recorder(CFG, FUSED_MOE_UNQUANTIZED_CONFIG)
    rec.seen = []
    out = FusedMoEKernel(_MetaPrepare(), rec, chunk_size=5, semantics="0.17").apply(x, w1, w2, w, ids, expert_map=emap,
                                                                   global_num_experts=8)
    assert len(rec.seen) == 4
    for chunk_ids, meta in rec.seen:
        local = emap.long()[chunk_ids.long()]
        expected = torch.bincount(local[local >= 0], minlength=4).int()
        assert torch.equal(meta.expert_num_tokens, expected)
        assert torch.equal(meta.expert_num_tokens_cpu, expected)
    assert torch.equal(out, fused_experts(x, w1, w2, w, ids, expert_map=emap, global_num_experts=8))


def _call(x, w1, w2, w, ids):
    """The operands of one experts step: 8 global experts, 4 local, bf16 on the CPU."""
    return ExpertsCall(in_dtype=torch.bfloat16, a1q=x, a1q_scale=None, w1=w1, w2=w2, topk_weights=w, topk_ids=ids,
                       activation=CFG.activation, global_num_experts=8, local_num_experts=4, expert_map=None,
                       apply_router_weight_on_input=False, expert_tokens_meta=None)


def test_single_chunk_shares_workspace13_with_the_output():
    x, w1, w2, w, ids = make()
    call = _call(x, w1, w2, w, ids)
    k = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG))
    ws13, ws2, out = k._allocate_buffers(call, M_chunk=19, M_full=19, N=256, K=256, top_k=2)
    assert ws13.data_ptr() == out.data_ptr() and ws2.data_ptr() != out.data_ptr()
    k = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), ReferenceExperts(CFG, FUSED_MOE_UNQUANTIZED_CONFIG), chunk_size=4,
                       semantics="0.17")
    ws13, ws2, out = k._allocate_buffers(call, M_chunk=4, M_full=19, N=256, K=256, top_k=2)
    assert ws13.data_ptr() != out.data_ptr() and ws13.shape[0] == 8 and out.shape[0] == 19
    assert not k.output_is_reduced()


def test_weight_and_reduce_impls():
    M, topk, K = 5, 3, 4
    y = torch.randn(M, topk, K)
    w = torch.rand(M, topk)
    ids = torch.randint(0, 4, (M, topk))
    out = TopKWeightAndReduceContiguous().apply(None, y, w, ids, False)
    torch.testing.assert_close(out, (y * w.unsqueeze(-1)).sum(1))
    torch.testing.assert_close(TopKWeightAndReduceContiguous().apply(None, y, w, ids, True), y.sum(1))
    dst = torch.empty(M, K)
    TopKWeightAndReduceNoOP().apply(dst, y[:, 0], w, ids, False)
    assert torch.equal(dst, y[:, 0])
    with pytest.raises(RuntimeError, match="replaced"):
        TopKWeightAndReduceDelegate().apply(None, y, w, ids, False)
    # NaiveBatched: slot e holds expert e's tokens in increasing order.
    ids = torch.tensor([[0, 1], [1, 0], [0, 2]])
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]])
    batched = torch.zeros(3, 3, 1)
    batched[0, :3, 0] = torch.tensor([10.0, 20.0, 30.0])  # tokens 0, 1, 2
    batched[1, :2, 0] = torch.tensor([1.0, 2.0])  # tokens 0, 1
    batched[2, :1, 0] = torch.tensor([7.0])  # token 2
    out = TopKWeightAndReduceNaiveBatched().apply(None, batched, w, ids, False)
    assert out[:, 0].tolist() == [0.5 * 10 + 0.25 * 1, 2.0 * 20 + 1.0 * 2, 3.0 * 30 + 4.0 * 7]
    # rank 1 without a map reduces its own range [3, 6) (vLLM: first_expert = num_local_experts * rank)
    out1 = TopKWeightAndReduceNaiveBatched(rank=1).apply(None, batched, w, ids + 3, False)
    assert torch.equal(out1, out)
    assert not TopKWeightAndReduceNaiveBatched(rank=1).apply(None, batched, w, ids, False).any()


def test_topk_weight_and_reduce_equality():
    """vLLM's ``__eq__``: same class (NaiveBatched: same rank)."""
    assert TopKWeightAndReduceContiguous() == TopKWeightAndReduceContiguous()
    assert TopKWeightAndReduceNoOP() == TopKWeightAndReduceNoOP()
    assert TopKWeightAndReduceDelegate() == TopKWeightAndReduceDelegate()
    assert TopKWeightAndReduceNoOP() != TopKWeightAndReduceContiguous()
    assert TopKWeightAndReduceNaiveBatched(1) == TopKWeightAndReduceNaiveBatched(1)
    assert TopKWeightAndReduceNaiveBatched(0) != TopKWeightAndReduceNaiveBatched(1)
    assert TopKWeightAndReduceNaiveBatched(0) != TopKWeightAndReduceContiguous()
    assert len({TopKWeightAndReduceNoOP(), TopKWeightAndReduceNoOP(), TopKWeightAndReduceNaiveBatched(2)}) == 2


def test_support_oracle_reason_for_the_current_device():
    """Seed 002's reason is "kernel does not support current device"; an experts class may append why."""
    from reference.modular import FusedMoEActivationFormat

    class NoDevice(ReferenceExperts):
        @staticmethod
        def _supports_current_device() -> bool:
            return False

    class NoDeviceWhy(NoDevice):
        @staticmethod
        def _current_device_unsupported_detail() -> str:
            return "needs sm_100"

    std = FusedMoEActivationFormat.Standard
    assert ReferenceExperts.is_supported_config(ReferenceExperts, CFG, None, None, std) == (True, None)
    assert NoDevice.is_supported_config(NoDevice, CFG, None, None, std) == (
        False, "kernel does not support current device")
    assert NoDeviceWhy.is_supported_config(NoDeviceWhy, CFG, None, None, std) == (
        False, "kernel does not support current device: needs sm_100")
