"""Side-by-side results: every backend on the same case, as ratios to the best backend and to the roofline floor.

A *record* is one benchmark's result (a dict; ``benchmarks/test_*.py`` build them): ``kind`` (``experts`` or
``gate``), ``case`` (shape id), ``M``, ``backend``, ``impl`` (class or op), ``median_s`` (per-call device time),
``floor_s``, ``bound``, ``flops``, ``bytes``, ``method`` and more. ``finalize`` adds ``x_best`` (time / best time of
the case) and ``x_floor`` (time / floor). ``render_markdown`` makes the table that the run prints last and writes to
``results/benchmark-<gpu>.md``; ``write`` writes that and ``results/benchmark-<gpu>.json`` (the plot's input).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

__all__ = ["finalize", "render_markdown", "render_suite", "write", "load", "fmt_time", "fmt_rate"]


def fmt_time(seconds: float) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    us = seconds * 1e6
    if us < 10:
        return f"{us:.2f} us"
    if us < 10_000:
        return f"{us:.1f} us"
    return f"{us / 1000:.2f} ms"


def fmt_rate(value: float | None, unit: str) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def finalize(records: list[dict]) -> list[dict]:
    """Add ``x_best`` and ``x_floor`` (and ``best`` = the fastest label) per (kind, case, M)."""
    groups: dict[tuple, list[dict]] = OrderedDict()
    for r in records:
        groups.setdefault((r["kind"], r["case"], r["M"]), []).append(r)
    for rs in groups.values():
        ok = [r for r in rs if r.get("median_s") and math.isfinite(r["median_s"])]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["median_s"])
        for r in ok:
            r["x_best"] = r["median_s"] / best["median_s"]
            r["x_floor"] = r["median_s"] / r["floor_s"] if r.get("floor_s") else float("nan")
            r["frac_of_floor"] = r["floor_s"] / r["median_s"] if r.get("floor_s") else float("nan")
            r["best"] = _label(best)
    return records


def _label(r: dict) -> str:
    return f"{r['backend']}.{r['impl']}"


def _column(r: dict, split: set[str]) -> str:
    if r["kind"] == "gate":
        return f"{r['backend']}.{r.get('op') or r['impl']}"
    return _label(r) if r["backend"] in split else r["backend"]


def _columns(records: list[dict]) -> tuple[list[str], set[str]]:
    """Experts: a column per backend (per backend.class where one backend has two classes on the same case).
    Gates: a column per backend.op (the tier GateLinear picks is shown in the cell)."""
    per_case: dict[tuple, dict[str, int]] = {}
    for r in records:
        d = per_case.setdefault((r["case"], r["M"]), {})
        d[r["backend"]] = d.get(r["backend"], 0) + 1
    split = {b for d in per_case.values() for b, n in d.items() if n > 1}
    cols: list[str] = []
    for r in records:
        c = _column(r, split)
        if c not in cols:
            cols.append(c)
    return cols, split


def _table(records: list[dict], title: str) -> list[str]:
    if not records:
        return []
    cols, split = _columns(records)
    head = ["case", "M", "floor", "bound"] + cols
    lines = [f"#### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows: dict[tuple, dict] = OrderedDict()
    n_per_row: dict[tuple, int] = {}
    for r in records:
        n_per_row[(r["case"], r["M"])] = n_per_row.get((r["case"], r["M"]), 0) + 1
    for r in records:
        key = (r["case"], r["M"])
        row = rows.setdefault(key, {"floor": r.get("floor_s"), "bound": r.get("bound", "")})
        col = _column(r, split)
        if r.get("median_s") is None:
            row[col] = "failed: " + str(r.get("error", ""))[:80]
            continue
        if row["floor"] is None:
            row["floor"], row["bound"] = r.get("floor_s"), r.get("bound", "")
        mark = "" if r.get("method") in ("cuda-graph", "wall-clock") else " (e)"
        best = " **best**" if r.get("x_best") == 1.0 and n_per_row[key] > 1 else ""
        if r["kind"] == "gate":
            sub = r.get("tier") or ""
        else:
            sub = "" if r["backend"] in split else r["impl"]
        row[col] = (f"{fmt_time(r['median_s'])}{mark} = {r.get('x_best', float('nan')):.2f}x best, "
                    f"{r.get('x_floor', float('nan')):.2f}x floor{best}" + (f" <sub>{sub}</sub>" if sub else ""))
    for (case, M), row in rows.items():
        cells = [case, str(M), fmt_time(row["floor"]), (row["bound"] or "")[:3]] + [row.get(c, "") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    shapes = OrderedDict((r["case"], r.get("shape", "")) for r in records)
    lines.append("")
    lines += [f"- `{c}`: {label}" for c, label in shapes.items() if label]
    lines.append("")
    return lines


def render_markdown(doc: dict) -> str:
    """The side-by-side tables of a results document (``write``'s JSON)."""
    dev, ceil = doc.get("device", {}), doc.get("ceilings", {})
    mm = ceil.get("matmul_flops_per_s", {})
    lines = [
        f"### {dev.get('name', '?')}: fused-MoE benchmarks ({doc.get('datetime', '')[:16]})",
        "",
        f"torch {dev.get('torch', '?')}" + (f", CUDA {dev['cuda']}" if dev.get("cuda") else "")
        + f"; backends: {', '.join(f'{k} {v}' for k, v in doc.get('backends', {}).items()) or '-'}.",
        f"Ceilings measured in this run: copy {fmt_rate(ceil.get('copy_bytes_per_s'), 'B/s')}; "
        + "; ".join(f"{k} matmul {fmt_rate(v, 'FLOP/s')}" for k, v in mm.items()) + ".",
        "",
        "Each cell: median time per call, then time / best backend on that row and time / roofline floor "
        "(floor = max(bytes of the experts touched + activations / copy bandwidth, FLOPs / matmul throughput of the "
        "scheme's dtype); 1.00x floor = at the roofline). (e) = timed eagerly between CUDA events (the implementation "
        "could not be captured in a CUDA graph, so launch gaps are included); no mark = CUDA-graph replay "
        "(or wall clock on CPU). A streaming kernel can land slightly under 1.00x floor: reads alone run a few "
        "percent faster than the read+write copy that measures the bandwidth.",
        "",
    ]
    if dev.get("kind") == "cpu":
        lines[-1:] = ["CPU run: scaled-down shapes, wall clock, one thread; the floor uses DRAM copy bandwidth while "
                      "small operands stay in the CPU caches, so it is indicative only.", ""]
    recs = doc.get("results", [])
    lines += _table([r for r in recs if r["kind"] == "experts"], "Experts (prepare + experts + finalize)")
    gates = [r for r in recs if r["kind"] == "gate"]
    for case in OrderedDict((r["case"], None) for r in gates):
        lines += _table([r for r in gates if r["case"] == case], f"Router gate GEMM: {case}")
    skipped = doc.get("skipped", [])
    if skipped:
        by_reason: dict[str, list[str]] = OrderedDict()
        for s in skipped:
            by_reason.setdefault(s["reason"], []).append(s["id"])
        lines += ["#### Not measured", ""]
        for reason, ids in by_reason.items():
            shown = ", ".join(ids[:4]) + (f", ... ({len(ids)} in all)" if len(ids) > 4 else "")
            lines.append(f"- {reason}: {shown}")
        lines.append("")
    return "\n".join(lines)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e6:.2f}"


def _variants(rows: list[dict]) -> list[str]:
    """The timed columns of ``rows`` in first-seen order, without A/A twins (``aa_column``: shown as a ratio)."""
    cols: list[str] = []
    for r in rows:
        for k in r.get("times_s", {}):
            if k not in cols and not k.endswith(AA):
                cols.append(k)
    return cols


#: the suffix of an A/A twin's column (``python -m benchmarks --aa``)
AA = " (A/A)"


def aa_column(name: str) -> str:
    """The column of ``name``'s A/A twin: a second instance of the same call, built anew (``cli._aa_twin``)."""
    return name + AA


def aa_spread(r: dict, ref: str) -> tuple[float, float, float, float] | None:
    """``(median, low, high, spread)`` of an interleaved row's A/A: the paired rounds' ratio of ``ref``'s twin to
    ``ref`` (``timing.paired_ratio``, 95%) and ``spread``, the farthest end of that interval from 1.00: how far two
    instances of one call read apart by their placement (their memory, their graph), which the paired rounds of one
    instance do not hold. None where the row has no twin."""
    iv = paired_speedup(r, aa_column(ref), ref)
    if iv is None:
        return None
    return (*iv, max(abs(1.0 - iv[1]), abs(iv[2] - 1.0)))


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


#: mean SM clocks of two compared timings further apart than this are named (their ratio is partly one of power)
CLOCKS_APART = 0.03


def sustained_text(ceilings: dict) -> str:
    """``"; sustained as the rows are timed: bf16 650 TFLOP/s at 1500 MHz (power cap in 80% of its samples), ..."``
    of ``timing.measure_ceilings``' sustained GEMM rates, or ``""`` without them."""
    rates = ceilings.get("sustained_matmul_flops_per_s") or {}
    if not rates:
        return ""
    clocks = ceilings.get("sustained_clocks", {})

    def one(k, v):
        c = clocks.get(k)
        at = (f" at {c['mean_mhz']:.0f} MHz" + (f" (power cap in {100 * c.get('capped', 0):.0f}% of its samples)"
                                                 if c.get("capped") else "")) if c else ""
        return f"{k} {fmt_rate(v, 'FLOP/s')}{at}"

    return "; sustained as the rows are timed: " + ", ".join(one(k, v) for k, v in rates.items())


def render_suite(doc: dict) -> str:
    """The table of ``python -m benchmarks --backend NAME`` (``benchmarks.cli``): per experts shape and M, each timed
    variant's time per call, the peer's figure and the speedup over it (of the variant the peer measures), the
    roofline floor and the fraction of it reached, the correctness check; then the router-gate table; failures."""
    dev, ceil = doc.get("device", {}), doc.get("ceilings", {})
    mm = ceil.get("matmul_flops_per_s", {})
    peer, compare = doc.get("peer"), doc.get("compare")
    lines = [f"# {doc.get('backend')} backend on {dev.get('name', '?')}: ceilings "
             f"{fmt_rate(ceil.get('copy_bytes_per_s'), 'B/s')} copy, "
             + ", ".join(f"{k} {fmt_rate(v, 'FLOP/s')}" for k, v in mm.items()) + sustained_text(ceil) + "."]
    live = bool(peer and peer.get("live"))
    chain = peer.get("chain_column") if live else None
    if live:
        lines.append(f"{peer['title']} = {peer['source']}: timed live in this run on the same weights and routings "
                     f"({peer['measures']}: GEMM1 + GEMM2 launches), its output checked against the reference first; "
                     f"column `{peer.get('column', peer['title'])}`.")
        lines.append(f"`{chain}` = vLLM's whole GEMM stage as fused_experts_impl runs it: GEMM1, its compiled "
                     "activation and requantization ops (built from its csrc by benchmarks.vllm_ops), GEMM2; the "
                     f"like-for-like peer of `{compare}`, column `speedup (chain)`." if chain else
                     f"no `{peer.get('column', peer['title'])} chain` column (vLLM's whole GEMM stage with its "
                     f"compiled ops): {(peer.get('chain_error') or 'not attached').splitlines()[0]}.")
    elif peer:
        lines.append(f"{peer['title']} = {peer['source']} ({peer['measures']}): compare only on an {peer['device']}.")
    rows = doc.get("experts", [])
    if rows:
        cols = _variants(rows)
        ref = compare if compare in cols else next((c for c in cols if c.startswith("step")), cols[0] if cols
                                                   else None)
        extra = list(dict.fromkeys(k for r in rows for k in r.get("extra", {})))
        # ratios of the step: to the GEMMs alone (what the step adds around them) and of the steps of the backends
        # timed beside it (a suite's `beside`) to this one (above 1: this backend's step is faster)
        ratios = []
        if compare == "gemms" and "step" in cols and "gemms" in cols:
            ratios.append(("step / gemms", "step", "gemms"))
        ratios += [(f"{c} / step", c, "step") for c in cols if c.endswith(" step") and "step" in cols]
        peer_col = peer.get("column", peer["title"]) if peer else None
        head = ["shape", "M"] + [f"{c} us" for c in cols]
        if peer:
            head += ([] if live else [f"{peer['title']} us"]) + ["speedup"] + (["speedup (chain)"] if chain else [])
        twins = any(aa_spread(r, ref) for r in rows)
        head += [r[0] for r in ratios] + ([f"A/A of {ref}"] if twins else []) + ["floor us", "% of floor",
                                                                               "check"] + extra
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            t = r.get("times_s", {})
            cells = [f"{r['case']} ({r['E']},{r['topk']},{r['K']},{r['I']})", str(r["M"])]
            cells += [_us(t.get(c)) + ("" if r.get("methods", {}).get(c) in (None, "cuda-graph", "wall-clock")
                                       else " (e)") for c in cols]
            t_ref = t.get(ref)
            if peer:
                cells += ([] if live else [_us(r.get("peer_s"))]) + [_speedup_cell(r, "peer_s", peer_col, ref)]
                if chain:
                    cells.append(_speedup_cell(r, "peer_chain_s", chain, ref))
            cells += [f"{t[a] / t[b]:.2f}" if t.get(a) and t.get(b) else "-" for _, a, b in ratios]
            if twins:
                aa = aa_spread(r, ref)
                cells.append(f"{aa[0]:.3f} ({aa[1]:.3f}-{aa[2]:.3f})" if aa else "-")
            floor = r.get("floor_s")
            cells += [_us(floor), f"{100 * floor / t_ref:.0f}%" if floor and t_ref else "-",
                      "; ".join(r.get("checks", {}).values()) or "-"]
            cells += [str(r.get("extra", {}).get(k, "")) for k in extra]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"floor = max(bytes of the experts touched + activations / copy bandwidth, FLOPs / matmul "
                     f"throughput); % of floor and speedup are of `{ref}`"
                     + (f" (speedup = {peer['title']} time / `{ref}` time)" if peer else "")
                     + "; check = worst metric / its error-model bound against the reference ((e): timed eagerly, "
                       "graph capture failed).")
        if any(r.get("timing") == "interleaved" and len(r.get("rounds_s", {})) > 1 for r in rows):
            lines.append("timing: interleaved (--timing): a row's columns were timed round for round in turn, so each "
                         "ratio was taken under the same clocks; a speedup is the median of the paired rounds' "
                         "ratios and its (low-high) the 95% interval of that median (distribution-free, "
                         "`timing.median_interval`): an interval across 1.00x is a tie within this run's noise.")
        if twins:
            lines.append(f"A/A (--aa): `{aa_column(ref)}` = a second instance of `{ref}`, its call built anew (its own "
                         "CUDA graph and workspaces) and timed in the same rounds; column `A/A of "
                         f"{ref}` = its paired ratio to `{ref}` (1.000 for a method without a placement effect), and "
                         "each speedup's interval is widened by the farthest end s of that interval from 1.00: "
                         "(low (1 - s), high (1 + s)), the share of a ratio that one instance's placement carries "
                         "and its rounds do not.")
        if doc.get("prepare") and any(c == "step" or c.startswith("step:") for c in cols):
            # the step's prepare quantizes the activations: with the backend's own ops (python -m benchmarks'
            # default) or the reference's torch ops (several kernels, most of a decode step's time)
            mode = doc.get("prepare_mode")
            how = {"backend": " (--prepare backend: the backend's own ops; --prepare reference: the reference's)",
                   "reference": " (--prepare reference; --prepare backend: the backend's own ops)"}.get(
                mode, " (MOE_BENCH_PREPARE=backend: the backend's own op)")
            ops = sorted({o for r in rows for v in r.get("prepare_ops", {}).values() for o in v.split(", ")})
            lines.append(f"step = the whole layer call: prepare + experts + finalize; the activations are quantized in "
                         f"prepare by {doc['prepare']}{how}" + (f"; ops run: {', '.join(ops)}." if ops else "."))
        graph = [f"{r['case']} M={r['M']} {k}: {v}" for r in rows for k, v in r.get("graph_errors", {}).items()]
        if graph:
            lines.append(f"not captured in a CUDA graph (timed eagerly, launch gaps included): {len(graph)}"
                         + "".join(f"\n  - {g[:200]}" for g in graph[:10]))
        pre = [x for r in rows if r["M"] >= 1024 and (x := row_speedup(r, "peer_s", peer_col, ref))]
        dec = [100 * r["floor_s"] / r["times_s"][ref] for r in rows if r.get("times_s", {}).get(ref)
               and r.get("floor_s") and 8 <= r["M"] <= 64]
        if pre:
            lines.append(f"prefill (M >= 1024) geometric-mean speedup of {ref} vs {peer['title']}: "
                         f"{_geomean(pre):.3f}x over {len(pre)} points")
        pre_c = [x for r in rows if chain and r["M"] >= 1024 and (x := row_speedup(r, "peer_chain_s", chain, ref))]
        if pre_c:
            lines.append(f"prefill (M >= 1024) geometric-mean speedup of {ref} vs {chain}: "
                         f"{_geomean(pre_c):.3f}x over {len(pre_c)} points")
        if dec:
            lines.append(f"decode (M 8..64) % of floor of {ref}: min {min(dec):.0f}%, mean {sum(dec) / len(dec):.0f}%")
        lines += _criteria(rows, ref, peer, ratios, chain, peer_col)
        lines += _clock_lines(rows, ref, [c for c in (peer_col, chain) if c])
    gates = doc.get("gate", [])
    if gates:
        cols = _variants(gates)
        lines += ["", "| router gate | M | floor us | " + " | ".join(f"{c} us" for c in cols) + " |",
                  "|" + "---|" * (3 + len(cols))]
        for r in gates:
            t = r.get("times_s", {})
            lines.append(f"| {r['case']} | {r['M']} | {_us(r.get('floor_s'))} | "
                         + " | ".join(_us(t.get(c)) for c in cols) + " |")
        lines.append("")
        lines += [f"- `{r['case']}`: {r['label']}" for r in {r["case"]: r for r in gates}.values()]
    fails = doc.get("failures", [])
    lines.append("")
    lines.append(f"failures: {len(fails)}" + "".join(f"\n  - {f[:220]}" for f in fails[:25]))
    lines += doc.get("notes", [])
    return "\n".join(lines)


#: issue 44's bar for the whole step against its GEMM stage (``step / gemms``)
STEP_OVER_GEMMS_BAR = 1.3


def paired_speedup(r: dict, peer: str, ref: str) -> tuple[float, float, float] | None:
    """``(median, low, high)`` of an interleaved row's paired rounds' ``peer / ref`` ratios
    (``timing.median_interval``, 95%), or None where the row was not timed interleaved or lacks either column."""
    from benchmarks.timing import paired_ratio

    rs = r.get("rounds_s") or {}
    a, b = rs.get(peer), rs.get(ref)
    if not a or not b or len(a) != len(b):
        return None
    return paired_ratio(a, b)


def row_speedup(r: dict, key: str, peer: str | None, ref: str) -> float | None:
    """A row's speedup of ``ref`` over its peer (:func:`_speedup_and_interval`'s first value)."""
    return _speedup_and_interval(r, key, peer, ref)[0]


def _speedup_and_interval(r: dict, key: str, peer: str | None, ref: str) -> tuple[float | None, tuple | None]:
    """``(speedup, interval)``: the median of the paired rounds' ratios and its ``(median, low, high)`` where the
    row was timed interleaved (drift between rounds cancels in each pair; the median of the ratios, not the ratio of
    the two medians, so that it lies inside its own interval; with an A/A twin of ``ref`` the interval is widened
    to ``(low (1 - s), high (1 + s))``, ``s`` its ``aa_spread``), else ``row[key] / times_s[ref]`` (``key``:
    ``peer_s`` or ``peer_chain_s``) and None; ``(None, None)`` without both times."""
    iv = paired_speedup(r, peer, ref) if peer else None
    if iv is not None:
        aa = aa_spread(r, ref)
        if aa is not None:  # widened by the placement's share (the peer's instance is one draw as ours is)
            iv = (iv[0], iv[1] * (1.0 - aa[3]), iv[2] * (1.0 + aa[3]))
        return iv[0], iv
    p, t = r.get(key), r.get("times_s", {}).get(ref)
    return (p / t if p and t else None), None


def _speedup_cell(r: dict, key: str, peer: str | None, ref: str) -> str:
    x, iv = _speedup_and_interval(r, key, peer, ref)
    return "-" if not x else f"{x:.2f}x" + (f" ({iv[1]:.2f}-{iv[2]:.2f})" if iv else "")


def _criteria(rows: list[dict], ref: str, peer, ratios: list, chain: str | None = None,
              peer_col: str | None = None) -> list[str]:
    """Summary lines counted over every row of the table: rows at or above the peer (speedup >= 1.00x, the rows
    below named; again against the peer's whole chain where there is one) and, for rows timed interleaved, how many
    of the paired rounds' 95% intervals lie at or above 1.00x, reach across it or lie below it (those named); the M =
    4096 rows' % of the floor, and ``step / gemms`` against ``STEP_OVER_GEMMS_BAR`` (the rows above it named)."""
    out = []
    for key, title, col in (("peer_s", peer and peer["title"], peer_col), ("peer_chain_s", chain, chain)):
        got = [(r, *_speedup_and_interval(r, key, col, ref)) for r in rows]
        sp = [(r, x) for r, x, _ in got if x]
        if title and sp:
            # three decimals where two would print a row below 1 as "1.00x"
            low = [f"{r['case']} M={r['M']} {x:.3f}x" if x >= 0.995 else f"{r['case']} M={r['M']} {x:.2f}x"
                   for r, x in sp if x < 1.0]
            no_peer = sum(1 for r in rows if r.get("times_s", {}).get(ref) and not r.get(key))
            out.append(f"rows at or above 1.00x of {title}: {len(sp) - len(low)} of {len(sp)}"
                       + (f" ({no_peer} rows without a peer time)" if no_peer else "")
                       + (f"; below: {', '.join(low)}" if low else ""))
            ivs = [(r, iv) for r, x, iv in got if x and iv is not None]
            if ivs:
                above = sum(1 for _, iv in ivs if iv[1] >= 1.0)
                across = [f"{r['case']} M={r['M']} ({iv[1]:.3f}-{iv[2]:.3f})" for r, iv in ivs
                          if iv[1] < 1.0 <= iv[2]]
                below = [f"{r['case']} M={r['M']} ({iv[1]:.3f}-{iv[2]:.3f})" for r, iv in ivs if iv[2] < 1.0]
                widened = sum(1 for r, _ in ivs if aa_spread(r, ref))
                out.append(f"  95% intervals of the paired rounds' ratio to {title} ({len(ivs)} rows timed "
                           f"interleaved" + (f", {widened} widened by their A/A spread" if widened else "")
                           + f"): {above} at or above 1.00x, {len(across)} across 1.00x (a tie within the "
                           f"noise), {len(below)} below" + (f"; across: {', '.join(across)}" if across else "")
                           + (f"; below: {', '.join(below)}" if below else ""))
    big = [100 * r["floor_s"] / r["times_s"][ref] for r in rows if r["M"] == 4096 and r.get("floor_s")
           and r.get("times_s", {}).get(ref)]
    if big:
        sus = [100 * r["floor_sustained_s"] / r["times_s"][ref] for r in rows if r["M"] == 4096
               and r.get("floor_sustained_s") and r.get("times_s", {}).get(ref)]
        out.append(f"M = 4096 % of floor of {ref}: min {min(big):.0f}% over {len(big)} rows"
                   + (f" (on the sustained GEMM ceilings: min {min(sus):.0f}%)" if len(sus) == len(big) else ""))
    if ("step / gemms", "step", "gemms") in ratios:
        rs = [(r, r["times_s"]["step"] / r["times_s"]["gemms"]) for r in rows
              if r.get("times_s", {}).get("step") and r.get("times_s", {}).get("gemms")]
        if rs:
            over = [f"{r['case']} M={r['M']} {x:.2f}" for r, x in rs if x > STEP_OVER_GEMMS_BAR]
            out.append(f"step / gemms: max {max(x for _, x in rs):.2f}; {len(rs) - len(over)} of {len(rs)} rows "
                       f"<= {STEP_OVER_GEMMS_BAR}" + (f"; above: {', '.join(over)}" if over else ""))
    return out


def _clock_lines(rows: list[dict], ref: str, peers: list[str]) -> list[str]:
    """What the GPU's clocks did during the timed rounds (``row["clocks"]``, sampled by ``timing.ClockSampler``):
    how many timings ran under the software power cap for most of their samples, the lowest mean SM clock, any other
    clock-event reason met (thermal, hardware slowdown, power brake), and the rows whose ``ref`` and peer timings ran
    at mean clocks more than ``CLOCKS_APART`` apart. Nothing where no clocks were sampled (CPU, or no NVML)."""
    from benchmarks.timing import CLOCK_EVENTS, POWER_CAP

    timings = []
    for r in rows:
        cl = r.get("clocks", {})
        if cl and r.get("timing") == "interleaved":  # its columns shared one sampler (the same stats): one timing
            cl = {"interleaved": next(iter(cl.values()))}
        timings += [(r, name, c) for name, c in cl.items()]
    if not timings:
        return []
    capped = sum(1 for _, _, c in timings if c.get("capped", 0.0) >= 0.5)
    r, name, c = min(timings, key=lambda t: t[2]["mean_mhz"])
    other = {n: sum(1 for _, _, c in timings if c["reasons"] & bit) for bit, n in CLOCK_EVENTS.items()
             if bit != POWER_CAP}
    out = [f"SM clock during the timed rounds (NVML, {len(timings)} timings): the software power cap held during "
           f"most of the samples of {capped} of them; lowest mean {c['mean_mhz']:.0f} MHz ({r['case']} M={r['M']} "
           f"{name})" + "".join(f"; {n} during {k}" for n, k in other.items() if k)]
    apart = []
    for r in rows:
        cl = r.get("clocks", {})
        for p in peers:
            if ref in cl and p in cl and abs(cl[ref]["mean_mhz"] / cl[p]["mean_mhz"] - 1) > CLOCKS_APART:
                apart.append(f"{r['case']} M={r['M']} {ref} {cl[ref]['mean_mhz']:.0f} / {p} "
                             f"{cl[p]['mean_mhz']:.0f} MHz")
    if apart:
        out.append(f"rows whose `{ref}` and peer timings ran at mean SM clocks more than "
                   f"{100 * CLOCKS_APART:.0f}% apart (under the power cap a ratio measures energy per step as much "
                   f"as schedule): {len(apart)}; " + ", ".join(apart))
    return out


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write(doc: dict, results_dir: Path, slug: str) -> tuple[Path, Path]:
    """Write ``benchmark-<slug>.json`` and ``.md`` under ``results_dir``; returns both paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    jpath = results_dir / f"benchmark-{slug}.json"
    mpath = results_dir / f"benchmark-{slug}.md"
    jpath.write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    mpath.write_text(render_markdown(doc) + "\n")
    return jpath, mpath


def load(path: str | Path) -> dict:
    doc = json.loads(Path(path).read_text())
    for r in doc.get("results", []):
        if r.get("kind") == "gate" and not r.get("op"):  # files written before op/tier were recorded
            op, _, tier = r["impl"].partition("[")
            r["op"], r["tier"] = op, tier.rstrip("]") or None
        for k, v in list(r.items()):
            if v is None and k in ("median_s", "floor_s", "x_best", "x_floor", "frac_of_floor"):
                r[k] = float("nan") if k != "median_s" else None
    return doc
