"""benchmarks/distributed.py on the CPU (gloo, the synthetic layer): the bytes each pair moves off a rank against a
brute-force count over routes, and one whole run of ``python -m benchmarks --distributed`` over 2 ranks."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.distributed import render, traffic_bytes
from reference.distributed import expert_placement


def _brute(kind, ids, owner, rank, W, rb, ob, sizes):
    disp, comb = [0] * W, [0] * W
    for t in range(ids.shape[0]):
        dests = [int(owner[e]) for e in ids[t].tolist() if e >= 0]
        for r in range(W):
            if r == rank:
                continue
            if kind == "allgather":
                disp[r] += rb
            elif kind == "alltoall" and r in dests:
                disp[r] += rb
                comb[r] += ob
            elif kind == "batched":
                disp[r] += rb * dests.count(r)
                comb[r] += ob * dests.count(r)
    if kind == "allgather":
        comb = [0 if r == rank else sizes[r] * ob for r in range(W)]
    return {"dispatch": disp, "combine": comb}


@pytest.mark.parametrize("kind", ["allgather", "alltoall", "batched"])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_traffic_bytes_matches_route_count(kind, placement):
    W, E, topk = 4, 32, 4
    owner, _ = expert_placement(E, W, placement)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(9)])
    ids[torch.rand(9, topk, generator=g) < 0.3] = -1
    sizes = [9, 0, 4, 7]
    for rank in range(W):
        got = traffic_bytes(kind, ids, owner, rank, W, 100, 7, sizes)
        assert got == _brute(kind, ids, owner, rank, W, 100, 7, sizes)


@pytest.mark.slow
def test_cli_runs_two_gloo_ranks(tmp_path):
    from benchmarks.cli import main

    out = tmp_path / "d.json"
    rc = main(["--distributed", "--backend", "torch", "--world-size", "2", "--shape", "small", "--ms", "0,3",
               "--reps", "2", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    ws = res["world_sizes"][0]
    assert ws["world_size"] == 2 and ws["allreduce"]["s"] > 0
    assert [m["M"] for m in ws["ms"]] == [0, 3]
    for m in ws["ms"]:
        pairs = {r["pair"] for r in m["rows"]}
        assert pairs == {"MoEPrepareAndFinalizeNaiveDPEPModular", "DeepEPHTPrepareAndFinalize",
                         "DeepEPLLPrepareAndFinalize"}
        for r in m["rows"]:
            assert not r.get("error"), r
            assert len(r["step_per_rank"]) == 2
            # the phases are consecutive intervals of the same step on the slowest rank of each
            assert r["step"] > 0 and r["dispatch"] <= r["step"] and r["combine"] <= r["step"]
        assert set(m["collectives"]) == {"a2a_dispatch", "a2a_combine", "allgather"}
        if m["M"] == 0:
            assert all(r["bytes_out"] == 0 for r in m["rows"])
    assert "## world size 2" in render(res)
