"""Padding routes under an expert map: ``topk_ids`` slots of ``-1`` ("no route") on an EP rank.

``-1`` ids come from routers that pad (fewer than topk routes for a token) and from dispatchers that mask routes;
``reference.experts.local_expert_ids`` defines them: a ``-1`` slot contributes nothing, whatever its weight, and
``expert_map`` is never indexed with it. Two classic bugs look the map up anyway:

- ``expert_map[max(id, 0)]``: the slot goes to global expert 0 (visible on the rank that holds expert 0, rank 0);
- ``expert_map[id]`` with Python / wrap-around indexing (vLLM #48371 read ``expert_map[-1]``): the slot goes to the
  last global expert (visible on the last rank).

The experts cases of ``test_experts.py`` route real logits (no ``-1``) and the only ``-1`` case elsewhere has no
expert map, so neither bug showed. These cases take a case's routed inputs (``make_experts_inputs``, Qwen3-30B-A3B
at its CPU EP size) and overwrite slots with ``-1``: a quarter of the tokens lose every slot (their output must be
exactly zero), a quarter lose one slot, the rest keep theirs; every ``-1`` slot gets a non-zero weight in
[0.5, 1), so an implementation that uses the slot shows. They run on rank 0 and on the last rank, for bf16 and
block FP8, once without chunking and once with a chunk size that makes the first chunk all padding. CPU-cheap
(16 local experts, 16-40 tokens).

Specs TODO (conformance/cases.py is being rewritten from backend claims): a ``pad_ids`` option of
``specs/cases.toml`` ``[[experts.extra]]`` entries would carry these cases; until then they are built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conformance.cases import ExpertsCase, seed_of
from conformance.inputs import ExpertsInputs, make_experts_inputs
from conformance.metrics import ConformanceFailure, assert_close
from conformance.experts_case import claims_config, moe_config_for
from conformance.hygiene import inputs_error_bound, run_with_reference
from specs import ModelSpec, load_models

__all__ = ["PaddingCase", "PADDING_CASES", "pad_routes", "padding_inputs"]

MODEL = "qwen3_30b_a3b"
SCHEMES = ("bf16", "fp8_block128")


@dataclass(frozen=True)
class PaddingCase:
    """An experts case with ``-1`` slots: ``rank`` is ``"first"`` or ``"last"`` (of the model's CPU EP size)."""

    scheme: str
    tokens: int
    rank: str
    chunk_size: int | None = None

    @property
    def model(self) -> ModelSpec:
        return load_models()[MODEL]

    def experts_case(self) -> ExpertsCase:
        m = self.model
        return ExpertsCase(m, self.scheme, self.tokens, m.cpu_ep_size, 0 if self.rank == "first" else
                           m.cpu_ep_size - 1, self.chunk_size)

    @property
    def id(self) -> str:
        return self.experts_case().id + "-pad"


# Grouped by rank: consecutive cases share the rank's cached bf16 weights (inputs.py caches one shard).
PADDING_CASES = [PaddingCase(scheme, 16, "first") for scheme in SCHEMES] + [
    PaddingCase("bf16", 40, "first", chunk_size=8),  # tokens 0-7 all padding: the first chunk routes nothing
] + [PaddingCase(scheme, 16, "last") for scheme in SCHEMES]


def pad_routes(topk_weights: torch.Tensor, topk_ids: torch.Tensor, seed: int, all_pad_first: int = 0):
    """``(weights, ids, all_pad)``: copies with ``-1`` slots written in, and the bool mask of tokens left no route.

    Token ``t`` (counting from ``all_pad_first``) loses every slot when ``t % 4 == 0`` and slot ``(t // 4) % topk``
    when ``t % 4 == 1``; the first ``all_pad_first`` tokens lose every slot. ``-1`` slots get weights in [0.5, 1).
    """
    ids, w = topk_ids.clone(), topk_weights.clone()
    M, topk = ids.shape
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(M, topk, dtype=torch.bool)
    for t in range(M):
        if t < all_pad_first or (t - all_pad_first) % 4 == 0:
            pad[t] = True
        elif (t - all_pad_first) % 4 == 1:
            pad[t, ((t - all_pad_first) // 4) % topk] = True
    pad = pad.to(ids.device)
    ids[pad] = -1
    w[pad] = (0.5 + 0.5 * torch.rand(int(pad.sum()), generator=g)).to(w.device, w.dtype)
    return w, ids, pad.all(dim=1)


def padding_inputs(pc: PaddingCase, device: str) -> tuple[ExpertsCase, ExpertsInputs, torch.Tensor]:
    """The case's routed inputs with ``-1`` slots (``pad_routes``); the mask of tokens with no route left."""
    case = pc.experts_case()
    inputs = make_experts_inputs(case, device)
    assert inputs.expert_map is not None, f"{case.id}: padding cases need an expert map (EP size > 1)"
    w, ids, all_pad = pad_routes(inputs.topk_weights, inputs.topk_ids, seed_of(pc.id),
                                 all_pad_first=pc.chunk_size or 0)
    inputs.topk_weights, inputs.topk_ids = w, ids
    return case, inputs, all_pad


def pytest_generate_tests(metafunc):
    if "experts_cls" in metafunc.fixturenames and "padding_case" in metafunc.fixturenames:
        classes = list(metafunc.config._moe_backend.experts)
        params = [pytest.param(cls, pc, id=f"{pc.id}-{cls.__name__}") for pc in PADDING_CASES for cls in classes]
        metafunc.parametrize(("experts_cls", "padding_case"),
                             params or [pytest.param(None, None, id="no-experts")])


def test_padding_ids_under_expert_map(backend, experts_cls, padding_case: PaddingCase, repro, record):
    """``-1`` slots with non-zero weights under an expert map: the output equals the reference, which drops them,
    and tokens left with no route are exactly zero."""
    if experts_cls is None:
        pytest.skip(f"backend {backend.name} offers no experts implementation")
    case, inputs, all_pad = padding_inputs(padding_case, backend.device)
    qc = inputs.quant_config
    ok, reason = claims_config(experts_cls, moe_config_for(case), qc)
    if not ok:
        pytest.skip(f"{experts_cls.__name__} does not claim {case.scheme} here: {reason}")
    record(component="hygiene", scheme=f"padding-ids-{case.scheme}", model=case.model.name, tokens=case.tokens,
           experts_class=experts_cls.__name__)
    out, expected = run_with_reference(experts_cls, case, inputs)
    what = f"{experts_cls.__name__} output with -1 routes"
    assert_close(out, expected, inputs_error_bound(experts_cls, case, inputs),
                 case=padding_case.id, what=what, repro=repro)
    empty = out[all_pad]
    if not bool((empty == 0).all()):
        t = int(all_pad.nonzero()[(empty != 0).any(dim=1).nonzero()[0, 0], 0])
        raise ConformanceFailure(
            f"{what}: token {t} has every slot -1 (no route) yet its output row is not zero "
            f"(max |out| {out[t].float().abs().max().item():.3e}): a -1 slot reached an expert\n"
            f"  case: {padding_case.id}\n  reproduce: {repro}")
