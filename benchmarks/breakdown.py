"""Per-kernel breakdown of a backend's whole experts step (or its GEMM stage beside vLLM's), on a GPU: where the time goes.

    python -m benchmarks.breakdown --backend deep_gemm --shapes dsv3_ep8-fp8_block128 --ms 8,64,4096
    python -m benchmarks.breakdown --backend cuda --shapes qwen3_30b-bf16 --ms 1,1024
    python -m benchmarks.breakdown --backend deep_gemm --ms 8 --expected-m 1,4,16,64
    python -m benchmarks.breakdown --backend triton --gemms --peer vllm --vllm-src DIR --shapes qwen3_30b-fp8_block128 --ms 1,8

The step is the benchmark's (``benchmarks.harness``: the same weights, rotating inputs, ``FusedMoEKernel``, and
``--prepare``: the backend's own quantizers in prepare by default, as ``python -m benchmarks``) for each
standard-format experts class of the backend that claims the shape, timed by ``benchmarks.timing`` in a CUDA
graph; then ``torch.profiler`` records 3 graph replays and each kernel's device time per call is listed in
launch order with the mean gap before it (its start minus the previous kernel's end: launch gaps, graph nodes that
are not kernels, waits) or, where a kernel launched with programmatic dependent launch starts before the previous one
ends, the overlap (its device time then includes its wait), then the sum, the overlap and the idle time (graph time -
(sum - overlap)), and the same rounds' time after a second of rest, each with its SM clock, power and power-cap
share (``timing.ClockSampler``): an "idle" that the rested rounds do not show is clocks, not gaps.
``--profile-range`` times nothing: each stage is called eagerly (twice to compile and warm up), then once more between
``cudaProfilerStart`` and ``cudaProfilerStop``, for an external profiler started with ``--profile-from-start off``
(compare Nsight Compute's elapsed cycles: the SM clock still moves under the power cap during its replays, 1.2-1.5
GHz on the H200)::

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats python -m benchmarks.breakdown \
        --backend triton --gemms --peer vllm --vllm-src DIR --shapes mixtral_tp2-fp8_tensor --ms 1024 --profile-range

``--expected-m`` (deep_gemm) times the step once per ``expected_m`` hint of the masked GEMMs (M < 128) instead of
``backends.deep_gemm.experts.expected_m_for``.
``--gemms`` breaks down the backend's GEMM-stage variants instead (``benchmarks/variants/<name>.py``: what
``python -m benchmarks`` times against vLLM), and ``--peer vllm`` vLLM's live GEMM1 + GEMM2 launches beside them, on the
same inputs (``benchmarks.peer_vllm``; its activation and requantization are precomputed, as in the bench): which of
the two GEMMs, or the kernel between them, makes the difference of a row; with vLLM's compiled activation and
requantization ops (``benchmarks.vllm_ops``, built on the GPU machine) also its whole GEMM stage (``vllm <version>
chain``), so those kernels are listed too.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _steps(backend: str, shape_id: str, M: int, prepare: str = "backend"):
    """``[(class name, call(i), n_sets, device)]`` of the backend's standard-format classes claiming the shape."""
    from backends import load_backend
    from benchmarks import harness, shapes, timing
    from benchmarks.harness import ExpertsParam

    b = load_backend(backend)
    shape = shapes.experts_shape(shape_id)
    dev = torch.device("cuda")
    inp = harness.experts_inputs(shape, M, dev, timing.device_info()["l2_bytes"])
    out = []
    for cls in b.experts:
        p = ExpertsParam(shape, M, b.name, cls)
        if harness.standard_modular(cls) and harness.supported(p)[0]:
            call, _ = harness.make_experts_call(p, inp, prepare=prepare)
            out.append((cls.__name__, call, len(inp.sets), dev))
    return out


def _gemm_stages(backend: str, shape_id: str, M: int, vllm=None):
    """``[(name, call(i), n_sets, device)]``: the backend's GEMM-stage variants (``benchmarks.variants.for_backend``)
    and, with ``vllm`` (a ``peer_vllm.VllmTriton``), vLLM's GEMM1 + GEMM2 launches on the same inputs."""
    from benchmarks import harness, shapes, timing
    from benchmarks.variants import for_backend

    hook = for_backend(backend)
    shape = shapes.experts_shape(shape_id)
    dev = torch.device("cuda")
    inp = harness.experts_inputs(shape, M, dev, timing.device_info()["l2_bytes"])
    n = len(inp.sets)
    out = [(name, call, n, dev) for name, call in hook.variants(shape, M, inp, dev)]
    if vllm is not None:
        from benchmarks import peer_vllm

        try:
            name, call, _ = peer_vllm.gemms_variant(vllm, shape, M, inp, dev)
            out.append((name, call, n, dev))
        except NotImplementedError as exc:  # a scheme vLLM's kernel does not run: the backend's rows still print
            print(f"{shape_id} M={M} {vllm.title}: not run: {exc}", flush=True)
            return out
        if vllm.ops is not None:  # its whole GEMM stage, its compiled activation and requantization between
            try:
                name, call = peer_vllm.chain_variant(vllm, shape, M, inp, dev)
                out.append((name, call, n, dev))
            except NotImplementedError as exc:
                print(f"{shape_id} M={M} {vllm.chain_title}: not run: {exc}", flush=True)
    if not out:
        print(f"{shape_id} M={M}: no GEMM-stage variant of {backend} covers this shape", flush=True)
    return out


def breakdown(call, n: int, dev, replays: int = 3) -> dict:
    """``{"graph_us", "kernels": [(position:name, us per call, us of gap before it)], "sum_us"}`` of ``call(i)``
    (i < n)."""
    from benchmarks import timing

    m, runner = timing.measure(call, n, dev, keep_runner=True, clocks=True)
    try:
        burst_us, rested = None, ""
        if getattr(runner, "graph", None) is not None:
            # the same rounds after a rest (the profiled replays below start from rested clocks too), their clocks
            time.sleep(1.0)
            with timing.ClockSampler(dev, period_ms=1) as sampler:
                per_call = sorted(timing.timed_rounds(runner, replays))
            burst_us, rested = per_call[len(per_call) // 2] * 1e6, sampler.summary()
        kernels = [(name[:90], us, gap) for name, us, gap in timing.kernel_timeline(runner, replays)]
    finally:
        runner.close()
    # a negative gap is an overlap with the kernel before (programmatic dependent launch): counted once in busy time
    overlap = -sum(min(gap, 0.0) for _, _, gap in kernels)
    return dict(graph_us=m.seconds * 1e6, kernels=kernels, sum_us=sum(t for _, t, _ in kernels), overlap_us=overlap,
                burst_us=burst_us, clocks=timing.clock_summary(m.clocks), rested_clocks=rested)


def profile_range(name: str, call, dev) -> None:
    """``call(0)`` twice (compiles, warms up), then once between ``cudaProfilerStart`` and ``cudaProfilerStop``."""
    for _ in range(2):
        call(0)
    torch.cuda.synchronize(dev)
    print(f"  profiled: {name}", flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    call(0)
    torch.cuda.synchronize(dev)
    torch.cuda.cudart().cudaProfilerStop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", required=True, help="registered backend name")
    ap.add_argument("--shapes", default="", help="comma-separated shape ids (default: the backend's suite)")
    ap.add_argument("--ms", default="1,8,64,1024,4096")
    ap.add_argument("--expected-m", default="", help="deep_gemm: expected_m hints to time (M < 128 only)")
    ap.add_argument("--gemms", action="store_true",
                    help="the backend's GEMM-stage variants (what the bench sets against vLLM), not the whole step")
    ap.add_argument("--peer", choices=("vllm",), default=None,
                    help="with --gemms: vLLM's live GEMM1 + GEMM2 launches beside them")
    ap.add_argument("--vllm-src", default=None, metavar="PATH", help="vLLM's source (see python -m benchmarks --help)")
    ap.add_argument("--prepare", choices=("backend", "reference"), default="backend",
                    help="the step's activation quantizers: the backend's own ops (default) or the reference's")
    ap.add_argument("--profile-range", action="store_true",
                    help="time nothing: call each stage once between cudaProfilerStart / Stop (for ncu "
                         "--profile-from-start off)")
    args = ap.parse_args(argv)
    if args.profile_range and args.expected_m:
        ap.error("--profile-range calls each stage once for a profiler; it does not combine with --expected-m")
    if args.peer and not args.gemms:
        ap.error("--peer vllm breaks down vLLM's GEMM launches beside the backend's GEMM stage: add --gemms")
    if args.vllm_src and not args.peer:
        ap.error("--vllm-src is vLLM's source for --peer vllm: add --gemms --peer vllm")
    if args.gemms and args.expected_m:
        ap.error("--expected-m times deep_gemm's whole step per hint; it does not combine with --gemms")
    if args.gemms:
        from benchmarks.variants import for_backend

        if for_backend(args.backend) is None:
            ap.error(f"backend {args.backend!r} has no GEMM-stage variants (benchmarks/variants/): "
                     "--gemms breaks down what `python -m benchmarks` sets against vLLM")
    if not torch.cuda.is_available():
        print("breakdown: needs a CUDA GPU")
        return 2
    from benchmarks import suites, timing

    vllm = None
    if args.peer == "vllm":
        from benchmarks import peer_vllm

        try:
            vllm = peer_vllm.load(args.vllm_src)
        except peer_vllm.PeerUnavailable as exc:
            print(f"breakdown: --peer vllm: {exc}")
            return 2
        peer_vllm.attach_ops(vllm, log=print)
        if vllm.ops is None:
            print(f"breakdown: vLLM's compiled activation / requantization ops not available (GEMM launches only): "
                  f"{vllm.ops_error}")

    shape_ids = [s for s in args.shapes.split(",") if s] or list(suites.suite(args.backend).experts)
    ms = [int(t) for t in args.ms.split(",") if t]
    for sid in shape_ids:
        for M in ms:
            if args.expected_m:
                from backends.deep_gemm import experts as X

                default = X.expected_m_for
                cells = []
                try:
                    for em in [int(t) for t in args.expected_m.split(",") if t]:
                        X.expected_m_for = lambda M, topk, E, em=em: em
                        for name, call, n, dev in _steps(args.backend, sid, M, args.prepare):
                            cells.append(f"{name} {em}: {timing.measure(call, n, dev).seconds * 1e6:.1f}")
                finally:
                    X.expected_m_for = default
                print(f"{sid} M={M} step us by expected_m: " + ", ".join(cells), flush=True)
                continue
            try:
                steps = (_gemm_stages(args.backend, sid, M, vllm) if args.gemms
                         else _steps(args.backend, sid, M, args.prepare))
            except Exception as exc:  # noqa: BLE001 - one failing case does not stop the others
                print(f"{sid} M={M}: {type(exc).__name__}: {exc}", flush=True)
                continue
            for name, call, n, dev in steps:
                if args.profile_range:
                    print(f"{sid} M={M} {name}:", flush=True)
                    profile_range(name, call, dev)
                    continue
                try:
                    b = breakdown(call, n, dev)
                except Exception as exc:  # noqa: BLE001
                    print(f"{sid} M={M} {name}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                ov = b["overlap_us"]
                print(f"\n{sid} M={M} {name}: graph {b['graph_us']:.1f} us per step, kernels {b['sum_us']:.1f} us"
                      + (f" ({ov:.1f} us of it overlapping the kernel before: PDL)" if ov > 0.05 else "")
                      + f", idle {b['graph_us'] - b['sum_us'] + ov:.1f} us", flush=True)
                if b["burst_us"] is not None:
                    print(f"  the rounds after 1 s of rest: {b['burst_us']:.1f} us per step "
                          f"({b['rested_clocks'] or 'clocks not sampled'}); the timed rounds: "
                          f"{b['clocks'] or 'clocks not sampled'}", flush=True)
                for kname, us, gap in b["kernels"]:
                    where = f"gap before {gap:6.1f}" if gap >= 0 else f"overlap    {-gap:6.1f}"
                    print(f"  {us:8.1f} us  ({where})  {kname}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
