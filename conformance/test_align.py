"""Alignment conformance: ``moe_align_block_size`` and ``count_expert_num_tokens`` against ``reference.align``,
exactly, on real routing shapes (every model's E and topk, with and without an EP expert_map); vLLM 0.33's
``moe_align_block_size(ignore_invalid_experts=False)`` (legacy mode) and ``return_scatter_idx`` for ops that take
them; ``fused_globalize_align_block_size`` (0.33, DeepEP-v2 INDEXED decode metadata) for backends that offer it.

An op without the ``ignore_invalid_experts`` parameter is the ``ignore_invalid_experts=True`` mode with a map (the
mode vLLM's experts call).

``sorted_token_ids`` is compared per block as a set (a GPU kernel fills an expert's slots with atomics, so the
order inside a block is not defined); everything else (block owners, padding value, padded count) exactly.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from conformance.cases import seed_of
from conformance.inputs import _gen, route, router_logits, routing_bias
from conformance.metrics import assert_exact, assert_same_blocks, assert_ulps
from reference import align as ra
from reference.routing import determine_expert_map
from specs import load_models

BLOCK_SIZES = (16, 64)
TOKENS = (1, 33, 256)


def _cases():
    for m, M, bs, ep in itertools.product(load_models().values(), TOKENS, BLOCK_SIZES, (False, True)):
        yield pytest.param((m, M, bs, ep), id=f"{m.name}-M{M}-bs{bs}" + (f"-ep{m.cpu_ep_size}r0" if ep else ""))


def _ids(m, M):
    g = _gen(seed_of(f"align-{m.name}-M{M}"))
    _, ids = route(m, router_logits(m, M, g), routing_bias(m, g))
    return ids


@pytest.mark.parametrize("case", list(_cases()))
def test_moe_align_block_size(backend, case, repro, record):
    op = backend.ops.get("moe_align_block_size")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement moe_align_block_size")
    m, M, bs, ep = case
    record(component="align", model=m.name, tokens=M, scheme=f"bs{bs}")
    ids = _ids(m, M)
    emap = determine_expert_map(m.cpu_ep_size, 0, m.num_experts)[1] if ep else None
    cid = f"moe_align_block_size[{m.name}-M{M}-bs{bs}{'-ep' if ep else ''}]"
    ref_sorted, ref_eids, ref_n = ra.moe_align_block_size(ids, bs, m.num_experts, emap, ignore_invalid_experts=True)
    dev = backend.device
    kw = dict(ignore_invalid_experts=True) if _takes(op, "ignore_invalid_experts") else {}
    out_sorted, out_eids, out_n = op(ids.to(dev), bs, m.num_experts, None if emap is None else emap.to(dev), **kw)
    assert_exact(out_n.cpu(), ref_n, case=cid, what="num_tokens_post_padded", repro=repro)
    assert_exact(out_eids.cpu(), ref_eids, case=cid, what="expert_ids (one per block, -1 unused)", repro=repro)
    assert_same_blocks(out_sorted.cpu(), ref_sorted, bs, case=cid,
                       what=f"sorted_token_ids (per-block sets; padding value {ids.numel()})", repro=repro)


def _needs_033(what: str) -> None:
    from reference.semantics import SemanticsVersion, current_semantics

    if current_semantics() < SemanticsVersion.V0_33:
        pytest.skip(f"{what} is vLLM 0.33's (not defined under --vllm-semantics 0.17)")


def _takes(op, name: str) -> bool:
    try:
        return name in inspect.signature(op).parameters
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("case", [c for c in _cases() if c.values[0][3] and c.values[0][2] == BLOCK_SIZES[0]])
def test_moe_align_block_size_legacy_mode_and_scatter_idx(backend, case, repro, record):
    """vLLM 0.33's two switches: the legacy EP mode (global alignment, then ``expert_ids = expert_map[expert_ids]``,
    unused blocks' -1 wrapping to the map's last entry) and the scatter index (ignore mode)."""
    _needs_033("moe_align_block_size(return_scatter_idx=True)")
    op = backend.ops.get("moe_align_block_size")
    if op is None or not (_takes(op, "ignore_invalid_experts") and _takes(op, "return_scatter_idx")):
        pytest.skip(f"backend {backend.name}'s moe_align_block_size does not take vLLM 0.33's ignore_invalid_experts "
                    "/ return_scatter_idx (its map mode is ignore_invalid_experts=True)")
    m, M, bs, _ = case
    record(component="align", model=m.name, tokens=M, scheme=f"bs{bs}-legacy")
    ids = _ids(m, M)
    emap = determine_expert_map(m.cpu_ep_size, m.cpu_ep_size - 1, m.num_experts)[1]  # last rank: map[-1] >= 0
    dev = backend.device
    cid = f"moe_align_block_size_legacy[{m.name}-M{M}-bs{bs}]"
    ref = ra.moe_align_block_size(ids, bs, m.num_experts, emap, ignore_invalid_experts=False)
    out = op(ids.to(dev), bs, m.num_experts, emap.to(dev), ignore_invalid_experts=False)
    assert_exact(out[2].cpu(), ref[2], case=cid, what="num_tokens_post_padded (non-local routes counted)",
                 repro=repro)
    assert_exact(out[1].cpu(), ref[1], case=cid, what="expert_ids (mapped after alignment)", repro=repro)
    assert_same_blocks(out[0].cpu(), ref[0], bs, case=cid, what="sorted_token_ids (per-block sets)", repro=repro)
    ref_sc = ra.moe_align_block_size(ids, bs, m.num_experts, emap, ignore_invalid_experts=True,
                                     return_scatter_idx=True)[3]
    out_sc = op(ids.to(dev), bs, m.num_experts, emap.to(dev), ignore_invalid_experts=True, return_scatter_idx=True)[3]
    assert_exact(out_sc.cpu(), ref_sc, case=cid, what="scatter_idx ((numel, 1) int32, -1 = dropped)", repro=repro)


@pytest.mark.parametrize("M,topk,bs,local_e,rank,frac", [
    (1, 16, 64, 28, 1, 1.0), (7, 8, 16, 32, 0, 0.75), (64, 16, 64, 28, 3, 0.5), (257, 6, 128, 28, 2, 0.75)])
def test_fused_globalize_align_block_size(backend, M, topk, bs, local_e, rank, frac, repro, record):
    """The DeepEP-v2 INDEXED decode chain in one op (vLLM 0.33 ``fused_globalize_align_block_size``): received local
    ids in ``[-1, local_e)``, rows past ``psum_recv_per_rank[-1]`` padding; the globalized ids, counts, block owners
    and scatter index exactly, the routes per block as sets (the kernel fills with atomics)."""
    _needs_033("fused_globalize_align_block_size")
    op = backend.ops.get("fused_globalize_align_block_size")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement fused_globalize_align_block_size (vLLM 0.33)")
    record(component="align", tokens=M, scheme=f"fused_globalize-bs{bs}")
    g = _gen(seed_of(f"fgas-{M}-{topk}-{bs}-{local_e}-{rank}"))
    idx = torch.randint(-1, local_e, (M, topk), generator=g, dtype=torch.int64)
    psum = torch.tensor([0, 0, 0, round(M * frac)], dtype=torch.int32)
    gne, reo = 4 * local_e, rank * local_e
    ref = ra.fused_globalize_align_block_size(idx.clone(), psum, reo, gne, local_e, bs, return_scatter_idx=True)
    dev = backend.device
    out = op(idx.clone().to(dev), psum.to(dev), reo, gne, local_e, bs, return_scatter_idx=True)
    cid = f"fused_globalize_align_block_size[M{M}-k{topk}-bs{bs}-E{local_e}-r{rank}]"
    assert_exact(out[0].cpu(), ref[0], case=cid, what="globalized recv_topk_idx (-1 = invalid)", repro=repro)
    assert_exact(out[3].cpu(), ref[3], case=cid, what="num_tokens_post_pad", repro=repro)
    assert_exact(out[2].cpu(), ref[2], case=cid, what="expert_ids (local, -1 unused)", repro=repro)
    assert_same_blocks(out[1].cpu(), ref[1], bs, case=cid, what=f"sorted_ids (per-block sets; padding {M * topk})",
                       repro=repro)
    assert_exact(out[4].cpu(), ref[4], case=cid, what="scatter_idx", repro=repro)


@pytest.mark.parametrize("case", [c for c in _cases() if c.values[0][2] == BLOCK_SIZES[0]])
def test_count_expert_num_tokens(backend, case, repro, record):
    op = backend.ops.get("count_expert_num_tokens")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement count_expert_num_tokens")
    m, M, _, ep = case
    record(component="align", model=m.name, tokens=M, scheme="count")
    ids = _ids(m, M)
    n_local = m.local_num_experts if ep else m.num_experts
    emap = determine_expert_map(m.cpu_ep_size, 0, m.num_experts)[1] if ep else None
    ref = ra.count_expert_num_tokens(ids, n_local, emap)
    dev = backend.device
    out = op(ids.to(dev), n_local, None if emap is None else emap.to(dev))
    assert_exact(out.cpu(), ref, case=f"count_expert_num_tokens[{m.name}-M{M}]", what="expert_num_tokens",
                 repro=repro)


@pytest.mark.parametrize("case", [c for c in _cases() if c.values[0][2] == BLOCK_SIZES[0] and c.values[0][1] != 256])
def test_moe_permute_unpermute(backend, case, tolerances, repro, record):
    """vLLM's ``moe_permute`` / ``moe_unpermute`` (CUTLASS grouped-GEMM layout): offsets, inverse and permuted
    indices exactly, the written rows and per-row scales bit-exactly; the unpermute (rows past the valid count
    poisoned with NaN, never read) within the activation ulps of its fp32 sum (one rounding to bf16)."""
    op_p, op_u = backend.ops.get("moe_permute"), backend.ops.get("moe_unpermute")
    if op_p is None or op_u is None:
        pytest.skip(f"backend {backend.name} does not implement vLLM's moe_permute / moe_unpermute")
    m, M, _, ep = case
    record(component="align", model=m.name, tokens=M, scheme="moe_permute")
    ids = _ids(m, M)
    K = 64
    g = _gen(seed_of(f"moe_permute-{m.name}-M{M}-{ep}"))
    h = torch.randn(M, K, generator=g).to(torch.bfloat16)
    scale = torch.rand(M, K // 32, generator=g)
    n_local, emap = (m.local_num_experts, determine_expert_map(m.cpu_ep_size, 0, m.num_experts)[1]) if ep \
        else (m.num_experts, None)
    dev = backend.device
    cid = f"moe_permute[{m.name}-M{M}{'-ep' if ep else ''}]"
    ref = ra.moe_permute(h, scale, ids, m.num_experts, n_local, emap)
    out = op_p(h.to(dev), scale.to(dev), ids.to(dev), m.num_experts, n_local, None if emap is None else emap.to(dev))
    valid = int(ref[2][-1]) if emap is not None else h.size(0) * ids.size(1)
    for i, what in ((2, "expert_first_token_offset"), (3, "inv_permuted_idx"), (4, "permuted_idx")):
        assert_exact(out[i].cpu(), ref[i], case=cid, what=what, repro=repro)
    assert_exact(out[0][:valid].cpu(), ref[0][:valid], case=cid, what="permuted rows (valid)", repro=repro)
    assert_exact(out[1].cpu(), ref[1], case=cid, what="permuted a1q_scale", repro=repro)
    w = torch.rand(M, ids.size(1), generator=g)
    x = torch.randn(ref[0].shape, generator=g).to(torch.bfloat16)
    if emap is not None:
        x[valid:] = float("nan")  # not local: must not be read
    exp = ra.moe_unpermute(torch.empty_like(h), x, w, ref[3], ref[2])
    got = op_u(torch.empty_like(h).to(dev), x.to(dev), w.to(dev), ref[3].to(dev), ref[2].to(dev))
    assert_ulps(got.cpu(), exp, tolerances["activation"]["ulps"]["bfloat16"], case=cid,
                what="moe_unpermute output", repro=repro)
