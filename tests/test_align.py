"""Tests of reference.align against hand-computed literals and independent pure-python oracles.

The oracles below use only python lists and dicts (no torch ops on the data), so they share no code path with the
reference (which groups with torch masks / nonzero and scatters with index_put).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.align import (
    _valid_deep_gemm_shape,
    compute_aligned_M_and_alignment,
    count_expert_num_tokens,
    deepgemm_moe_permute,
    deepgemm_unpermute_and_reduce,
    max_num_tokens_padded,
    moe_align_block_size,
    valid_deep_gemm,
)

I32 = torch.int32


def t32(x):
    return torch.tensor(x, dtype=I32)


# --------------------------------------------------------------------------------------------------------------
# independent oracles (pure python)
# --------------------------------------------------------------------------------------------------------------


def oracle_local_expert(route_id: int, num_ids: int, expert_map: list[int] | None) -> int | None:
    """Local expert of one route, or None when it is dropped (-1, out of range with dropping, non-local)."""
    if route_id == -1 or route_id < 0 or route_id >= num_ids:
        return None
    if expert_map is None:
        return route_id
    mapped = expert_map[route_id]
    return None if mapped == -1 else mapped


def oracle_groups(topk_ids: list[list[int]], num_ids: int, expert_map: list[int] | None) -> dict[int, list[int]]:
    """local expert -> flat route indices, in the order the routes are met (increasing flat index)."""
    groups: dict[int, list[int]] = {}
    flat = 0
    for row in topk_ids:
        for rid in row:
            e = oracle_local_expert(rid, num_ids, expert_map)
            if e is not None:
                groups.setdefault(e, []).append(flat)
            flat += 1
    return groups


def oracle_align(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False):
    numel = sum(len(r) for r in topk_ids)
    length = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        while length % block_size:
            length += 1
    if numel < num_experts:
        length = min(length, numel * block_size)
    groups = oracle_groups(topk_ids, num_experts, expert_map)
    sorted_ids: list[int] = []
    blocks: list[int] = []
    for e in sorted(groups):
        chunk = list(groups[e])
        while len(chunk) % block_size:
            chunk.append(numel)
        sorted_ids += chunk
        blocks += [e] * (len(chunk) // block_size)
    post = len(sorted_ids)
    sorted_ids += [numel] * (length - post)
    num_blocks = (length + block_size - 1) // block_size
    blocks += [-1] * (num_blocks - len(blocks))
    return sorted_ids, blocks, post


# --------------------------------------------------------------------------------------------------------------
# moe_align_block_size: hand-computed examples
# --------------------------------------------------------------------------------------------------------------


def test_align_hand_example():
    # flat routes: 0->e0, 1->e1, 2->e1, 3->e2, 4->e0, 5->e2; numel = 6; length = 6 + 4*3 = 18; 5 blocks.
    s, e, n = moe_align_block_size(t32([[0, 1], [1, 2], [0, 2]]), block_size=4, num_experts=4)
    assert s.dtype == e.dtype == n.dtype == I32
    assert s.tolist() == [0, 4, 6, 6, 1, 2, 6, 6, 3, 5, 6, 6, 6, 6, 6, 6, 6, 6]
    assert e.tolist() == [0, 1, 2, -1, -1]  # unused blocks -1 (vLLM #35161), not 0
    assert n.shape == (1,) and n.tolist() == [12]


def test_align_hand_example_pad_sorted_ids():
    s, e, n = moe_align_block_size(t32([[0, 1], [1, 2], [0, 2]]), 4, 4, pad_sorted_ids=True)
    # 18 rounded up to 20
    assert s.tolist() == [0, 4, 6, 6, 1, 2, 6, 6, 3, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6]
    assert e.tolist() == [0, 1, 2, -1, -1]
    assert n.tolist() == [12]


def test_align_vllm_docstring_example():
    # vLLM's docstring example (it says num_experts=4 but uses id 4; 5 experts are meant).
    topk = t32([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    s, e, n = moe_align_block_size(topk, 4, 5)
    assert s.tolist()[:16] == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert s.tolist()[16:] == [12] * 11  # length 12 + 5*3 = 27
    assert e.tolist() == [1, 2, 3, 4, -1, -1, -1]
    assert n.tolist() == [16]


def test_align_cap_when_fewer_routes_than_experts():
    # numel = 2 < 8 experts: length min(2 + 8*3, 2*4) = 8
    s, e, n = moe_align_block_size(t32([[3], [1]]), 4, 8)
    assert s.tolist() == [1, 2, 2, 2, 0, 2, 2, 2]
    assert e.tolist() == [1, 3]
    assert n.tolist() == [8]


def test_align_minus_one_dropped():
    # flat [0, -1, -1, 1], numel 4, length 4 + 2*1 = 6
    s, e, n = moe_align_block_size(t32([[0, -1], [-1, 1]]), 2, 2)
    assert s.tolist() == [0, 4, 3, 4, 4, 4]
    assert e.tolist() == [0, 1, -1]
    assert n.tolist() == [4]


def test_align_expert_map_drops_non_local():
    # global 1 -> local 0, global 3 -> local 1; flat [0,1,1,2,0,3]: local routes 1,2 (e0) and 5 (e1)
    emap = t32([-1, 0, -1, 1])
    s, e, n = moe_align_block_size(t32([[0, 1], [1, 2], [0, 3]]), 4, 4, expert_map=emap,
                                   ignore_invalid_experts=True)
    assert s.tolist() == [1, 2, 6, 6, 5, 6, 6, 6] + [6] * 10
    assert e.tolist() == [0, 1, -1, -1, -1]
    assert n.tolist() == [8]


def test_align_expert_map_orders_by_local_id():
    # global 0 -> local 1, global 2 -> local 0: local expert 0 (global 2) comes first
    emap = t32([1, -1, 0, -1])
    s, e, n = moe_align_block_size(t32([[0, 1], [1, 2], [0, 2]]), 4, 4, expert_map=emap,
                                   ignore_invalid_experts=True)
    assert s.tolist() == [3, 5, 6, 6, 0, 4, 6, 6] + [6] * 10
    assert e.tolist() == [0, 1, -1, -1, -1]
    assert n.tolist() == [8]


def test_align_out_of_range_ids():
    with pytest.raises(ValueError, match="outside"):
        moe_align_block_size(t32([[0, 5]]), 2, 4)
    with pytest.raises(ValueError, match="drop_out_of_range_ids"):
        moe_align_block_size(t32([[0, -2]]), 2, 4)
    # dropping: same as the -1 sentinel; numel stays 2 (padding value)
    s, e, n = moe_align_block_size(t32([[0, 5]]), 2, 4, drop_out_of_range_ids=True)
    assert s.tolist() == [0, 2, 2, 2] and e.tolist() == [0, -1] and n.tolist() == [2]
    # with a map, the id space is the map's
    with pytest.raises(ValueError, match="outside"):
        moe_align_block_size(t32([[4]]), 2, 4, expert_map=t32([0, 1, -1, -1]))


def test_align_empty_batch():
    s, e, n = moe_align_block_size(torch.empty((0, 8), dtype=I32), 16, 64)
    assert s.shape == (0,) and e.shape == (0,) and n.tolist() == [0]
    s, e, n = moe_align_block_size(torch.empty((0, 8), dtype=I32), 16, 64, pad_sorted_ids=True)
    assert s.shape == (0,) and e.shape == (0,) and n.tolist() == [0]


def test_align_int64_ids_accepted():
    s, _, _ = moe_align_block_size(torch.tensor([[1, 0]], dtype=torch.int64), 2, 2)
    assert s.tolist() == [1, 2, 0, 2]


def test_max_num_tokens_padded_values():
    assert max_num_tokens_padded(6, 4, 4) == 18
    assert max_num_tokens_padded(6, 4, 4, pad_sorted_ids=True) == 20
    assert max_num_tokens_padded(2, 8, 4) == 8
    assert max_num_tokens_padded(3, 8, 4, pad_sorted_ids=True) == 12
    assert max_num_tokens_padded(0, 8, 4) == 0
    assert max_num_tokens_padded(4096 * 8, 256, 64) == 32768 + 256 * 63


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(topk_ids=t32([0, 1]), block_size=4, num_experts=4), "2-D"),
        (dict(topk_ids=torch.tensor([[0.0, 1.0]]), block_size=4, num_experts=4), "signed integer"),
        (dict(topk_ids=torch.tensor([[0, 1]], dtype=torch.uint8), block_size=4, num_experts=4), "signed integer"),
        (dict(topk_ids=t32([[0, 1]]), block_size=0, num_experts=4), "block_size"),
        (dict(topk_ids=t32([[0, 1]]), block_size=-4, num_experts=4), "block_size"),
        (dict(topk_ids=t32([[0, 1]]), block_size=True, num_experts=4), "block_size"),
        (dict(topk_ids=t32([[0, 1]]), block_size=4, num_experts=0), "num_experts"),
        (dict(topk_ids=t32([[0, 1]]), block_size=4, num_experts=4, expert_map=t32([0, 1, -1])), "shape"),
        (dict(topk_ids=t32([[0, 1]]), block_size=4, num_experts=4, expert_map=t32([[0, 1, 2, 3]])), "1-D"),
        (dict(topk_ids=t32([[0, 1]]), block_size=4, num_experts=4, expert_map=t32([0, 0, -1, -1])), "same local"),
        (dict(topk_ids=t32([[0, 1]]), block_size=4, num_experts=4, expert_map=t32([0, -3, -1, -1])), "expert_map"),
        (dict(topk_ids=t32([[0, 1]]), block_size=4, num_experts=4, expert_map=t32([0, 4, -1, -1])), "expert_map"),
    ],
)
def test_align_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        moe_align_block_size(**kwargs)


# --------------------------------------------------------------------------------------------------------------
# count_expert_num_tokens
# --------------------------------------------------------------------------------------------------------------


def test_count_hand():
    c = count_expert_num_tokens(t32([[0, 1], [1, 2], [0, 2]]), 4)
    assert c.dtype == I32 and c.tolist() == [2, 2, 2, 0]
    assert count_expert_num_tokens(t32([[0, -1], [-1, -1]]), 2).tolist() == [1, 0]
    assert count_expert_num_tokens(torch.empty((0, 4), dtype=I32), 3).tolist() == [0, 0, 0]


def test_count_expert_map():
    # 4 global experts, local: global 1 -> 0, global 3 -> 1
    c = count_expert_num_tokens(t32([[0, 1], [1, 2], [0, 3]]), 2, t32([-1, 0, -1, 1]))
    assert c.tolist() == [2, 1]


def test_count_errors():
    with pytest.raises(ValueError, match="outside"):
        count_expert_num_tokens(t32([[0, 3]]), 3)
    assert count_expert_num_tokens(t32([[0, 3]]), 3, drop_out_of_range_ids=True).tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match="outside"):  # id beyond the map (vLLM #48371-style out-of-bounds read)
        count_expert_num_tokens(t32([[4]]), 2, t32([-1, 0, -1, 1]))
    with pytest.raises(ValueError, match="expert_map"):  # local id 2 does not exist with 2 local experts
        count_expert_num_tokens(t32([[1]]), 2, t32([-1, 2, -1, 1]))
    with pytest.raises(ValueError, match="signed integer"):
        count_expert_num_tokens(torch.tensor([[0.0]]), 2)


# --------------------------------------------------------------------------------------------------------------
# compute_aligned_M_and_alignment
# --------------------------------------------------------------------------------------------------------------


def test_compute_aligned_M_worst_case():
    # 3*2 = 6 routes; min(6, 4) = 4 active; 6 + 4*3 = 18 -> 20
    assert compute_aligned_M_and_alignment(3, 2, 4, 4) == (20, 4)
    # decode: 1 token, top-8 of 256 local experts, align 128: 8 + 8*127 = 1024 (not 8 + 256*127)
    assert compute_aligned_M_and_alignment(1, 8, 256, 128) == (1024, 128)
    assert compute_aligned_M_and_alignment(0, 8, 16, 128) == (0, 128)


def test_compute_aligned_M_many_tokens():
    # min(800, 16) = 16 active: 800 + 16*127 = 2832 -> round_up(2832, 128) = 2944
    assert compute_aligned_M_and_alignment(100, 8, 16, 128) == (2944, 128)


def test_compute_aligned_M_cpu_counts():
    meta = SimpleNamespace(expert_num_tokens=t32([2, 2, 2, 0]), expert_num_tokens_cpu=t32([2, 2, 2, 0]))
    assert compute_aligned_M_and_alignment(3, 2, 4, 4, meta) == (12, 4)
    meta = SimpleNamespace(expert_num_tokens=None, expert_num_tokens_cpu=[129, 0, 1])
    assert compute_aligned_M_and_alignment(65, 2, 3, 128, meta) == (256 + 0 + 128, 128)
    # no CPU counts: the worst-case formula
    meta = SimpleNamespace(expert_num_tokens=t32([2, 2, 2, 0]), expert_num_tokens_cpu=None)
    assert compute_aligned_M_and_alignment(3, 2, 4, 4, meta) == (20, 4)


def test_compute_aligned_M_per_call_alignment():
    # 8 + 8*63 = 512
    assert compute_aligned_M_and_alignment(1, 8, 256, 128, per_call_alignment=64) == (512, 64)
    # larger than alignment: ignored
    assert compute_aligned_M_and_alignment(1, 8, 256, 128, per_call_alignment=256) == (1024, 128)
    # CPU counts win: exact size at the caller's alignment
    meta = SimpleNamespace(expert_num_tokens=None, expert_num_tokens_cpu=[1, 0])
    assert compute_aligned_M_and_alignment(1, 1, 2, 128, meta, per_call_alignment=64) == (128, 128)


def test_compute_aligned_M_errors():
    with pytest.raises(ValueError, match="alignment"):
        compute_aligned_M_and_alignment(3, 2, 4, 0)
    with pytest.raises(ValueError, match="M"):
        compute_aligned_M_and_alignment(-1, 2, 4, 4)
    with pytest.raises(ValueError, match="expert_num_tokens_cpu"):
        compute_aligned_M_and_alignment(3, 2, 4, 4, SimpleNamespace(expert_num_tokens_cpu=[1, 2]))
    with pytest.raises(ValueError, match="expert_num_tokens_cpu"):
        compute_aligned_M_and_alignment(3, 2, 2, 4, SimpleNamespace(expert_num_tokens_cpu=[-1, 2]))


# --------------------------------------------------------------------------------------------------------------
# deepgemm_moe_permute / deepgemm_unpermute_and_reduce: hand examples
# --------------------------------------------------------------------------------------------------------------

TOPK_3x2 = [[0, 1], [1, 2], [0, 2]]


def test_permute_hand_example():
    aq = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    scale = torch.tensor([[10.0], [20.0], [30.0]])
    perm, sperm, eids, inv, align = deepgemm_moe_permute(aq, scale, t32(TOPK_3x2), 4, alignment=4, block_size=2)
    # M_sum = 20 (worst case); e0 rows 0-1 (t0, t2), e1 rows 4-5 (t0, t1), e2 rows 8-9 (t1, t2)
    assert align == 4
    assert eids.dtype == I32
    assert eids.tolist() == [0, 0, -1, -1, 1, 1, -1, -1, 2, 2, -1, -1] + [-1] * 8
    assert inv.dtype == I32 and inv.tolist() == [[0, 4], [5, 8], [1, 9]]
    expected = [[0.0, 0.0]] * 20
    for row, tok in [(0, 0), (1, 2), (4, 0), (5, 1), (8, 1), (9, 2)]:
        expected[row] = aq[tok].tolist()
    assert perm.tolist() == expected
    assert sperm.dtype == torch.float32
    assert sperm.flatten().tolist() == [10, 30, 0, 0, 10, 20, 0, 0, 20, 30] + [0] * 10


def test_permute_with_cpu_counts_is_exact_size():
    aq = torch.tensor([[1.0], [2.0], [3.0]])
    meta = SimpleNamespace(expert_num_tokens=t32([2, 2, 2, 0]), expert_num_tokens_cpu=t32([2, 2, 2, 0]))
    perm, sperm, eids, inv, align = deepgemm_moe_permute(aq, None, t32(TOPK_3x2), 4, None, meta, alignment=4)
    assert sperm is None and align == 4
    assert eids.tolist() == [0, 0, -1, -1, 1, 1, -1, -1, 2, 2, -1, -1]
    assert perm.flatten().tolist() == [1, 3, 0, 0, 1, 2, 0, 0, 2, 3, 0, 0]


def test_permute_expert_map_hand():
    # global 1 -> local 0, global 3 -> local 1; routes (0,1),(1,0) -> e0; (2,1) -> e1; others non-local
    aq = torch.tensor([[1.0], [2.0], [3.0]])
    topk = t32([[0, 1], [1, 2], [0, 3]])
    perm, _, eids, inv, align = deepgemm_moe_permute(aq, None, topk, 2, t32([-1, 0, -1, 1]), alignment=2)
    # M_sum: 6 + min(6, 2)*1 = 8
    assert eids.tolist() == [0, 0, 1, -1, -1, -1, -1, -1]
    assert inv.tolist() == [[-1, 0], [1, -1], [-1, 2]]
    assert perm.flatten().tolist() == [1, 2, 3, 0, 0, 0, 0, 0]


def test_permute_fp8_rows_bit_exact_and_aq_out_overwritten():
    bits = torch.tensor([[0x01, 0x7E], [0xFE, 0x38]], dtype=torch.uint8)  # includes +-448 and a subnormal
    aq = bits.view(torch.float8_e4m3fn)
    # M_sum = 4 + min(4, 2) * 127 = 258 -> 384 with alignment 128
    aq_out = torch.full((384, 2), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # poisoned with NaN
    perm, _, eids, inv, _ = deepgemm_moe_permute(aq, None, t32([[1, 0], [0, 1]]), 2, aq_out=aq_out)
    assert perm.data_ptr() == aq_out.data_ptr()
    pb = perm.view(torch.uint8)
    assert inv.tolist() == [[128, 0], [1, 129]]
    assert pb[0].tolist() == [0x01, 0x7E] and pb[1].tolist() == [0xFE, 0x38]
    assert pb[128].tolist() == [0x01, 0x7E] and pb[129].tolist() == [0xFE, 0x38]
    others = [r for r in range(384) if r not in (0, 1, 128, 129)]
    assert pb[others].eq(0).all()
    assert eids[:2].tolist() == [0, 0] and eids[128:130].tolist() == [1, 1]
    assert (eids[2:128] == -1).all() and (eids[130:] == -1).all()


def test_permute_errors():
    aq = torch.ones(3, 4)
    with pytest.raises(ValueError, match="stale|count_expert_num_tokens"):
        meta = SimpleNamespace(expert_num_tokens=t32([3, 1, 2, 0]), expert_num_tokens_cpu=None)
        deepgemm_moe_permute(aq, None, t32(TOPK_3x2), 4, expert_tokens_meta=meta, alignment=4)
    with pytest.raises(ValueError, match="aq_out"):
        deepgemm_moe_permute(aq, None, t32(TOPK_3x2), 4, aq_out=torch.empty(3, 4), alignment=4)
    with pytest.raises(ValueError, match="aq_scale"):
        deepgemm_moe_permute(aq, torch.ones(3, 1), t32(TOPK_3x2), 4, alignment=4, block_size=2)
    with pytest.raises(ValueError, match="rows"):
        deepgemm_moe_permute(aq, None, t32([[0, 1]]), 4)
    with pytest.raises(ValueError, match="outside"):  # id 4 with 4 local experts and no map
        deepgemm_moe_permute(aq, None, t32([[0, 1], [1, 4], [0, 2]]), 4)


def test_unpermute_hand_example():
    # a rows: row r holds [r, 10r]; routes: (0,0)->row 0, (0,1)->row 4, (1,0)->row 5, (1,1) non-local (-1 id)
    a = torch.tensor([[float(r), 10.0 * r] for r in range(8)])
    topk = t32([[0, 1], [1, -1]])
    w = torch.tensor([[0.5, 0.25], [2.0, 100.0]])
    inv = t32([[0, 4], [5, 7]])  # inv[1,1] is ignored (route dropped)
    out = torch.full((2, 2), float("nan"))
    res = deepgemm_unpermute_and_reduce(a, topk, w, inv, None, out)
    assert res is out
    # token 0: 0.5*[0,0] + 0.25*[4,40] = [1, 10]; token 1: 2*[5,50] = [10, 100]
    assert out.tolist() == [[1.0, 10.0], [10.0, 100.0]]


def test_unpermute_non_local_and_empty_tokens():
    a = torch.tensor([[1.0], [2.0]])
    emap = t32([0, -1])  # global 1 on another rank
    topk = t32([[0, 1], [1, 1]])
    out = torch.full((2, 1), float("nan"), dtype=torch.bfloat16)
    deepgemm_unpermute_and_reduce(a, topk, torch.ones(2, 2), t32([[1, -1], [-1, -1]]), emap, out)
    assert out.float().tolist() == [[2.0], [0.0]]  # token 1 has no local route: written as 0


def test_unpermute_errors():
    a = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="inv_perm"):  # local route with no row
        deepgemm_unpermute_and_reduce(a, t32([[0]]), torch.ones(1, 1), t32([[-1]]), None, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="inv_perm"):  # row beyond a
        deepgemm_unpermute_and_reduce(a, t32([[0]]), torch.ones(1, 1), t32([[4]]), None, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="output"):
        deepgemm_unpermute_and_reduce(a, t32([[0]]), torch.ones(1, 1), t32([[0]]), None, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="outside"):
        deepgemm_unpermute_and_reduce(a, t32([[2]]), torch.ones(1, 1), t32([[0]]), t32([0, 1]), torch.zeros(1, 2))
    # dropping without a map: a route the permute dropped (inv_perm -1) contributes nothing
    out = torch.full((1, 2), 7.0)
    deepgemm_unpermute_and_reduce(a, t32([[9]]), torch.ones(1, 1), t32([[-1]]), None, out, drop_out_of_range_ids=True)
    assert out.tolist() == [[0.0, 0.0]]


def test_permute_drop_then_unpermute_zero_experts():
    # ids >= local experts (zero experts) dropped consistently by both halves
    aq = torch.tensor([[1.0], [2.0]])
    topk = t32([[0, 5], [5, 1]])
    perm, _, eids, inv, _ = deepgemm_moe_permute(aq, None, topk, 2, alignment=2, drop_out_of_range_ids=True)
    assert inv.tolist() == [[0, -1], [-1, 2]]
    out = torch.empty(2, 1)
    deepgemm_unpermute_and_reduce(perm, topk, torch.tensor([[1.0, 9.0], [9.0, 3.0]]), inv, None, out,
                                  drop_out_of_range_ids=True)
    assert out.tolist() == [[1.0], [6.0]]


# --------------------------------------------------------------------------------------------------------------
# valid_deep_gemm (seed 001 rules)
# --------------------------------------------------------------------------------------------------------------


def _fp8(*shape):
    return torch.zeros(shape, dtype=torch.float8_e4m3fn)


def test_valid_deep_gemm_shape():
    assert _valid_deep_gemm_shape(128, 640, 128)
    assert not _valid_deep_gemm_shape(127, 640, 128)
    assert not _valid_deep_gemm_shape(128, 600, 128)
    assert not _valid_deep_gemm_shape(128, 640, 100)
    assert _valid_deep_gemm_shape(64, 64, 64, alignment=64)


def test_valid_deep_gemm_rules():
    hs = torch.zeros(128, 256, dtype=torch.bfloat16)
    w1, w2 = _fp8(2, 1280, 256), _fp8(2, 256, 640)  # N = w2.size(2) = 640 > 512
    assert valid_deep_gemm(hs, w1, w2) == (True, None)
    ok, why = valid_deep_gemm(hs[:127], w1, w2)
    assert not ok and "M=127" in why
    ok, why = valid_deep_gemm(hs, _fp8(2, 1024, 256), _fp8(2, 256, 512))  # N = 512
    assert not ok and "512" in why
    ok, why = valid_deep_gemm(hs, w1, _fp8(2, 256, 600))  # N not a multiple of 128
    assert not ok and "N=600" in why
    ok, why = valid_deep_gemm(hs, w1, w2.to(torch.bfloat16))
    assert not ok and "float8_e4m3fn" in why
    ok, why = valid_deep_gemm(torch.zeros(256, 128, dtype=torch.bfloat16).t(), w1, w2)  # (128, 256) non-contiguous
    assert not ok and "contiguous" in why
    with pytest.raises(ValueError):
        valid_deep_gemm(hs, w1[0], w2)


# --------------------------------------------------------------------------------------------------------------
# properties against the oracles (hypothesis)
# --------------------------------------------------------------------------------------------------------------


@st.composite
def routing_problems(draw):
    num_experts = draw(st.integers(1, 10))
    M = draw(st.integers(0, 9))
    topk = draw(st.integers(1, 4))
    ids = draw(
        st.lists(st.lists(st.integers(-1, num_experts - 1), min_size=topk, max_size=topk), min_size=M, max_size=M)
    )
    expert_map = None
    if draw(st.booleans()):
        held = draw(st.lists(st.booleans(), min_size=num_experts, max_size=num_experts))
        globals_held = [g for g in range(num_experts) if held[g]]
        local_ids = draw(st.permutations(list(range(len(globals_held)))))
        expert_map = [-1] * num_experts
        for g, l in zip(globals_held, local_ids):
            expert_map[g] = l
    return ids, topk, num_experts, expert_map


def _topk_tensor(ids, topk):
    return torch.tensor(ids, dtype=I32).reshape(len(ids), topk)


PROP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(routing_problems(), st.sampled_from([1, 2, 3, 4, 8, 16]), st.booleans())
def test_align_matches_oracle_and_properties(problem, block_size, pad):
    ids, topk, E, emap = problem
    topk_ids = _topk_tensor(ids, topk)
    emap_t = None if emap is None else torch.tensor(emap, dtype=I32)
    s, e, n = moe_align_block_size(topk_ids, block_size, E, emap_t, pad, ignore_invalid_experts=True)
    exp_s, exp_e, exp_n = oracle_align(ids, block_size, E, emap, pad)
    assert s.tolist() == exp_s
    assert e.tolist() == exp_e
    assert n.tolist() == [exp_n]

    # properties, checked on the output alone
    numel = len(ids) * topk
    s_l, e_l, post = s.tolist(), e.tolist(), n.item()
    groups = oracle_groups(ids, E, emap)
    local_routes = sorted(i for g in groups.values() for i in g)
    assert sorted(x for x in s_l if x != numel) == local_routes  # each local route exactly once
    assert all(x == numel for x in s_l[post:])  # tail is padding
    assert post % block_size == 0 and post <= len(s_l)
    if pad:
        assert len(s_l) % block_size == 0
    for b, exp_expert in enumerate(e_l):
        block = [x for x in s_l[b * block_size : (b + 1) * block_size] if x != numel]
        if b * block_size >= post:
            assert exp_expert == -1 and block == []  # unused blocks: -1, padding only
        else:
            assert exp_expert >= 0 and block  # used blocks hold >= 1 route ...
            assert all(x in groups[exp_expert] for x in block)  # ... all of one expert
    counts = count_expert_num_tokens(topk_ids, max(E, 1), emap_t)
    assert post == sum(-(-c // block_size) * block_size for c in counts.tolist())


@PROP
@given(routing_problems())
def test_count_matches_oracle(problem):
    ids, topk, E, emap = problem
    num_local = E if emap is None else max(1, sum(1 for x in emap if x >= 0))
    emap_t = None if emap is None else torch.tensor(emap, dtype=I32)
    got = count_expert_num_tokens(_topk_tensor(ids, topk), num_local, emap_t).tolist()
    groups = oracle_groups(ids, E, emap)
    assert got == [len(groups.get(e, [])) for e in range(num_local)]


@PROP
@given(routing_problems(), st.sampled_from([1, 2, 4, 8]), st.booleans(), st.integers(1, 3))
def test_permute_unpermute_roundtrip(problem, alignment, use_cpu_counts, K):
    ids, topk, E, emap = problem
    num_local = E if emap is None else max(1, sum(1 for x in emap if x >= 0))
    M = len(ids)
    topk_ids = _topk_tensor(ids, topk)
    emap_t = None if emap is None else torch.tensor(emap, dtype=I32)
    gen = torch.Generator().manual_seed(M * 131 + topk * 17 + E)
    aq = torch.randn(M, K, generator=gen)
    w = torch.rand(M, topk, generator=gen)
    groups = oracle_groups(ids, E, emap)
    counts = [len(groups.get(e, [])) for e in range(num_local)]
    meta = None
    if use_cpu_counts:
        meta = SimpleNamespace(expert_num_tokens=torch.tensor(counts, dtype=I32), expert_num_tokens_cpu=counts)

    perm, _, eids, inv, align = deepgemm_moe_permute(aq, None, topk_ids, num_local, emap_t, meta, alignment=alignment)
    M_sum = perm.shape[0]
    exact = sum(-(-c // alignment) * alignment for c in counts)
    if use_cpu_counts:
        assert M_sum == exact
    else:
        mt = M * topk
        assert M_sum == -(-(mt + min(mt, num_local) * (alignment - 1)) // alignment) * alignment
        assert exact <= M_sum
    assert align == alignment and M_sum % align == 0

    # layout: expert e's rows are contiguous, start at an aligned offset, hold its routes in flat order
    eids_l, inv_l = eids.tolist(), inv.tolist()
    start = 0
    for e in range(num_local):
        assert start % alignment == 0
        rows = list(range(start, start + counts[e]))
        assert [eids_l[r] for r in rows] == [e] * counts[e]
        assert [inv_l[f // topk][f % topk] for f in groups.get(e, [])] == rows
        for f, r in zip(groups.get(e, []), rows):
            assert torch.equal(perm[r], aq[f // topk])
        pad_rows = range(start + counts[e], start + -(-counts[e] // alignment) * alignment)
        assert all(eids_l[r] == -1 for r in pad_rows)
        assert all(not perm[r].any() for r in pad_rows)
        start += -(-counts[e] // alignment) * alignment
    assert all(x == -1 for x in eids_l[start:])
    local_flat = {f for g in groups.values() for f in g}
    assert all(inv_l[f // topk][f % topk] == -1 for f in range(M * topk) if f not in local_flat)

    # identity "experts": unpermute gives the weighted sum of the inputs over local routes
    out = torch.full((M, K), float("nan"))
    deepgemm_unpermute_and_reduce(perm, topk_ids, w, inv, emap_t, out)
    expected = [[0.0] * K for _ in range(M)]
    for f in sorted(local_flat):
        t, k = divmod(f, topk)
        for j in range(K):
            expected[t][j] += float(w[t, k]) * float(aq[t, j])
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32).reshape(M, K), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# vLLM 0.33: moe_align_block_size(ignore_invalid_experts, return_scatter_idx); fused_globalize_align_block_size
# --------------------------------------------------------------------------------------------------------------

from reference.align import fused_globalize_align_block_size, globalize_recv_topk_idx  # noqa: E402


def test_align_legacy_mode_by_hand():
    """ignore_invalid_experts=False (vLLM's default): align the 4 global experts, then map expert_ids; the unused
    5th block's -1 wraps to expert_map[-1] = 1 (torch indexing, vLLM #48371)."""
    emap = t32([-1, 0, -1, 1])
    s, e, n = moe_align_block_size(t32([[0, 1], [1, 2], [0, 3]]), 4, 4, expert_map=emap)
    assert s.tolist() == [0, 4, 6, 6, 1, 2, 6, 6, 3, 6, 6, 6, 5, 6, 6, 6, 6, 6]
    assert e.tolist() == [-1, 0, -1, 1, 1]
    assert n.tolist() == [16]
    _, e, _ = moe_align_block_size(t32([[0, 1], [1, 2], [0, 3]]), 4, 4, expert_map=t32([-1, 0, 1, -1]))
    assert e.tolist() == [-1, 0, 1, -1, -1]  # the last global expert is remote: -1 wraps to -1


def test_align_scatter_idx():
    ids = t32([[0, -1], [2, 1]])
    *_, sc = moe_align_block_size(ids, 2, 3, return_scatter_idx=True)
    assert sc.dtype == I32 and sc.tolist() == [[0], [-1], [2], [3]]
    emap = t32([0, -1, 1])
    *_, sc = moe_align_block_size(ids, 2, 3, emap, ignore_invalid_experts=True, return_scatter_idx=True)
    assert sc.tolist() == [[0], [-1], [2], [-1]]  # route 3 -> global 1: not local
    with pytest.raises(ValueError, match="requires ignore_invalid_experts"):
        moe_align_block_size(ids, 2, 3, emap, return_scatter_idx=True)
    assert len(moe_align_block_size(ids, 2, 3)) == 3


def _linear_map(gne, reo, local_e):
    m = torch.full((gne,), -1, dtype=I32)
    m[reo: reo + local_e] = torch.arange(local_e, dtype=I32)
    return m


@pytest.mark.parametrize("n,topk,block_size,local_e,rank,fill", [
    (1, 1, 16, 28, 0, "rand"), (7, 6, 32, 28, 2, "rand"), (64, 8, 64, 32, 3, "all_local"),
    (257, 16, 128, 28, 1, "rand"), (33, 8, 16, 32, 0, "all_nonlocal"), (20, 4, 16, 28, 3, "single")])
def test_fused_globalize_align_equals_the_chain_like_vllms_test(n, topk, block_size, local_e, rank, fill):
    """vLLM 0.33 test_fused_globalize_align_block_size.py::test_fused_matches_reference, re-derived: the fused
    result equals _globalize_recv_topk_idx + moe_align_block_size(ignore_invalid_experts=True) on the used prefix,
    the expert_ids tail is -1, the sorted tail is numel, and the per-expert route sets agree; scatter_idx too."""
    g = torch.Generator().manual_seed(n * 131 + topk)
    ep, gne, reo = 4, local_e * 4, rank * local_e
    if fill == "all_nonlocal":
        idx = torch.full((n, topk), -1, dtype=torch.int64)
    elif fill == "single":
        idx = torch.zeros((n, topk), dtype=torch.int64)
    elif fill == "all_local":
        idx = torch.randint(0, local_e, (n, topk), generator=g)
    else:
        idx = torch.randint(-1, local_e, (n, topk), generator=g)
    num_recv = round(n * 0.75)
    idx[num_recv:] = torch.randint(-1, local_e, (n - num_recv, topk), generator=g)
    psum = torch.zeros(ep, dtype=I32)
    psum[-1] = num_recv
    ref_global = globalize_recv_topk_idx(idx.clone(), psum, reo, gne)
    rs, re_, rn, rsc = moe_align_block_size(ref_global, block_size, gne, _linear_map(gne, reo, local_e),
                                            ignore_invalid_experts=True, return_scatter_idx=True)
    fg, fs, fe, fn, fsc = fused_globalize_align_block_size(idx.clone(), psum, reo, gne, local_e, block_size,
                                                           return_scatter_idx=True)
    total = n * topk
    assert torch.equal(fg, ref_global) and torch.equal(fn, rn) and torch.equal(fsc, rsc)
    nb = int(fn) // block_size
    assert torch.equal(fe[:nb], re_[:nb]) and bool((fe[nb:] == -1).all()) and bool((fs[int(fn):] == total).all())
    assert torch.equal(fs[: int(fn)], rs[: int(fn)])  # the reference's order is deterministic on both sides
    assert fs.numel() == max_num_tokens_padded(total, local_e, block_size)


def test_fused_globalize_drops_ids_past_the_local_range_and_validates():
    idx = torch.tensor([[3, 0]], dtype=torch.int64)  # local_e = 2: id 3 is not a local slot
    fg, s, e, n = fused_globalize_align_block_size(idx, torch.tensor([1], dtype=I32), 2, 8, 2, 2)
    assert fg.tolist() == [[-1, 2]] and n.tolist() == [2] and e.tolist()[0] == 0
    assert globalize_recv_topk_idx(torch.tensor([[3, 0]]), torch.tensor([1]), 2, 8).tolist() == [[5, 2]]
    with pytest.raises(ValueError, match="int64"):
        fused_globalize_align_block_size(idx.int(), torch.tensor([1]), 2, 8, 2, 2)
    with pytest.raises(ValueError, match="1024"):
        fused_globalize_align_block_size(idx, torch.tensor([1]), 0, 4096, 2048, 2)


# --------------------------------------------------------------------------------------------------------------
# vLLM's moe_permute / moe_unpermute (fused_moe/moe_permute_unpermute.py)
# --------------------------------------------------------------------------------------------------------------

from reference.align import moe_permute, moe_unpermute  # noqa: E402


def test_moe_permute_by_hand():
    """E=4, map: global 1 -> 0, global 2 -> 1 (others remote). Routes (flat): [2, 0 | 1, -1 | 3, 1]
    -> keys [1, 4, 0, 4, 7, 0]; stable order 2, 5, 0, 1, 3, 4; valid = 3."""
    h = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8)
    ids = t32([[2, 0], [1, -1], [3, 1]])
    emap = t32([-1, 0, 1, -1])
    ph, sc, off, inv, pidx = moe_permute(h, torch.arange(3.0).reshape(3, 1).expand(3, 2).contiguous(), ids, 4,
                                         2, emap)
    assert off.dtype == torch.int64 and off.tolist() == [0, 2, 3]
    assert inv.tolist() == [2, 3, 0, 4, 5, 1]
    assert pidx.tolist() == [2, 5, 0, 6, 6, 6]
    assert torch.equal(ph[:3], h[[1, 2, 0]]) and bool((ph[3:] == 0).all())
    assert sc[:, 0].tolist() == [1.0, 2.0, 0.0, 2.0, 2.0, 2.0]  # past valid: clamp(6 -> 5) // 2 = token 2
    # without a map every row is written, the -1 route last (key n_expert)
    ph, _, off, inv, pidx = moe_permute(h, None, t32([[2, 0], [1, -1], [3, 1]]), 4)
    assert off.tolist() == [0, 1, 3, 4, 5] and pidx.tolist() == [1, 2, 5, 0, 4, 3]
    assert torch.equal(ph, h[[0, 1, 2, 0, 2, 1]])


@pytest.mark.parametrize("n_token,n_expert,topk,ep_size,rank", [(1, 16, 2, 1, 0), (33, 64, 6, 4, 3),
                                                                (50, 16, 8, 16, 7), (17, 64, 8, 4, 0)])
def test_moe_permute_unpermute_like_vllms_test(n_token, n_expert, topk, ep_size, rank):
    """vLLM's tests/kernels/moe/test_moe_permute_unpermute.py oracle (torch_permute / torch_unpermute), re-derived:
    keys local id / id + n_expert, stable sort, offsets, inverse, valid rows bit-exact, the masked weighted sum."""
    from reference.routing import determine_expert_map

    g = torch.Generator().manual_seed(n_token * 7 + topk)
    n_hidden = 64
    h = torch.randn(n_token, n_hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_expert, generator=g)[:topk] for _ in range(n_token)]).to(I32)
    emap, n_local = None, n_expert
    if ep_size > 1:
        n_local, emap = determine_expert_map(ep_size, rank, n_expert)[:2]
    start = n_local * rank
    tk = ids.long()
    if emap is not None:
        local = emap.long()[tk] != -1
        tk = local * (tk - start) + (~local) * (tk + n_expert)
    sorted_ids, sorted_idx = torch.sort(tk.flatten(), stable=True)
    gold_off = torch.tensor([int((sorted_ids < e).sum()) for e in range(n_local + 1)])
    gold_inv = torch.sort(sorted_idx).indices
    ph, _, off, inv, _ = moe_permute(h, None, ids, n_expert, n_local, emap)
    assert torch.equal(off, gold_off) and torch.equal(inv.long(), gold_inv)
    valid = int(gold_off[-1])
    assert torch.equal(ph[:valid], h[sorted_idx[:valid] // topk])
    w = torch.rand(n_token, topk, generator=g)
    x = (0.5 * ph.float() + torch.randn(ph.shape, generator=g)).to(torch.bfloat16)
    out = moe_unpermute(torch.empty_like(h), x, w, inv, off)
    xm = x.clone()
    xm[valid:] = 0  # vLLM's torch_unpermute zeroes the invalid rows
    gold = (xm[inv.long()].view(-1, topk, n_hidden).double() * w.double().unsqueeze(2)).sum(1)
    torch.testing.assert_close(out.double(), gold.to(torch.bfloat16).double(), atol=0, rtol=2 ** -7)


def test_moe_unpermute_errors():
    with pytest.raises(ValueError, match="float32"):
        moe_unpermute(torch.empty(1, 8), torch.zeros(2, 8), torch.ones(1, 2, dtype=torch.bfloat16), t32([0, 1]))
    with pytest.raises(ValueError, match="dtype must be same"):
        moe_unpermute(torch.empty(1, 8, dtype=torch.bfloat16), torch.zeros(2, 8), torch.ones(1, 2), t32([0, 1]))
    with pytest.raises(ValueError, match="16 bytes"):
        moe_permute(torch.zeros(2, 3), None, t32([[0], [1]]), 2)


def test_deepgemm_permute_psum_layout_by_hand():
    """vLLM 0.33 use_psum_layout: same rows, expert_ids = per-expert logical ends start_e + count_e (int32 (E,))."""
    aq = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    ref = deepgemm_moe_permute(aq, None, t32(TOPK_3x2), 4, alignment=4)
    perm, _, ends, inv, align = deepgemm_moe_permute(aq, None, t32(TOPK_3x2), 4, use_psum_layout=True, alignment=4)
    # e0 rows 0-1, e1 rows 4-5, e2 rows 8-9, e3 empty at 12
    assert ends.dtype == I32 and ends.tolist() == [2, 6, 10, 12]
    assert torch.equal(perm, ref[0]) and torch.equal(inv, ref[3]) and align == ref[4]
    from reference.semantics import SemanticsError

    with pytest.raises(SemanticsError):
        _psum_017(aq)


def _psum_017(aq):
    from reference.semantics import use_semantics

    with use_semantics("0.17"):
        return deepgemm_moe_permute(aq, None, t32(TOPK_3x2), 4, use_psum_layout=True, alignment=4)
