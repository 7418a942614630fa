"""Per-rank timing of the distributed MoE step (dispatch, experts, combine) over N ranks, next to the single-GPU
experts step and the NCCL collectives alone at the same bytes.

    python -m benchmarks --distributed --backend triton --world-size 2,4                 # DeepSeek-V3 EP, M 1..4096
    python -m benchmarks.distributed --backend triton --world-size 4 --ms 1,64 --json out.json
    python -m benchmarks.distributed --backend torch --world-size 2 --shape small --ms 1,8   # CPU, gloo (tests)

Each world size starts N ranks (``Ranks``: spawned processes, NCCL with rank r on ``cuda:r``, gloo on the CPU, as
the conformance suite's ``RankCluster``). Every rank holds its ``determine_expert_map`` ("linear") share of the layer
(``--shape dsv3``: DeepSeek-V3, E=256, topk=8, K=7168, I=2048, FP8 1x128-block activations and 128x128-block
weights, quantized by the reference as conformance does; ``--shape small``: the conformance suite's synthetic layer,
E=32, topk=4, K=256, I=128, bf16) and M tokens of its own, routed by top-k of random logits over all E experts
(uniform load; DeepSeek's grouped top-k is not modelled). For each prepare/finalize pair
(``reference.distributed.REFERENCE_PREPARE_FINALIZE`` and the backend's own ``Backend.prepare_finalize``) and each of
the backend's experts classes of that pair's activation format that claims the rank's configuration, the step runs
through ``reference.distributed.EPFusedMoEKernel``:

- ``dispatch``: ``prepare`` (quantization + the all-to-all / all-gather), ``experts``: from the end of prepare to the
  start of finalize (the experts on the received rows; ``compute`` in the JSON), ``combine``: ``finalize`` (weight-and-reduce + the reverse
  collective), ``step``: all three. Device time between CUDA events recorded around the phases on each rank's stream
  (the reference pairs synchronise with the host for their counts, so the events bracket real work); wall clock on
  the CPU. Every repetition starts after a barrier; the median over ``--reps`` repetitions per rank is reported.
- ``1-GPU experts``: ``FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts)`` on the same rank's local experts with
  M tokens routed top-k over them (the ``dsv3_ep8`` benchmark shape's convention): the step without communication.
- ``NCCL alone``: ``all_to_all_single`` of uint8 rows with the dispatch's per-destination byte counts of the
  all-to-all pair (codes + scales + ids + weights per row), the same for the combine (bf16 partials back), and
  ``all_gather_into_tensor`` of the all-gather pair's M rows; and, once per world size, an ``all_reduce`` of 1 GiB
  bf16 (the machine's reference bus bandwidth).

Bus bandwidth (nccl-tests' convention): all-to-all and all-gather ``busbw = bytes_out_of_rank / time`` where
``bytes_out_of_rank`` counts only bytes leaving the rank (a row a rank keeps is not moved); the step's busbw counts the
bytes the dispatch and the combine move off the rank, over the step time; all-reduce ``busbw = 2 (N-1)/N * S / t``.
The table gives the slowest rank's median (the step is as slow as its slowest rank) and the per-rank medians.

The batched pair (DeepEP low-latency layout) allocates ``E_local * M * N`` rows per expert slot set; above
``--batched-max-m`` (default 1024) it is not run (reason in the table): DeepEP's low-latency path is the decode path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

from benchmarks.timing import time_samples

__all__ = ["main", "bench_rank", "traffic_bytes", "render", "SHAPES"]

# (E, topk, K, I, scheme, dtype)
SHAPES = {
    "dsv3": dict(E=256, topk=8, K=7168, I=2048, scheme="fp8_block128", label="DeepSeek-V3 (E=256, topk=8, K=7168, "
                 "I=2048, fp8_block128)"),
    "small": dict(E=32, topk=4, K=256, I=128, scheme="bf16", label="synthetic (E=32, topk=4, K=256, I=128, bf16)"),
    "small_fp8": dict(E=32, topk=4, K=256, I=128, scheme="fp8_block128",
                      label="synthetic (E=32, topk=4, K=256, I=128, fp8_block128)"),
}
DEFAULT_MS = (1, 64, 1024, 4096)


def _log(*a) -> None:
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------------------
# Bytes each pair moves off a rank
# ------------------------------------------------------------------------------------------------------------


def traffic_bytes(kind: str, topk_ids: torch.Tensor, owner: torch.Tensor, rank: int, world_size: int,
                  row_bytes: int, out_row_bytes: int, sizes: list[int]) -> dict:
    """Bytes this rank sends to *other* ranks in the dispatch and in the combine, per destination.

    Args:
        kind: ``"allgather"`` (every row to every rank; the combine returns each other rank's partial of this rank's
            received rows), ``"alltoall"`` (each token once to every other rank holding one of its experts; partials
            back), ``"batched"`` (each (token, k) route to its expert's rank; one output row back per route).
        topk_ids: this rank's ``(M, topk)`` global expert ids (-1: no route). owner: ``(E,)`` rank of each expert.
        row_bytes: bytes of one dispatched row (codes + scales + ids + weights). out_row_bytes: one combined row.
        sizes: every rank's token count (the all-gather's combine sends this rank's partials of other ranks' tokens).

    Returns:
        ``{"dispatch": [bytes to rank r], "combine": [bytes to rank r]}`` (0 for r == rank).
    """
    W = world_size
    M = topk_ids.shape[0]
    disp, comb = [0] * W, [0] * W
    ids = topk_ids.long().cpu()
    valid = ids >= 0
    dest = torch.where(valid, owner[ids.clamp(min=0)], torch.full_like(ids, -1))
    for r in range(W):
        if r == rank:
            continue
        if kind == "allgather":
            disp[r] = M * row_bytes
            comb[r] = sizes[r] * out_row_bytes  # this rank's partial of rank r's tokens goes back to r
        elif kind == "alltoall":
            n = int((dest == r).any(dim=1).sum())
            disp[r] = n * row_bytes
            comb[r] = n * out_row_bytes  # symmetric: counted on the sending side of the dispatch
        elif kind == "batched":
            n = int((dest == r).sum())
            disp[r] = n * row_bytes
            comb[r] = n * out_row_bytes
        else:
            raise ValueError(f"unknown traffic kind {kind!r}")
    return {"dispatch": disp, "combine": comb}


def _pf_kind(pf_cls) -> str:
    from reference.distributed import DeepEPLLPrepareAndFinalize, MoEPrepareAndFinalizeNaiveDPEPModular
    from reference.modular import FusedMoEActivationFormat

    if issubclass(pf_cls, MoEPrepareAndFinalizeNaiveDPEPModular):
        return "allgather"
    if issubclass(pf_cls, DeepEPLLPrepareAndFinalize):
        return "batched"
    fmt = getattr(pf_cls, "activation_format", None)
    try:
        fmt = fmt.fget(None) if isinstance(fmt, property) else None
    except Exception:
        fmt = None
    return "batched" if fmt == FusedMoEActivationFormat.BatchedExperts else "alltoall"


# ------------------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------------------

_RANK_STATE: dict = {}


class _PhaseTimer:
    """Events (or host clocks on the CPU) around prepare and finalize of one prepare/finalize instance."""

    def __init__(self, pf, device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        prep, fin = pf.prepare, pf.finalize

        def mark():
            if self.cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.marks.append(e)
            else:
                self.marks.append(time.perf_counter())

        def prepare(*a, **kw):
            mark()
            out = prep(*a, **kw)
            mark()
            return out

        def finalize(*a, **kw):
            mark()
            out = fin(*a, **kw)
            mark()
            return out

        pf.prepare, pf.finalize = prepare, finalize
        self.mark = mark

    def phases(self) -> dict:
        """Seconds of dispatch, experts, combine and step from the last four marks."""
        m = self.marks[-4:]
        if self.cuda:
            m[-1].synchronize()
            d = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
        else:
            d = lambda a, b: b - a  # noqa: E731
        return {"dispatch": d(m[0], m[1]), "compute": d(m[1], m[2]), "combine": d(m[2], m[3]), "step": d(m[0], m[3])}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, reps: int, warmup: int, barrier: bool) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` calls (``benchmarks.timing.time_samples``); each
    timed call after a barrier of all ranks when ``barrier``."""
    import torch.distributed as dist

    return time_samples(fn, device, reps=reps, warmup=warmup, before=dist.barrier if barrier else None)


def _layer(spec: dict, rank: int, world_size: int, device):
    """This rank's quantized local experts (cached per process): ``(w1, w2, qc, expert_map, num_local, owner)``."""
    from reference.distributed import expert_placement
    from reference.routing import determine_expert_map
    from reference.schemes import quantize_weights

    key = ("layer", spec["E"], spec["K"], spec["I"], spec["scheme"], world_size)
    if key in _RANK_STATE:
        return _RANK_STATE[key]
    _RANK_STATE.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    E, K, I = spec["E"], spec["K"], spec["I"]
    num_local, emap, _ = determine_expert_map(world_size, rank, E, "linear")
    num_local = E if emap is None else num_local
    g = torch.Generator(device=device)
    g.manual_seed(1000 + rank)
    w1 = (torch.randn(num_local, 2 * I, K, generator=g, device=device) * K**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_local, K, I, generator=g, device=device) * I**-0.5).to(torch.bfloat16)
    w1, w2, qc = quantize_weights(spec["scheme"], w1, w2)
    owner, _ = expert_placement(E, world_size, "linear")
    out = (w1, w2, qc, None if emap is None else emap.to(device), num_local, owner)
    _RANK_STATE[key] = out
    return out


def _moe_config(spec, rank, world_size, num_local, ep=True):
    from reference.activation import MoEActivation
    from reference.config import FusedMoEConfig, FusedMoEParallelConfig

    return FusedMoEConfig(num_experts=spec["E"] if ep else num_local, experts_per_token=spec["topk"],
                          hidden_dim=spec["K"], intermediate_size_per_partition=spec["I"],
                          num_local_experts=num_local, activation=MoEActivation.SILU, in_dtype=torch.bfloat16,
                          moe_parallel_config=FusedMoEParallelConfig.make_ep(world_size if ep else 1,
                                                                             rank if ep else 0))


def _claims(cls, moe_config, qc, fmt) -> tuple[bool, str | None]:
    try:
        return cls.is_supported_config(cls, moe_config, qc.weight_key, qc.activation_key, fmt)
    except Exception as exc:  # a claim that raises is not a claim
        return False, f"is_supported_config raised {type(exc).__name__}: {exc}"


def _make_experts(cls, moe_config, qc, cap, world_size):
    from reference.modular import FusedMoEActivationFormat

    if cls.activation_format() == FusedMoEActivationFormat.BatchedExperts:
        return cls(moe_config, qc, max_num_tokens=cap, num_dispatchers=world_size)
    return cls(moe_config, qc)


def _tokens(spec, M, rank, device, E_route):
    from reference.routing import fused_topk

    g = torch.Generator(device=device)
    g.manual_seed(7919 * M + rank)
    x = torch.randn(M, spec["K"], generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(M, E_route, generator=g, device=device)
    w, ids = fused_topk(x, logits, min(spec["topk"], E_route), renormalize=True)
    return x, w, ids


def _row_bytes(spec, qc, topk) -> tuple[int, int]:
    """Bytes of one dispatched row (codes, scales, topk ids int64 and weights fp32) and of one combined row."""
    K = spec["K"]
    if qc.a1.dtype is None:
        codes, scales = 2 * K, 0
    else:
        codes = K * torch.empty((), dtype=qc.a1.dtype).element_size()
        scales = 4 * (K // 128 if spec["scheme"].startswith("fp8_block") else 1)
    return codes + scales + topk * (8 + 4), 2 * K


def bench_rank(rank: int, world_size: int, device, spec: dict, M: int, pf_names: list[str], backend_spec: str,
               reps: int, warmup: int, batched_max_m: int) -> dict:
    """One M on one rank: every (pair, experts class) step, the 1-GPU experts step and the collectives alone.
    Returns ``{"rows": [...], "collectives": {...}}`` with per-rank seconds (medians) and bytes."""
    import torch.distributed as dist

    from backends import load_backend
    from reference.distributed import EPFusedMoEKernel, REFERENCE_PREPARE_FINALIZE
    from reference.activation import MoEActivation
    from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP

    backend = load_backend(backend_spec)
    w1, w2, qc, emap, num_local, owner = _layer(spec, rank, world_size, device)
    E, topk = spec["E"], spec["topk"]
    sizes = [M] * world_size
    x, tw, ids = _tokens(spec, M, rank, device, E)
    row_b, out_b = _row_bytes(spec, qc, topk)
    cfg = _moe_config(spec, rank, world_size, num_local)
    pfs = [p for p in (*REFERENCE_PREPARE_FINALIZE, *getattr(backend, "prepare_finalize", ()))
           if not pf_names or p.__name__ in pf_names]
    rows = []
    for pf_cls in pfs:
        kind = _pf_kind(pf_cls)
        traffic = traffic_bytes(kind, ids, owner, rank, world_size, row_b, out_b, sizes)
        fmt = (FusedMoEActivationFormat.BatchedExperts if kind == "batched" else FusedMoEActivationFormat.Standard)
        for ex_cls in backend.experts:
            if ex_cls.activation_format() != fmt:
                continue
            row = {"pair": pf_cls.__name__, "experts": ex_cls.__name__, "kind": kind,
                   "sent_dispatch": sum(traffic["dispatch"]), "sent_combine": sum(traffic["combine"])}
            ok, reason = _claims(ex_cls, cfg, qc, fmt)
            if ok and kind == "batched" and M > batched_max_m:
                ok, reason = False, f"batched slots of E_local x M*N rows: not run above M={batched_max_m}"
            # every rank must agree to run (collectives): a claim that differs between ranks skips everywhere
            flag = torch.tensor([1 if ok else 0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if not int(flag.item()):
                row["skipped"] = reason or "not claimed on every rank"
                rows.append(row)
                continue
            try:
                pf = pf_cls(group=None, moe_config=cfg, max_num_tokens=max(M, 1),
                            expert_placement_strategy="linear", quantize_after_dispatch=False)
                experts = _make_experts(ex_cls, cfg, qc, max(M, 1), world_size)
                kernel = EPFusedMoEKernel(pf, experts)
                timer = _PhaseTimer(pf, device)
                phases = []

                def step():
                    kernel.apply(x, w1, w2, tw, ids, activation=MoEActivation.SILU, global_num_experts=E,
                                 expert_map=emap)

                for i in range(warmup + reps):
                    if i >= warmup:
                        dist.barrier()
                        _sync(device)
                    step()
                    if i >= warmup:
                        phases.append(timer.phases())
                for k in ("dispatch", "compute", "combine", "step"):
                    row[k] = statistics.median(p[k] for p in phases)
                # the same experts class alone on one GPU: M tokens routed over the local experts, no communication
                cfg1 = _moe_config(spec, rank, world_size, num_local, ep=False)
                ok1, reason1 = _claims(ex_cls, cfg1, qc, fmt)
                if ok1 and fmt == FusedMoEActivationFormat.Standard:
                    x1, tw1, ids1 = _tokens(spec, M, rank + 101, device, num_local)
                    k1 = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), _make_experts(ex_cls, cfg1, qc, max(M, 1), 1))
                    row["single"] = statistics.median(_time(
                        lambda: k1.apply(x1, w1, w2, tw1, ids1, activation=MoEActivation.SILU,
                                         global_num_experts=num_local), device, reps, warmup, barrier=False))
                elif not ok1:
                    row["single_note"] = reason1
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                row["traceback"] = traceback.format_exc(limit=6)[-1500:]
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    colls = _collectives(rank, world_size, device, ids, owner, row_b, out_b, sizes, reps, warmup)
    return {"rank": rank, "M": M, "rows": rows, "collectives": colls}


def _collectives(rank, world_size, device, ids, owner, row_b, out_b, sizes, reps, warmup) -> dict:
    """NCCL (gloo) alone: the all-to-all's dispatch and combine byte splits, and the all-gather of M rows."""
    import torch.distributed as dist

    W = world_size
    out = {}
    a2a = traffic_bytes("alltoall", ids, owner, rank, W, row_b, out_b, sizes)
    for phase, per_dest in (("a2a_dispatch", a2a["dispatch"]), ("a2a_combine", a2a["combine"])):
        send = torch.tensor(per_dest, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        recv_l = recv.tolist()
        src = torch.zeros(sum(per_dest), dtype=torch.uint8, device=device)
        dst = torch.empty(sum(recv_l), dtype=torch.uint8, device=device)
        t = _time(lambda: dist.all_to_all_single(dst, src, output_split_sizes=recv_l, input_split_sizes=per_dest),
                  device, reps, warmup, barrier=True)
        out[phase] = {"s": statistics.median(t), "bytes_out": sum(per_dest)}
    M = ids.shape[0]
    n = max(M * row_b, 1)
    src = torch.zeros(n, dtype=torch.uint8, device=device)
    dst = torch.empty(n * W, dtype=torch.uint8, device=device)
    t = _time(lambda: dist.all_gather_into_tensor(dst, src), device, reps, warmup, barrier=True)
    out["allgather"] = {"s": statistics.median(t), "bytes_out": n * (W - 1)}
    return out


def allreduce_rank(rank: int, world_size: int, device, nbytes: int, reps: int) -> dict:
    """All-reduce of ``nbytes`` bf16 (the machine's reference bus bandwidth): median seconds on this rank."""
    import torch.distributed as dist

    t = torch.ones(max(nbytes // 2, 1), dtype=torch.bfloat16, device=device)
    s = statistics.median(_time(lambda: dist.all_reduce(t), device, reps, 2, barrier=True))
    return {"rank": rank, "s": s, "bytes": t.numel() * 2}


def env_rank(rank: int, world_size: int, device) -> dict:
    info = {"torch": torch.__version__, "host": platform.node()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:
            info["nccl"] = f"unknown ({type(exc).__name__})"
        info["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE")
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


# ------------------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------------------


def _us(s) -> str:
    return "·" if s is None else f"{s * 1e6:.1f}" if s < 1e-5 else f"{s * 1e6:.0f}"


def _gbs(b, s) -> str:
    return "·" if not s or b is None else f"{b / s / 1e9:.1f}"


def summarize(per_rank: list[dict]) -> tuple[list[dict], dict]:
    """Merge the ranks' results of one (world size, M): rows keyed by (pair, experts) with the slowest rank's
    median per phase, each rank's step, the bytes off the busiest rank; collectives likewise."""
    rows = []
    for i, r0 in enumerate(per_rank[0]["rows"]):
        rr = [p["rows"][i] for p in per_rank]
        row = {k: r0[k] for k in ("pair", "experts", "kind")}
        err = next((r.get("error") for r in rr if r.get("error")), None)
        if r0.get("skipped"):
            row["skipped"] = r0["skipped"]
        elif err:
            row["error"] = err
            row["traceback"] = next(r.get("traceback") for r in rr if r.get("error"))
        else:
            for k in ("dispatch", "compute", "combine", "step", "single"):
                vals = [r.get(k) for r in rr]
                row[k] = max(vals) if all(v is not None for v in vals) else None
            row["step_per_rank"] = [r["step"] for r in rr]
            row["bytes_out"] = max(r["sent_dispatch"] + r["sent_combine"] for r in rr)
            if any(r.get("single_note") for r in rr):
                row["single_note"] = next(r["single_note"] for r in rr if r.get("single_note"))
        rows.append(row)
    colls = {}
    for k in per_rank[0]["collectives"]:
        vals = [p["collectives"][k] for p in per_rank]
        colls[k] = {"s": max(v["s"] for v in vals), "bytes_out": max(v["bytes_out"] for v in vals)}
    return rows, colls


def render(result: dict) -> str:
    """Markdown: per world size, the all-reduce reference, then one table per M."""
    lines = [f"# Distributed MoE step: `{result['backend']}`, {result['shape_label']}", ""]
    env = result.get("env", {})
    lines.append(f"- device: {env.get('gpu') or env.get('cpu')}; torch {env.get('torch')}; "
                 f"NCCL {env.get('nccl', '-')}; NCCL_NVLS_ENABLE={env.get('NCCL_NVLS_ENABLE')}; "
                 f"{result['time']}; {result['reps']} repetitions (median per rank; the slowest rank shown)")
    lines.append(f"- command: `{result['command']}`")
    lines.append("- times in µs; busbw in GB/s = bytes leaving the busiest rank / time (all-reduce: 2(N-1)/N S/t); "
                 "`% AR` = the step's or collective's busbw over the all-reduce's")
    lines.append("")
    for ws in result["world_sizes"]:
        W = ws["world_size"]
        ar = ws.get("allreduce")
        ar_bw = 2 * (W - 1) / W * ar["bytes"] / ar["s"] if ar else None
        lines += [f"## world size {W}", ""]
        if ar:
            lines.append(f"all-reduce of {ar['bytes'] / 2**30:.2f} GiB bf16: {ar['s'] * 1e3:.2f} ms, busbw "
                         f"{ar_bw / 1e9:.0f} GB/s")
            lines.append("")
        lines.append("| M/rank | pair | experts class | dispatch | experts | combine | step | step per rank | 1-GPU experts "
                     "| MB off rank | step busbw | % AR |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for m in ws["ms"]:
            M = m["M"]
            for r in m["rows"]:
                if r.get("skipped") or r.get("error"):
                    what = f"skipped: {r['skipped']}" if r.get("skipped") else f"**error**: {r['error'][:160]}"
                    lines.append(f"| {M} | {r['pair']} | {r['experts']} | {what} |||||||||")
                    continue
                bw = r["bytes_out"] / r["step"] if r["step"] else None
                pct = f"{100 * bw / ar_bw:.1f}" if bw and ar_bw else "·"
                single = _us(r.get("single")) if r.get("single") is not None else "·"
                lines.append(f"| {M} | {r['pair']} | {r['experts']} | {_us(r['dispatch'])} | {_us(r['compute'])} | "
                             f"{_us(r['combine'])} | {_us(r['step'])} | "
                             f"{' / '.join(_us(s) for s in r['step_per_rank'])} | {single} | "
                             f"{r['bytes_out'] / 1e6:.2f} | {_gbs(r['bytes_out'], r['step'])} | {pct} |")
        lines += ["", "NCCL alone, same bytes (slowest rank):", "",
                  "| M/rank | collective | MB off rank | time | busbw | % AR |", "|---|---|---|---|---|---|"]
        for m in ws["ms"]:
            for k, v in m["collectives"].items():
                bw = v["bytes_out"] / v["s"] if v["s"] else None
                pct = f"{100 * bw / ar_bw:.1f}" if bw and ar_bw else "·"
                lines.append(f"| {m['M']} | {k} | {v['bytes_out'] / 1e6:.2f} | {_us(v['s'])} | "
                             f"{_gbs(v['bytes_out'], v['s'])} | {pct} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------
# The ranks (the benchmarks may not import the conformance suite's RankCluster: tests/test_layers.py)
# ------------------------------------------------------------------------------------------------------------


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time; the message names it."""


def _rank_main(rank, world_size, init_file, device, timeout_s, inq, outq):
    from datetime import timedelta

    import torch.distributed as dist

    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
        else:
            torch.set_num_threads(1)
            dev = torch.device("cpu")
        extra = {"device_id": dev} if device == "cuda" else {}
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s), **extra)
    except BaseException:
        outq.put((rank, 0, False, traceback.format_exc()))
        return
    while True:
        job = inq.get()
        if job is None:
            break
        jid, fn, a = job
        try:
            outq.put((rank, jid, True, fn(rank, world_size, dev, *a)))
        except BaseException:
            outq.put((rank, jid, False, traceback.format_exc(limit=8)))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class Ranks:
    """``world_size`` spawned ranks in one process group (NCCL with rank r on ``cuda:r``, gloo on the CPU);
    ``run(fn, *args, timeout=...)`` calls ``fn(rank, world_size, device, *args)`` on every rank (``fn`` a module-level
    function) and returns the results in rank order, or raises ``RankFailure``."""

    def __init__(self, world_size: int, device: str, timeout_s: float = 120.0):
        import tempfile

        ctx = torch.multiprocessing.get_context("spawn")
        self.world_size, self._job = world_size, 0
        self._dir = tempfile.TemporaryDirectory(prefix="moe-bench-dist-")
        init = os.path.join(self._dir.name, "rendezvous")
        self._out = ctx.Queue()
        self._in = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_rank_main, daemon=True, args=(r, world_size, init, device, timeout_s,
                                                                        self._in[r], self._out))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 600.0) -> list:
        import queue

        self._job += 1
        for q in self._in:
            q.put((self._job, fn, args))
        results: dict = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailure(f"ranks {sorted(set(range(self.world_size)) - set(results))} did not answer "
                                  f"{getattr(fn, '__name__', fn)} within {timeout:.0f} s")
            try:
                rank, jid, ok, payload = self._out.get(timeout=min(1.0, left))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                if dead:
                    raise RankFailure(f"rank(s) {dead} died (exit codes "
                                      f"{[self._procs[r].exitcode for r in dead]})") from None
                continue
            if not ok:
                raise RankFailure(f"rank {rank} raised in {getattr(fn, '__name__', fn)}:\n{payload}")
            if jid == self._job:
                results[rank] = payload
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._in:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._dir.cleanup()


# ------------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.splitlines()[0],
                                 epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True, help="registered backend name or module:attribute")
    ap.add_argument("--world-size", default="2", help="comma-separated world sizes (default 2)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="dsv3 (default on a GPU backend) or small (default on the CPU)")
    ap.add_argument("--ms", default=None, help="tokens per rank, comma-separated (default 1,64,1024,4096)")
    ap.add_argument("--pairs", default="", help="comma-separated prepare/finalize class names (default: all)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batched-max-m", type=int, default=1024)
    ap.add_argument("--allreduce-bytes", type=int, default=None, help="default 1 GiB on CUDA, 8 MiB on the CPU")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--md", default=None, help="write the Markdown table here")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one M may take on the ranks")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from backends import load_backend

    backend = load_backend(args.backend)
    reason = backend.unavailable_reason()
    if reason is not None:
        _log(f"benchmarks.distributed: backend {backend.name} cannot run here: {reason}")
        return 2
    device = "cuda" if backend.device == "cuda" else "cpu"
    shape = args.shape or ("dsv3" if device == "cuda" else "small")
    spec = SHAPES[shape]
    ms = [int(m) for m in args.ms.split(",")] if args.ms else list(DEFAULT_MS)
    sizes = [int(w) for w in str(args.world_size).split(",")]
    pairs = [p for p in args.pairs.split(",") if p]
    ar_bytes = args.allreduce_bytes or (2**30 if device == "cuda" else 8 * 2**20)
    result = {"backend": backend.name, "shape": shape, "shape_label": spec["label"], "reps": args.reps,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "python -m benchmarks.distributed " + " ".join(sys.argv[1:] if argv is None else argv),
              "world_sizes": []}
    rc = 0
    for W in sizes:
        if device == "cuda" and torch.cuda.device_count() < W:
            _log(f"world size {W}: needs {W} GPUs, this machine has {torch.cuda.device_count()}; not run")
            continue
        t0 = time.monotonic()
        cluster = Ranks(W, device, timeout_s=max(60.0, args.timeout / 3))
        ws = {"world_size": W, "ms": []}
        try:
            env = cluster.run(env_rank)[0]
            result.setdefault("env", env)
            ar = cluster.run(allreduce_rank, ar_bytes, args.reps, timeout=args.timeout)
            ws["allreduce"] = {"s": max(a["s"] for a in ar), "bytes": ar[0]["bytes"]}
            for M in ms:
                per_rank = cluster.run(bench_rank, spec, M, pairs, args.backend, args.reps, args.warmup,
                                       args.batched_max_m, timeout=args.timeout)
                rows, colls = summarize(per_rank)
                ws["ms"].append({"M": M, "rows": rows, "collectives": colls})
                errs = [r for r in rows if r.get("error")]
                rc = rc or (1 if errs else 0)
                _log(f"[w{W} M={M}] {len(rows)} rows ({len(errs)} errors), {time.monotonic() - t0:.0f} s")
                for r in errs:
                    _log(f"  {r['pair']} + {r['experts']}: {r['error']}\n{r.get('traceback', '')}")
        except RankFailure as exc:
            _log(f"world size {W}: {exc}")
            ws["failure"] = str(exc)[:4000]
            rc = 1
        finally:
            cluster.close()
        result["world_sizes"].append(ws)
    text = render(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
