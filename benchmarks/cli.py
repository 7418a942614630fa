"""``python -m benchmarks --backend NAME``: one backend's side-by-side table (the per-backend bench scripts' table).

    python -m benchmarks --backend triton                    # the triton suite (< 8 minutes on an H200)
    python -m benchmarks --backend triton --quick            # M in the suite's quick_M
    python -m benchmarks --backend cuda --shapes qwen3_30b-bf16 --ms 1,64 --json out.json
    python -m benchmarks --backend torch                     # CPU: the scaled-down shapes, wall clock
    python -m benchmarks --backend triton --list             # what the suite runs, nothing timed
    python -m benchmarks --backend triton --peer vllm --vllm-src /tmp/vcache/vllm-0.33.0   # vLLM's kernel live
    python -m benchmarks --distributed --backend triton --world-size 2,4   # EP over N ranks: benchmarks/distributed.py

What runs is data: ``benchmarks/suites.toml`` (shapes, token counts, the peer, router-gate shapes) and
``benchmarks/peers.toml`` (the peers' reference figures). For each experts shape and M:

1. inputs from ``benchmarks.harness`` (weights quantized by the reference as conformance does, rotating input sets
   and weight copies whose bytes exceed the L2, so decode is measured from HBM);
2. each experts class of the backend that claims the configuration, through
   ``FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls)`` (the ``step`` column: the whole layer call, prepare + experts
   + finalize; ``--prepare backend``, the default, quantizes the activations in prepare with the backend's own ops,
   as a serving user runs the layer; ``--prepare reference`` with the reference's torch ops, the same for every
   backend); up to the suite's ``check_max_M`` its output is first checked against the reference with the error
   model's bound (``benchmarks.check``; a failing class is not timed);
3. the backend's own extra variants, if ``benchmarks/variants/`` has a module for it (``variants.VARIANTS``; the GEMM
   stage alone, which the peers' figures time): ``variants(shape, M, inputs, device) -> [(name, call(i))]``,
   ``extra(shape, inputs) -> {column: text}``, ``gate_variants(gate_shape, M, sets) -> [(name, call(i))]``, each
   optional;
4. timing by ``benchmarks.timing`` (the whole call captured in a CUDA graph and replayed, median of rounds; a row's
   columns round for round in turn, ``timing.measure_interleaved``, unless ``--timing sequential``; with ``--aa``
   an A/A twin of the compared column, built anew, in the same rounds, whose spread widens each speedup's interval;
   a call that cannot be captured is timed eagerly between CUDA events and the reason is printed and recorded in
   ``graph_errors``; wall clock on CPU); floor and roofline by ``benchmarks.roofline`` on the ceilings
   ``benchmarks.timing.measure_ceilings`` measures in the same run. ``step / gemms`` (suites that compare
   ``gemms``) is what the step adds around its GEMM stage.

``--peer vllm`` (suites that compare ``gemms``: triton, deep_gemm) replaces the stored figures with vLLM's own Triton
``fused_moe_kernel`` and tuned configs, read from an installed vllm or its source (``--vllm-src`` / ``$MOE_VLLM_SRC``;
``benchmarks.peer_vllm``), timed in this run on the same weights and routings (GEMM1 + GEMM2 launches, as the stored
figures), after its output is checked against the reference like the backend's classes; ``--peer none`` shows no
peer. The table is printed last (``benchmarks.report.render_suite``). Exit status: 0, 1 if a check failed or a variant
raised, 2 if the backend cannot run here (the reason is printed: no CUDA GPU, missing package, capability).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

__all__ = ["main", "parse_args", "run_suite"]

NOT_HERE = 2


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                 epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True, help="registered backend name or module:attribute")
    ap.add_argument("--shapes", type=_csv, default=[], help="comma-separated shape ids or aliases (default: suite)")
    ap.add_argument("--ms", type=_ints, default=[], help="comma-separated token counts (default: suite's M)")
    ap.add_argument("--quick", action="store_true", help="the suite's quick_M only")
    ap.add_argument("--no-check", action="store_true", help="time without checking outputs against the reference")
    ap.add_argument("--no-gate", action="store_true", help="skip the router-gate table")
    ap.add_argument("--list", action="store_true", help="print what the suite runs and exit (no device needed)")
    ap.add_argument("--peer", choices=("stored", "vllm", "none"), default="stored",
                    help="stored: the suite's figures of benchmarks/peers.toml (default); vllm: vLLM's Triton "
                         "fused_moe_kernel timed live here (--vllm-src); none: no peer column")
    ap.add_argument("--vllm-src", default=None, metavar="PATH",
                    help="vLLM source for --peer vllm: an unpacked sdist, an sdist .tar.gz, a vllm package directory "
                         "or a `python -m benchmarks.peer_vllm slice` tree (default: $MOE_VLLM_SRC, else an installed "
                         "vllm, never imported)")
    ap.add_argument("--prepare", choices=("backend", "reference"), default="backend",
                    help="the step's activation quantizers in prepare: the backend's own ops (default: what a "
                         "serving user runs) or the reference's torch ops (the same for every backend)")
    ap.add_argument("--timing", choices=("interleaved", "sequential"), default="interleaved",
                    help="interleaved (default): a row's columns (step, gemms, the peer) timed round for round in "
                         "turn, so a speedup is taken under the same clocks, with a 95%% interval from the paired "
                         "rounds; sequential: each column's rounds in one block, one column after the other")
    ap.add_argument("--aa", action="store_true",
                    help="A/A: in every row also time a second instance of the compared column (`gemms`, else the "
                         "step), its call built anew (its own CUDA graph and workspaces), and widen each speedup's "
                         "interval by the two instances' spread: the placement's share of a ratio, which the paired "
                         "rounds do not hold (an H200 read identical 16 us GEMM stages 0.992-1.024x of one another)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                    help="stop starting new (shape, M) rows after this many seconds (default: the suite's budget_s)")
    ap.add_argument("--json", default=None, help="write the results here (default: $OUT/benchmark-<backend>.json "
                                                 "when $OUT is set)")
    args = ap.parse_args(argv)
    if args.quick and args.ms:
        ap.error("--quick and --ms are exclusive")
    if args.vllm_src is not None and args.peer != "vllm":
        ap.error("--vllm-src goes with --peer vllm")
    if args.aa and args.timing != "interleaved":
        ap.error("--aa needs --timing interleaved (the twin is paired round for round with its column)")
    return args


def log(*a) -> None:
    print(*a, flush=True)


def _plan(args, suite):
    from benchmarks import shapes as S

    ids = [suite.resolve(s) for s in args.shapes] if args.shapes else list(suite.experts)
    experts = [S.experts_shape(i) for i in ids]
    ms = tuple(args.ms) if args.ms else (suite.quick_M if args.quick else suite.M)
    gates = [] if args.no_gate or args.shapes else suite.gate_shapes()
    gate_ms = tuple(args.ms) if args.ms else tuple(m for m in suite.gate_M if not args.quick or m in (1, 16))
    return experts, ms, gates, gate_ms


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--distributed" in argv:  # the distributed step over N ranks: benchmarks/distributed.py
        from benchmarks import distributed

        return distributed.main([a for a in argv if a != "--distributed"])
    args = parse_args(argv)
    from backends import BackendNotFound, load_backend
    from benchmarks import suites

    suite = suites.suite(args.backend)
    if args.budget_s is not None:
        suite = dataclasses.replace(suite, budget_s=args.budget_s)
    try:
        experts, ms, gates, gate_ms = _plan(args, suite)
    except KeyError as exc:
        log(f"benchmarks: {exc.args[0]}")
        return NOT_HERE
    live = None  # --peer vllm: the source root (the kernel is loaded once the backend can run)
    if args.peer == "vllm":
        if suite.compare != "gemms":
            log(f"benchmarks: --peer vllm: the {args.backend} suite has no GEMM-stage variant (compare = "
                f"{suite.compare or 'none'}) to set against vLLM's GEMM1 + GEMM2 launches; no peer column")
        else:
            from benchmarks import peer_vllm

            try:
                live = peer_vllm.find_source(args.vllm_src)
            except peer_vllm.PeerUnavailable as exc:
                log(f"benchmarks: --peer vllm: {exc}")
                return NOT_HERE
    if args.list:
        peer_text = (f"vLLM {peer_vllm.version_of(live)} (live) from {live}" if live is not None
                     else (suite.peer or "-") if args.peer == "stored" else "-")
        log(f"suite of {args.backend}: M {list(ms)}; check up to M={suite.check_max_M}; peer {peer_text}")
        for s in experts:
            log(f"  {s.id}: {s.label}")
        for g in gates:
            log(f"  {g.id}: {g.label} at M {list(gate_ms)}")
        return 0
    try:
        backend = load_backend(args.backend)
    except BackendNotFound as exc:
        log(f"benchmarks: {exc}")
        return NOT_HERE
    status = backend.availability_status()
    if status is not None:
        log(f"benchmarks: backend {args.backend!r} cannot run here: {status}")
        return NOT_HERE
    vllm = None
    if live is not None:
        from benchmarks import peer_vllm

        try:
            vllm = peer_vllm.load(live)
        except (peer_vllm.PeerUnavailable, ImportError) as exc:
            log(f"benchmarks: --peer vllm: cannot load vLLM's kernel from {live}: {exc}")
            return NOT_HERE
        log(f"peer: vLLM {vllm.version} fused_moe_kernel from {vllm.fused_moe_path} (kernel file {vllm.kernel_path})")
        peer_vllm.attach_ops(vllm, log=log)
        log("peer: vLLM's compiled activation / requantization ops: "
            + (f"loaded (column `{vllm.chain_title}`)" if vllm.ops is not None else
               f"not available, no `{vllm.chain_title}` column: {vllm.ops_error}"))
    doc = run_suite(backend, suite, experts, ms, gates, gate_ms, check=not args.no_check,
                    peer_mode="vllm" if vllm is not None else "none" if args.peer != "stored" else "stored",
                    vllm=vllm, prepare=args.prepare, timing_mode=args.timing, aa=args.aa)
    from benchmarks import report

    path = args.json or (os.path.join(os.environ["OUT"], f"benchmark-{args.backend}.json")
                         if os.environ.get("OUT") else None)
    if path:
        try:
            with open(path, "w") as f:
                json.dump(report._jsonable(doc), f, indent=1, default=str)
        except OSError as exc:
            doc["notes"].append(f"could not write {path}: {exc}")
    log()
    log(report.render_suite(doc))
    if path:
        log(f"written: {path}")
    return 1 if doc["failures"] else 0


def run_suite(backend, suite, experts, ms, gates, gate_ms, *, check: bool = True, peer_mode: str = "stored",
              vllm=None, prepare: str = "backend", timing_mode: str = "interleaved", aa: bool = False) -> dict:
    """Measure ``experts`` x ``ms`` (and the gate shapes) for ``backend``; the results document. ``peer_mode``:
    ``stored`` (the suite's peers.toml figures), ``vllm`` (``vllm``, a ``benchmarks.peer_vllm.VllmTriton``, timed
    live on every row) or ``none``; ``prepare``: the step's quantizers (``benchmarks.harness._prepare_for``);
    ``timing_mode``: ``interleaved`` (a row's columns round for round in turn, ``timing.measure_interleaved``) or
    ``sequential`` (each column's rounds in one block, one column after the other); ``aa``: an A/A twin of the
    compared column in every row (``_aa_twin``; interleaved only)."""
    import torch

    from benchmarks import harness, report, roofline, suites, timing, variants
    from benchmarks.harness import ExpertsParam

    t0 = time.time()
    device = torch.device(backend.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(int(os.environ.get("MOE_BENCH_CPU_THREADS", "1")))
    info = timing.device_info()
    log(f"[{time.time() - t0:6.1f}s] {backend.name} {backend.version} on {info['name']}, torch {info['torch']}")
    ceilings = timing.measure_ceilings(device)
    l2 = info.get("l2_bytes", 50 * 2**20)
    mm = ceilings["matmul_flops_per_s"]
    log(f"[{time.time() - t0:6.1f}s] ceilings: copy {report.fmt_rate(ceilings['copy_bytes_per_s'], 'B/s')}, "
        + ", ".join(f"{k} {report.fmt_rate(v, 'FLOP/s')}" for k, v in mm.items())
        + report.sustained_text(ceilings))
    sustained = roofline.sustained(ceilings)  # the GEMM ceilings as the rows are timed (GPU), None on the CPU
    settings = timing.Settings.from_env(device.type == "cuda")
    hook = variants.for_backend(backend.name)
    peer = suites.peer(suite.peer) if suite.peer and peer_mode == "stored" else None
    doc = {"backend": backend.name, "version": backend.version, "device": info, "ceilings": ceilings,
           "peer": None if peer is None else {k: getattr(peer, k) for k in ("name", "title", "device", "source",
                                                                             "measures", "unit")},
           "compare": suite.compare, "experts": [], "gate": [], "failures": [], "notes": [],
           "prepare_mode": prepare, "timing_mode": timing_mode}
    if vllm is not None:
        doc["peer"] = {"name": "vllm_live", "title": f"vLLM {vllm.version} (live)", "device": info.get("name"),
                       "source": f"{vllm.fused_moe_path} (fused_moe_kernel, tuned configs of its configs/; per row: "
                                 "extra.vllm_config)", "measures": "gemms", "unit": "us", "live": True,
                       "column": vllm.title, "version": vllm.version, "root": str(vllm.root),
                       "chain_column": vllm.chain_title if vllm.ops is not None else None,
                       "chain_error": vllm.ops_error}

    def fail(what: str, exc: BaseException) -> None:
        msg = f"{what}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        doc["failures"].append(msg)
        log(f"  FAILED {msg}")
        traceback.print_exc()

    for shape in experts:
        for M in ms:
            if time.time() - t0 > suite.budget_s:
                doc["notes"].append(f"time budget ({suite.budget_s:.0f} s; --budget-s) reached: {shape.id} M={M} "
                                    "not timed")
                continue
            row = {"case": shape.id, "label": shape.label, "M": M, "scheme": shape.scheme, "E": shape.E,
                   "topk": shape.topk, "K": shape.K, "I": shape.I, "times_s": {}, "methods": {}, "checks": {},
                   "extra": {}, "graph_errors": {}, "prepare_ops": {}}
            try:
                inp = harness.experts_inputs(shape, M, device, l2)
                if hook is not None and hasattr(hook, "extra"):
                    row["extra"] = dict(hook.extra(shape, inp))
            except Exception as exc:  # noqa: BLE001 - a bench survives a failing case
                fail(f"inputs {shape.id} M={M}", exc)
                continue
            floor_s, bound = inp.work.floor(ceilings)
            if sustained is not None:
                row["floor_sustained_s"] = inp.work.floor(sustained)[0]
            row.update(floor_s=floor_s, bound=bound, flops=inp.work.flops, bytes=inp.work.bytes,
                       touched=inp.touched, peer_s=peer.seconds(shape.id, M, inp.work.flops) if peer else None)
            classes = [c for c in backend.experts if harness.standard_modular(c)]
            claimed = []
            for cls in classes:
                ok, _ = harness.supported(ExpertsParam(shape, M, backend.name, cls))
                if ok:
                    claimed.append(cls)
            if not claimed:
                row["note"] = "no experts class claims this configuration"
            timed = []  # (column, call, graph key, class to check or None)
            for cls in claimed:
                name = "step" if len(claimed) == 1 else f"step:{cls.__name__}"
                row.setdefault("impl", cls.__name__)
                try:
                    call, prep = harness.make_experts_call(ExpertsParam(shape, M, backend.name, cls), inp,
                                                           prepare=prepare)
                    doc.setdefault("prepare", prep)
                    timed.append((name, call, cls.__name__, cls))
                except Exception as exc:  # noqa: BLE001
                    row["times_s"][name] = None
                    fail(f"{shape.id} M={M} {name}", exc)
            if hook is not None and hasattr(hook, "variants") and claimed:
                try:
                    timed += [(name, call, name, None) for name, call in hook.variants(shape, M, inp, device)]
                except Exception as exc:  # noqa: BLE001
                    fail(f"{shape.id} M={M} variants", exc)
            for other in suite.beside if claimed else ():
                timed += _beside(other, shape, M, inp, row, fail, prepare)
            if aa and claimed and timing_mode == "interleaved":
                timed += _aa_twin(timed, suite.compare, backend, hook, shape, M, inp, device, prepare, fail)
            if vllm is not None and claimed:
                timed += _vllm_peer(vllm, shape, M, inp, device, row, doc, check and M <= suite.check_max_M)
            _time_row(timed, row, doc, shape, M, inp, device, settings, backend.name, fail,
                      check=check and M <= suite.check_max_M, interleave=timing_mode == "interleaved")
            if vllm is not None:  # the peer's columns and check last
                row["times_s"][vllm.title] = row["times_s"].pop(vllm.title, None)
                if vllm.ops is not None:
                    row["times_s"][vllm.chain_title] = row["times_s"].pop(vllm.chain_title, None)
                    row["peer_chain_s"] = row["times_s"][vllm.chain_title]
                for k in (vllm.title, vllm.chain_title):
                    if k in row["checks"]:
                        row["checks"][k] = row["checks"].pop(k)
                row["peer_s"] = row["times_s"][vllm.title]
            doc["experts"].append(row)
            log(f"[{time.time() - t0:6.1f}s] {shape.id} M={M}: "
                + ", ".join(f"{k} {v * 1e6:.2f} us" if v else f"{k} -" for k, v in row["times_s"].items())
                + f"; floor {floor_s * 1e6:.2f} us" + (f"; {' '.join(row['checks'].values())}" if row["checks"]
                                                       else ""))
    for shape in gates:
        for M in gate_ms:
            try:
                row = _gate_row(backend, shape, M, device, l2, ceilings, settings, hook)
                doc["gate"].append(row)
                doc["failures"] += row["errors"]
                log(f"[{time.time() - t0:6.1f}s] {shape.id} M={M}: " + ", ".join(
                    f"{k} {v * 1e6:.2f} us" if v else f"{k} -" for k, v in row["times_s"].items()))
            except Exception as exc:  # noqa: BLE001
                fail(f"gate {shape.id} M={M}", exc)
    doc["wall_s"] = round(time.time() - t0, 1)
    return doc


def _aa_twin(timed: list, compare: str | None, backend, hook, shape, M: int, inp, device, prepare: str, fail) -> list:
    """``[(report.aa_column(ref), call, graph key, None)]``: a second instance of the row's compared column ``ref``
    (``compare`` where the row times it, else its first step column), the call built anew as the first was (the
    backend's ``variants`` hook, or ``harness.make_experts_call``): its own closure, CUDA graph and workspaces, so
    that the two read apart by what an instance's placement does to the time (``report.aa_spread``); ``[]`` where
    there is nothing to twin or the rebuild fails (``fail``)."""
    from benchmarks import harness, report
    from benchmarks.harness import ExpertsParam

    names = [t[0] for t in timed]
    ref = compare if compare in names else next((n for n in names if n.startswith("step")), None)
    if ref is None:
        return []
    _, _, key, cls = timed[names.index(ref)]
    try:
        if cls is None:  # a variant of the backend's hook (``gemms``)
            call = dict(hook.variants(shape, M, inp, device))[ref]
        else:
            call, _ = harness.make_experts_call(ExpertsParam(shape, M, backend.name, cls), inp, prepare=prepare)
    except Exception as exc:  # noqa: BLE001
        fail(f"{shape.id} M={M} A/A twin of {ref}", exc)
        return []
    return [(report.aa_column(ref), call, key, None)]


def _time_row(timed: list, row: dict, doc: dict, shape, M: int, inp, device, settings, backend_name: str, fail,
              *, check: bool, interleave: bool) -> None:
    """Check and time a row's columns (``timed``: ``[(column, call, graph key, class to check or None)]``) into
    ``row``: ``times_s``, ``methods``, ``clocks``, ``graph_errors``, ``prepare_ops``; interleaved, also
    ``rounds_s`` (each column's per-call seconds round by round, paired by index) and ``timing: "interleaved"``. A
    column whose check fails is not timed; one that raises fails alone (``fail``)."""
    from benchmarks import timing

    runners = {}  # column -> (prepared Runner, call); sequential: measured at once instead
    for name, call, key, cls in timed:
        row["times_s"][name] = None
        try:
            if cls is not None and check:
                c = _check(shape, M, cls, inp, call(0))
                row["checks"][name] = c.text
                if not c.ok:
                    doc["failures"].append(f"check {shape.id} M={M} {cls.__name__}: {c.text}")
                    log(f"  {shape.id} M={M} {name}: {c.text} (not timed)")
                    continue
            gkey = f"{backend_name}.{key}.{shape.scheme}"
            if interleave:
                r = timing.Runner(call, len(inp.sets), device, settings, graph_key=gkey)
                r.prepare()
                runners[name] = (r, call)
            else:
                _record(row, doc, shape, M, name, call, timing.measure(call, len(inp.sets), device, settings,
                                                                       graph_key=gkey, clocks=settings.clocks), device)
        except Exception as exc:  # noqa: BLE001
            fail(f"{shape.id} M={M} {name}", exc)
    if not runners:
        return
    try:
        got = timing.measure_interleaved({k: r for k, (r, _) in runners.items()}, clocks=settings.clocks)
    except Exception as exc:  # noqa: BLE001
        fail(f"{shape.id} M={M} interleaved timing of {', '.join(runners)}", exc)
        return
    finally:
        for r, _ in runners.values():
            r.close()
    row["timing"], row["rounds_s"] = "interleaved", got.rounds
    for name, (_, call) in runners.items():
        _record(row, doc, shape, M, name, call, got.measurements[name], device)


def _record(row: dict, doc: dict, shape, M: int, name: str, call, m, device) -> None:
    """One column's :class:`benchmarks.timing.Measurement` into ``row`` (and the run's clock note into ``doc``)."""
    row["times_s"][name], row["methods"][name] = m.seconds, m.method
    if m.clocks is not None:
        row.setdefault("clocks", {})[name] = m.clocks
    elif m.clocks_error and device.type == "cuda" and not doc.get("clocks_error"):
        doc["clocks_error"] = m.clocks_error
        doc["notes"].append(f"clocks not sampled: {m.clocks_error} (pip install nvidia-ml-py)")
    if device.type == "cuda" and m.method != "cuda-graph":
        row["graph_errors"][name] = m.graph_error or f"timed by {m.method}"
        log(f"  {shape.id} M={M} {name}: not captured in a CUDA graph, timed eagerly "
            f"(launch gaps included): {row['graph_errors'][name]}")
    used = _prepare_ops(call)
    if used is not None:
        row["prepare_ops"][name] = used


def _prepare_ops(call) -> str | None:
    """Which quantizers a step's prepare ran (``harness.make_experts_call``'s ``call.prepares``): the backend ops a
    ``BackendQuantPrepare`` called (``reference`` where it fell back to the reference's, ``unquantized``), or
    ``reference`` for the reference's prepare; None for a variant."""
    preps = getattr(call, "prepares", None)
    if preps is None:
        return None
    used = sorted({op for p in preps for op in getattr(p, "used", {})})
    return ", ".join(used) if used else "reference"


def _beside(name: str, shape, M: int, inp, row: dict, fail, prepare: str = "backend") -> list:
    """``[(column, call, graph key, class)]`` for the step of backend ``name`` (a suite's ``beside``) on the same
    inputs: its first standard-format experts class that claims the configuration; none (with a note) when the
    backend cannot run here or claims nothing."""
    from backends import BackendNotFound, load_backend
    from benchmarks import harness
    from benchmarks.harness import ExpertsParam

    try:
        other = load_backend(name)
    except BackendNotFound as exc:
        row.setdefault("notes", []).append(f"beside {name}: {exc}")
        return []
    status = other.availability_status()
    if status is not None:
        row.setdefault("notes", []).append(f"beside {name}: cannot run here: {status}")
        return []
    for cls in other.experts:
        p = ExpertsParam(shape, M, other.name, cls)
        if harness.standard_modular(cls) and harness.supported(p)[0]:
            try:
                call, _ = harness.make_experts_call(p, inp, prepare=prepare)
            except Exception as exc:  # noqa: BLE001
                fail(f"{shape.id} M={M} {name} step", exc)
                return []
            return [(f"{name} step", call, f"{name}.{cls.__name__}", cls)]
    row.setdefault("notes", []).append(f"beside {name}: no experts class claims this configuration")
    return []


def _vllm_peer(vllm, shape, M, inp, device, row, doc, check: bool) -> list:
    """``[(column, call, graph key, None)]`` for vLLM's live GEMM1 + GEMM2 and, with its compiled ops attached, its
    whole GEMM stage (``peer_vllm.chain_variant``), after its check (a failing or unsupported peer is reported, not
    timed: ``[]``; a shape the chain does not cover gets a note)."""
    from benchmarks import peer_vllm

    name = vllm.title
    try:
        name, call, source = peer_vllm.gemms_variant(vllm, shape, M, inp, device)
    except NotImplementedError as exc:
        row["extra"]["vllm_config"] = "-"
        note = f"{name}: {shape.id} not run: {exc}"
        if note not in doc["notes"]:
            doc["notes"].append(note)
        return []
    except Exception as exc:  # noqa: BLE001 - the peer fails alone
        msg = f"{shape.id} M={M} {name}: {type(exc).__name__}: {str(exc).strip()[:200]}"
        doc["failures"].append(msg)
        log(f"  FAILED {msg}")
        traceback.print_exc()
        return []
    row["extra"]["vllm_config"] = source

    def checked(column: str, stage: bool) -> bool:
        """The peer's check of one column (recorded in the row); False: not to be timed (a check that raised is a
        failure of the run, a peer outside its bound only a note: the peer's defect, not the backend's)."""
        if not check:
            return True
        try:
            c = peer_vllm.check(vllm, shape, M, inp, device, stage=stage)
        except Exception as exc:  # noqa: BLE001 - the peer fails alone
            doc["failures"].append(f"check {shape.id} M={M} {column}: {type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
            return False
        row["checks"][column] = f"{column}: {c.text}"
        if not c.ok:
            doc["notes"].append(f"check {shape.id} M={M} {column}: {c.text} (not timed)")
            log(f"  {shape.id} M={M} {column}: {c.text} (not timed)")
        return c.ok

    if not checked(name, stage=False):
        return []
    out = [(name, call, f"vllm{vllm.version}.gemms", None)]
    if vllm.ops is not None:  # the whole stage with vLLM's compiled ops: its own check, its own column
        try:
            chain_name, stage = peer_vllm.chain_variant(vllm, shape, M, inp, device)
        except NotImplementedError as exc:
            note = f"{vllm.chain_title}: {shape.id} not run: {exc}"
            if note not in doc["notes"]:
                doc["notes"].append(note)
            return out
        if checked(chain_name, stage=True):  # a failing chain leaves the GEMM-launch column timed
            out.append((chain_name, stage, f"vllm{vllm.version}.chain", None))
    return out


def _check(shape, M, cls, inp, out):
    from benchmarks.check import experts_bound, reference_output, verdict

    w1, w2, qc = inp.weights.copies[0]
    h, tw, ids = inp.sets[0]
    ref, heavy = reference_output(h, w1, w2, tw, ids, qc, heavy=True, activation=shape.activation,
                                  global_num_experts=shape.E)
    return verdict(out, ref.to(out.device), experts_bound(shape, qc, M, cls, heavy=heavy))


def _gate_row(backend, shape, M, device, l2, ceilings, settings, hook) -> dict:
    from benchmarks import harness, timing
    from benchmarks.harness import GateParam

    sets, work = harness.gate_inputs(shape, M, device, l2)
    floor_s, bound = work.floor(ceilings)
    row = {"case": shape.id, "label": shape.label, "M": M, "floor_s": floor_s, "bound": bound, "times_s": {},
           "methods": {}, "notes": {}}
    calls = []
    for op in shape.ops:
        if op in backend.ops:
            calls.append((op, GateParam(shape, M, backend.name, op)))
    for op in harness.TORCH_GATE_OPS.get(shape.id, ()):
        calls.append((op, GateParam(shape, M, "torch", op)))
    timed = []
    for name, p in calls:
        call, reason = harness.make_gate_call(p, sets)
        if call is None:
            row["notes"][name] = reason
            continue
        timed.append((name + (f"[{call.tier}]" if hasattr(call, "tier") else ""), call))
    row["errors"] = []
    if hook is not None and hasattr(hook, "gate_variants"):
        try:
            timed += list(hook.gate_variants(shape, M, sets))
        except Exception as exc:  # noqa: BLE001 - a failed build or check: reported, the other ops still timed
            row["errors"].append(f"gate {shape.id} M={M} variants: {type(exc).__name__}: {exc}"[:300])
    for name, call in timed:
        try:
            call(0)
            m = timing.measure(call, len(sets), device, settings, graph_key=f"gate.{name}")
            row["times_s"][name], row["methods"][name] = m.seconds, m.method
        except (NotImplementedError, ValueError) as exc:  # outside the op's contract here (test_bench_gate skips)
            row["times_s"][name] = None
            row["notes"][name] = f"{type(exc).__name__}: {str(exc).strip()[:100]}"
        except Exception as exc:  # noqa: BLE001
            row["times_s"][name] = None
            row["errors"].append(f"gate {shape.id} M={M} {name}: {type(exc).__name__}: {exc}"[:300])
    return row


if __name__ == "__main__":
    sys.exit(main())
