"""A / B of tuned-table entries through the benchmark itself: ``python -m tools.triton.table_ab SPEC.json``.

The tuner (``tools.triton.tune``) times its candidates with its own harness and explores only its candidate lists;
this tool takes hand-written entries (a vLLM default config, a tile the sweep never draws) and judges them where
the issue's figures come from: ``python -m benchmarks --backend triton --peer none --no-gate`` on one shape, each
variant's tables in a directory of its own (``MOE_TRITON_CONFIG_DIR``), the variants run in turn ``--rounds``
times (interleaved, so clock drift falls on all of them), the output checked against the reference by the
benchmark (a row whose check fails is printed as such and not timed; the variant's other rows still count).

SPEC (JSON): ``{"name": {"shape": "qwen3_30b-fp8_channel_token", "table": "E=...json", "ms": [1, 8],
"entries": {"8": {"gemm1": {...}, "gemm2": {...}}}, "merge": true}}``; ``merge`` (default true) updates the
committed entry's keys, false replaces the entry. A variant named ``base`` per shape is added (the committed
tables). Output: a line per (shape, M, variant) with the median ``gemms`` and ``step`` over the rounds, and
``OUT/table_ab.json``; with ``--aa`` each bench run also times an A/A twin of ``gemms`` (``python -m benchmarks
--aa``: a second instance of the same call) and its ratio to ``gemms`` is shown beside each row (a variant's gain
inside that spread is the placement of one instance, not the config: an H200 read identical 16 us stages up to 2.4%
apart); each variant's tables stay in ``OUT/table_ab/<variant>/`` to be committed by hand.
Variants whose table is another GPU's are skipped (one spec may hold the H100's and the H200's); an entry the
backend's config check rejects stops the run before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "backends" / "triton" / "configs"


def write_tables(out: Path, name: str, var: dict) -> Path:
    """The committed tables with ``var``'s entries applied, in ``out/name``.

    Raises:
        ValueError: a resulting entry that ``configs.sanitize_config`` rejects (the backend would silently run its
            default config for that M instead, and the A / B would time the default under the variant's name).
    """
    from backends.triton.configs import sanitize_config

    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    for f in CONFIGS.glob("*.json"):
        shutil.copy(f, d / f.name)
    if var.get("entries"):
        path = d / var["table"]
        table = json.loads(path.read_text())
        block = re.search(r"block_shape=\[(\d+),(\d+)\]", var["table"])
        for m, entry in var["entries"].items():
            if var.get("merge", True) and m in table:
                for g in ("gemm1", "gemm2"):
                    table[m][g] = {k: v for k, v in {**table[m][g], **entry.get(g, {})}.items() if v is not None}
            else:
                table[m] = entry
            try:
                sanitize_config(table[m], block_shape=[int(block[1]), int(block[2])] if block else None)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"variant {name!r}, M={m} of {var['table']}: the entry {table[m]} is not a valid "
                                 f"config ({type(exc).__name__}: {exc}); the backend would run its default "
                                 "config instead") from exc
        path.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), indent=1))
    return d


def for_device(spec: dict, device: str) -> tuple[dict, list[str]]:
    """``(the variants that change a table of ``device``, the names of the others)``: a variant whose table is another
    GPU's would time the committed tables under its name (``configs.device_name()`` picks the table)."""
    kept, other = {}, []
    for name, var in spec.items():
        table = var.get("table")
        if table and f"device_name={device}," not in table and not table.endswith(f"device_name={device}.json"):
            other.append(name)
        else:
            kept[name] = var
    return kept, other


def row_result(row: dict) -> tuple[float, float, float | None] | None:
    """``(gemms us, step us, A/A ratio or None)`` of one bench row (``python -m benchmarks``' JSON), the ratio that
    of ``gemms``' twin to ``gemms`` where the run had ``--aa`` (``benchmarks.report.aa_spread``'s median); None
    where ``gemms`` was not timed (a class whose check failed)."""
    from benchmarks.report import aa_spread

    t = row["times_s"]
    if "gemms" not in t or t["gemms"] is None:
        return None
    aa = aa_spread(row, "gemms")
    return t["gemms"] * 1e6, (t.get("step") or float("nan")) * 1e6, (aa[0] if aa else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="JSON file of variants (see above)")
    ap.add_argument("--rounds", type=int, default=2, help="times each variant runs, interleaved (default 2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "results"), help="where tables and results go")
    ap.add_argument("--aa", action="store_true", help="each bench run also times an A/A twin of gemms (python -m "
                                                       "benchmarks --aa), its ratio shown beside each row")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    from backends.triton.configs import device_name

    dev = device_name()
    spec, other = for_device(spec, dev)
    if other:
        print(f"skipped (their tables are another GPU's than {dev}): {', '.join(other)}", flush=True)
    if not spec:
        print("no variant changes this GPU's tables", flush=True)
        return 2
    out = Path(args.out) / "table_ab"
    variants = {}
    for shape in dict.fromkeys(v["shape"] for v in spec.values()):
        ms = sorted({m for v in spec.values() if v["shape"] == shape for m in v["ms"]})
        variants[f"base:{shape}"] = {"shape": shape, "ms": ms}
    variants.update(spec)
    dirs = {name: write_tables(out, name.replace(":", "_"), var) for name, var in variants.items()}
    times: dict = {}
    aas: dict = {}  # (shape, M, variant) -> each round's A/A ratio (--aa)
    for r in range(args.rounds):
        for name, var in variants.items():
            js = out / f"{name.replace(':', '_')}-{r}.json"
            cmd = [sys.executable, "-m", "benchmarks", "--backend", "triton", "--peer", "none", "--no-gate",
                   "--shapes", var["shape"], "--ms", ",".join(map(str, var["ms"])), "--json", str(js)] + (
                ["--aa"] if args.aa else [])
            env = dict(os.environ, MOE_TRITON_CONFIG_DIR=str(dirs[name]))
            js.unlink(missing_ok=True)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if not js.exists():  # (the bench writes its JSON before it exits 1 on a failed check)
                print(f"[round {r}] {name}: rc {p.returncode}\n{p.stdout[-1500:]}{p.stderr[-1500:]}", flush=True)
                continue
            res = json.loads(js.read_text())
            got = []
            for row in res["experts"]:
                got_row = row_result(row)
                if got_row is None:  # a class whose check failed is not timed
                    got.append(f"M={row['M']} not timed")
                    continue
                g, s, aa = got_row
                times.setdefault((var["shape"], row["M"], name), []).append((g, s))
                if aa is not None:
                    aas.setdefault((var["shape"], row["M"], name), []).append(aa)
                got.append(f"M={row['M']} {g:.2f} / {s:.2f}" + (f" (A/A {aa:.3f})" if aa is not None else ""))
            for f in res.get("failures", []):
                print(f"[round {r}] {name}: check failed: {f}", flush=True)
            # as each run ends (a cut call keeps what it printed): gemms / step, us
            print(f"[round {r}] {name}: {'; '.join(got)}", flush=True)
    summary = []
    for (shape, m, name), ts in sorted(times.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        g = statistics.median(x[0] for x in ts)
        s = statistics.median(x[1] for x in ts)
        aa = aas.get((shape, m, name))
        summary.append(dict(shape=shape, M=m, variant=name, gemms_us=g, step_us=s, rounds=[list(x) for x in ts],
                            **({"aa": aa} if aa else {})))
        print(f"{shape:34s} M={m:<5d} {name:28s} gemms {g:8.2f} us  step {s:8.2f} us  "
              f"({', '.join(f'{x[0]:.2f}' for x in ts)})"
              + (f"  A/A {min(aa):.3f}-{max(aa):.3f}" if aa else ""), flush=True)
    (Path(args.out) / "table_ab.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
