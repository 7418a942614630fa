"""``python -m benchmarks --backend NAME`` on a CPU machine: argument handling, the refusal without a GPU, the table
renderer on synthetic figures, the suites' data, and the FLOP / byte / roofline arithmetic of one shape by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cli, report, roofline, suites
from benchmarks.shapes import experts_shape

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = not torch.cuda.is_available()


def test_arguments():
    a = cli.parse_args(["--backend", "triton", "--shapes", "qwen3_30b_bf16, dsv3_ep8-fp8_block128", "--ms", "1,64"])
    assert a.backend == "triton" and a.shapes == ["qwen3_30b_bf16", "dsv3_ep8-fp8_block128"] and a.ms == [1, 64]
    assert not a.quick and not a.no_check and a.json is None
    assert a.prepare == "backend"  # the step a serving user pays: the backend's own quantizers in prepare
    assert a.timing == "interleaved"  # a row's columns round for round: its speedups under the same clocks
    assert cli.parse_args(["--backend", "triton", "--timing", "sequential"]).timing == "sequential"
    assert cli.parse_args(["--backend", "triton", "--prepare", "reference"]).prepare == "reference"
    for bad in ([], ["--backend", "triton", "--ms", "1,x"], ["--backend", "triton", "--quick", "--ms", "1"],
                ["--backend", "triton", "--prepare", "torch"]):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(bad)
        assert e.value.code == 2


def test_plan_resolves_aliases_and_quick():
    s = suites.suite("triton")
    experts, ms, gates, _ = cli._plan(cli.parse_args(["--backend", "triton", "--shapes", "qwen3_30b_fp8blk"]), s)
    assert [e.id for e in experts] == ["qwen3_30b-fp8_block128"] and ms == s.M and gates == []
    _, ms, _, _ = cli._plan(cli.parse_args(["--backend", "triton", "--quick"]), s)
    assert ms == (1, 64, 4096)
    experts, _, gates, gate_ms = cli._plan(cli.parse_args(["--backend", "cuda"]), suites.suite("cuda"))
    assert "dsv3_ep8-fp8_channel_token" in [e.id for e in experts]
    assert [g.id for g in gates] == ["dsv3_gate", "kimi_k2_gate", "minimax_m2_gate"]
    assert gate_ms == (1, 4, 8, 12, 16, 32)


def test_unknown_shape_and_backend_are_refused(capsys):
    assert cli.main(["--backend", "triton", "--shapes", "nope"]) == cli.NOT_HERE
    assert "unknown experts shape 'nope'" in capsys.readouterr().out
    assert cli.main(["--backend", "no_such_backend", "--ms", "1"]) == cli.NOT_HERE
    assert "unknown backend 'no_such_backend'" in capsys.readouterr().out


def test_list_needs_no_device(capsys):
    assert cli.main(["--backend", "triton", "--list"]) == 0
    out = capsys.readouterr().out
    assert "dsv3_tp8-fp8_block128: DeepSeek-V3" in out and "peer vllm_triton_h200" in out


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a CUDA GPU")
def test_no_gpu_refusal_names_the_reason():
    """The process exits 2 with the backend's own availability reason (``availability_status``), no traceback."""
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--backend", "triton"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot run here" in r.stdout and "no CUDA GPU" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr
    from backends import load_backend

    status = load_backend("cuda").availability_status()
    assert status is not None
    assert cli.main(["--backend", "cuda"]) == 2


def test_peers_and_suites_are_data():
    p = suites.peer("vllm_triton_h200")
    assert p.unit == "us" and p.value("dsv3_ep8-fp8_block128", 4096) == 4993.44
    assert p.seconds("qwen3_30b-bf16", 64) == pytest.approx(283.92e-6)
    assert p.seconds("gpt_oss_120b-bf16", 64) is None
    d = suites.peer("deepgemm_h800")
    assert d.seconds("n4096-k7168", 32768, flops=1346e12) == pytest.approx(1.0)
    for name, s in suites.suites().items():
        for shape in s.experts_shapes():  # every id resolves
            assert shape.E > 0
        assert set(s.aliases.values()) <= set(s.experts), name
        if s.peer:
            assert set(suites.peer(s.peer).figures) <= {x.id for x in s.experts_shapes()} | set(
                suites.suite("triton").experts)


def test_new_scheme_on_a_known_prefix():
    s = experts_shape("dsv3_ep8-bf16")
    assert (s.E, s.topk, s.K, s.I, s.scheme) == (32, 8, 7168, 2048, "bf16")
    with pytest.raises(KeyError):
        experts_shape("dsv3_ep8-no_such_scheme")


def test_roofline_by_hand():
    """Qwen3-30B-A3B bf16 (E=128, topk 8, K=2048, I=768) at M=64 with 100 experts touched, on a device of 4 TB/s and
    800 TFLOP/s bf16."""
    s = experts_shape("qwen3_30b-bf16")
    assert (s.E, s.topk, s.K, s.I, s.N) == (128, 8, 2048, 768, 1536)
    flops = roofline.experts_flops(64, 8, 2048, 1536, 768)
    assert flops == 2 * 64 * 8 * (2048 * 1536 + 768 * 2048) == 4_831_838_208
    per_expert = (1536 * 2048 + 2048 * 768) * 2  # w1 + w2, bf16
    nbytes = roofline.experts_bytes(100, per_expert, 64, 2048, 8)
    assert nbytes == 100 * 9_437_184 + 64 * 2048 * 4 + 64 * 8 * 8 == 944_246_784
    ceil = {"copy_bytes_per_s": 4e12, "matmul_flops_per_s": {"bf16": 800e12}}
    t, bound = roofline.Work(flops, nbytes, "bf16").floor(ceil)
    assert bound == "memory" and t == pytest.approx(944_246_784 / 4e12)  # 236.06 us vs 6.04 us of compute
    t, bound = roofline.Work(flops * 100, nbytes, "bf16").floor(ceil)
    assert bound == "compute" and t == pytest.approx(483_183_820_800 / 800e12)


def _doc():
    row = dict(case="qwen3_30b-bf16", label="Qwen3", M=64, E=128, topk=8, K=2048, I=768, scheme="bf16",
               times_s={"step": 400e-6, "gemms": 250e-6}, methods={"step": "cuda-graph", "gemms": "cuda-events"},
               checks={"step": "ok 0.31"}, floor_s=200e-6, bound="memory", peer_s=283.92e-6, extra={"tuned": "y"})
    pre = dict(row, M=4096, times_s={"step": 1e-3, "gemms": 0.5e-3, "triton step": 1.5e-3}, methods={}, checks={},
               floor_s=0.25e-3, peer_s=1e-3, extra={})
    return {"backend": "triton", "device": {"name": "NVIDIA H200"},
            "ceilings": {"copy_bytes_per_s": 4.28e12, "matmul_flops_per_s": {"bf16": 7.9e14, "fp8": 1.26e15}},
            "peer": {"title": "vLLM H200", "device": "NVIDIA H200", "source": "perf-anchors", "measures": "gemms"},
            "compare": "gemms", "experts": [row, pre], "prepare": "reference",
            "gate": [dict(case="dsv3_gate", label="DeepSeek gate", M=1, floor_s=1e-6, times_s={"v0:a": 4e-6,
                                                                                                "F.linear": None})],
            "failures": ["check x: FAIL"], "notes": ["a note"]}


def test_table_on_synthetic_figures():
    text = report.render_suite(_doc())
    lines = text.splitlines()
    assert lines[0].startswith("# triton backend on NVIDIA H200: ceilings 4.28 TB/s copy, bf16 790 TFLOP/s")
    head = next(ln for ln in lines if ln.startswith("| shape"))
    # step / gemms: what the step adds around its GEMMs; "triton step / step": a backend timed beside (`beside`)
    assert head == ("| shape | M | step us | gemms us | triton step us | vLLM H200 us | speedup | step / gemms | "
                    "triton step / step | floor us | % of floor | check | tuned |")
    assert "| qwen3_30b-bf16 (128,8,2048,768) | 64 | 400.00 | 250.00 (e) | - | 283.92 | 1.14x | 1.60 | - | 200.00 | "\
           "80% | ok 0.31 | y |" in lines
    assert "| qwen3_30b-bf16 (128,8,2048,768) | 4096 | 1000.00 | 500.00 | 1500.00 | 1000.00 | 2.00x | 2.00 | 1.50 | "\
           "250.00 | 50% | - |  |" in lines
    assert "prefill (M >= 1024) geometric-mean speedup of gemms vs vLLM H200: 2.000x over 1 points" in lines
    assert "decode (M 8..64) % of floor of gemms: min 80%, mean 80%" in lines
    assert "| dsv3_gate | 1 | 1.00 | 4.00 | - |" in lines
    assert "failures: 1" in text and "a note" in lines
    assert ("step = the whole layer call: prepare + experts + finalize; the activations are quantized in prepare by "
            "reference (MOE_BENCH_PREPARE=backend: the backend's own op).") in lines


def _doc_issue44():
    """Four rows as the triton suite's with a live peer: one below the peer, one whose step is 1.5x its GEMMs, an
    M = 4096 row, one step timed eagerly (its capture failed)."""
    def row(case, M, step, gemms, peer, floor, **kw):
        return dict(case=case, label=case, M=M, E=8, topk=2, K=4096, I=7168, scheme="fp8_tensor",
                    times_s={"step": step * 1e-6, "gemms": gemms * 1e-6, "vLLM 0.33.0": peer * 1e-6},
                    methods={"step": "cuda-graph", "gemms": "cuda-graph", "vLLM 0.33.0": "cuda-graph"},
                    checks={}, floor_s=floor * 1e-6, peer_s=peer * 1e-6, extra={},
                    prepare_ops={"step": "scaled_fp8_quant"}, graph_errors={}, **kw)
    rows = [row("mixtral_tp2-fp8_tensor", 1, 110.0, 100.0, 81.0, 84.0),
            row("mixtral_tp2-fp8_tensor", 8, 390.0, 260.0, 270.0, 250.0),
            row("mixtral_tp2-fp8_tensor", 4096, 2600.0, 2500.0, 2600.0, 1800.0),
            row("qwen3_30b-bf16", 64, 300.0, 280.0, 290.0, 280.0)]
    rows[3]["prepare_ops"] = {"step": "unquantized"}
    rows[3]["methods"]["step"] = "cuda-events"
    rows[3]["graph_errors"] = {"step": "RuntimeError: operation not permitted when stream is capturing"}
    return {"backend": "triton", "device": {"name": "NVIDIA H200"},
            "ceilings": {"copy_bytes_per_s": 4.2e12, "matmul_flops_per_s": {"bf16": 7.9e14}},
            "peer": {"title": "vLLM 0.33.0 (live)", "device": "NVIDIA H200", "source": "vllm", "measures": "gemms",
                     "unit": "us", "live": True, "column": "vLLM 0.33.0"},
            "compare": "gemms", "experts": rows, "prepare": "triton quant ops (scaled_fp8_quant)",
            "prepare_mode": "backend", "gate": [], "failures": [], "notes": []}


def test_table_reads_issue_44_criteria_per_row():
    """The summary counts every row: rows at or above the peer (the rows below named), the M = 4096 rows' % of the
    floor, step / gemms against 1.3 (the rows above named), which quantizers the step's prepare ran, and the rows
    timed eagerly with their capture error."""
    lines = report.render_suite(_doc_issue44()).splitlines()
    head = next(ln for ln in lines if ln.startswith("| shape"))
    assert "| step / gemms |" in head
    assert "| mixtral_tp2-fp8_tensor (8,2,4096,7168) | 8 | 390.00 | 260.00 | 270.00 | 1.04x | 1.50 | 250.00 | 96% |" \
        in "\n".join(lines)
    assert "rows at or above 1.00x of vLLM 0.33.0 (live): 3 of 4; below: mixtral_tp2-fp8_tensor M=1 0.81x" in lines
    assert "M = 4096 % of floor of gemms: min 72% over 1 rows" in lines
    assert "step / gemms: max 1.50; 3 of 4 rows <= 1.3; above: mixtral_tp2-fp8_tensor M=8 1.50" in lines
    assert any(ln.startswith("step = the whole layer call") and "by triton quant ops (scaled_fp8_quant) "
               "(--prepare backend" in ln and ln.endswith("ops run: scaled_fp8_quant, unquantized.") for ln in lines)
    i = lines.index("not captured in a CUDA graph (timed eagerly, launch gaps included): 1")
    assert lines[i + 1] == ("  - qwen3_30b-bf16 M=64 step: RuntimeError: operation not permitted when stream is "
                            "capturing")
    assert "| qwen3_30b-bf16 (8,2,4096,7168) | 64 | 300.00 (e) |" in "\n".join(lines)


def test_table_gives_each_interleaved_speedup_its_interval():
    """Rows timed interleaved (``rounds_s``: each column's rounds, paired by index) take their speedup from the
    paired rounds' ratios (the median, with its 95% interval beside it), and the summary sorts the rows by it: at or
    above 1.00x, across it (a tie within the run's noise), below it. Oracle: the intervals of hand-made rounds (10
    pairs: the 2nd and 9th ratios, `median_interval`'s order statistics for n = 10)."""
    doc = _doc_issue44()
    rows = doc["experts"]
    ours = [100e-6] * 10
    # M=1: ratios 0.80 .. 0.89 (below); M=8: 0.96 .. 1.05 (across); M=4096 and M=64 left sequential
    rows[0]["rounds_s"] = {"gemms": ours, "vLLM 0.33.0": [(80 + i) * 1e-6 for i in range(10)]}
    rows[1]["rounds_s"] = {"gemms": ours, "vLLM 0.33.0": [(96 + i) * 1e-6 for i in range(10)]}
    for r in rows[:2]:
        r["timing"] = "interleaved"
    text = report.render_suite(doc)
    # the speedup of an interleaved row is its paired rounds' median ratio (the upper median of ten: the 6th)
    assert "| 0.85x (0.81-0.88) |" in text and "| 1.01x (0.97-1.04) |" in text
    assert "| 1.04x |" in text  # M=4096: no rounds, no interval: vLLM's time / ours
    lines = text.splitlines()
    assert "rows at or above 1.00x of vLLM 0.33.0 (live): 3 of 4; below: mixtral_tp2-fp8_tensor M=1 0.85x" in lines
    assert ("  95% intervals of the paired rounds' ratio to vLLM 0.33.0 (live) (2 rows timed interleaved): 0 at or "
            "above 1.00x, 1 across 1.00x (a tie within the noise), 1 below; across: mixtral_tp2-fp8_tensor M=8 "
            "(0.970-1.040); below: mixtral_tp2-fp8_tensor M=1 (0.810-0.880)") in lines
    assert any(ln.startswith("timing: interleaved (--timing)") for ln in lines)
    doc["experts"] = rows[2:]
    assert "95% intervals" not in report.render_suite(doc)  # sequential rows: no interval line


def test_table_widens_each_interval_by_the_aa_spread():
    """``--aa``: a row with an A/A twin of ``gemms`` (a second instance, built anew) shows the twin's paired ratio to
    ``gemms`` and widens its speedup's interval by the farthest end s of that ratio's interval from 1.00, to
    ``(low (1 - s), high (1 + s))``; the summary sorts by the widened interval. Oracle: hand-made rounds, the twin
    1.5% slower in every round (s = 0.015), vLLM's ratios 0.986 .. 0.995 (interval 0.987-0.994: below 1.00 alone,
    0.972-1.009 widened: across)."""
    doc = _doc_issue44()
    rows = doc["experts"]
    ours = [100e-6] * 10
    rows[0]["rounds_s"] = {"gemms": ours, "vLLM 0.33.0": [(98.6 + 0.1 * i) * 1e-6 for i in range(10)],
                           report.aa_column("gemms"): [101.5e-6] * 10}
    rows[0]["times_s"][report.aa_column("gemms")] = 101.5e-6
    rows[1]["rounds_s"] = {"gemms": ours, "vLLM 0.33.0": [(80 + i) * 1e-6 for i in range(10)]}  # no twin: as before
    for r in rows[:2]:
        r["timing"] = "interleaved"
    text = report.render_suite(doc)
    lines = text.splitlines()
    head = next(ln for ln in lines if ln.startswith("| shape"))
    assert "| A/A of gemms |" in head and "gemms (A/A) us" not in head  # the twin as a ratio, not a column of times
    assert "| 0.99x (0.97-1.01) |" in text and "| 1.015 (1.015-1.015) |" in text
    assert "| 0.85x (0.81-0.88) |" in text
    assert ("  95% intervals of the paired rounds' ratio to vLLM 0.33.0 (live) (2 rows timed interleaved, 1 widened "
            "by their A/A spread): 0 at or above 1.00x, 1 across 1.00x (a tie within the noise), 1 below; across: "
            "mixtral_tp2-fp8_tensor M=1 (0.972-1.009); below: mixtral_tp2-fp8_tensor M=8 (0.810-0.880)") in lines
    assert any(ln.startswith("A/A (--aa): `gemms (A/A)` = a second instance of `gemms`") for ln in lines)
    assert report.aa_spread(rows[1], "gemms") is None
    rows[0]["rounds_s"][report.aa_column("gemms")] = list(ours)  # a twin that reads the same: nothing widened
    assert "| 0.99x (0.99-0.99) |" in report.render_suite(doc)


def test_aa_twin_builds_the_compared_column_anew():
    """``cli._aa_twin``: the compared column (``gemms`` where the row has it, else its first step) is built again the
    way it was (the backend's variants hook asked anew; a step's ``make_experts_call``), so the twin is another
    instance, not the same call; a failing rebuild is reported (``fail``) and leaves the row without a twin."""
    from types import SimpleNamespace

    built = []

    def variants(shape, M, inp, device):
        call = lambda i: None  # noqa: E731
        built.append(call)
        return [("gemms", call), ("other", call)]

    first = lambda i: None  # noqa: E731
    timed = [("step", first, "TritonExperts", object), ("gemms", first, "gemms", None)]
    shape = SimpleNamespace(id="x")
    twin = cli._aa_twin(timed, "gemms", None, SimpleNamespace(variants=variants), shape, 1, None, "cpu", "backend",
                        None)
    assert [(n, k, c) for n, _, k, c in twin] == [("gemms (A/A)", "gemms", None)]
    assert twin[0][1] is built[0] and twin[0][1] is not first
    failed = []

    def broken(shape, M, inp, device):
        raise RuntimeError("no kernel")

    assert cli._aa_twin(timed, "gemms", None, SimpleNamespace(variants=broken), shape, 1, None, "cpu", "backend",
                        lambda what, exc: failed.append(what)) == []
    assert failed == ["x M=1 A/A twin of gemms"]
    assert cli._aa_twin([("peer", first, "p", None)], "gemms", None, None, shape, 1, None, "cpu", "backend",
                        None) == []  # nothing of ours to twin


def test_torch_backend_aa_on_cpu(capsys, tmp_path):
    """``--aa`` end to end on the CPU: the step's twin is timed in the same rounds (as many as the step's), its
    ratio is a column of the table; with ``--timing sequential`` the flag is refused."""
    out = tmp_path / "r.json"
    rc = cli.main(["--backend", "torch", "--shapes", "qwen3_30b-bf16-cpu_small", "--ms", "1", "--aa", "--json",
                   str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    row = json.loads(out.read_text())["experts"][0]
    assert len(row["rounds_s"]["step (A/A)"]) == len(row["rounds_s"]["step"]) >= 5
    assert "| A/A of step |" in text
    with pytest.raises(SystemExit):
        cli.parse_args(["--backend", "torch", "--aa", "--timing", "sequential"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the triton suite's GEMM stage (gemms)")
def test_triton_gemms_twin_on_gpu(capsys, tmp_path):
    """``--aa`` on the triton suite: the twin of ``gemms`` (the variants hook asked anew) is captured and timed in
    the same rounds, and its ratio to ``gemms`` is a column of the table (run on the GPU by
    ``tools/gpu/gpu_session.sh tests-benchmarks_cli``)."""
    out = tmp_path / "r.json"
    rc = cli.main(["--backend", "triton", "--shapes", "qwen3_30b-bf16", "--ms", "1", "--aa", "--peer", "none",
                   "--no-gate", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    row = json.loads(out.read_text())["experts"][0]
    assert len(row["rounds_s"]["gemms (A/A)"]) == len(row["rounds_s"]["gemms"]) >= 5
    assert row["methods"]["gemms (A/A)"] == "cuda-graph"
    assert "| A/A of gemms |" in text


def test_table_says_what_the_clocks_did():
    """The clocks sampled during each timing (``timing.ClockSampler``): how many ran under the software power cap
    (reason bit 0x4) for most of their samples, the lowest mean clock and where, other clock-event reasons met, and the
    rows whose compared column and peer ran at clocks more than 3% apart; a document without clocks (CPU) prints no
    such line."""
    doc = _doc_issue44()
    assert not any(ln.startswith("SM clock") for ln in report.render_suite(doc).splitlines())

    def clk(mhz, reasons, capped=0.0):
        return dict(mean_mhz=mhz, min_mhz=mhz - 50, max_mhz=1980.0, watts=500.0, reasons=reasons, capped=capped,
                    samples=30)

    rows = doc["experts"]
    rows[0]["clocks"] = {"gemms": clk(1980.0, 0), "vLLM 0.33.0": clk(1975.0, 0x1)}  # 0.3% apart: not named
    # the power cap in most samples of two timings, in a few of a third (not counted); one met a thermal slowdown
    rows[2]["clocks"] = {"gemms": clk(1554.0, 0x4, 0.9), "vLLM 0.33.0": clk(1840.0, 0x24, 0.5),
                         "step": clk(1600.0, 0x4, 0.1)}
    lines = report.render_suite(doc).splitlines()
    assert ("SM clock during the timed rounds (NVML, 5 timings): the software power cap held during most of the "
            "samples of 2 of them; lowest mean 1554 MHz (mixtral_tp2-fp8_tensor M=4096 gemms); sw thermal during 1"
            ) in lines
    assert ("rows whose `gemms` and peer timings ran at mean SM clocks more than 3% apart (under the power cap a "
            "ratio measures energy per step as much as schedule): 1; mixtral_tp2-fp8_tensor M=4096 gemms 1554 / "
            "vLLM 0.33.0 1840 MHz") in lines


@pytest.mark.skipif(not NO_GPU, reason="the CPU run of the torch backend")
def test_torch_backend_step_uses_its_own_quantizers(capsys, tmp_path):
    """``--prepare backend`` (the default): the FP8 step quantizes its input with the backend's own ops (recorded per
    row in ``prepare_ops``) and still passes the check against the reference (the error model's bound);
    ``--prepare reference`` runs the reference's prepare."""
    import json

    out = tmp_path / "r.json"
    shapes = "qwen3_30b-fp8_block128-cpu_small,mixtral_tp2-fp8_tensor-cpu_small,qwen3_30b-fp8_channel_token-cpu_small"
    rc = cli.main(["--backend", "torch", "--shapes", shapes, "--ms", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    ops = {r["case"]: r["prepare_ops"]["step"] for r in doc["experts"]}
    assert ops == {"qwen3_30b-fp8_block128-cpu_small": "per_token_group_quant_fp8",
                   "mixtral_tp2-fp8_tensor-cpu_small": "scaled_fp8_quant",
                   "qwen3_30b-fp8_channel_token-cpu_small": "scaled_fp8_quant"}, ops
    assert all(r["checks"]["step"].startswith("ok ") for r in doc["experts"]), doc["experts"]
    assert doc["prepare_mode"] == "backend" and doc["prepare"].startswith("torch quant ops")
    rc = cli.main(["--backend", "torch", "--shapes", "mixtral_tp2-fp8_tensor-cpu_small", "--ms", "2", "--prepare",
                   "reference", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["prepare"] == "reference" and doc["experts"][0]["prepare_ops"]["step"] == "reference"


def test_sustained_ceilings_beside_the_floor():
    """The GEMM ceilings sustained as the rows are timed (under a power cap below the burst ones the floor uses) are
    printed in the header with their clock, and the M = 4096 line gives the fraction of the floor on them beside the
    filed one; the floor itself stays on the burst ceilings (``roofline.sustained`` only substitutes the rates)."""
    from benchmarks import roofline

    ceil = {"copy_bytes_per_s": 4.2e12, "matmul_flops_per_s": {"bf16": 7.9e14, "fp8": 1.44e15, "fp32": 5e13}}
    assert roofline.sustained(ceil) is None
    ceil["sustained_matmul_flops_per_s"] = {"bf16": 6.5e14, "fp8": 1.2e15}
    ceil["sustained_clocks"] = {"fp8": dict(mean_mhz=1610.0, min_mhz=1500.0, max_mhz=1980.0, watts=690.0,
                                            reasons=0x4, capped=0.75, samples=40)}
    s = roofline.sustained(ceil)
    assert s["matmul_flops_per_s"] == {"bf16": 6.5e14, "fp8": 1.2e15, "fp32": 5e13}
    assert ceil["matmul_flops_per_s"]["fp8"] == 1.44e15  # not modified
    flops = 2.4e12  # a compute-bound row: 1.667 ms at the burst ceiling, 2.0 ms sustained
    assert roofline.floor_seconds(flops, 1e9, ceil, "fp8")[0] == pytest.approx(flops / 1.44e15)
    assert roofline.floor_seconds(flops, 1e9, s, "fp8")[0] == pytest.approx(2e-3)

    doc = _doc_issue44()
    doc["ceilings"] = ceil
    lines = report.render_suite(doc).splitlines()
    assert lines[0].endswith("fp32 50 TFLOP/s; sustained as the rows are timed: bf16 650 TFLOP/s, fp8 1.2e+03 "
                             "TFLOP/s at 1610 MHz (power cap in 75% of its samples).")
    assert "M = 4096 % of floor of gemms: min 72% over 1 rows" in lines  # no sustained floor on the row
    doc["experts"][2]["floor_sustained_s"] = 2160e-6
    lines = report.render_suite(doc).splitlines()
    assert "M = 4096 % of floor of gemms: min 72% over 1 rows (on the sustained GEMM ceilings: min 86%)" in lines


@pytest.mark.skipif(not NO_GPU, reason="the CPU run of the torch backend")
def test_budget_flag_overrides_the_suites(capsys, tmp_path):
    """``--budget-s`` replaces the suite's ``budget_s``: after it no new row starts, and each row left out is named
    with the flag that raises it (a fresh GPU machine's cold Triton cache took the triton suite past 450 s)."""
    import json

    out = tmp_path / "r.json"
    rc = cli.main(["--backend", "torch", "--shapes", "qwen3_30b-bf16-cpu_small", "--ms", "1,2", "--budget-s", "0",
                   "--no-gate", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["experts"] == []
    assert doc["notes"] == [f"time budget (0 s; --budget-s) reached: qwen3_30b-bf16-cpu_small M={m} not timed"
                            for m in (1, 2)]
    rc = cli.main(["--backend", "torch", "--shapes", "qwen3_30b-bf16-cpu_small", "--ms", "1,2", "--budget-s", "600",
                   "--no-gate", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [r["M"] for r in doc["experts"]] == [1, 2] and not any("budget" in n for n in doc["notes"])


@pytest.mark.skipif(not NO_GPU, reason="the CPU run of the torch backend")
def test_torch_backend_runs_on_cpu(capsys, tmp_path):
    out = tmp_path / "r.json"
    rc = cli.main(["--backend", "torch", "--shapes", "qwen3_30b-bf16-cpu_small", "--ms", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "| qwen3_30b-bf16-cpu_small (16,8,256,128) | 1 |" in text and "ok " in text and out.exists()
