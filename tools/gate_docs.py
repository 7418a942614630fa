"""The generated block of ``docs/gate_tiers.md``: the router gate tiers of ``reference.gate`` and the tier each
real model's gate takes, as Markdown.

    python -m tools.gate_docs            # rewrite the block between the markers of docs/gate_tiers.md
    python -m tools.gate_docs --check    # exit 1 when the block is stale (tests/test_gate.py checks the same)
    python -m tools.gate_docs --print    # print the block only

The model columns are computed with ``reference.gate.select_gate_tier`` and ``resolve_params_dtype`` (its public
API only), never written by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from reference.gate import (
    CPU,
    ROCM_MI300,
    SM80,
    SM89,
    SM90,
    SM100,
    SM103,
    SM120,
    GateTier,
    Platform,
    resolve_params_dtype,
    select_gate_tier,
)

__all__ = ["render_tier_table", "BEGIN", "END", "DOC", "regenerate"]

DOC = Path(__file__).resolve().parents[1] / "docs" / "gate_tiers.md"
BEGIN = "<!-- BEGIN GENERATED: tools.gate_docs.render_tier_table() -->\n"
END = "<!-- END GENERATED -->\n"


# (label, H, E, bias, params_dtype, force_fp32_compute), from shared/facts/models.md ("gate dtype" column).
_MODEL_GATES: tuple[tuple[str, int, int, bool, torch.dtype, bool], ...] = (
    ("DeepSeek-V3 / R1 / V3.2", 7168, 256, False, torch.bfloat16, False),
    ("Kimi-K2", 7168, 384, False, torch.bfloat16, False),
    ("MiniMax-M2 / M2.5", 3072, 256, False, torch.float32, False),
    ("GLM-4.5 / 4.6 / 4.7", 5120, 160, False, torch.float32, False),
    ("Nemotron-3-Nano-30B-A3B", 2688, 128, False, torch.bfloat16, True),
    ("Qwen3-30B-A3B", 2048, 128, False, torch.bfloat16, False),
    ("Qwen3-235B-A22B", 4096, 128, False, torch.bfloat16, False),
    ("Qwen3-Next-80B-A3B", 2048, 512, False, torch.bfloat16, False),
    ("Mixtral-8x7B", 4096, 8, False, torch.bfloat16, False),
    ("Mixtral-8x22B", 6144, 8, False, torch.bfloat16, False),
    ("Llama-4-Scout", 5120, 16, False, torch.bfloat16, False),
    ("Llama-4-Maverick", 5120, 128, False, torch.bfloat16, False),
    ("gpt-oss-20b", 2880, 32, True, torch.bfloat16, False),
    ("gpt-oss-120b", 2880, 128, True, torch.bfloat16, False),
    ("DBRX", 6144, 16, False, torch.bfloat16, False),
    ("Granite-3.0-3B-A800M", 1536, 40, False, torch.bfloat16, False),
    ("Hunyuan-A13B", 4096, 64, False, torch.bfloat16, False),
    ("ERNIE-4.5-21B-A3B", 2560, 64, False, torch.bfloat16, False),
)

_DTYPE_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float64: "fp64"}

_TIER_ROWS: dict[GateTier, tuple[str, str, str, str]] = {
    # tier: (chosen when, kernel contract, output dtype, reference numerics)
    GateTier.DSV3_ROUTER_GEMM: (
        "specialized (CUDA, SM90 or SM10x, no bias); H = 7168; E in {256, 384}; M <= 16 (M = 0 too). "
        "x, weight and out dtypes are not checked by the dispatch",
        "x bf16, weight bf16, out fp32 or bf16, 1 <= M <= 16 (SM90-SM103)",
        "`out_dtype`; None -> `torch.get_default_dtype()` (fp32)",
        "exact dot product rounded once to fp32; bf16 out: that fp32 rounded once to bf16",
    ),
    GateTier.FP32_ROUTER_GEMM: (
        "no bias; weight fp32; CUDA, SM90 or SM10x; H = 3072; E = 256; x fp32 or bf16; M <= 32",
        "weight fp32, x fp32 or bf16, 0 <= M <= 32",
        "fp32 (`out_dtype` ignored)",
        "`x.float() @ W.T`: exact, rounded once to fp32",
    ),
    GateTier.FP32_DISPATCH_F_LINEAR: (
        "as tier 2, but M > 32 (runtime switch inside `fp32_router_gemm_dispatch`)",
        "weight fp32, x fp32 or bf16 (full fp32, not TF32)",
        "fp32 (`out_dtype` ignored)",
        "same as tier 2",
    ),
    GateTier.CUBLAS_BF16_FP32: (
        "specialized; weight bf16; `out_dtype` fp32 (at init or via `set_out_dtype`); x bf16",
        "x bf16, weight bf16",
        "fp32",
        "exact dot product rounded once to fp32 (no bf16 rounding)",
    ),
    GateTier.F_LINEAR: (
        "everything else (any platform, bias, other dims or dtypes)",
        "x cast to the weight dtype when `out_dtype` is set; else x and weight must share a dtype",
        "`out_dtype`, or the weight dtype when unset",
        "exact `x @ W.T + b` rounded once to fp32, then once to the weight dtype, then cast to `out_dtype`",
    ),
}

_TIER_ORDER = (
    GateTier.DSV3_ROUTER_GEMM,
    GateTier.FP32_ROUTER_GEMM,
    GateTier.FP32_DISPATCH_F_LINEAR,
    GateTier.CUBLAS_BF16_FP32,
    GateTier.F_LINEAR,
)

_SPECIALIZED_PLATFORMS = (SM90, SM100, SM103)
_OTHER_PLATFORMS = (CPU, SM80, SM89, SM120, ROCM_MI300)
_M_BANDS = ((1, 16), (17, 32), (33, 4096))


def _tier_label(t: GateTier) -> str:
    return "2 (F.linear)" if t is GateTier.FP32_DISPATCH_F_LINEAR else str(t.value)


def _model_tiers(
    model: tuple[str, int, int, bool, torch.dtype, bool], platform: Platform, M: int, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, GateTier]:
    _, H, E, bias, params_dtype, force = model
    w_dtype = resolve_params_dtype(params_dtype, bias=bias, force_fp32_compute=force, platform=platform)
    tier = select_gate_tier(
        M, H, E, x_dtype=torch.bfloat16, weight_dtype=w_dtype, out_dtype=out_dtype, bias=bias, platform=platform
    )
    return w_dtype, tier


def _uniform(values: list) -> object:
    first = values[0]
    if any(v != first for v in values[1:]):  # pragma: no cover - guarded by tests
        raise AssertionError(f"platforms of one group disagree: {values}")
    return first


def render_tier_table() -> str:
    """The gate tiers and the tier each real model's gate takes, as Markdown (the body of ``docs/gate_tiers.md``).

    Two tables: (1) the tiers, with the condition that selects each (first match wins), the contract of the
    implementation it runs, its output dtype, its reference numerics, and the models it serves; (2) per model
    (gate configs of ``shared/facts/models.md``), the stored weight dtype and the tier on SM90/SM100/SM103 and on
    other platforms, by token band. The model columns are computed with ``select_gate_tier`` and
    ``resolve_params_dtype`` (x bf16; ``out_dtype`` fp32 unless a column says otherwise), never written by hand.

    Returns:
        A Markdown string ending in a newline. Deterministic.

    Mirrors the tier list of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
    """
    fp32 = torch.float32
    # tier -> models reaching it on a Hopper/Blackwell platform (out_dtype fp32, any M band)
    served: dict[GateTier, list[str]] = {t: [] for t in _TIER_ORDER}
    rows2: list[str] = []
    for model in _MODEL_GATES:
        name, H, E, bias, params_dtype, force = model
        spec_cells = []
        tiers_here: list[GateTier] = []
        w_spec = _uniform([_model_tiers(model, p, 1, fp32)[0] for p in _SPECIALIZED_PLATFORMS])
        for lo, hi in _M_BANDS:
            ts = {_uniform([_model_tiers(model, p, M, fp32)[1] for p in _SPECIALIZED_PLATFORMS]) for M in (lo, hi)}
            if len(ts) != 1:  # pragma: no cover - bands are chosen so that the tier is constant in each
                raise AssertionError(f"tier not constant over M in [{lo}, {hi}] for {name}")
            t = ts.pop()
            tiers_here.append(t)
            spec_cells.append(_tier_label(t))
        none_tier = _uniform([_model_tiers(model, p, 64, None)[1] for p in _SPECIALIZED_PLATFORMS])
        other = {_model_tiers(model, p, M, fp32) for p in _OTHER_PLATFORMS for M in (1, 64)}
        other_cell = ", ".join(sorted(f"{_DTYPE_SHORT[w]} weight, tier {_tier_label(t)}" for w, t in other))
        for t in dict.fromkeys(tiers_here):
            served[t].append(name)
        flags = []
        if bias:
            flags.append("bias")
        if force:
            flags.append("force_fp32_compute")
        rows2.append(
            f"| {name} | {H} | {E} | {_DTYPE_SHORT[params_dtype]}{' (' + ', '.join(flags) + ')' if flags else ''} "
            f"| {_DTYPE_SHORT[w_spec]} | {' | '.join(spec_cells)} | {_tier_label(none_tier)} | {other_cell} |"
        )

    lines = [
        "| Tier | `GateTier` | Seed call | Chosen when (first match wins) | Implementation contract "
        "| Output dtype | Reference numerics | Models (SM90 / SM10x; x bf16, `out_dtype` fp32) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in _TIER_ORDER:
        when, contract, out, numerics = _TIER_ROWS[t]
        models = ", ".join(served[t]) if served[t] else "-"
        if t is GateTier.F_LINEAR:
            models = f"every model on CPU, SM80, SM89, SM120, ROCm; on SM90 / SM10x: {models}"
        lines.append(
            f"| {_tier_label(t)} | `{t.name}` | `{t.kernel}` | {when} | {contract} | {out} | {numerics} | {models} |"
        )

    table2 = [
        "| Model | H | E | gate params_dtype | weight on SM90 / SM10x | SM90 / SM10x, M 1-16 | M 17-32 | M > 32 "
        "| SM90 / SM10x, `out_dtype` None, M > 32 | CPU, SM80, SM89, SM120, ROCm (any M) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows2,
    ]
    return (
        "\n".join(lines)
        + "\n\nTier by model (x bf16, `out_dtype` fp32 unless the column says otherwise; computed with "
        "`select_gate_tier`):\n\n"
        + "\n".join(table2)
        + "\n"
    )


def regenerate(text: str) -> str:
    """``text`` (the contents of ``docs/gate_tiers.md``) with the block between ``BEGIN`` and ``END`` replaced by
    ``render_tier_table()``.

    Raises:
        ValueError: the markers are missing or repeated.
    """
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{DOC} must hold each marker once: {BEGIN.strip()} ... {END.strip()}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + render_tier_table() + END + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/gate_tiers.md is stale")
    mode.add_argument("--print", action="store_true", help="print the generated block only")
    args = ap.parse_args(argv)
    if args.print:
        print(render_tier_table(), end="")
        return 0
    text = DOC.read_text()
    new = regenerate(text)
    if args.check:
        if new != text:
            print(f"{DOC} is stale: run `python -m tools.gate_docs`")
            return 1
        print(f"{DOC} is current")
        return 0
    if new != text:
        DOC.write_text(new)
        print(f"rewrote the generated block of {DOC}")
    else:
        print(f"{DOC} is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
