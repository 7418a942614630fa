"""Library code of the distributed conformance test (conformance/test_distributed.py; tests/test_distributed.py uses
it too): the cases (``DistCase``, the synthetic layer E=32, topk=4, K=256, I=128, SiLU, bf16), their inputs drawn
identically in the parent and every rank, the single-process expected output, one rank's part of a case
(``run_rank_case``), and the spawned rank processes (``RankCluster``, ``ClusterPool``).
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache

import torch

from conformance.cases import seed_of
from reference.activation import MoEActivation
from reference.config import FusedMoEConfig, FusedMoEParallelConfig
from reference.distributed import EPFusedMoEKernel, fused_experts_ep
from reference.experts import fused_experts_with_heavy
from reference.modular import FusedMoEActivationFormat
from reference.routing import determine_expert_map, fused_topk
from reference.schemes import quantize_weights

__all__ = ["DistCase", "RankCluster", "RankFailure", "dist_cases", "make_global_inputs", "make_rank_inputs",
           "expected_output", "run_rank_case", "default_timeout", "ClusterPool", "rank_shard", "moe_config_for",
           "pack_tensor", "unpack_tensor", "single_process_output", "E", "TOPK", "K", "I", "MODEL", "ACTIVATION", "DTYPE", "SCENARIOS"]

# The synthetic layer: small enough for CPU ranks, E divisible by 8 ranks with topk experts on each.
E, TOPK, K, I = 32, 4, 256, 128
MODEL = "synthetic_e32_k256"
# DeepSeek-V3's expert-parallel layout (256 routed experts, top-8; at EP=8 32 local experts per rank) at the suite's
# small K and I (DeepSeek-V3's real 7168 x 2048 experts do not fit CPU ranks): layout "dsv3".
LAYOUTS = {"synthetic": (E, TOPK, MODEL), "dsv3": (256, 8, "deepseek_v3_ep_layout_e256_k256")}
ACTIVATION = MoEActivation.SILU
DTYPE = torch.bfloat16

# (scenario, scheme, quantization placement, expert placement strategy)
SCENARIOS = [
    ("uneven", "bf16", "-", "linear"),
    ("uneven", "bf16", "-", "round_robin"),
    ("one_rank", "bf16", "-", "round_robin"),
    ("padded", "bf16", "-", "linear"),
    ("weight_on_input", "bf16", "-", "round_robin"),
    ("uneven", "fp8_block128", "before", "linear"),
    ("uneven", "fp8_block128", "after", "round_robin"),
    ("padded", "fp8_block128", "before", "round_robin"),
    ("one_rank", "fp8_channel_token", "before", "linear"),
    ("uneven", "fp8_channel_token", "after", "linear"),
    ("overflow", "bf16", "-", "linear"),  # batched format only: a rank over max_num_tokens must raise
    # DeepSeek-V3's layout (E=256, topk=8; 32 local experts per rank at world size 8)
    ("uneven", "fp8_block128", "before", "linear", "dsv3"),
    ("uneven", "fp8_block128", "after", "linear", "dsv3"),
    ("one_rank", "bf16", "-", "linear", "dsv3"),
    ("padded", "fp8_block128", "before", "round_robin", "dsv3"),
]


def default_timeout() -> float:
    """Seconds a collective may wait (the process group's timeout); ``MOE_DIST_TIMEOUT``, default 60."""
    return float(os.environ.get("MOE_DIST_TIMEOUT", "60"))


@dataclass(frozen=True)
class DistCase:
    world_size: int
    scenario: str  # uneven | one_rank | padded | weight_on_input | overflow
    scheme: str  # bf16 | fp8_block128 | fp8_channel_token
    quant: str  # before | after | - (unquantized)
    placement: str  # linear | round_robin
    layout: str = "synthetic"  # synthetic (E=32, topk=4) | dsv3 (E=256, topk=8): LAYOUTS

    @property
    def id(self) -> str:
        q = "" if self.quant == "-" else f"-q{self.quant}"
        lay = "" if self.layout == "synthetic" else f"-{self.layout}"
        return f"w{self.world_size}-{self.scenario}-{self.scheme}{q}-{self.placement}{lay}"

    @property
    def seed(self) -> int:
        """From the id without the quantization placement: before/after dispatch see the same inputs."""
        lay = "" if self.layout == "synthetic" else f"-{self.layout}"
        return seed_of(f"distributed-w{self.world_size}-{self.scenario}-{self.scheme}-{self.placement}{lay}")

    @property
    def E(self) -> int:  # noqa: N802 (vLLM's name)
        return LAYOUTS[self.layout][0]

    @property
    def model(self) -> str:
        return LAYOUTS[self.layout][2]

    @property
    def topk(self) -> int:
        return 1 if self.scenario == "weight_on_input" else LAYOUTS[self.layout][1]

    @property
    def apply_router_weight_on_input(self) -> bool:
        return self.scenario == "weight_on_input"

    def tokens_per_rank(self) -> list[int]:
        """Uneven, with a rank holding none (rank 1; rank 0 in ``one_rank``, the rank every token goes to)."""
        N = self.world_size
        if self.scenario == "one_rank":
            return [0 if r == 0 else 2 + r for r in range(N)] if N > 1 else [5]
        return [0 if r == 1 else 3 + (5 * r + 2) % 8 for r in range(N)]

    def max_num_tokens(self) -> int:
        """The batched format's per-rank capacity: the largest rank's tokens (one less in ``overflow``)."""
        cap = max(max(self.tokens_per_rank()), 1)
        return cap - 1 if self.scenario == "overflow" else cap


def dist_cases(world_sizes: list[int]) -> list[DistCase]:
    """Every scenario at every world size (a scenario's fifth field, if any, is its layout)."""
    return [DistCase(n, *s) for n in world_sizes for s in SCENARIOS]


# ------------------------------------------------------------------------------------------------------------
# Inputs: drawn from the case's seed, identically in the parent (reference) and in every rank.
# ------------------------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


@lru_cache(maxsize=2)
def _layer_weights(E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 ``w1 (E, 2I, K)``, ``w2 (E, K, I)`` of a layer of E experts (the same for every case of that layout)."""
    g = _gen(seed_of(f"distributed-weights-E{E}-K{K}-I{I}"))
    w1 = (torch.randn(E, 2 * I, K, generator=g) * K**-0.5).to(DTYPE)
    w2 = (torch.randn(E, K, I, generator=g) * I**-0.5).to(DTYPE)
    return w1, w2


@lru_cache(maxsize=4)
def make_global_inputs(case: DistCase) -> dict:
    """The layer's bf16 weights for all E experts and the union of the ranks' tokens with their routing (CPU; cached:
    callers only read it)."""
    E = case.E
    w1, w2 = _layer_weights(E)
    g = _gen(case.seed)
    sizes = case.tokens_per_rank()
    M = sum(sizes)
    hidden = torch.randn(M, K, generator=g).to(DTYPE)
    logits = torch.randn(M, E, generator=g)
    if case.scenario == "one_rank":  # every route to the experts of rank 0
        _, emap, _ = determine_expert_map(case.world_size, 0, E, case.placement)
        if emap is not None:
            logits[:, emap < 0] = -1e4
    weights, ids = fused_topk(hidden, logits, case.topk, renormalize=case.topk > 1)
    if case.scenario == "padded":  # -1 padding: ~30% of the routes, and every route of each rank's first token
        drop = torch.rand(M, case.topk, generator=g) < 0.3
        starts = torch.tensor([sum(sizes[:r]) for r in range(len(sizes)) if sizes[r] > 0], dtype=torch.long)
        drop[starts] = True
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    return {"w1": w1, "w2": w2, "hidden": hidden, "topk_weights": weights, "topk_ids": ids, "sizes": sizes}


def moe_config_for(case: DistCase, rank: int, num_local_experts: int) -> FusedMoEConfig:
    return FusedMoEConfig(num_experts=case.E, experts_per_token=case.topk, hidden_dim=K, intermediate_size_per_partition=I,
                          num_local_experts=num_local_experts, activation=ACTIVATION, in_dtype=DTYPE,
                          moe_parallel_config=FusedMoEParallelConfig.make_ep(case.world_size, rank))


def rank_shard(case: DistCase, rank: int, gi: dict | None = None):
    """Rank ``rank``'s experts: ``(w1, w2, quant_config, expert_map, num_local)`` on the CPU, quantized locally
    (every scheme here quantizes per expert, so this equals slicing the quantized layer)."""
    gi = make_global_inputs(case) if gi is None else gi
    if gi["w1"] is _layer_weights(case.E)[0] and gi["w2"] is _layer_weights(case.E)[1]:
        return _quantized_shard(case.E, case.scheme, case.world_size, rank, case.placement)
    return _shard(gi["w1"], gi["w2"], case.E, case.scheme, case.world_size, rank, case.placement)


def _shard(w1_all, w2_all, E, scheme, world_size, rank, placement):
    num_local, emap, _ = determine_expert_map(world_size, rank, E, placement)
    if emap is None:
        held = torch.arange(E)
    else:  # global expert of each local index
        held = torch.empty(num_local, dtype=torch.long)
        held[emap[emap >= 0].long()] = (emap >= 0).nonzero().squeeze(1)
    w1, w2, qc = quantize_weights(scheme, w1_all[held], w2_all[held])
    return w1, w2, qc, emap, num_local


@lru_cache(maxsize=32)
def _quantized_shard(E, scheme, world_size, rank, placement):
    """``_shard`` of the layout's own weights, cached: the weights do not depend on the case (callers only read it;
    quantizing DeepSeek-V3's 256 experts again for every case cost seconds a case on the CPU)."""
    w1_all, w2_all = _layer_weights(E)
    return _shard(w1_all, w2_all, E, scheme, world_size, rank, placement)


def make_rank_inputs(case: DistCase, rank: int, device) -> dict:
    """Rank ``rank``'s share: its tokens, its experts, its ``expert_map`` and ``FusedMoEConfig``, on ``device``."""
    from conformance.inputs import to_device as _to

    gi = make_global_inputs(case)
    sizes = gi["sizes"]
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    w1, w2, qc, emap, num_local = rank_shard(case, rank, gi)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return {"hidden": to(gi["hidden"][rows]), "topk_weights": to(gi["topk_weights"][rows]),
            "topk_ids": to(gi["topk_ids"][rows]), "w1": to(w1), "w2": to(w2), "quant_config": _to(qc, device),
            "expert_map": to(emap), "moe_config": moe_config_for(case, rank, num_local), "sizes": sizes}


def single_process_output(case: DistCase) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_experts`` over all E experts on the union of all ranks' tokens, in one process, and the call's values
    at GEMM2's input for the error model's heavy event (``reference.experts.fused_experts_with_heavy``): every route
    is held by some rank, and each rank's activation of a route is this one's."""
    gi = make_global_inputs(case)
    w1, w2, qc = _quantized_shard(case.E, case.scheme, 1, 0, "linear")[:3]  # all E experts
    return fused_experts_with_heavy(gi["hidden"], w1, w2, gi["topk_weights"], gi["topk_ids"], quant_config=qc,
                                    activation=ACTIVATION, global_num_experts=case.E,
                                    apply_router_weight_on_input=case.apply_router_weight_on_input)


def expected_output(case: DistCase, combine: str | None = None) -> torch.Tensor:
    """The layer on the union of all ranks' tokens, in one process. ``combine=None``: ``fused_experts`` over all E
    experts; ``"partials"`` / ``"routes"``: ``reference.distributed.fused_experts_ep`` over the ranks' shards (the
    standard formats' combine rounds each rank's partial output once more; the batched one is ``fused_experts``)."""
    gi = make_global_inputs(case)
    kw = dict(activation=ACTIVATION, global_num_experts=case.E,
              apply_router_weight_on_input=case.apply_router_weight_on_input)
    if combine is None:
        return single_process_output(case)[0]
    shards = [rank_shard(case, r, gi)[:4] for r in range(case.world_size)]
    return fused_experts_ep(gi["hidden"], gi["topk_weights"], gi["topk_ids"], shards, combine=combine, **kw)


def pack_tensor(t: torch.Tensor) -> bytes:
    """A tensor as bytes (``torch.save`` of its CPU copy), to cross the rank queues."""
    buf = io.BytesIO()
    torch.save(t.detach().cpu(), buf)
    return buf.getvalue()


def unpack_tensor(b: bytes) -> torch.Tensor:
    """The inverse of ``pack_tensor`` (CPU tensor)."""
    return torch.load(io.BytesIO(b), weights_only=True)


def _is_batched(cls) -> bool:
    return cls.activation_format() == FusedMoEActivationFormat.BatchedExperts


def run_rank_case(rank: int, world_size: int, device, case: DistCase, pf_cls: type, experts_cls: type) -> dict:
    """One rank's part of a case (runs in the spawned rank): ``{"out": bytes}``, or ``{"raised": message}`` for the
    ``overflow`` scenario, where raising is the required behaviour."""
    inp = make_rank_inputs(case, rank, device)
    qc, moe_config = inp["quant_config"], inp["moe_config"]
    cap = case.max_num_tokens()
    pf = pf_cls(group=None, moe_config=moe_config, max_num_tokens=cap, expert_placement_strategy=case.placement,
                quantize_after_dispatch=case.quant == "after")
    if _is_batched(experts_cls):
        experts = experts_cls(moe_config, qc, max_num_tokens=cap, num_dispatchers=world_size)
    else:
        experts = experts_cls(moe_config, qc)
    kernel = EPFusedMoEKernel(pf, experts, poison=float("nan"))
    try:
        out = kernel.apply(inp["hidden"], inp["w1"], inp["w2"], inp["topk_weights"], inp["topk_ids"],
                           activation=ACTIVATION, global_num_experts=case.E, expert_map=inp["expert_map"],
                           apply_router_weight_on_input=case.apply_router_weight_on_input)
    except Exception as exc:
        if case.scenario == "overflow":
            return {"raised": f"{type(exc).__name__}: {exc}"}
        hint = ""
        if _is_batched(experts_cls):
            T = cap * world_size
            _, _, out_shape = experts.workspace_shapes(T, inp["w1"].shape[1], K, case.topk, case.E,
                                                       moe_config.num_local_experts, None, ACTIVATION)
            if tuple(out_shape)[:2] != (moe_config.num_local_experts, T):
                hint = (f"\n  {experts_cls.__name__}.workspace_shapes gives an output of {tuple(out_shape)} but the "
                        f"batched dispatch delivers slots of max_num_tokens * num_dispatchers = {cap} * {world_size} "
                        f"= {T} rows per local expert (vLLM BatchedTritonExperts.workspace_shapes)")
        raise RuntimeError(f"{type(exc).__name__}: {exc}{hint}") from exc
    return {"out": pack_tensor(out)}


# ------------------------------------------------------------------------------------------------------------
# The ranks: spawned once per world size, fed jobs through queues.
# ------------------------------------------------------------------------------------------------------------


class RankFailure(RuntimeError):
    """Some ranks raised, died or did not answer in time; the message names each of them."""


def _rank_main(rank, world_size, init_file, dist_backend, device, timeout_s, inq, outq):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
        else:
            dev = torch.device("cpu")
        extra = {"device_id": dev} if device == "cuda" else {}  # NCCL: bind the rank to its GPU eagerly
        dist.init_process_group(dist_backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **extra)
    except BaseException:
        outq.put(("error", rank, 0, traceback.format_exc()))
        return
    outq.put(("ready", rank, 0, None))
    while True:
        job = inq.get()
        if job is None:
            break
        job_id, fn, args = job
        try:
            outq.put(("ok", rank, job_id, fn(rank, world_size, dev, *args)))
        except BaseException:
            outq.put(("error", rank, job_id, traceback.format_exc(limit=8)))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _ping(rank, world_size, device, nonce):
    """Health check: every rank gathers the nonce; a group left misaligned by a failed case gives wrong values."""
    import torch.distributed as dist

    t = torch.tensor([nonce, rank], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t)
    return [p.tolist() for p in parts] == [[nonce, r] for r in range(world_size)]


class RankCluster:
    """``world_size`` spawned ranks in one process group (gloo on CPU, NCCL with ``device="cuda"``, rank r on
    ``cuda:r``). ``run(fn, *args)`` calls ``fn(rank, world_size, device, *args)`` on every rank (``fn`` a module-level
    function) and returns the results in rank order, or raises ``RankFailure`` naming the ranks that raised, died or
    did not answer within ``timeout`` (default: the collective timeout + 30 s)."""

    def __init__(self, world_size: int, device: str = "cpu", timeout_s: float | None = None,
                 startup_s: float = 300.0):
        self.world_size = world_size
        self.device = device
        self.timeout_s = default_timeout() if timeout_s is None else timeout_s
        self.dist_backend = "nccl" if device == "cuda" else "gloo"
        ctx = torch.multiprocessing.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="moe-dist-")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._out = ctx.Queue()
        self._in = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_rank_main, daemon=True, name=f"moe-dist-rank{r}",
                                   args=(r, world_size, init_file, self.dist_backend, device, self.timeout_s,
                                         self._in[r], self._out))
                       for r in range(world_size)]
        self._job = 0
        self.healthy = True
        for p in self._procs:
            p.start()
        ready, errors, missing = self._collect(0, startup_s)
        if errors or missing:
            self.close()
            raise RankFailure(self._describe(errors, missing, startup_s, "starting the process group"))

    def _collect(self, job_id: int, timeout: float) -> tuple[dict, dict, list[int]]:
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        grace = None  # once a rank failed, the others get a short grace (they may be stuck in a collective)
        while len(results) + len(errors) < self.world_size:
            now = time.monotonic()
            end = deadline if grace is None else min(deadline, grace)
            if now >= end:
                break
            try:
                kind, rank, jid, payload = self._out.get(timeout=min(1.0, end - now))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in results and r not in errors and not p.is_alive():
                        errors[r] = f"rank process died (exit code {p.exitcode})"
                        grace = grace or time.monotonic() + 5.0
                continue
            if jid != job_id:
                continue  # a late answer to an earlier, failed job
            if kind == "error":
                errors[rank] = payload
                grace = grace or time.monotonic() + min(10.0, self.timeout_s + 5.0)
            else:
                results[rank] = payload
        missing = [r for r in range(self.world_size) if r not in results and r not in errors]
        return results, errors, missing

    def _describe(self, errors: dict, missing: list[int], timeout: float, what: str) -> str:
        lines = [f"{len(errors) + len(missing)} of {self.world_size} ranks failed {what}:"]
        for r in sorted(errors):
            lines.append(f"  rank {r} raised:\n    " + errors[r].strip().replace("\n", "\n    "))
        for r in missing:
            lines.append(f"  rank {r} did not answer within {timeout:.0f} s (hung collective or stuck rank)")
        return "\n".join(lines)

    def run(self, fn, *args, timeout: float | None = None) -> list:
        if not self.healthy:
            raise RankFailure("this cluster failed an earlier job; start a new one")
        timeout = self.timeout_s + 30.0 if timeout is None else timeout
        self._job += 1
        for q in self._in:
            q.put((self._job, fn, args))
        results, errors, missing = self._collect(self._job, timeout)
        if errors or missing:
            self.healthy = not missing and self._still_aligned()
            raise RankFailure(self._describe(errors, missing, timeout, f"job {getattr(fn, '__name__', fn)}"))
        return [results[r] for r in range(self.world_size)]

    def _still_aligned(self) -> bool:
        """After a failed job whose ranks all answered: can the group still be used (no half-done collective)?"""
        self._job += 1
        for q in self._in:
            q.put((self._job, _ping, (self._job,)))
        results, errors, missing = self._collect(self._job, min(self.timeout_s, 20.0) + 5.0)
        return not errors and not missing and all(results.values())

    def close(self) -> None:
        for q in self._in:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:  # ranks stuck in a collective
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._dir.cleanup()


class ClusterPool:
    """One live ``RankCluster`` per (world size, device), restarted after a failure that left it unusable."""

    def __init__(self):
        self._clusters: dict[tuple[int, str], RankCluster] = {}

    def get(self, world_size: int, device: str) -> RankCluster:
        key = (world_size, device)
        c = self._clusters.get(key)
        if c is not None and not c.healthy:
            c.close()
            c = None
        if c is None:
            c = self._clusters[key] = RankCluster(world_size, device)
        return c

    def close(self) -> None:
        for c in self._clusters.values():
            c.close()
        self._clusters.clear()
