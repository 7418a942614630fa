"""Alignment conformance: ``moe_align_block_size`` and ``count_expert_num_tokens`` against ``reference.align``,
exactly, on real routing shapes (every model's E and topk, with and without an EP expert_map).

``sorted_token_ids`` is compared per block as a set (a GPU kernel fills an expert's slots with atomics, so the
order inside a block is not defined); everything else (block owners, padding value, padded count) exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conformance.cases import seed_of
from conformance.inputs import _gen, route, router_logits, routing_bias
from conformance.metrics import assert_exact, assert_same_blocks
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
    ref_sorted, ref_eids, ref_n = ra.moe_align_block_size(ids, bs, m.num_experts, emap)
    dev = backend.device
    out_sorted, out_eids, out_n = op(ids.to(dev), bs, m.num_experts, None if emap is None else emap.to(dev))
    assert_exact(out_n.cpu(), ref_n, case=cid, what="num_tokens_post_padded", repro=repro)
    assert_exact(out_eids.cpu(), ref_eids, case=cid, what="expert_ids (one per block, -1 unused)", repro=repro)
    assert_same_blocks(out_sorted.cpu(), ref_sorted, bs, case=cid,
                       what=f"sorted_token_ids (per-block sets; padding value {ids.numel()})", repro=repro)


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
