"""The declared cases as data: real model layer configs, token counts, tolerances, known failures.

A small typed loader over the TOML files beside this module. It imports nothing of the project, so conformance,
benchmarks and docs all read the same numbers.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

__all__ = ["SPECS_DIR", "ModelSpec", "load_models", "load_cases", "load_tolerances",
           "oracle_tolerance", "load_schemes", "load_error_inputs", "load_xfails", "XFail"]

SPECS_DIR = Path(__file__).resolve().parent


def _load(name: str) -> dict:
    path = SPECS_DIR / name
    with path.open("rb") as f:
        return tomllib.load(f)


@dataclass(frozen=True)
class ModelSpec:
    """One real MoE layer (shared/facts/models.md). H = hidden_size, I = intermediate_size, E = num_experts."""

    name: str
    display: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    scoring_func: str
    renormalize: bool
    activation: str
    schemes: tuple[str, ...]
    cpu_ep_size: int
    gate_weight_dtype: str = "bfloat16"
    gate_out_dtype: str | None = None
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    e_score_correction_bias: bool = False
    shared_intermediate_size: int | None = None
    apply_router_weight_on_input: bool = False
    gemm1_alpha: float | None = None
    gemm1_clamp_limit: float | None = None
    expert_bias: bool = False

    @property
    def use_grouped_topk(self) -> bool:
        return self.num_expert_group is not None

    @property
    def local_num_experts(self) -> int:
        return self.num_experts // self.cpu_ep_size


@cache
def load_models() -> dict[str, ModelSpec]:
    """All model specs by name, in file order.

    Raises:
        ValueError: a model entry with unknown or missing keys (names the model and the key).
    """
    models = {}
    for name, raw in _load("models.toml")["models"].items():
        raw = dict(raw)
        raw["schemes"] = tuple(raw.get("schemes", ()))
        try:
            models[name] = ModelSpec(name=name, **raw)
        except TypeError as exc:
            raise ValueError(f"specs/models.toml [models.{name}]: {exc}") from None
        if models[name].num_experts % models[name].cpu_ep_size:
            raise ValueError(f"specs/models.toml [models.{name}]: cpu_ep_size must divide num_experts")
    return models


@cache
def load_cases() -> dict:
    return _load("cases.toml")


@cache
def load_schemes() -> dict:
    """Quantization schemes by name (``schemes.toml``)."""
    return _load("schemes.toml")["schemes"]


@cache
def load_error_inputs() -> list[dict]:
    """Bad-input cases (``error_inputs.toml``): id, mutation, expect, optional needs_cuda."""
    entries = _load("error_inputs.toml")["error"]
    for e in entries:
        if e.get("expect") not in ("raises", "reference", "raises_or_reference"):
            raise ValueError(f"specs/error_inputs.toml {e.get('id')}: expect must be raises|reference|"
                             "raises_or_reference")
    return entries


@cache
def load_tolerances() -> dict:
    """The whole of ``tolerances.toml`` (error_model, routing, activation, gate, benchmark tables)."""
    return _load("tolerances.toml")





def oracle_tolerance(bound) -> dict[str, float]:
    """Bounds for comparing two implementations with each other (e.g. the benchmarks' sanity check of a kernel
    against the torch backend) when each is within ``bound`` of the reference (the error model's bound of the case,
    ``{"max_norm", "rms_norm", "calc_diff"}``): the triangle inequality gives ``[benchmark] oracle_factor`` times
    max_norm and rms_norm, and its square times calc_diff (``calc_diff = |x - y|^2 / (|x|^2 + |y|^2)``, a squared
    distance)."""
    f = float(load_tolerances()["benchmark"]["oracle_factor"])
    return {"max_norm": f * float(bound["max_norm"]), "rms_norm": f * float(bound["rms_norm"]),
            "calc_diff": f * f * float(bound["calc_diff"])}


@dataclass(frozen=True)
class XFail:
    """A known failure: a test node-id prefix, why it fails, and the issue tracking it (required)."""

    node_id: str
    reason: str
    issue: str
    strict: bool = True


@cache
def load_xfails(backend: str) -> tuple[XFail, ...]:
    """Known failures of one backend (``specs/xfail/<backend>.toml``, or ``$MOE_XFAIL_DIR/<backend>.toml``; absent
    file = none). Entries are strict by default: a known failure that passes fails the run (XPASS(strict)).

    Raises:
        ValueError: an entry without a reason or an issue link.
    """
    import os

    path = Path(os.environ.get("MOE_XFAIL_DIR", SPECS_DIR / "xfail")) / f"{backend}.toml"
    if not path.exists():
        return ()
    with path.open("rb") as f:
        raw = tomllib.load(f)
    out = []
    for i, entry in enumerate(raw.get("xfail", [])):
        missing = [k for k in ("node_id", "reason", "issue") if not entry.get(k)]
        if missing:
            raise ValueError(f"{path} entry {i}: missing {', '.join(missing)} (every known failure needs both)")
        out.append(XFail(**entry))
    return tuple(out)
