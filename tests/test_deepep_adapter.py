"""examples/clients/deepep.py without DeepEP: the layout conversion between the suite's expert placements and
DeepEP's linear one, checked against DeepEP's documented dispatch semantics emulated here (intranode.cu: a token goes
to rank r if one of its ids lies in ``[r * E_local, (r + 1) * E_local)``; the receiver sees ``id - r * E_local`` there
and -1 with weight 0 elsewhere) and against the layout ``reference.distributed.DeepEPHTPrepareAndFinalize``
specifies (global ids, -1 for routes held elsewhere), derived from ``determine_expert_map`` directly."""

from __future__ import annotations

import pytest
import torch

from examples.clients.deepep import (
    DeepEPIntranodePrepareAndFinalize,
    deepep_expert_ids,
    global_expert_ids,
    held_experts,
)
from reference.activation import MoEActivation
from reference.config import FusedMoEConfig, FusedMoEParallelConfig
from reference.distributed import expert_placement
from reference.routing import determine_expert_map
from reference.schemes import quantize_weights


def _emulated_deepep_dispatch(lin: torch.Tensor, weights: torch.Tensor, rank: int, num_local: int):
    """DeepEP intranode dispatch seen from destination ``rank`` for one source's tokens: (token indices received,
    local ids, weights) as intranode.cu writes them."""
    lo, hi = rank * num_local, (rank + 1) * num_local
    here = (lin >= lo) & (lin < hi)
    rows = here.any(dim=1).nonzero().squeeze(1)
    local = torch.where(here[rows], lin[rows] - lo, torch.full_like(lin[rows], -1))
    w = torch.where(here[rows], weights[rows], torch.zeros_like(weights[rows]))
    return rows, local, w


def _routing(M, E, topk, seed, pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]) if M else \
        torch.empty(0, topk, dtype=torch.long)
    if pad and M:
        ids[torch.rand(M, topk, generator=g) < 0.25] = -1
    w = torch.rand(M, topk, generator=g)
    return ids, w


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("W,E,topk", [(2, 32, 4), (4, 32, 4), (8, 256, 8), (8, 32, 4)])
def test_round_trip_matches_reference_layout(placement, W, E, topk):
    owner, local_index = expert_placement(E, W, placement)
    nl = E // W
    for src in range(W):
        ids, w = _routing(7 + 3 * src if src != 1 else 0, E, topk, seed=W * 100 + src)
        lin = deepep_expert_ids(ids, owner, local_index, nl)
        assert lin.dtype == torch.int64 and torch.equal(lin < 0, ids < 0)
        for dst in range(W):
            rows, local, rw = _emulated_deepep_dispatch(lin, w, dst, nl)
            # the reference layout, from determine_expert_map of the destination (independent of the adapter)
            _, emap, _ = determine_expert_map(W, dst, E, placement)
            held_here = emap >= 0
            valid = ids >= 0
            on_dst = valid & held_here[ids.clamp(min=0)]
            exp_rows = on_dst.any(dim=1).nonzero().squeeze(1)
            assert torch.equal(rows, exp_rows)
            exp_ids = torch.where(on_dst[exp_rows], ids[exp_rows], torch.full_like(ids[exp_rows], -1))
            held = held_experts(owner, local_index, dst)
            got = global_expert_ids(local, held)
            assert torch.equal(got, exp_ids)
            assert torch.equal(rw, torch.where(exp_ids >= 0, w[exp_rows], torch.zeros_like(w[exp_rows])))
            # DeepEP's per-local-expert counts (its local index) equal the expert_map's local index of the routes
            counts = torch.bincount(local[local >= 0], minlength=nl)
            exp_counts = torch.bincount(emap[exp_ids[exp_ids >= 0]].long(), minlength=nl)
            assert torch.equal(counts, exp_counts)


def test_held_experts_is_the_expert_map_inverse():
    for placement in ("linear", "round_robin"):
        owner, local_index = expert_placement(32, 4, placement)
        for r in range(4):
            _, emap, _ = determine_expert_map(4, r, 32, placement)
            held = held_experts(owner, local_index, r)
            assert torch.equal(emap[held], torch.arange(8, dtype=emap.dtype))


def test_out_of_range_ids_are_no_route():
    owner, local_index = expert_placement(8, 2, "linear")
    ids = torch.tensor([[0, 7, -1, 8]])
    assert deepep_expert_ids(ids, owner, local_index, 4).tolist() == [[0, 7, -1, -1]]


def _cfg(W, dtype=torch.bfloat16, E=32, K=256):
    return FusedMoEConfig(num_experts=E, experts_per_token=4, hidden_dim=K, intermediate_size_per_partition=128,
                          num_local_experts=E // W, activation=MoEActivation.SILU, in_dtype=dtype,
                          moe_parallel_config=FusedMoEParallelConfig.make_ep(W, 0))


def _qc(scheme):
    return quantize_weights(scheme, torch.zeros(1, 256, 256, dtype=torch.bfloat16),
                            torch.zeros(1, 256, 128, dtype=torch.bfloat16))[2]


@pytest.mark.parametrize("scheme,after,ok", [
    ("bf16", False, True), ("fp8_block128", False, True), ("fp8_block128", True, True),
    ("fp8_channel_token", False, True), ("fp8_tensor", False, False), ("fp8_tensor", True, True),
])
def test_claims(scheme, after, ok):
    claimed, reason = DeepEPIntranodePrepareAndFinalize.is_supported_config(_cfg(4), _qc(scheme), after)
    assert claimed is ok, reason
    assert (reason is None) is ok


def test_claims_refuse_fp16_and_uneven_experts():
    assert not DeepEPIntranodePrepareAndFinalize.is_supported_config(_cfg(4, torch.float16), _qc("bf16"), False)[0]
    assert not DeepEPIntranodePrepareAndFinalize.is_supported_config(_cfg(3, E=32), _qc("bf16"), False)[0]


def test_backend_without_deepep_says_why(monkeypatch):
    monkeypatch.setenv("MOE_DEEPEP_BASE", "torch")
    from examples.clients.deepep import backend

    b = backend()
    assert b.name == "torch_deepep"
    assert DeepEPIntranodePrepareAndFinalize in b.prepare_finalize
    reason = b.unavailable_reason()
    assert reason is not None and ("CUDA" in str(reason) or "deep_ep" in str(reason))
