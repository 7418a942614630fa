"""Roofline plot of a benchmark run: ``python -m benchmarks.plot results/benchmark-<gpu>.json [-o out.png]``.

One panel per shape (experts shapes, then router gates): achieved time per call against M (log-log), one line per
backend implementation, and the roofline floor of the same calls (black dashed; grey shading below it is out of
reach). A last panel places every result on the classic roofline: achieved TFLOP/s against arithmetic intensity
(FLOP per byte moved), under the measured bandwidth and matmul ceilings. Needs matplotlib (``pip install
matplotlib``, the ``plot`` extra); it runs on any machine from the JSON alone, so the GPU machine need not have it.
"""

from __future__ import annotations

import argparse
import math
from collections import OrderedDict
from pathlib import Path

from benchmarks import report

__all__ = ["plot_file", "plot_doc", "main"]


def _label(r: dict) -> str:
    """backend.class for experts; backend.op for gates (the tier GateLinear picks changes with M: one line)."""
    return f"{r['backend']}.{r.get('op') or r['impl']}" if r.get("kind") == "gate" else f"{r['backend']}.{r['impl']}"


def plot_doc(doc: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in doc.get("results", []) if r.get("median_s")]
    cases: dict[str, list[dict]] = OrderedDict()
    for r in recs:
        cases.setdefault(r["case"], []).append(r)
    n = len(cases) + 1
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    labels = sorted({_label(r) for r in recs})
    cmap = plt.get_cmap("tab20")
    color = {lab: cmap(i % 20) for i, lab in enumerate(labels)}
    for ax, (case, rs) in zip(flat, cases.items()):
        floor = sorted({(r["M"], r["floor_s"]) for r in rs if r.get("floor_s")})
        if floor:
            ms, fs = zip(*floor)
            ax.plot(ms, [f * 1e6 for f in fs], "k--", lw=1.5, label="roofline floor")
            ax.fill_between(ms, [f * 1e6 * 1e-3 for f in fs], [f * 1e6 for f in fs], color="0.9")
        by_impl: dict[str, list] = OrderedDict()
        for r in rs:
            by_impl.setdefault(_label(r), []).append(r)
        for lab, pts in by_impl.items():
            pts.sort(key=lambda r: r["M"])
            eager = all(r.get("method") == "cuda-events" for r in pts)
            ax.plot([r["M"] for r in pts], [r["median_s"] * 1e6 for r in pts], "o-" if not eager else "s:",
                    color=color[lab], label=lab + (" (eager)" if eager else ""), ms=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lo = min([r["median_s"] for r in rs] + [f for _, f in floor]) * 1e6
        ax.set_ylim(bottom=lo / 2)
        ax.set_title(rs[0].get("shape", case), fontsize=8)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("time per call (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    ax = flat[len(cases)]
    ceil = doc.get("ceilings", {})
    bw = ceil.get("copy_bytes_per_s")
    mm = ceil.get("matmul_flops_per_s", {})
    if bw and mm:
        xs = [2.0**k for k in range(-2, 14)]
        for dt, peak in mm.items():
            ax.plot(xs, [min(peak, bw * x) / 1e12 for x in xs], "--", lw=1,
                    label=f"roof {dt} ({report.fmt_rate(peak, 'FLOP/s')})")
    for lab in labels:
        pts = [r for r in recs if _label(r) == lab and r.get("bytes")]
        ax.scatter([r["flops"] / r["bytes"] for r in pts], [r["flops"] / r["median_s"] / 1e12 for r in pts],
                   s=10, color=color[lab], label=lab)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("all results on the roofline", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=5, ncol=2)
    for ax in flat[len(cases) + 1:]:
        ax.axis("off")
    dev = doc.get("device", {})
    fig.suptitle(f"fused-MoE benchmarks on {dev.get('name', '?')} ({doc.get('datetime', '')[:10]}): time vs the "
                 f"roofline floor", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_file(json_path: str | Path, out: str | Path | None = None) -> Path:
    """Plot ``json_path`` (``results/benchmark-<gpu>.json``) to ``out`` (default: same stem, ``.png``)."""
    json_path = Path(json_path)
    return plot_doc(report.load(json_path), Path(out) if out else json_path.with_suffix(".png"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__.splitlines()[0])
    ap.add_argument("json", help="results/benchmark-<gpu>.json written by `nox -s benchmark`")
    ap.add_argument("-o", "--out", help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    print(plot_file(args.json, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
