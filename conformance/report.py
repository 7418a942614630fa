"""Render per-case conformance results (``results/conformance-<backend>.json``) as a Markdown matrix.

    python -m conformance.report results/conformance-torch.json [-o docs/conformance/torch.md]

One table per component (experts, routing, gate, quant, align, activation): rows are models (or ops), columns are
schemes; a cell reads ``pass 4/4``, ``FAIL 1/4``, ``unsupported`` (with the reason below the table) or ``skipped``.
The header stamps backend, version, torch, device and capability. The conformance run writes
``results/conformance-<backend>.md`` itself.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

__all__ = ["render", "main"]


def _cell(entries: list[dict], notes: dict[str, int]) -> str:
    n = len(entries)
    passed = sum(e["outcome"] == "passed" for e in entries)
    failed = [e for e in entries if e["outcome"] == "failed"]
    unsupported = [e for e in entries if e.get("support") == "unsupported"]
    xfailed = [e for e in entries if e.get("xfail")]
    if failed:
        crashed = sum(bool(e.get("crashed")) for e in failed)
        return f"**FAIL** {len(failed)}/{n}" + (f" ({crashed} crashed)" if crashed else "")
    parts = []
    if passed:
        parts.append(f"pass {passed}/{n}")
    if unsupported:
        reason = unsupported[0].get("reason", "")
        ref = notes.setdefault(reason, len(notes) + 1)
        parts.append(f"unsupported[^{ref}]")
    if xfailed:
        parts.append(f"known failure {len(xfailed)}")
    rest = n - passed - len(unsupported) - len(xfailed)
    if rest > 0 and not parts:
        reason = next((e.get("reason", "") for e in entries if e.get("reason")), "skipped")
        ref = notes.setdefault(reason, len(notes) + 1)
        parts.append(f"skipped[^{ref}]")
    return ", ".join(parts) or "-"


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
    if payload.get("unavailable"):
        lines.append(f"- **unavailable here**: {payload['unavailable']}")
    results = payload["results"]
    total = defaultdict(int)
    for e in results:
        total[e["outcome"]] += 1
    lines += ["- cases: " + ", ".join(f"{v} {k}" for k, v in sorted(total.items())), ""]
    by_component: dict[str, list[dict]] = defaultdict(list)
    for e in results:
        fallback = e["nodeid"].split("::")[0].split("/")[-1].removeprefix("test_").removesuffix(".py")
        by_component[e.get("component", fallback)].append(e)
    notes: dict[str, int] = {}
    for component in sorted(by_component):
        entries = by_component[component]
        grid: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for e in entries:
            grid[(e.get("model", "-"), str(e.get("scheme", "-")))].append(e)
        rows = sorted({r for r, _ in grid})
        cols = sorted({c for _, c in grid})
        lines += [f"## {component}", "", "| model | " + " | ".join(cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for r in rows:
            cells = [_cell(grid[(r, c)], notes) if (r, c) in grid else "" for c in cols]
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        lines.append("")
    failures = [e for e in results if e["outcome"] == "failed"]
    if failures:
        lines += ["## Failures", ""] + [f"- `{e['nodeid']}`: {e.get('message', '')}" for e in failures] + [""]
    for reason, ref in notes.items():
        lines.append(f"[^{ref}]: {reason}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="+", help="results/conformance-<backend>.json file(s)")
    p.add_argument("-o", "--output", type=Path, help="output file (one input) or directory (several)")
    args = p.parse_args(argv)
    for path in args.results:
        md = render(json.loads(path.read_text()))
        if args.output is None:
            print(md)
            continue
        out = args.output / path.with_suffix(".md").name if args.output.is_dir() else args.output
        out.write_text(md)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
