"""Expert parallelism across processes: the reference prepare/finalize pairs of ``reference.distributed`` at world
sizes 2 and 4 on gloo, and the distributed conformance suite against planted communication faults.

The planted faults (each a prepare/finalize class of a broken backend, run by ``conformance/test_distributed.py`` in a
subprocess exactly as a user would) must turn the suite red, while the same selection with the reference classes
stays green:

- ``DropLastTokenDispatch``: the dispatch loses the last token of every rank;
- ``WeightsTwiceCombine``: the combine applies the router weights twice;
- ``SilentOverflowDispatch``: a rank over ``max_num_tokens`` has its extra tokens dropped instead of raising.

The faults and their backends live in ``tests/broken_backends.py`` (a test module is never imported by the suite).
By hand: ``python -m pytest conformance/test_distributed.py --backend tests.broken_backends:dist_planted --world-size 2``
(``tests.broken_backends:dist_reference`` runs the reference experts classes alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conformance.distributed_case import (
    DistCase,
    RankCluster,
    RankFailure,
    expected_output,
    make_global_inputs,
    ACTIVATION,
    DTYPE,
    I,
    K,
    rank_shard,
    run_rank_case,
    unpack_tensor,
)
from conformance.experts_case import routes_error_bound
from conformance.metrics import assert_close
from reference.distributed import (
    BatchedReferenceExpertsEP,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    MoEPrepareAndFinalizeNaiveDPEPModular,
    REFERENCE_PREPARE_FINALIZE,
    quantize_slots,
    expert_placement,
    fused_experts_ep,
)
from reference.experts import ReferenceExperts, experts_unreduced
from reference.modular import FusedMoEActivationFormat, moe_kernel_quantize_input
from reference.routing import determine_expert_map

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------------------
# The planted faults (tests/broken_backends.py), run as a user would
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """One run of the distributed suite (world size 2, a small selection) over the reference pairs and the three
    planted faults, as a user would run it: ``(CompletedProcess, {prepare_finalize: [result entries]})``."""
    tmp = tmp_path_factory.mktemp("planted")
    cmd = [sys.executable, "-m", "pytest", "conformance/test_distributed.py", "--backend",
           "tests.broken_backends:dist_planted", "--world-size", "2", "-k", "uneven-bf16-linear or overflow",
           "-p", "no:cacheprovider", "-q", "--results-dir", str(tmp)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=900)
    by_pf: dict[str, list[dict]] = {}
    for e in json.loads((tmp / "conformance-broken_dist_planted.json").read_text())["results"]:
        if e.get("component") == "distributed":
            by_pf.setdefault(e["prepare_finalize"], []).append(e)
    return r, by_pf


@pytest.mark.slow  # a distributed conformance run with planted faults (CI also runs the distributed suite itself)
def test_reference_pairs_stay_green(planted_run):
    r, by_pf = planted_run
    assert r.returncode == 1, r.stdout[-4000:]  # red: the planted faults below
    for pf in REFERENCE_PREPARE_FINALIZE:
        entries = by_pf[pf.__name__]
        assert entries and all(e["outcome"] == "passed" and e["world_size"] == 2 for e in entries), entries
    assert any(e["scenario"] == "overflow" for e in by_pf["DeepEPLLPrepareAndFinalize"])


@pytest.mark.slow  # a distributed conformance run with planted faults (CI also runs the distributed suite itself)
def test_dispatch_that_drops_the_last_token_is_caught(planted_run):
    r, by_pf = planted_run
    (e,) = by_pf["DropLastTokenDispatch"]
    assert e["outcome"] == "failed" and "differs from the reference" in e["message"], e
    assert "failing ranks: rank 0 (rows 0..4" in r.stdout  # rank 0's last token; rank 1 has none


@pytest.mark.slow  # a distributed conformance run with planted faults (CI also runs the distributed suite itself)
def test_combine_that_applies_router_weights_twice_is_caught(planted_run):
    _, by_pf = planted_run
    (e,) = [e for e in by_pf["WeightsTwiceCombine"] if e["scenario"] == "uneven"]
    assert e["outcome"] == "failed" and "differs from the reference" in e["message"], e


@pytest.mark.slow  # a distributed conformance run with planted faults (CI also runs the distributed suite itself)
def test_batched_dispatch_that_overflows_silently_is_caught(planted_run):
    _, by_pf = planted_run
    outcome = {e["scenario"]: e for e in by_pf["SilentOverflowDispatch"]}
    assert outcome["uneven"]["outcome"] == "passed"  # within capacity it is a correct dispatch
    assert outcome["overflow"]["outcome"] == "failed" and "silent overflow" in outcome["overflow"]["message"]


# ------------------------------------------------------------------------------------------------------------
# The reference pairs, rank by rank, at world sizes 2 and 4 (gloo)
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def cluster(request):
    c = RankCluster(request.param)
    yield c
    c.close()


def _run(cluster, case, pf, experts):
    results = cluster.run(run_rank_case, case, pf, experts)
    return results


def _check(cluster, case, pf, experts):
    out = torch.cat([unpack_tensor(r["out"]) for r in _run(cluster, case, pf, experts)])
    batched = experts.activation_format() == FusedMoEActivationFormat.BatchedExperts
    expected = expected_output(case, "routes" if batched else "partials")
    qc = rank_shard(case, 0)[2]  # the scheme's formats (the bound reads descriptors, not values)
    tol = routes_error_bound(qc, act_dtype=DTYPE, K=K, I=I, activation=ACTIVATION,
                             topk_ids=make_global_inputs(case)["topk_ids"], experts_cls=experts).as_tolerance()
    assert_close(out, expected, tol, case=case.id, what=f"{pf.__name__} + {experts.__name__}")
    return out, expected


_STANDARD = [MoEPrepareAndFinalizeNaiveDPEPModular, DeepEPHTPrepareAndFinalize]


@pytest.mark.parametrize("scenario", [("uneven", "bf16", "-", "linear"), ("one_rank", "bf16", "-", "round_robin"),
                                      ("padded", "fp8_block128", "before", "round_robin"),
                                      ("weight_on_input", "fp8_channel_token", "after", "linear")],
                         ids=lambda s: "-".join(s))
def test_reference_pairs_match_the_single_process_layer(cluster, scenario):
    case = DistCase(cluster.world_size, *scenario)
    for pf in _STANDARD:
        _check(cluster, case, pf, ReferenceExperts)
    _check(cluster, case, DeepEPLLPrepareAndFinalize, BatchedReferenceExpertsEP)


def _dispatch_census(rank, world_size, device, case, pf_cls):
    """Dispatch only (no experts): the routes this rank received, as (global expert, source token) pairs."""
    from conformance.distributed_case import make_rank_inputs

    inp = make_rank_inputs(case, rank, device)
    pf = pf_cls(group=None, max_num_tokens=case.max_num_tokens(), expert_placement_strategy=case.placement)
    a1q, _, meta, ids, _ = pf.prepare(inp["hidden"], inp["topk_weights"], inp["topk_ids"], 32, inp["expert_map"],
                                      False, inp["quant_config"])
    counts = meta.expert_num_tokens.tolist() if meta is not None else None
    if ids is None:  # batched: rows per slot
        return {"routes": int(sum(counts)), "counts": counts}
    emap = inp["expert_map"]
    held = (ids >= 0) & (emap.long()[ids.long().clamp(min=0)] >= 0) if emap is not None else ids >= 0
    return {"routes": int(held.sum()), "counts": counts, "rows": int(a1q.shape[0])}


@pytest.mark.parametrize("pf", REFERENCE_PREPARE_FINALIZE, ids=lambda c: c.__name__)
def test_dispatch_delivers_every_route_once(cluster, pf):
    case = DistCase(cluster.world_size, "padded", "bf16", "-", "round_robin")
    gi = make_global_inputs(case)
    valid = int((gi["topk_ids"] >= 0).sum())
    got = cluster.run(_dispatch_census, case, pf)
    assert sum(g["routes"] for g in got) == valid  # no route lost, none delivered twice
    if pf is DeepEPHTPrepareAndFinalize:  # expert_num_tokens counts the routes each local expert received
        assert all(sum(g["counts"]) == g["routes"] for g in got)
    if pf is MoEPrepareAndFinalizeNaiveDPEPModular:
        assert all(g["rows"] == sum(gi["sizes"]) for g in got)  # every rank sees every token


def test_capacity_error_is_raised_on_every_rank_naming_the_rank(cluster):
    case = DistCase(cluster.world_size, "overflow", "bf16", "-", "linear")
    results = cluster.run(run_rank_case, case, DeepEPLLPrepareAndFinalize, BatchedReferenceExpertsEP)
    sizes, cap = case.tokens_per_rank(), case.max_num_tokens()
    over = [r for r, m in enumerate(sizes) if m > cap]
    for res in results:
        assert "DispatchCapacityError" in res["raised"], res
        assert f"EP rank {over[0]} dispatches {sizes[over[0]]} tokens" in res["raised"]
    assert cluster.run(_ping_ok)[0]  # the group is still usable: the check ran before any data moved


def _ping_ok(rank, world_size, device):
    import torch.distributed as dist

    t = torch.tensor([rank], device=device)
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t)
    return [int(p) for p in parts] == list(range(world_size))


class DeferredQuantExperts(ReferenceExperts):
    """Experts that quantize a1 themselves (``expects_unquantized_inputs``): prepare must not quantize."""

    @property
    def expects_unquantized_inputs(self):
        return True

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        assert hidden_states.dtype == torch.bfloat16 and a1q_scale is None, "prepare quantized a deferred input"
        a1q, scale = moe_kernel_quantize_input(hidden_states, None, self.quant_config, "a1")
        y = experts_unreduced(a1q, scale, w1, w2, topk_ids, expert_map, self.quant_config, activation, output.dtype)
        output.copy_(y.view(output.shape))


class DeferredQuantBatchedExperts(BatchedReferenceExpertsEP):
    @property
    def expects_unquantized_inputs(self):
        return True

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        assert hidden_states.dtype == torch.bfloat16 and a1q_scale is None, "prepare quantized a deferred input"
        q, s = quantize_slots(hidden_states, expert_tokens_meta.expert_num_tokens.tolist(), self.quant_config)
        super().apply(output, q, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map, s,
                      a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input)


def test_deferred_input_quantization(cluster):
    case = DistCase(cluster.world_size, "uneven", "fp8_block128", "-", "round_robin")
    for pf in _STANDARD:
        _check(cluster, case, pf, DeferredQuantExperts)
    _check(cluster, case, DeepEPLLPrepareAndFinalize, DeferredQuantBatchedExperts)


def test_quantization_before_and_after_dispatch_give_the_same_output(cluster):
    outs = {}
    for q in ("before", "after"):
        case = DistCase(cluster.world_size, "uneven", "fp8_block128", q, "linear")
        for pf, ex in ((DeepEPHTPrepareAndFinalize, ReferenceExperts),
                       (DeepEPLLPrepareAndFinalize, BatchedReferenceExpertsEP)):
            outs[q, pf] = torch.cat([unpack_tensor(r["out"]) for r in cluster.run(run_rank_case, case, pf, ex)])
    for pf in (DeepEPHTPrepareAndFinalize, DeepEPLLPrepareAndFinalize):
        assert torch.equal(outs["before", pf], outs["after", pf])  # row-local scales: the same codes either way


def test_dynamic_per_tensor_scale_before_dispatch_is_refused(cluster):
    case = DistCase(cluster.world_size, "uneven", "fp8_tensor", "before", "linear")
    from reference.schemes import quantize_weights

    qc = quantize_weights("fp8_tensor", torch.zeros(1, 256, 256, dtype=torch.bfloat16),
                          torch.zeros(1, 256, 128, dtype=torch.bfloat16))[2]
    ok, reason = DeepEPHTPrepareAndFinalize.is_supported_config(None, qc, False)
    assert not ok and "per-tensor" in reason
    assert DeepEPHTPrepareAndFinalize.is_supported_config(None, qc, True) == (True, None)
    with pytest.raises(RankFailure, match="dynamic per-tensor a1 scale cannot be quantized before dispatch"):
        cluster.run(run_rank_case, case, DeepEPHTPrepareAndFinalize, ReferenceExperts)


def _wrong_expert_map(rank, world_size, device):
    from conformance.distributed_case import make_rank_inputs

    case = DistCase(world_size, "uneven", "bf16", "-", "round_robin")
    inp = make_rank_inputs(case, rank, device)
    pf = DeepEPHTPrepareAndFinalize(expert_placement_strategy="linear")
    try:
        pf.prepare(inp["hidden"], inp["topk_weights"], inp["topk_ids"], 32, inp["expert_map"], False,
                   inp["quant_config"])
    except ValueError as exc:
        return str(exc)
    return None


def test_expert_map_of_another_placement_is_refused_on_every_rank(cluster):
    msgs = cluster.run(_wrong_expert_map)
    for r, m in enumerate(msgs):
        assert m is not None and f"rank {r}'s expert_map is not its 'linear' placement" in m


# ------------------------------------------------------------------------------------------------------------
# Hangs: a collective one rank never joins times out, and the failure names the ranks.
# ------------------------------------------------------------------------------------------------------------


def _skip_collective(rank, world_size, device):
    import torch.distributed as dist

    if rank == 1:
        return "skipped"
    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    return "joined"


def _stuck(rank, world_size, device):
    if rank == 1:
        time.sleep(120)
    return "ok"


@pytest.mark.slow  # waits for its timeout
def test_hung_collective_times_out_and_names_the_rank():
    c = RankCluster(2, timeout_s=3.0)
    try:  # rank 1 never joins the all-reduce: rank 0's collective times out (process group timeout)
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            c.run(_skip_collective, timeout=30.0)
        msg = str(info.value)
        assert "rank 0 raised" in msg and "_skip_collective" in msg and time.monotonic() - t0 < 30.0, msg
        assert not c.healthy  # a timed-out group is not reused
    finally:
        c.close()
    c = RankCluster(2, timeout_s=3.0)
    try:  # rank 1 is stuck outside any collective: the parent-side wait times out
        with pytest.raises(RankFailure, match=r"rank 1 did not answer within 5 s"):
            c.run(_stuck, timeout=5.0)
        assert not c.healthy
    finally:
        c.close()


# ------------------------------------------------------------------------------------------------------------
# The single-process definitions (no processes)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_size", [1, 2, 3, 4, 8])
def test_expert_placement_matches_determine_expert_map(ep_size, strategy):
    owner, local = expert_placement(32, ep_size, strategy)
    for r in range(ep_size):
        n, emap, _ = determine_expert_map(ep_size, r, 32, strategy)
        if emap is None:
            assert torch.equal(owner, torch.zeros(32, dtype=torch.long))
            continue
        assert torch.equal(owner == r, emap >= 0) and torch.equal(local[owner == r], emap[emap >= 0].long())


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fused_experts_ep_definitions(world_size):
    from conformance.distributed_case import rank_shard
    from reference.experts import fused_experts

    case = DistCase(world_size, "padded", "bf16", "-", "round_robin")
    single = expected_output(case)
    assert torch.equal(expected_output(case, "routes"), single)  # the batched combine: fused_experts exactly
    partials = expected_output(case, "partials")
    # One more rounding of each rank's partial p_r: |partials - single| <= u (2 |out| + sum_r |p_r|), u = 2^-8.
    gi = make_global_inputs(case)
    p_abs = sum(fused_experts(gi["hidden"], w1, w2, gi["topk_weights"], gi["topk_ids"], global_num_experts=32,
                              expert_map=emap, quant_config=qc).float().abs()
                for w1, w2, qc, emap, _ in (rank_shard(case, r, gi) for r in range(world_size)))
    bound = 2.0**-8 * (2 * single.float().abs() + p_abs) * 1.01 + 1e-6
    assert bool(((partials.float() - single.float()).abs() <= bound).all())
    with pytest.raises(ValueError, match="combine must be"):
        fused_experts_ep(single, single, single, [], combine="sum")
