"""Per-case conformance results (``results/conformance-<backend>.json``): failure parsing, merging of runs, and the
Markdown matrix.

    python -m conformance.report results/conformance-torch.json                 # print the matrix
    python -m conformance.report results/conformance-torch.json -o torch.md     # one file
    python -m conformance.report results/*.json -o docs/conformance/            # conformance-X.json -> X.md

The conformance run writes ``results/conformance-<backend>.{json,md}`` itself. A run over the whole suite replaces
the file; a run with a selection (``-k``, ``-m``, node ids, ``--replay``, ``--deselect``, ``-x`` stopping early)
merges into it case by case (``merge``), and the header lists every run that contributed with its selection.

Each result record keeps what the terminal showed: for a failure the whole ``ConformanceFailure`` message and its
parts (``parse_failure``: the metrics over their bounds, the worst coordinates with both values, the case, the
reproduce command, the diagnosis); for an experts case the metrics, their ``bounds`` and the ``margin`` (the worst
metric / bound: 1.0 is at the bound).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

__all__ = ["render", "main", "parse_failure", "merge", "margin", "output_name", "outcome_counts"]

_NUM = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan)"
_VIOLATION = re.compile(rf"\b(max_norm|rms_norm|calc_diff) = ({_NUM}) > ({_NUM})")
_METRIC = re.compile(rf"\b(max_norm|rms_norm|calc_diff)=({_NUM})")
_WORST = re.compile(r"worst at \[([\d, ]*)\]: got (\S+), expected (\S+)")
_AT = re.compile(r"^\s*(?:first )?at \[([\d, ]*)\]: got (\S+?),? expected (\S+?)(?: \(value before rounding (\S+)\))?$")
_FIRST_AT = re.compile(r"first at \[([\d, ]*)\]: got (\S+), expected (\S+)")
_FIELD = re.compile(r"^\s*(case|reproduce|diagnosis): (.*)$")
_REPLAY = re.compile(r"replay them: (.*)$")


def _num(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _index(text: str) -> list[int]:
    return [int(i) for i in text.split(",") if i.strip()]


def parse_failure(message: str) -> dict:
    """The parts of a ``ConformanceFailure`` message (``conformance.metrics`` writes them; missing parts are left
    out): ``headline`` (first line), ``violations`` ([{metric, value, bound}]), ``metrics`` ({name: value}),
    ``worst`` ({index, got, expected}), ``mismatches`` (the first differing elements of an exact comparison),
    ``case``, ``reproduce``, ``diagnosis`` (first line) and ``stages`` (the diagnosis's per-stage lines), ``replay``.
    """
    text = message.removeprefix("ConformanceFailure: ").removeprefix("conformance.metrics.ConformanceFailure: ")
    lines = text.splitlines()
    out: dict = {"headline": lines[0].strip() if lines else ""}
    violations = [{"metric": m, "value": _num(v), "bound": _num(b)} for m, v, b in _VIOLATION.findall(text)]
    if violations:
        out["violations"] = violations
    metrics = {m: _num(v) for m, v in _METRIC.findall(text)}
    for v in violations:
        metrics.setdefault(v["metric"], v["value"])
    if metrics:
        out["metrics"] = metrics
    worst = _WORST.search(text) or _FIRST_AT.search(text)
    if worst:
        out["worst"] = {"index": _index(worst[1]), "got": _num(worst[2]), "expected": _num(worst[3])}
    mismatches = []
    in_diagnosis = False
    for line in lines[1:]:
        field = _FIELD.match(line)
        if field:
            key, value = field[1], field[2].strip()
            out[key] = value
            in_diagnosis = key == "diagnosis"
            continue
        replay = _REPLAY.search(line)
        if replay:
            out["replay"] = replay[1].strip()
            in_diagnosis = False
            continue
        if in_diagnosis and line.startswith("  ") and line.strip():
            out.setdefault("stages", []).append(line.strip())
            continue
        at = _AT.match(line)
        if at:
            m = {"index": _index(at[1]), "got": _num(at[2]), "expected": _num(at[3])}
            if at[4]:
                m["before_rounding"] = _num(at[4])
            mismatches.append(m)
    if mismatches:
        out["mismatches"] = mismatches
        out.setdefault("worst", {k: mismatches[0][k] for k in ("index", "got", "expected")})
    return out


def margin(entry: dict) -> float | None:
    """Worst metric / bound of an entry with ``bounds`` (1.0 = at the bound; > 1 fails), else None."""
    bounds = entry.get("bounds") or {}
    ratios = []
    for metric, bound in bounds.items():
        value = entry.get(metric)
        if not isinstance(value, (int, float)) or not isinstance(bound, (int, float)):
            continue
        if bound > 0:
            ratios.append(value / bound)
        elif value > 0 or math.isnan(value):
            ratios.append(math.inf)
    return max(ratios) if ratios else None


def merge(old: dict | None, new: dict) -> dict:
    """``new`` (a run with a selection) merged into ``old`` (the file already there) case by case: entries of
    ``new`` replace those of ``old`` with the same node id, the others stay; ``runs`` lists both files' runs. A
    payload of another backend, or none, is not merged (``new`` is returned)."""
    if not old or old.get("backend") != new.get("backend") or "results" not in old:
        return new
    fresh = {e["nodeid"]: e for e in new["results"]}
    results = [fresh.pop(e["nodeid"], e) for e in old["results"]]
    results += list(fresh.values())
    merged = {**new, "results": results}
    merged["runs"] = list(old.get("runs") or [_run_of(old)]) + list(new.get("runs") or [_run_of(new)])
    merged["full"] = bool(old.get("full"))
    return merged


def _run_of(payload: dict) -> dict:
    return {"time": payload.get("time"), "selection": payload.get("selection"),
            "cases": len(payload.get("results", ()))}


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if x == x and abs(x) != math.inf else str(x)
    return str(x)


def _margin_text(entries: list[dict], outcome: str = "passed") -> str:
    margins = [m for e in entries if e["outcome"] == outcome and (m := margin(e)) is not None]
    return f" · {max(margins):.2g}" if margins else ""


def _cell(entries: list[dict], notes: dict[str, int]) -> str:
    n = len(entries)
    passed = sum(e["outcome"] == "passed" for e in entries)
    failed = [e for e in entries if e["outcome"] == "failed"]
    unsupported = [e for e in entries if e.get("support") == "unsupported"]
    xfailed = [e for e in entries if e.get("xfail")]
    parts = []
    if failed:
        crashed = sum(bool(e.get("crashed")) for e in failed)
        parts.append(f"**FAIL** {len(failed)}/{n}" + (f" ({crashed} crashed)" if crashed else "")
                     + _margin_text(entries, "failed"))
    if passed:
        parts.append(f"pass {passed}/{n}" + _margin_text(entries))
    if unsupported:
        parts.append("unsupported" + _refs([e.get("reason", "") for e in unsupported], notes))
    if xfailed:
        parts.append(f"known failure {len(xfailed)}")
    rest = n - passed - len(failed) - len(unsupported) - len(xfailed)
    if rest > 0:
        reasons = [e.get("reason") or "skipped" for e in entries if e["outcome"] == "skipped"
                   and e.get("support") != "unsupported" and not e.get("xfail")]
        parts.append(f"skipped {rest}" + _refs(reasons or ["skipped"], notes))
    return ", ".join(parts)


def _refs(reasons: list[str], notes: dict[str, int]) -> str:
    """Footnote marks for every distinct reason of a cell, the commonest first (ties by text): the same report
    whatever order the cases ran in (pytest-xdist), and no reason hidden behind another's."""
    counts = Counter(reasons)
    order = sorted(counts, key=lambda r: (-counts[r], r))
    return "".join(f"[^{notes.setdefault(r, len(notes) + 1)}]" for r in order)


def _tokens(entries: list[dict]) -> str:
    toks = sorted({e["tokens"] for e in entries if isinstance(e.get("tokens"), int)})
    return ", ".join(map(str, toks)) or "·"


def _table(entries: list[dict], notes: dict[str, int]) -> list[str]:
    if not any(e.get("model") for e in entries):  # ops without a model: one row per case family
        rows: dict[str, list[dict]] = defaultdict(list)
        for e in entries:
            rows[str(e.get("scheme", e["nodeid"].split("[")[0].split("::")[-1]))].append(e)
        lines = ["| case | result | tokens |", "|---|---|---|"]
        lines += [f"| {r} | {_cell(rows[r], notes)} | {_tokens(rows[r])} |" for r in sorted(rows)]
        return lines
    # Distributed cases (test_distributed.py) carry the world size: one row per model and world size.
    ws = any(e.get("world_size") for e in entries)
    grid: dict[tuple, list[dict]] = defaultdict(list)
    for e in entries:
        row = (e.get("model") or "(no model)", e.get("world_size") or 1) if ws else (e.get("model") or "(no model)",)
        grid[(row, str(e.get("scheme", "·")))].append(e)
    rows_ = sorted({r for r, _ in grid})
    cols = sorted({c for _, c in grid})
    head = "| model | world size | tokens | " if ws else "| model | tokens | "
    lines = [head + " | ".join(cols) + " |", "|---|" + ("---|" if ws else "") + "---|" + "---|" * len(cols)]
    for r in rows_:
        row_entries = [e for (rr, _), es in grid.items() if rr == r for e in es]
        cells = [_cell(grid[(r, c)], notes) if (r, c) in grid else "·" for c in cols]
        label = f"{r[0]} | {r[1]}" if ws else r[0]
        lines.append(f"| {label} | {_tokens(row_entries)} | " + " | ".join(cells) + " |")
    return lines


def _failure_lines(e: dict) -> list[str]:
    f = e.get("failure") or {}
    lines = [f"### `{e['nodeid']}`", ""]
    head = f.get("headline") or (e.get("message", "").splitlines() or [""])[0]
    lines.append(f"- {'crashed: ' if e.get('crashed') else ''}{head}")
    for v in f.get("violations", []):
        lines.append(f"- {v['metric']} = {_fmt(v['value'])} > bound {_fmt(v['bound'])}")
    if f.get("metrics") and not f.get("violations"):
        lines.append("- metrics: " + ", ".join(f"{k} = {_fmt(v)}" for k, v in f["metrics"].items()))
    if f.get("worst"):
        w = f["worst"]
        lines.append(f"- worst at {w['index']}: got {w['got']}, expected {w['expected']}")
    if f.get("diagnosis"):
        lines.append(f"- diagnosis: {f['diagnosis']}")
        lines += [f"  - {s}" for s in f.get("stages", [])]
    if f.get("reproduce"):
        lines += ["- reproduce:", "", "  ```bash", f"  {f['reproduce']}", "  ```"]
    if f.get("replay"):
        lines += [f"- replay the dumped inputs: `{f['replay']}`"]
    if not f and e.get("message"):
        lines += ["", "```", e["message"][:3000], "```"]
    return lines + [""]


_LEGEND = ("Cells: `pass n/N · m`: n of the cell's N cases passed, m = the worst metric / bound over them (experts: "
           "max_norm, rms_norm, calc_diff against the case's error-model bound, reference/error_model.py; 1.0 is at the bound). `**FAIL** f/N · m`: "
           "f cases failed, m over the failing ones; see Failures below. `unsupported`: not claimed by the backend, and it raised as required. `skipped`: not "
           "run (reason in the note). `·`: no case of that model x scheme in the specs. `tokens`: token counts (M) "
           "of the row's cases.")


def outcome_counts(results: list[dict]) -> dict[str, int]:
    """Cases per outcome: passed, failed, skipped, and xfailed (a known failure pytest reports as skipped with
    ``wasxfail``: counted apart, never as a skip)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    for e in results:
        key = "xfailed" if e.get("xfail") and e["outcome"] == "skipped" else e["outcome"]
        counts[key] = counts.get(key, 0) + 1
    return counts


def render(payload: dict) -> str:
    """Markdown for one backend's results payload (the JSON the conformance run writes)."""
    lines = [
        f"# Conformance matrix: `{payload['backend']}`",
        "",
        f"- version: {payload['version']}",
        f"- torch: {payload['torch']}",
        f"- device: {payload['device']}" + (f" (capability {payload['capability']})" if payload.get("capability")
                                           else ""),
        f"- generated: {payload['time']}",
    ]
    if payload.get("semantics"):
        lines.append(f"- vLLM semantics checked: {payload['semantics']}")
    if payload.get("nccl"):
        lines.append(f"- NCCL: {payload['nccl']} (distributed cases: one process per GPU)")
    if payload.get("unavailable"):
        lines.append(f"- **unavailable here**: {payload['unavailable']}")
    runs = payload.get("runs") or []
    if any(r.get("selection") for r in runs) or payload.get("selection"):
        if not payload.get("full", True):
            lines.append("- **partial**: only the selected cases below were run (no full run in this file)")
        lines.append("- runs merged into this file (latest last; a case shows its latest result):")
        for r in runs:
            sel = r.get("selection") or "full suite"
            lines.append(f"  - {r.get('time')}: {sel} ({r.get('cases')} cases)")
    results = payload["results"]
    total = outcome_counts(results)
    lines += ["- cases: " + ", ".join(f"{v} {k}" for k, v in total.items() if v), "", _LEGEND, ""]
    by_component: dict[str, list[dict]] = defaultdict(list)
    for e in results:
        fallback = e["nodeid"].split("::")[0].split("/")[-1].removeprefix("test_").removesuffix(".py")
        by_component[e.get("component", fallback)].append(e)
    notes: dict[str, int] = {}
    for component in sorted(by_component):
        entries = by_component[component]
        classes = sorted({e["experts_class"] for e in entries if e.get("experts_class")})
        groups = [(f"{component}: {c}", [e for e in entries if e.get("experts_class") == c]) for c in classes]
        rest = [e for e in entries if not e.get("experts_class")]
        if rest or not groups:
            groups.append((component, rest))
        for title, group in groups:
            lines += [f"## {title}", ""] + _table(group, notes) + [""]
    lines += _claims_lines(payload.get("claims") or {}, results)
    failures = [e for e in results if e["outcome"] == "failed"]
    if failures:
        lines += ["## Failures", ""]
        for e in failures:
            lines += _failure_lines(e)
    for reason, ref in notes.items():
        lines.append(f"[^{ref}]: {reason}")
    return "\n".join(lines) + "\n"


def _covered(entries: list[dict], dim: str, value: str) -> bool:
    if dim == "scheme":
        return any(e.get("scheme") == value for e in entries)
    if dim == "activation":
        return any(e.get("activation") == value for e in entries)
    if dim == "regime":
        return any(e.get("regime") == value for e in entries)
    if dim == "expert_map":
        last = value == "last ep rank"
        return any((e.get("ep_size") or 1) > 1 and (e.get("ep_rank") == e.get("ep_size", 1) - 1) == last
                   for e in entries)
    if dim == "chunking":
        return any(e.get("chunk_size") for e in entries)
    return False


def _claims_lines(claims: dict, results: list[dict]) -> list[str]:
    """Each experts class's claims and, per claim dimension, the claimed values that had at least one claimed
    experts case that ran (passed or failed) in this file, and those that had none."""
    if not claims:
        return []
    lines = ["## Claims and their coverage", ""]
    for cls, c in sorted(claims.items()):
        ran = [e for e in results if e.get("component") == "experts" and e.get("experts_class") == cls
               and e.get("support") == "claimed" and e["outcome"] in ("passed", "failed")]
        lines += [f"### {cls}", "", "| claim | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in c.get("record", {}).items()]
        lines += ["", "| dimension | claimed values with a case | without |", "|---|---|---|"]
        for dim, values in c.get("dimensions", {}).items():
            if not values:
                continue
            yes = [v for v in values if _covered(ran, dim, v)]
            no = [v for v in values if v not in yes]
            lines.append(f"| {dim} | {', '.join(yes) or '-'} | {', '.join(no) or '-'} |")
        lines.append("")
    return lines


def output_name(results_path: Path) -> str:
    """``conformance-torch.json`` -> ``torch.md`` (the name of the committed matrices in docs/conformance/)."""
    return results_path.with_suffix(".md").name.removeprefix("conformance-")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="+", help="results/conformance-<backend>.json file(s)")
    p.add_argument("-o", "--output", type=Path,
                   help="output .md file (one input) or directory (created if missing; conformance-X.json -> X.md)")
    args = p.parse_args(argv)
    out = args.output
    to_dir = out is not None and (out.is_dir() or out.suffix != ".md" or len(args.results) > 1)
    if to_dir and out.suffix == ".md":
        p.error(f"{len(args.results)} inputs cannot all be written to the one file {out}; give a directory")
    if to_dir:
        out.mkdir(parents=True, exist_ok=True)
        names = [output_name(path) for path in args.results]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            p.error(f"several inputs would be written to {', '.join(sorted(dupes))} in {out}")
    for path in args.results:
        md = render(json.loads(path.read_text()))
        if out is None:
            print(md)
            continue
        target = out / output_name(path) if to_dir else out
        target.write_text(md)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
