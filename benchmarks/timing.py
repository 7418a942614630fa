"""Timing done right (.library/device/METHOD.md, shared/facts/perf-anchors.md "Measuring right").

GPU: every call is timed on the device, never with a host clock around asynchronous launches.

1. Inputs rotate: the caller prepares ``n_sets`` independent input sets (activations and routing, and weight copies
   when the layer's weights are small) whose bytes together exceed the L2 several times (``rotation_sets``), and
   ``call(i)`` runs on set ``i``. Consecutive calls therefore never find their operands in the 50 MB L2: decode is
   measured from HBM, as it runs inside a model where other layers evict the cache.
2. Warm-up: every set runs once first (Triton JIT, autotuning, cuBLAS handles, allocator growth).
3. CUDA-graph replay: ``calls_per_round`` calls (>= ``n_sets`` and >= ~1 ms of work, so small problems are many
   calls per graph and launch gaps shrink, as vLLM's benchmark_moe.py does with 10 calls per graph) are captured in
   one graph; one round = one replay between two CUDA events; the per-call time is the round's device time divided
   by ``calls_per_round``. An implementation that cannot be captured (host synchronisation, data-dependent sizes read
   on the host) falls back to CUDA events around the same ``calls_per_round`` eager calls; the method is recorded
   (the ``method`` column) because eager timing includes launch gaps.
4. Many rounds (enough for ``MOE_BENCH_SECONDS`` of measurement, at least 5 or 10) and pytest-benchmark's median.

pytest-benchmark records whatever its timer returns: this suite's timer is ``measured_clock`` (set with
``@pytest.mark.benchmark(timer=measured_clock)``), the running sum of the *measured* seconds, so the difference
around one ``Runner.round`` is that round's per-call device time. The stored statistics (median, IQR, ...) are
device times, and ``--benchmark-compare-fail=median:10%`` gates on them.

CPU: the same protocol with ``time.perf_counter`` around one call per round (wall clock; the CPU has no device).

``MOE_BENCH_PLANTED_SLOWDOWN=<fraction>`` (for tests of the gate only): rounds of the ``torch`` backend take that
fraction longer (a CPU busy-wait, or ``torch.cuda._sleep`` inside the measured time on a GPU).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "measured_clock",
    "Settings",
    "Runner",
    "rotation_sets",
    "measure_ceilings",
    "device_info",
    "planted_slowdown",
    "median_time",
    "time_samples",
    "Measurement",
    "measure",
    "Interleaved",
    "measure_interleaved",
    "median_interval",
    "paired_ratio",
    "timed_rounds",
    "ClockSampler",
    "clock_summary",
    "CLOCK_EVENTS",
    "POWER_CAP",
]

_MEASURED = [0.0]


def measured_clock() -> float:
    """pytest-benchmark timer: total measured seconds so far (device time on a GPU, wall time on CPU)."""
    return _MEASURED[0]


def _add(seconds: float) -> None:
    _MEASURED[0] += seconds


def planted_slowdown() -> float:
    """``MOE_BENCH_PLANTED_SLOWDOWN`` as a fraction (0 when unset)."""
    return float(os.environ.get("MOE_BENCH_PLANTED_SLOWDOWN", "0") or 0)


@dataclass
class Settings:
    budget_s: float  # measured time to spend per benchmark (rounds = budget / round time, clamped)
    min_rounds: int = 10
    min_rounds_slow: int = 5  # when one round takes > 50 ms
    max_rounds: int = 300
    target_round_s: float = 1e-3  # graph / events rounds hold >= this much work
    max_calls_per_round: int = 256
    graphs: bool = True
    clocks: bool = True  # sample the GPU's clocks over the timed rounds (ClockSampler); MOE_BENCH_CLOCKS=0: off

    @staticmethod
    def from_env(on_gpu: bool) -> "Settings":
        budget = float(os.environ.get("MOE_BENCH_SECONDS", "0.5" if on_gpu else "0.15"))
        graphs = os.environ.get("MOE_BENCH_GRAPHS", "1").lower() not in ("0", "false", "no")
        clocks = os.environ.get("MOE_BENCH_CLOCKS", "1").lower() not in ("0", "false", "no")
        return Settings(budget_s=budget, graphs=graphs, clocks=clocks)


def rotation_sets(bytes_per_call: float, l2_bytes: int, *, min_sets: int = 2, max_sets: int = 16) -> int:
    """Input sets needed so that the bytes of the other sets touched between two uses of one set are >= 3 x L2."""
    need = math.ceil(4.0 * l2_bytes / max(bytes_per_call, 1.0))
    return max(min_sets, min(max_sets, need))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """Measures ``call(i)`` (``i`` in ``range(n_sets)``) and feeds ``measured_clock``.

    Use: ``r = Runner(call, n_sets, device, settings); r.prepare(); benchmark.pedantic(r.round, rounds=r.rounds,
    warmup_rounds=1)``; ``r.close()`` frees the graph. After ``prepare``: ``method`` (``cuda-graph``,
    ``cuda-events`` or ``wall-clock``), ``calls_per_round``, ``rounds``, ``graph_error`` (why capture failed).
    """

    def __init__(self, call: Callable[[int], object], n_sets: int, device: torch.device | str, settings: Settings,
                 *, slowdown: float = 0.0, allow_graph: bool = True, graph_key: str | None = None):
        self.call = call
        self.n_sets = max(1, int(n_sets))
        self.device = torch.device(device)
        self.settings = settings
        self.slowdown = float(slowdown)
        self.allow_graph = allow_graph and settings.graphs
        self.graph_key = graph_key  # an implementation whose capture failed once is timed eagerly from then on
        self.method = "?"
        self.calls_per_round = 1
        self.rounds = settings.min_rounds
        self.graph_error: str | None = None
        self.estimate_s = float("nan")
        self._graph = None
        self._next = 0

    # -- preparation -----------------------------------------------------------------------------------------
    def prepare(self) -> None:
        if self.device.type == "cuda":
            self._prepare_cuda()
        else:
            self._prepare_cpu()

    def _rounds_for(self, t_round: float) -> int:
        s = self.settings
        lo = s.min_rounds_slow if t_round > 0.05 else s.min_rounds
        return max(lo, min(s.max_rounds, math.ceil(s.budget_s / max(t_round, 1e-9))))

    def _prepare_cpu(self) -> None:
        for i in range(self.n_sets):
            self.call(i)
        t0 = time.perf_counter()
        for i in range(self.n_sets):
            self.call(i)
        self.estimate_s = (time.perf_counter() - t0) / self.n_sets
        self.method, self.calls_per_round = "wall-clock", 1
        self.rounds = self._rounds_for(self.estimate_s)

    def _prepare_cuda(self) -> None:
        s, n = self.settings, self.n_sets
        for i in range(max(n, 2)):  # warm-up: JIT compilation, autotuning, handles, allocator growth
            self.call(i % n)
        torch.cuda.synchronize(self.device)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._spin_cycles = int(_cycles_per_s(self.device) * 50e-6)  # ~50 us, see round()
        key = self.graph_key
        if self.allow_graph and key is not None and key in _GRAPH_FAILED:
            self.allow_graph = False
            self.graph_error = f"not captured: capture failed earlier for {key} ({_GRAPH_FAILED[key]})"
        if self.allow_graph:
            # One graph over the n sets gives the per-call graph time; recapture with enough calls for >= ~1 ms.
            self.calls_per_round = n
            if self._capture(n):
                per_call = median_time(self._graph.replay, self.device, reps=3, warmup=1) / n
                calls = max(n, min(s.max_calls_per_round, math.ceil(s.target_round_s / max(per_call, 1e-7))))
                calls = min(s.max_calls_per_round, math.ceil(calls / n) * n) if calls > n else n
                if calls > n:
                    self._graph = None
                    self.calls_per_round = calls
                    if not self._capture(calls):
                        self.calls_per_round = n
                        self._capture(n)
            elif key is not None:
                _GRAPH_FAILED[key] = self.graph_error
        if self._graph is not None:
            self.method = "cuda-graph"
            t_round = median_time(self.round_body, self.device, reps=3, warmup=1)
        else:
            self.method = "cuda-events"
            t_pass = median_time(lambda: [self.call(j) for j in range(n)], self.device, reps=1, warmup=0)
            per_call = t_pass / n
            calls = max(n, min(s.max_calls_per_round, math.ceil(s.target_round_s / max(per_call, 1e-7))))
            self.calls_per_round = math.ceil(calls / n) * n if calls > n else n
            t_round = per_call * self.calls_per_round
        self.estimate_s = t_round / self.calls_per_round
        self.rounds = self._rounds_for(t_round)

    def _capture(self, calls: int) -> bool:
        n = self.n_sets
        graph = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
                for i in range(n):
                    self.call(i)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(graph):
                for j in range(calls):
                    self.call(j % n)
            graph.replay()
            torch.cuda.synchronize(self.device)
            self._graph = graph
            return True
        except Exception as exc:  # host sync, unsupported op during capture, ...: time eagerly instead
            msg = str(exc).strip().splitlines()
            self.graph_error = f"{type(exc).__name__}: {msg[0] if msg else ''}"[:200]
            del graph
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
            self._graph = None
            return False

    def round_body(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self._eager_round_body()

    def _eager_round_body(self) -> None:
        n = self.n_sets
        for j in range(self.calls_per_round):
            self.call((self._next + j) % n)

    # -- one measured round ------------------------------------------------------------------------------------
    def round(self) -> None:
        if self.device.type != "cuda":
            i = self._next % self.n_sets
            self._next += 1
            t0 = time.perf_counter()
            self.call(i)
            t1 = time.perf_counter()
            if self.slowdown > 0:
                end = t1 + self.slowdown * (t1 - t0)
                while time.perf_counter() < end:
                    pass
            _add(time.perf_counter() - t0)
            return
        if self._graph is not None:
            # Keep the GPU busy while the host submits the graph, so the start event does not open on an idle GPU
            # waiting for the launch (that would add the launch latency to short graphs).
            torch.cuda._sleep(self._spin_cycles)
        self._start.record()
        self.round_body()
        self._end.record()
        self._end.synchronize()
        t = self._start.elapsed_time(self._end) / 1e3
        if self.slowdown > 0:
            t += _gpu_sleep(self.slowdown * t, self.device)
        _add(t / self.calls_per_round)

    @property
    def graph(self):
        """The captured CUDA graph (``calls_per_round`` calls), or None (eager or CPU timing)."""
        return self._graph

    def close(self) -> None:
        self._graph = None


@dataclass(frozen=True)
class Measurement:
    """Per-call time of one implementation: ``seconds`` (median over rounds) and how it was taken."""

    seconds: float
    method: str
    calls_per_round: int
    rounds: int
    graph_error: str | None = None
    clocks: dict | None = None  # ClockSampler.stats() over the timed rounds (measure(..., clocks=True))
    clocks_error: str | None = None  # why there are none (ClockSampler.error)

    @property
    def us(self) -> float:
        return self.seconds * 1e6


def timed_rounds(runner: Runner, rounds: int) -> list[float]:
    """Per-call seconds of ``rounds`` of a prepared :class:`Runner`'s rounds (``measured_clock`` around each)."""
    times = []
    for _ in range(rounds):
        t0 = measured_clock()
        runner.round()
        times.append(measured_clock() - t0)
    return times


def measure(call: Callable[[int], object], n_sets: int, device: torch.device | str,
            settings: Settings | None = None, *, graph_key: str | None = None, allow_graph: bool = True,
            keep_runner: bool = False, clocks: bool = False):
    """Time ``call(i)`` (``i`` in ``range(n_sets)``) outside pytest: :class:`Runner`'s protocol (warm-up, a CUDA graph
    of >= ``n_sets`` calls or events around eager calls, rounds for the budget), the median of the rounds. Returns a
    :class:`Measurement`; with ``keep_runner`` also the open :class:`Runner` (its ``graph`` for a profiler);
    ``clocks``: the GPU's clocks sampled over the timed rounds (not the warm-up or the capture),
    ``Measurement.clocks``."""
    device = torch.device(device)
    settings = settings or Settings.from_env(device.type == "cuda")
    r = Runner(call, n_sets, device, settings, allow_graph=allow_graph, graph_key=graph_key)
    r.prepare()
    m = measure_interleaved({"call": r}, clocks=clocks).measurements["call"]  # a group of one: its own rounds
    if keep_runner:
        return m, r
    r.close()
    return m


@dataclass(frozen=True)
class Interleaved:
    """What :func:`measure_interleaved` measured: each implementation's :class:`Measurement` (median of its rounds)
    and its per-call seconds round by round (``rounds[name][j]``: round ``j``, taken next to the other
    implementations' round ``j``, so two names' lists pair up by index)."""

    measurements: dict[str, Measurement]
    rounds: dict[str, list[float]]

    def ratio(self, num: str, den: str, confidence: float = 0.95) -> tuple[float, float, float]:
        """:func:`paired_ratio` of two names' rounds (``num`` the peer and ``den`` the backend: a speedup)."""
        return paired_ratio(self.rounds[num], self.rounds[den], confidence)


def paired_ratio(num: list[float], den: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(median, low, high)`` of the paired rounds' ``num[j] / den[j]`` ratios (:func:`median_interval`): rounds
    taken side by side (:func:`measure_interleaved`), so drift between rounds cancels within each pair.

    Raises:
        ValueError: the two lists differ in length, or are empty.
    """
    if len(num) != len(den):
        raise ValueError(f"paired_ratio needs rounds that pair up, got {len(num)} and {len(den)}")
    return median_interval([a / b for a, b in zip(num, den)], confidence)


def measure_interleaved(runners: dict[str, Runner], *, clocks: bool = False) -> Interleaved:
    """Time prepared :class:`Runner` s round for round in turn (``A B C``, then ``C B A``, ...), so that clock drift,
    the power cap's state and the neighbours' heat fall on every implementation alike: a ratio of two of them is
    taken side by side, not minutes apart (under an H200's power cap two timings of one row a few seconds apart ran
    at mean SM clocks up to 9% apart). Each runner gets one unmeasured round first; all get the smallest of their
    ``rounds`` (each runner's round count is its share of the ``MOE_BENCH_SECONDS`` budget, so the whole takes at most
    that budget per implementation). ``clocks``: one :class:`ClockSampler` over all the rounds, its stats in every
    :class:`Measurement` (the implementations shared those clocks).

    Raises:
        ValueError: no runners.
    """
    if not runners:
        raise ValueError("measure_interleaved needs at least one prepared Runner")
    names = list(runners)
    device = runners[names[0]].device
    for r in runners.values():
        r.round()  # one unmeasured round each (pytest-benchmark's warmup_rounds=1)
    n = min(r.rounds for r in runners.values())
    times: dict[str, list[float]] = {k: [] for k in names}
    sampler = ClockSampler(device) if clocks else None
    with sampler or contextlib.nullcontext():
        for j in range(n):
            for k in (names if j % 2 == 0 else names[::-1]):  # alternate the order: no name always goes first
                times[k] += timed_rounds(runners[k], 1)
    stats = sampler.stats() if sampler else None
    error = sampler.error if sampler else None
    ms = {}
    for k in names:
        r, t = runners[k], sorted(times[k])
        ms[k] = Measurement(t[len(t) // 2], r.method, r.calls_per_round, n, r.graph_error, stats, error)
    return Interleaved(ms, times)


def median_interval(xs: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(median, low, high)`` of the samples ``xs``: the median (the upper one of an even count, as
    :func:`measure`'s) and a distribution-free confidence interval for the population median, the order statistics
    ``x_(k)`` and ``x_(n + 1 - k)`` with the largest ``k`` such that ``P(Binomial(n, 1/2) < k) <= (1 -
    confidence) / 2`` (each sample falls below the median with probability 1/2, whatever the distribution; the
    interval covers the median with probability >= ``confidence``). Below 6 samples no ``k`` reaches 95%: the
    interval is then the samples' range (it covers with probability ``1 - 2^(1-n)``).

    Raises:
        ValueError: no samples, or ``confidence`` outside (0, 1).
    """
    if not xs:
        raise ValueError("median_interval needs at least one sample")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    x = sorted(xs)
    n = len(x)
    tail, below, k = (1.0 - confidence) / 2.0, 0.0, 0
    while k < n // 2:
        below += math.comb(n, k) / 2.0**n  # P(Binomial(n, 1/2) <= k)
        if below > tail:
            break
        k += 1
    k = max(k, 1)
    return x[n // 2], x[k - 1], x[n - k]


_SLEEP_CYCLES_PER_S: dict[int, float] = {}
_GRAPH_FAILED: dict[str, str] = {}  # implementation -> why its capture failed (not retried for other cases)


def kernel_breakdown(runner: "Runner", replays: int = 3) -> list[tuple[str, float]]:
    """``[(position:kernel name, us per call)]`` of a prepared :class:`Runner`'s CUDA graph (``measure(...,
    keep_runner=True)``): ``torch.profiler`` records ``replays`` replays; each kernel's device time is averaged over
    the calls, in launch order.

    Raises:
        RuntimeError: the call was not captured in a graph, or the profiler missed kernels.
    """
    return [(name, us) for name, us, _ in kernel_timeline(runner, replays)]


def kernel_timeline(runner: "Runner", replays: int = 3) -> list[tuple[str, float, float]]:
    """As :func:`kernel_breakdown`, with each kernel's mean gap in us: its start minus the end of the kernel launched
    before it (the previous call's last kernel for the first; negative when they overlap, as with programmatic
    dependent launch). Where a step's idle time sits: a launch gap, a memset or copy node of the graph (not a
    kernel), a wait.

    Raises:
        RuntimeError: the call was not captured in a graph, or the profiler missed kernels.
    """
    from torch.profiler import ProfilerActivity, profile

    g = runner.graph
    if g is None:
        raise RuntimeError(f"not captured in a CUDA graph: {runner.graph_error}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0),
                key=lambda e: e.time_range.start)
    calls = replays * runner.calls_per_round
    if not ev or len(ev) % calls:
        raise RuntimeError(f"{len(ev)} kernel records for {calls} calls: the profiler did not see every kernel")
    per = len(ev) // calls
    out = []
    for j in range(per):
        idx = [c * per + j for c in range(calls)]
        # the first record of a replay follows the previous replay's end (host time between replays): not a gap
        gaps = [ev[i].time_range.start - ev[i - 1].time_range.end for i in idx if i % (per * runner.calls_per_round)]
        out.append((f"{j}:{ev[idx[0]].name}", sum(ev[i].device_time for i in idx) / calls,
                    sum(gaps) / len(gaps) if gaps else 0.0))
    return out


def _cycles_per_s(device: torch.device) -> float:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SLEEP_CYCLES_PER_S:
        cyc = 2_000_000
        t = median_time(lambda: torch.cuda._sleep(cyc), device, reps=3, warmup=1)
        _SLEEP_CYCLES_PER_S[idx] = cyc / max(t, 1e-9)
    return _SLEEP_CYCLES_PER_S[idx]


def _gpu_sleep(seconds: float, device: torch.device) -> float:
    """Spin the GPU for about ``seconds`` with ``torch.cuda._sleep``; returns the measured device time."""
    rate = _cycles_per_s(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(max(1, int(seconds * rate)))
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def time_samples(fn: Callable[[], object], device: torch.device | str, *, reps: int = 10, warmup: int = 2,
                 before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn()`` after ``warmup`` runs (CUDA events on a GPU, the wall clock on
    the CPU); ``before()`` runs untimed ahead of each timed run (e.g. a ``torch.distributed`` barrier)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if before is not None:
            before()
            _sync(device)
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median_time(fn: Callable[[], object], device: torch.device | str, *, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs (CUDA events on a GPU)."""
    times = sorted(time_samples(fn, device, reps=reps, warmup=warmup))
    return times[len(times) // 2]


# --------------------------------------------------------------------------------------------------------------
# Device and ceilings
# --------------------------------------------------------------------------------------------------------------


#: NVML's clock-event reason bits (``nvmlClocksEventReason*``) a timing can meet; 0x1 (idle) and 0x2 / 0x10 / 0x100
#: (application clocks, sync boost, display) are left out
CLOCK_EVENTS = {0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal",
                0x80: "hw power brake"}
POWER_CAP = 0x4


class ClockSampler:
    """The GPU's SM clock (MHz) and active clock-event reasons, sampled through NVML (``nvidia-ml-py``'s
    ``pynvml``, the library ``torch.cuda.clock_rate`` uses) every ``period_ms`` by a background thread while the
    ``with`` block runs, and its mean board power over the block (the energy counter read at both ends; NVML's power
    reading is a one-second average on Ampere and newer): whether two timings saw the same clocks (a sustained FP8
    or bf16 prefill replay runs under the software power cap at a lower clock than a short rested one).

    ``with ClockSampler(device) as c: ...``; then :meth:`stats` / :meth:`summary` (None / ``""`` where nothing was
    sampled: a CPU device, no ``pynvml``, no NVML driver; ``error`` says which) and ``samples`` (``[(sm_mhz,
    reasons bitmask)]``). Never raises: clocks are context for a timing, not a check. The thread holds the GIL for
    a few microseconds a sample (NVML's calls go through ctypes, which releases it); ``MOE_BENCH_CLOCKS=0`` turns the
    benchmark's sampling off for an A / B of that.
    """

    _handles: dict = {}  # device ordinal -> (NVML handle, how it was found)

    def __init__(self, device: torch.device | str | None = None, period_ms: float = 20.0):
        self.device = torch.device(device) if device is not None else torch.device("cuda")
        self.period_s = float(period_ms) / 1e3
        self.samples: list[tuple[float, int]] = []
        self.error: str | None = None
        self.watts: float | None = None
        self.found_by: str | None = None
        self._stop = None
        self._thread = None
        self._energy = None

    def _handle(self):
        """The NVML handle of the device: by its UUID (CUDA's ordinals differ from NVML's under
        ``CUDA_VISIBLE_DEVICES``), else by torch's own mapping to NVML's index (``found_by`` says which)."""
        import pynvml

        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if idx not in ClockSampler._handles:
            pynvml.nvmlInit()
            try:
                uuid = str(torch.cuda.get_device_properties(idx).uuid)
                found = (pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"), "uuid")
            except Exception:  # noqa: BLE001 - no uuid on this torch, or NVML does not know it
                nvml_idx = getattr(torch.cuda, "_get_nvml_device_index", lambda i: i)(idx)
                found = (pynvml.nvmlDeviceGetHandleByIndex(nvml_idx), f"index {nvml_idx}")
            ClockSampler._handles[idx] = found
        return ClockSampler._handles[idx]

    @staticmethod
    def _reasons_getter(pynvml, h):
        """The clock-event reasons' getter this driver has (renamed from "throttle" reasons in newer drivers)."""
        get = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if get is not None:
            try:
                get(h)
                return get
            except pynvml.NVMLError_FunctionNotFound:  # an older driver under a newer binding
                pass
        return pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def __enter__(self) -> "ClockSampler":
        import threading

        if self.device.type != "cuda":
            self.error = "not a GPU"
            return self
        try:
            import pynvml

            h, self.found_by = self._handle()
            reasons = self._reasons_getter(pynvml, h)

            def sample():
                return float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)), int(reasons(h))

            sample()  # fails here, not in the thread, when NVML cannot answer
        except Exception as exc:  # noqa: BLE001 - no pynvml, no driver, an old GPU: no clocks
            self.error = f"{type(exc).__name__}: {exc}"[:200]
            return self
        try:  # mJ since the driver loaded (Volta and newer)
            self._energy = (pynvml.nvmlDeviceGetTotalEnergyConsumption(h), time.perf_counter(), h)
        except Exception:  # noqa: BLE001 - no energy counter: no power figure
            self._energy = None
        self._stop = threading.Event()

        def run():
            while True:
                try:
                    self.samples.append(sample())
                except Exception as exc:  # noqa: BLE001
                    self.error = f"{type(exc).__name__}: {exc}"[:200]
                    return
                if self._stop.wait(self.period_s):
                    return

        self._thread = threading.Thread(target=run, name="ClockSampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)  # a hung NVML call must not hang the benchmark
        if self._energy is not None:
            try:
                import pynvml

                e0, t0, h = self._energy
                dt = time.perf_counter() - t0
                self.watts = (pynvml.nvmlDeviceGetTotalEnergyConsumption(h) - e0) / 1e3 / dt if dt > 0 else None
            except Exception:  # noqa: BLE001
                self.watts = None

    def stats(self) -> dict | None:
        """``{"mean_mhz", "min_mhz", "max_mhz", "watts", "reasons", "capped", "samples"}`` over the samples
        (``reasons``: the bitwise or of theirs, NVML's clock-event bits; ``capped``: the fraction of samples with the
        software power cap, 0x4; ``watts``: the mean board power over the block, None without an energy counter),
        or None without samples."""
        if not self.samples:
            return None
        mhz = [m for m, _ in self.samples]
        reasons = 0
        for _, r in self.samples:
            reasons |= r
        capped = sum(1 for _, r in self.samples if r & POWER_CAP) / len(mhz)
        return dict(mean_mhz=sum(mhz) / len(mhz), min_mhz=min(mhz), max_mhz=max(mhz), watts=self.watts,
                    reasons=reasons, capped=capped, samples=len(mhz))

    def summary(self) -> str:
        """:func:`clock_summary` of :meth:`stats`."""
        return clock_summary(self.stats())


def clock_summary(st: dict | None) -> str:
    """``"SM 1755 MHz (1650-1980), 690 W, power cap in 80% of 31 samples"`` of :meth:`ClockSampler.stats` (the
    other clock-event reasons named where met), or ``""``."""
    if st is None:
        return ""
    other = [name for bit, name in CLOCK_EVENTS.items() if bit != POWER_CAP and st["reasons"] & bit]
    return (f"SM {st['mean_mhz']:.0f} MHz ({st['min_mhz']:.0f}-{st['max_mhz']:.0f})"
            + (f", {st['watts']:.0f} W" if st.get("watts") is not None else "")
            + f", power cap in {100 * st.get('capped', 0.0):.0f}% of {st['samples']} samples"
            + (f"; also {', '.join(other)}" if other else ""))


def device_info() -> dict:
    """Name, slug (for baseline folders and result files), capability and software of the benchmark device."""
    import platform
    import re

    info = {"torch": torch.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        info.update(
            kind="cuda", name=name, capability=list(torch.cuda.get_device_capability(0)),
            sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=int(getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20), cuda=torch.version.cuda,
        )
    else:
        name = f"CPU {platform.machine()} ({os.cpu_count()} cores)"
        info.update(kind="cpu", name=name, l2_bytes=2 * 2**20, threads=torch.get_num_threads())
    slug = "cpu" if info["kind"] == "cpu" else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    info["slug"] = slug
    return info


def _sustained_matmul(device: torch.device, calls: dict, flops_per_call: float) -> dict:
    """The rates of ``calls`` (``{dtype: call(i)}``: ``measure_ceilings``' GEMMs of ``flops_per_call`` each) timed
    with the rows' protocol (``measure``: a CUDA graph, rounds for the ``MOE_BENCH_SECONDS`` budget, median) and
    the clocks of those rounds: ``sustained_matmul_flops_per_s`` and ``sustained_clocks``. Under an H200's software
    power cap these run at a lower clock than the ceilings' short bursts, as the prefill rows do (a dense GEMM's power
    is not a grouped MoE GEMM's: the report prints the clock beside the rate); the floor stays on the burst ceilings
    and the report prints the fraction of this one beside it. A failure is a note (``sustained_error``), never the
    ceilings' end."""
    try:
        rates, clocks = {}, {}
        for k, call in calls.items():
            m = measure(call, 1, device, clocks=True)
            rates[k] = flops_per_call / m.seconds
            if m.clocks is not None:
                clocks[k] = m.clocks
        return {"sustained_matmul_flops_per_s": rates, "sustained_clocks": clocks}
    except Exception as exc:  # noqa: BLE001 - context for the floor, not a ceiling
        return {"sustained_error": f"{type(exc).__name__}: {exc}"[:200]}


def measure_ceilings(device: torch.device | str) -> dict:
    """Copy bandwidth and matmul throughputs of this device, measured now (once per run).

    GPU: device-to-device copy of 1 GiB (bytes read + written), 8192^3 bf16 ``torch.mm`` and fp8 ``torch._scaled_mm``
    (random data), 4096^3 fp32 ``torch.mm`` without TF32 (the fp32 router gate's ceiling); medians of CUDA-event
    timings after warm-up (short bursts: rested clocks); and the bf16 / fp8 GEMMs sustained as the rows are timed
    (``_sustained_matmul``). CPU: 128 MiB copy, 1024^3 fp32 matmul (the CPU paths upcast bf16/fp8 to fp32, so every
    dtype's ceiling is the fp32 one).
    """
    device = torch.device(device)
    g = torch.Generator(device=device)
    g.manual_seed(1234)
    out: dict = {"device": str(device)}
    if device.type == "cuda":
        n = 2**29  # bf16 elements: 1 GiB
        src = torch.randn(n, device=device, dtype=torch.bfloat16, generator=g)
        dst = torch.empty_like(src)
        t = median_time(lambda: dst.copy_(src), device, reps=20, warmup=3)
        out["copy_bytes_per_s"] = 2 * n * 2 / t
        out["copy_method"] = "1 GiB bf16 copy_, read + written"
        del src, dst
        S = 8192
        a = torch.randn(S, S, device=device, dtype=torch.bfloat16, generator=g)
        b = torch.randn(S, S, device=device, dtype=torch.bfloat16, generator=g)
        gemms = {"bf16": lambda i=0: torch.mm(a, b)}
        flops = {"bf16": 2.0 * S**3 / median_time(gemms["bf16"], device, reps=10, warmup=3)}
        try:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t()  # column-major second operand
            one = torch.ones((), device=device, dtype=torch.float32)
            fp8 = lambda i=0: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
            flops["fp8"] = 2.0 * S**3 / median_time(fp8, device, reps=10, warmup=3)
            gemms["fp8"] = fp8
        except Exception as exc:  # no fp8 matmul here (pre-SM89): fp8 schemes use the bf16 ceiling
            flops["fp8"] = flops["bf16"]
            out["fp8_note"] = f"no fp8 matmul ({type(exc).__name__}); bf16 ceiling used"
        # the same GEMMs again as the rows are timed (the bursts above run at rested clocks)
        out.update(_sustained_matmul(device, gemms, 2.0 * S**3))
        del a, b, gemms
        a8 = b8 = fp8 = None  # noqa: F841 - freed before the cache is emptied below
        S32 = 4096
        a32 = torch.randn(S32, S32, device=device, generator=g)
        b32 = torch.randn(S32, S32, device=device, generator=g)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            flops["fp32"] = 2.0 * S32**3 / median_time(lambda: torch.mm(a32, b32), device, reps=5, warmup=2)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        del a32, b32
        torch.cuda.empty_cache()
        out["matmul_method"] = "8192^3 bf16 mm, 8192^3 fp8 _scaled_mm, 4096^3 fp32 mm (no TF32), random data"
    else:
        n = 2**25  # fp32 elements: 128 MiB
        src = torch.randn(n, generator=g)
        dst = torch.empty_like(src)
        t = median_time(lambda: dst.copy_(src), device, reps=5, warmup=1)
        out["copy_bytes_per_s"] = 2 * n * 4 / t
        out["copy_method"] = "128 MiB fp32 copy_, read + written"
        S = 1024
        a = torch.randn(S, S, generator=g)
        b = torch.randn(S, S, generator=g)
        f32 = 2.0 * S**3 / median_time(lambda: torch.mm(a, b), device, reps=5, warmup=1)
        flops = {"fp32": f32, "bf16": f32, "fp8": f32}
        out["matmul_method"] = "1024^3 fp32 mm (CPU paths compute in fp32: bf16/fp8 ceilings = fp32)"
    out["matmul_flops_per_s"] = flops
    return out
