"""The benchmark suite's arithmetic and plumbing, on CPU in a few seconds: the canonical shapes, the roofline floors
(against perf-anchors.md's measured H200 table), the CPU timer and planted slowdown, the side-by-side ratios, the plot,
and the per-device baseline storage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import report, shapes, timing
from benchmarks.roofline import experts_bytes, experts_flops, floor_seconds, gate_work

REPO = Path(__file__).resolve().parents[1]
# perf-anchors.md, "Measured on this project's GPU machine (NVIDIA H200)": the ceilings of that run.
H200_ANCHOR = {"copy_bytes_per_s": 4.28e12, "matmul_flops_per_s": {"bf16": 679e12, "fp8": 1260e12}}


def test_canonical_shapes_are_perf_anchors():
    got = {s.id: (s.E, s.topk, s.K, s.I, s.scheme) for s in shapes.gpu_experts_shapes()}
    assert got == {
        "dsv3_ep8-fp8_block128": (32, 8, 7168, 2048, "fp8_block128"),
        "dsv3_tp8-fp8_block128": (256, 8, 7168, 256, "fp8_block128"),
        "mixtral_tp2-bf16": (8, 2, 4096, 7168, "bf16"),
        "mixtral_tp2-fp8_tensor": (8, 2, 4096, 7168, "fp8_tensor"),
        "qwen3_30b-bf16": (128, 8, 2048, 768, "bf16"),
        "qwen3_30b-fp8_block128": (128, 8, 2048, 768, "fp8_block128"),
        "qwen3_235b_tp4-bf16": (128, 8, 4096, 384, "bf16"),
        "gpt_oss_120b-bf16": (128, 4, 2880, 2880, "bf16"),
    }
    assert shapes.DECODE_M == (1, 8, 32, 64) and shapes.PREFILL_M == (1024, 4096, 16384)
    assert shapes.GATE_M == (1, 16, 32, 256)
    for s in shapes.cpu_experts_shapes():
        assert s.id.endswith("cpu_small") and s.K % 128 == 0 and s.I % 128 == 0


@pytest.mark.parametrize("case, M, touched, bytes_per_weight, dtype, anchor_us", [
    # (E, topk, K, I); floors of perf-anchors' H200 table (scales and activations move < 0.1% more bytes here)
    ((8, 2, 4096, 7168), 1, 2, 2, "bf16", 82.41),       # Mixtral TP2 bf16, decode: weight streaming
    ((128, 8, 2048, 768), 1, 8, 2, "bf16", 17.66),      # Qwen3-30B bf16
    ((256, 8, 7168, 256), 1, 8, 1, "fp8", 10.3),        # DeepSeek-V3 TP8 fp8
    ((32, 8, 7168, 2048), 1, 8, 1, "fp8", 82.41),       # DeepSeek-V3 EP8-local fp8
    ((8, 2, 4096, 7168), 1024, 8, 2, "bf16", 531.05),   # Mixtral TP2 bf16, prefill: compute
    ((32, 8, 7168, 2048), 4096, 32, 1, "fp8", 2291.02),
])
def test_floor_reproduces_perf_anchors(case, M, touched, bytes_per_weight, dtype, anchor_us):
    E, topk, K, I = case  # noqa: E741
    per_expert = 3 * K * I * bytes_per_weight  # w1 (2I x K) + w2 (K x I)
    flops = experts_flops(M, topk, K, 2 * I, I)
    nbytes = experts_bytes(touched, per_expert, M, K, topk)
    floor, _ = floor_seconds(flops, nbytes, H200_ANCHOR, dtype)
    assert floor * 1e6 == pytest.approx(anchor_us, rel=0.01)


def test_gate_work_and_rotation():
    w = gate_work(16, 7168, 256, 2, 2, 4)
    assert w.flops == 2 * 16 * 7168 * 256 and w.compute_dtype == "bf16"
    assert w.bytes == 256 * 7168 * 2 + 16 * 7168 * 2 + 16 * 256 * 4
    assert gate_work(1, 3072, 256, 2, 4, 4).compute_dtype == "fp32"
    # Enough sets that >= 3 L2s of other data pass between two uses of one set; clamped.
    assert timing.rotation_sets(3.7e6, 50 * 2**20, max_sets=64) == 57
    assert timing.rotation_sets(1e9, 50 * 2**20) == 2
    assert timing.rotation_sets(1.0, 50 * 2**20) == 16


def test_cpu_runner_feeds_the_clock_and_plants_slowdown(monkeypatch):
    # A fake perf_counter, so that a loaded machine cannot stretch the measured time: each read advances it by 1 us,
    # each call by 2 ms (the planted slowdown's busy wait then ends after its 1 ms of reads).
    now = [0.0]

    def clock():
        now[0] += 1e-6
        return now[0]

    def call(i):
        now[0] += 0.002

    monkeypatch.setattr(timing.time, "perf_counter", clock)
    settings = timing.Settings(budget_s=0.02, min_rounds=3)
    for slowdown, lo, hi in ((0.0, 0.002, 0.0021), (0.5, 0.003, 0.0031)):
        r = timing.Runner(call, 2, "cpu", settings, slowdown=slowdown)
        r.prepare()
        assert r.method == "wall-clock" and r.rounds >= 3
        t0 = timing.measured_clock()
        r.round()
        assert lo <= timing.measured_clock() - t0 <= hi


def test_interleaved_rounds_take_turns_and_pair_up(monkeypatch):
    """``timing.measure_interleaved``: after one unmeasured round each, the runners' rounds alternate (A B, then B
    A, ...) for the smallest round count of the group; each name's Measurement is the median of its own rounds, and
    round ``j`` of two names pairs up (a drift that slows every call alike cancels in their ratio)."""
    now, log = [0.0], []

    def clock():
        return now[0]

    def make(name, base):
        def call(i):
            log.append(name)
            now[0] += base * (1.0 + 0.01 * len(log))  # everything drifts slower as the run goes on
        return call

    monkeypatch.setattr(timing.time, "perf_counter", clock)
    settings = timing.Settings(budget_s=0.02, min_rounds=3)
    runners = {}
    for name, base in (("a", 1e-3), ("b", 2e-3)):
        runners[name] = timing.Runner(make(name, base), 2, "cpu", settings)
        runners[name].prepare()
    assert runners["a"].rounds > runners["b"].rounds  # a's rounds are shorter: b's count sets the group's
    log.clear()
    got = timing.measure_interleaved(runners)
    n = runners["b"].rounds
    assert log[:2] == ["a", "b"]  # the unmeasured rounds
    assert log[2:] == [x for j in range(n) for x in (("a", "b") if j % 2 == 0 else ("b", "a"))]
    assert set(got.rounds) == {"a", "b"} and all(len(v) == n for v in got.rounds.values())
    for k in ("a", "b"):
        m = got.measurements[k]
        assert m.rounds == n and m.method == "wall-clock" and m.seconds == sorted(got.rounds[k])[n // 2]
    # paired: b / a is 2 x the drift between two adjacent calls, whatever the drift did over the run
    med, lo, hi = got.ratio("b", "a")
    assert 1.9 < lo <= med <= hi < 2.2, (lo, med, hi)
    with pytest.raises(ValueError, match="at least one"):
        timing.measure_interleaved({})
    with pytest.raises(ValueError, match="pair up"):
        timing.paired_ratio([1.0], [1.0, 2.0])


def test_median_interval_covers_the_median():
    """The distribution-free interval of ``timing.median_interval`` against an independent oracle: over 2000 draws of
    n samples from a skewed distribution with a known median (the exponential's ln 2), it covers that median at
    least as often as its confidence says (and not always: it is not the samples' range); its endpoints are order
    statistics at the binomial's 2.5% quantile (n = 10: the 2nd and 9th)."""
    import random

    rng = random.Random(7)
    for n in (10, 30, 200):
        hits = 0
        for _ in range(2000):
            xs = [rng.expovariate(1.0) for _ in range(n)]
            _, lo, hi = timing.median_interval(xs)
            hits += lo <= math.log(2) <= hi
        assert 0.94 <= hits / 2000 < 0.995, (n, hits)
    xs = [float(i) for i in range(1, 11)]
    assert timing.median_interval(list(reversed(xs))) == (6.0, 2.0, 9.0)
    assert timing.median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # fewer than 6: the range
    with pytest.raises(ValueError, match="at least one sample"):
        timing.median_interval([])
    with pytest.raises(ValueError, match="confidence"):
        timing.median_interval([1.0], confidence=1.0)


def _rec(case, M, backend, impl, t, floor=1e-4, kind="experts"):
    return {"kind": kind, "case": case, "shape": f"label of {case}", "M": M, "backend": backend, "impl": impl,
            "median_s": t, "floor_s": floor, "bound": "memory", "method": "cuda-graph", "flops": 1e9,
            "bytes": 1e8}


def test_side_by_side_ratios_and_markdown(tmp_path):
    recs = report.finalize([
        _rec("qwen", 1, "torch", "TorchExperts", 4e-4),
        _rec("qwen", 1, "triton", "TritonExperts", 2e-4),
        _rec("qwen", 1, "cuda", "CutlassExpertsBf16", 3e-4),
        _rec("dsv3_gate", 1, "cuda", "dsv3_router_gemm", 3e-6, 1e-6, kind="gate"),
        _rec("dsv3_gate", 1, "torch", "F.linear", 9e-6, 1e-6, kind="gate"),
    ])
    by = {(r["case"], r["backend"]): r for r in recs}
    assert by[("qwen", "triton")]["x_best"] == 1.0 and by[("qwen", "torch")]["x_best"] == pytest.approx(2.0)
    assert by[("qwen", "cuda")]["x_floor"] == pytest.approx(3.0)
    assert by[("dsv3_gate", "torch")]["x_best"] == pytest.approx(3.0)
    doc = {"device": {"name": "Test GPU", "slug": "test-gpu", "torch": "x"}, "datetime": "2026-11-22T00:00",
           "ceilings": {"copy_bytes_per_s": 4e12, "matmul_flops_per_s": {"bf16": 8e14}}, "results": recs,
           "skipped": [{"id": "qwen-M1-deep_gemm.X", "reason": "not installed"}]}
    md = report.render_markdown(doc)
    assert "| case | M | floor | bound | torch | triton | cuda |" in md
    assert "200.0 us = 1.00x best, 2.00x floor **best**" in md
    assert "#### Router gate GEMM: dsv3_gate" in md and "cuda.dsv3_router_gemm" in md
    assert "not installed: qwen-M1-deep_gemm.X" in md
    jpath, mpath = report.write(doc, tmp_path, "test-gpu")
    assert json.loads(jpath.read_text())["results"][0]["case"] == "qwen"
    assert mpath.read_text().startswith("### Test GPU")


@pytest.mark.slow  # subprocess runs of the benchmark suite
def test_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot

    recs = report.finalize([_rec("qwen", m, b, "X", t * m ** 0.5, 1e-5 * m) for m in (1, 8, 64)
                            for b, t in (("torch", 1e-4), ("triton", 3e-5))])
    doc = {"device": {"name": "Test GPU"}, "datetime": "2026-11-22",
           "ceilings": {"copy_bytes_per_s": 4e12, "matmul_flops_per_s": {"bf16": 8e14, "fp8": 1.3e15}},
           "results": recs}
    jpath = tmp_path / "benchmark-test.json"
    jpath.write_text(json.dumps(doc))
    assert plot.main([str(jpath)]) == 0
    png = jpath.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # subprocess runs of the benchmark suite
def test_storage_is_chosen_per_device():
    """Without --benchmark-storage the suite stores and compares under benchmarks/baselines/<device slug>."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MOE_BENCH_SHAPES="no-such-shape")
    out = subprocess.run([sys.executable, "-m", "pytest", "benchmarks", "--co", "-p", "no:cacheprovider"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert f"baselines: {REPO / 'benchmarks' / 'baselines' / 'cpu'}" in text, text[-2000:]
    assert timing.device_info()["slug"] == ("cpu" if not torch.cuda.is_available() else timing.device_info()["slug"])


def test_kernel_breakdown_needs_a_cuda_graph():
    # The per-kernel breakdown (backends' profile / breakdown tools) reads a captured graph; a CPU (or eager) run has
    # none and must say so rather than return an empty breakdown.
    from benchmarks import timing

    _, runner = timing.measure(lambda i: None, 1, "cpu", timing.Settings(budget_s=0.01), keep_runner=True)
    try:
        with pytest.raises(RuntimeError, match="not captured in a CUDA graph"):
            timing.kernel_breakdown(runner)
    finally:
        runner.close()


def _fake_nvml(readings, energy_mj):
    """A stand-in for pynvml: each clock read draws the next ``(MHz, reasons)`` of ``readings`` (the last repeats);
    the energy counter reads the values of ``energy_mj`` in turn; handles by UUID and by index differ."""
    import types

    state = {"r": readings[-1], "n": 0}
    it = iter(readings)
    energy = iter(energy_mj)

    def clock(h, kind):
        assert kind == 1 and h in ("by-uuid", "by-index")
        state["r"] = next(it, readings[-1])
        state["n"] += 1
        return state["r"][0]

    class NVMLError_FunctionNotFound(Exception):
        pass

    return state, types.SimpleNamespace(
        NVML_CLOCK_SM=1, nvmlInit=lambda: None, NVMLError_FunctionNotFound=NVMLError_FunctionNotFound,
        nvmlDeviceGetHandleByUUID=lambda u: "by-uuid", nvmlDeviceGetHandleByIndex=lambda i: "by-index",
        nvmlDeviceGetClockInfo=clock, nvmlDeviceGetCurrentClocksEventReasons=lambda h: state["r"][1],
        nvmlDeviceGetTotalEnergyConsumption=lambda h: next(energy))


def _wait_for(cond, seconds=10.0):
    import time

    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "the sampler thread stopped sampling"
        time.sleep(0.001)


def test_clock_sampler_reads_nvml_and_never_raises(monkeypatch):
    # The sampler's thread reads the SM clock and the clock-event reasons until the block ends (the probe reading
    # before the thread starts is not a sample); the power is the energy counter's difference over the block; the
    # summary gives the mean / range, the power-cap share and any other reason met. Without pynvml, with NVML
    # failing, or on the CPU, nothing is sampled, `error` says why and nothing raises.
    import sys
    import time

    from benchmarks import timing

    state, fake = _fake_nvml([(1980, 0x0), (1700, 0x4), (1800, 0x4 | 0x20), (1800, 0x1)], [1_000_000, 1_000_700])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(timing.ClockSampler, "_handles", {0: ("by-uuid", "uuid")})
    with timing.ClockSampler(torch.device("cuda", 0), period_ms=1) as c:
        _wait_for(lambda: state["n"] >= 6)
    assert c.samples[:3] == [(1700.0, 0x4), (1800.0, 0x24), (1800.0, 0x1)]
    n = len(c.samples)
    time.sleep(0.01)
    assert len(c.samples) == n  # the thread stopped with the block
    st = c.stats()
    assert (st["min_mhz"], st["max_mhz"], st["reasons"], st["capped"]) == (1700.0, 1800.0, 0x25, 2 / n)
    assert 0 < st["watts"] < 700 / 0.005  # 0.7 J over the block (at least 5 ms long)
    assert c.summary().startswith("SM 1") and f"power cap in {100 * 2 / n:.0f}% of {n} samples" in c.summary()
    assert c.summary().endswith("; also sw thermal")

    fake.nvmlDeviceGetClockInfo = lambda h, kind: (_ for _ in ()).throw(RuntimeError("NVML_ERROR_NOT_SUPPORTED"))
    with timing.ClockSampler(torch.device("cuda", 0)) as c:
        pass
    assert c.summary() == "" and "NVML_ERROR_NOT_SUPPORTED" in c.error
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with timing.ClockSampler(torch.device("cuda", 0)) as c:
        pass
    assert c.stats() is None and "pynvml" in c.error
    with timing.ClockSampler(torch.device("cpu")) as c:
        pass
    assert c.summary() == "" and c.error == "not a GPU"


def test_clock_sampler_finds_the_device_by_uuid_else_by_torchs_nvml_index(monkeypatch):
    # CUDA's ordinal is not NVML's under CUDA_VISIBLE_DEVICES: the handle comes by the device's UUID, and where that
    # fails by torch's own mapping to NVML's index; an older driver without the "event reasons" getter is read
    # through the older "throttle reasons" one.
    import sys
    import types

    from benchmarks import timing

    state, fake = _fake_nvml([(1980, 0x0)], [0, 0])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(timing.ClockSampler, "_handles", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="1234-abcd"))
    seen = []
    fake.nvmlDeviceGetHandleByUUID = lambda u: seen.append(u) or "by-uuid"
    assert timing.ClockSampler(torch.device("cuda", 3))._handle() == ("by-uuid", "uuid")
    assert seen == ["GPU-1234-abcd"]

    def no_uuid(u):
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    fake.nvmlDeviceGetHandleByUUID = no_uuid
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda i: i + 4, raising=False)
    assert timing.ClockSampler(torch.device("cuda", 2))._handle() == ("by-index", "index 6")

    def missing(h):
        raise fake.NVMLError_FunctionNotFound()

    fake.nvmlDeviceGetCurrentClocksEventReasons = missing
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4
    with timing.ClockSampler(torch.device("cuda", 2), period_ms=1) as c:
        _wait_for(lambda: len(c.samples) >= 1)
    assert c.samples[0] == (1980.0, 0x4) and c.found_by == "index 6"


def test_sustained_matmul_times_each_gemm_as_the_rows_are(monkeypatch):
    # The plumbing of measure_ceilings' sustained rates (the GEMMs themselves run on a GPU only): each dtype's GEMM
    # (the ceilings' own callables) goes through timing.measure with its clocks, the rate is its FLOPs / the measured
    # seconds, the clocks are kept.
    from benchmarks import timing

    seen = []
    a = torch.randn(64, 64)
    gemms = {"bf16": lambda i=0: a @ a, "fp8": lambda i=0: a @ a.t()}

    def fake_measure(call, n_sets, device, settings=None, *, clocks=False, **kw):
        seen.append((call, n_sets, clocks))
        return timing.Measurement(2e-3 if len(seen) == 1 else 1e-3, "cuda-graph", 1, 10, None,
                                  {"mean_mhz": 1600.0, "reasons": 4} if clocks else None)

    monkeypatch.setattr(timing, "measure", fake_measure)
    out = timing._sustained_matmul(torch.device("cpu"), gemms, 2.0 * 64**3)
    assert seen == [(gemms["bf16"], 1, True), (gemms["fp8"], 1, True)]
    assert out["sustained_matmul_flops_per_s"] == {"bf16": pytest.approx(2 * 64**3 / 2e-3),
                                                   "fp8": pytest.approx(2 * 64**3 / 1e-3)}
    assert out["sustained_clocks"]["fp8"]["mean_mhz"] == 1600.0

    def broken(*a, **k):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(timing, "measure", broken)  # a failure is a note, not the end of the ceilings
    out = timing._sustained_matmul(torch.device("cpu"), gemms, 2.0 * 64**3)
    assert out == {"sustained_error": "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"}


def test_breakdown_peer_needs_the_gemm_stage(capsys):
    # vLLM's live launches are GEMM1 + GEMM2 only: they are broken down beside the backend's GEMM stage (--gemms),
    # never beside its whole step, and asking for that is a usage error that says what to add
    from benchmarks import breakdown

    for argv, says in ((["--backend", "triton", "--peer", "vllm"], "add --gemms"),
                       (["--backend", "triton", "--vllm-src", "x"], "add --gemms --peer vllm"),
                       (["--backend", "deep_gemm", "--gemms", "--expected-m", "4"], "does not combine"),
                       (["--backend", "deep_gemm", "--expected-m", "4", "--profile-range"], "does not combine"),
                       (["--backend", "torch", "--gemms"], "no GEMM-stage variants")):
        with pytest.raises(SystemExit) as exc:
            breakdown.main(argv)
        assert exc.value.code == 2
        assert says in capsys.readouterr().err, argv


def test_breakdown_counts_a_pdl_overlap_once(monkeypatch):
    """``benchmarks.breakdown``: a kernel launched with programmatic dependent launch starts before the previous one
    ends (a negative gap in ``timing.kernel_timeline``); the overlap is reported as such and the step's busy time
    counts it once (earlier breakdowns printed negative gaps and a negative idle time)."""
    from types import SimpleNamespace

    from benchmarks import breakdown, timing

    class Runner:
        def close(self):
            pass

    timeline = [("0:gemm1", 46.3, 0.3), ("1:act_quant", 19.5, -17.6), ("2:gemm2", 39.3, -14.9)]
    monkeypatch.setattr(timing, "measure", lambda call, n, dev, keep_runner=False, clocks=False: (
        SimpleNamespace(seconds=72.8e-6, clocks=None), Runner()))
    monkeypatch.setattr(timing, "kernel_timeline", lambda runner, replays=3: timeline)
    b = breakdown.breakdown(lambda i: None, 1, None)
    assert b["sum_us"] == pytest.approx(105.1) and b["overlap_us"] == pytest.approx(32.5)
    assert b["graph_us"] - (b["sum_us"] - b["overlap_us"]) == pytest.approx(0.2)


def test_breakdown_profile_range_brackets_one_warm_call(monkeypatch):
    """``--profile-range``: the profiler's range holds exactly one call of the stage, after two that compile and warm
    up, and is closed after the device finished it (a kernel still running at ``cudaProfilerStop`` is not profiled)."""
    import torch

    from benchmarks import breakdown

    events = []

    class Cudart:
        def cudaProfilerStart(self):
            events.append("start")

        def cudaProfilerStop(self):
            events.append("stop")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: events.append("sync"))
    breakdown.profile_range("gemms", lambda i: events.append(f"call {i}"), None)
    assert events == ["call 0", "call 0", "sync", "start", "call 0", "sync", "stop"]
