"""Distributed conformance: expert parallelism across processes (``--world-size N``).

With ``--world-size N`` (comma-separated for several, e.g. ``2,4``) every case spawns (once per world size, then
reused) N ranks with ``torch.multiprocessing`` (spawn): gloo on the CPU, NCCL when the backend runs on CUDA and each
rank has its own GPU (rank r uses ``cuda:r``; N = 1 is the single-GPU NCCL smoke test). Each rank holds its
``determine_expert_map`` share of a small synthetic MoE layer (E=32, topk=4, K=256, I=128, SiLU, bf16) and its own
tokens, and runs one experts class of the backend inside ``reference.distributed.EPFusedMoEKernel`` with one
prepare/finalize pair: the reference pairs of ``reference.distributed`` (all-gather / reduce-scatter, all-to-all
standard, all-to-all batched) and the backend's own (``Backend.prepare_finalize``), constructed as::

    pf_cls(group=None, moe_config=..., max_num_tokens=..., expert_placement_strategy=..., quantize_after_dispatch=...)

Pairs whose activation formats differ are not combined. Every rank's output, concatenated in rank order, is compared
with the single-process reference on the union of the ranks' tokens, within the error model's bound over all their
routes (``conformance.experts_case.routes_error_bound``): for the batched
format ``reference.experts.fused_experts`` over all experts itself; for the standard formats the same computed per
rank's experts and summed (``reference.distributed.fused_experts_ep(combine="partials")``), because their combine
receives each rank's partial output in the activation dtype (one more rounding of each partial, as in vLLM and
DeepEP; the suite's bf16 bound is tight enough to reject one extra rounding, so it cannot be compared with
``fused_experts`` directly). The distance to ``fused_experts`` is recorded as ``single_process_*``.

Cases (``SCENARIOS``), on the synthetic layer and on DeepSeek-V3's expert layout (``LAYOUTS["dsv3"]``: E=256, topk=8,
at world size 8 its real EP=8 layout of 32 local experts per rank, at the suite's small K and I): uneven tokens per
rank (one rank with none), every token routed to the
experts of one rank (which has no tokens of its own), ``topk_ids`` with -1 padding (a token with no route at all),
``apply_router_weight_on_input`` (topk 1), linear and round-robin placement, bf16, FP8 1x128-group and per-token
activations quantized before and after the dispatch, and, for the batched format, a rank over ``max_num_tokens``,
which must raise on every rank (never lose tokens silently).

An experts class that does not claim a rank's configuration (``is_supported_config``), or a prepare/finalize class
that does not claim the quantization placement (its ``is_supported_config(moe_config, quant_config,
quantize_after_dispatch)`` if it has one), is skipped with the reason. A collective that hangs times out (the
process group's timeout, ``MOE_DIST_TIMEOUT`` seconds, default 60, and a parent-side wait) and fails the case naming
the ranks; the ranks are then restarted.
"""

from __future__ import annotations

import pytest
import torch

from conformance.distributed_case import (ACTIVATION, DTYPE, I, K, ClusterPool, DistCase, RankFailure,
                                          dist_cases, expected_output, make_global_inputs, moe_config_for,
                                          run_rank_case, single_process_output, unpack_tensor)
from conformance.experts_case import claims_config, routes_error_bound
from conformance.metrics import ConformanceFailure, assert_close, error_stats
from reference.distributed import REFERENCE_PREPARE_FINALIZE
from reference.modular import FusedMoEActivationFormat
from reference.routing import determine_expert_map
from reference.schemes import quantize_weights

# ------------------------------------------------------------------------------------------------------------
# pytest
# ------------------------------------------------------------------------------------------------------------


def _world_sizes(config) -> list[int]:
    raw = config.getoption("--world-size", default=None)
    if not raw:
        return []
    try:
        sizes = [int(s) for s in str(raw).split(",") if s.strip()]
    except ValueError:
        raise pytest.UsageError(f"--world-size takes N or N,N,...; got {raw!r}") from None
    if any(n < 1 for n in sizes):
        raise pytest.UsageError(f"--world-size values must be >= 1, got {raw!r}")
    return sizes


def _pf_format(cls):
    """The class's activation format when it can be read without an instance (None: decided at run time)."""
    prop = getattr(cls, "activation_format", None)
    try:
        return prop.fget(None) if isinstance(prop, property) else None
    except Exception:
        return None


def pytest_generate_tests(metafunc):
    if not {"pf_cls", "experts_cls", "case"} <= set(metafunc.fixturenames):
        return
    sizes = _world_sizes(metafunc.config)
    backend = metafunc.config._moe_backend
    if not sizes:
        metafunc.parametrize(("pf_cls", "experts_cls", "case"), [pytest.param(
            None, None, None, id="no-world-size",
            marks=pytest.mark.skip(reason="distributed conformance runs with --world-size N (N ranks)"))])
        return
    pfs = [*REFERENCE_PREPARE_FINALIZE, *getattr(backend, "prepare_finalize", ())]
    params = []
    for case in dist_cases(sizes):
        for pf in pfs:
            fmt = _pf_format(pf)
            if case.scenario == "overflow" and fmt != FusedMoEActivationFormat.BatchedExperts:
                continue
            for ex in backend.experts:
                if fmt is not None and ex.activation_format() != fmt:
                    continue
                params.append(pytest.param(pf, ex, case, id=f"{case.id}-{pf.__name__}-{ex.__name__}"))
    if not params:
        params = [pytest.param(None, None, None, id="no-experts",
                               marks=pytest.mark.skip(reason=f"backend {backend.name} offers no experts class"))]
    metafunc.parametrize(("pf_cls", "experts_cls", "case"), params)


@pytest.fixture(scope="session")
def dist_clusters():
    pool = ClusterPool()
    yield pool
    pool.close()


def _rank_of_row(row: int, sizes: list[int]) -> int:
    start = 0
    for r, n in enumerate(sizes):
        if row < start + n:
            return r
        start += n
    return -1


def test_distributed(backend, pf_cls, experts_cls, case: DistCase, repro, record, dist_clusters):
    N = case.world_size
    record(world_size=N, model=case.model, scheme=case.scheme if case.quant == "-" else f"{case.scheme}-q{case.quant}",
           component="distributed", tokens=sum(case.tokens_per_rank()), experts_class=experts_cls.__name__,
           prepare_finalize=pf_cls.__name__, scenario=case.scenario, placement=case.placement)
    device = "cuda" if backend.device == "cuda" else "cpu"
    if device == "cuda" and torch.cuda.device_count() < N:
        pytest.skip(f"world size {N} needs {N} GPUs (one per rank, NCCL); this machine has "
                    f"{torch.cuda.device_count()}")
    # Claims: the experts class on every rank's configuration, the prepare/finalize on the quantization placement.
    inp_qc = quantize_weights(case.scheme, torch.zeros(1, 2 * I, K, dtype=DTYPE), torch.zeros(1, K, I, dtype=DTYPE))[2]
    for r in range(N):
        num_local, _, _ = determine_expert_map(N, r, case.E, case.placement)
        claimed, reason = claims_config(experts_cls, moe_config_for(case, r, num_local), inp_qc)
        if not claimed:
            record(support="unsupported", reason=reason)
            pytest.skip(f"unsupported: {experts_cls.__name__} on rank {r}: {reason}")
    pf_claim = getattr(pf_cls, "is_supported_config", None)
    if pf_claim is not None:
        ok, reason = pf_claim(moe_config_for(case, 0, case.E // N), inp_qc, case.quant == "after")
        if not ok:
            record(support="unsupported", reason=reason)
            pytest.skip(f"unsupported: {pf_cls.__name__}: {reason}")
    record(support="claimed")

    where = f"{pf_cls.__name__} + {experts_cls.__name__} over {N} ranks ({'NCCL' if device == 'cuda' else 'gloo'})"
    cluster = dist_clusters.get(N, device)
    try:
        results = cluster.run(run_rank_case, case, pf_cls, experts_cls)
    except RankFailure as exc:
        raise ConformanceFailure(f"{where}: {exc}\n  case: {case.id}\n  reproduce: {repro} --world-size {N}") from None

    sizes = case.tokens_per_rank()
    if case.scenario == "overflow":
        quiet = [r for r, res in enumerate(results) if "raised" not in res]
        if quiet:
            over = [r for r, m in enumerate(sizes) if m > case.max_num_tokens()]
            raise ConformanceFailure(
                f"{where}: silent overflow: rank(s) {over} dispatch {[sizes[r] for r in over]} tokens with "
                f"max_num_tokens={case.max_num_tokens()}, yet rank(s) {quiet} returned an output instead of raising "
                f"(tokens past the capacity are lost)\n  case: {case.id}\n  reproduce: {repro} --world-size {N}")
        record(raised=results[0]["raised"][:200])
        return

    outs = [unpack_tensor(res["out"]) for res in results]
    for r, (o, m) in enumerate(zip(outs, sizes)):
        if tuple(o.shape) != (m, K) or o.dtype != DTYPE:
            raise ConformanceFailure(f"{where}: rank {r} returned {tuple(o.shape)} {o.dtype}, expected ({m}, {K}) "
                                     f"{DTYPE}\n  case: {case.id}\n  reproduce: {repro} --world-size {N}")
    out = torch.cat(outs)
    batched = experts_cls.activation_format() == FusedMoEActivationFormat.BatchedExperts
    expected = expected_output(case, "routes" if batched else "partials")
    single_out, heavy = single_process_output(case)
    single = error_stats(out, single_out)  # recorded: the distance to fused_experts over all experts
    record(single_process_max_norm=single.max_norm, single_process_rms_norm=single.rms_norm)
    # The one rule: the error model's bound over every route of the union of the ranks' tokens.
    tol = routes_error_bound(inp_qc, act_dtype=DTYPE, K=K, I=I, activation=ACTIVATION,
                             topk_ids=make_global_inputs(case)["topk_ids"], experts_cls=experts_cls,
                             heavy=heavy).as_tolerance()
    try:
        stats = assert_close(out, expected, tol, case=case.id, what=f"{where} output (rows in rank order)",
                             repro=f"{repro} --world-size {N}")
    except ConformanceFailure as exc:
        bad = []
        start = 0
        for r, m in enumerate(sizes):
            if m:
                s = error_stats(outs[r], expected[start : start + m])
                if s.nonfinite or any(not getattr(s, k) <= v for k, v in tol.items() if hasattr(s, k)):
                    bad.append(f"rank {r} (rows {start}..{start + m - 1}: max_norm {s.max_norm:.2e}, "
                               f"{s.nonfinite} non-finite)")
            start += m
        raise ConformanceFailure(f"{exc}\n  failing ranks: {', '.join(bad) or 'none alone (only the union)'}") \
            from None
    record(**stats.as_dict())
