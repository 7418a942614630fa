"""Property-based fuzz of a backend's experts classes, inside their claims (issue 22, item 2).

Hypothesis draws synthetic MoE layers: E in [1, 64], topk in [1, E], odd and even K and I (multiples of 128 where the
scheme's 128-wide groups or blocks need them), M in {0, 1, odd, up to 4096}, every scheme of specs/schemes.toml,
every activation, expert maps (EP 1/2/4/8, any rank; linear or round-robin placement), bf16/fp16/fp32 activations
for unquantized schemes, non-contiguous hidden states, and -1 padding slots. Each draw runs through the reference's
modular kernel (outputs poisoned with NaN) and is checked against ``reference.experts.fused_experts`` with the
error model's bound (``reference.error_model``): a draw the class claims (``is_supported_config``) must match; one it
does not claim must raise, never return a tensor.

A failure is shrunk by hypothesis to a minimal case, printed with a one-line repro command, and appended to
``specs/regressions.toml``, which ``conformance/test_regressions.py`` replays in every conformance run.

    python -m conformance.fuzz --backend torch --budget 60
    nox -s fuzz -- --backend triton --budget 600
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from conformance.cases import seed_of, situ_params
from conformance.inputs import to_device
from reference.activation import MoEActivation
from reference.config import FusedMoEConfig, FusedMoEParallelConfig
from reference.error_model import experts_error_bound
from reference.experts import fused_experts_with_heavy
from reference.metrics import error_stats
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from reference.batched import BatchedPrepareAndFinalize, BatchedReferenceExperts
from reference.routing import determine_expert_map, fused_topk
from reference.schemes import UNQUANTIZED, get_scheme, quantize_weights, schemes
from specs import SPECS_DIR

__all__ = ["FuzzCase", "make_inputs", "check_case", "Outcome", "main", "REGRESSIONS"]

REGRESSIONS = SPECS_DIR / "regressions.toml"
_INSIDE = 8  # of 10 draws inside the class's claims; the rest check that unclaimed configurations raise
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@functools.lru_cache(maxsize=None)
def _needs_k_multiple_of_128(scheme: str) -> bool:
    """Whether ``scheme`` quantizes in groups or blocks along K (so K and I are drawn as multiples of 128, a multiple
    of every group size of specs/schemes.toml: 16, 32, 64, 128): a quant key grouped along its columns, or weights
    the scheme's own quantizer refuses at K = 16, I = 8 (its group is not in the key: WNA16's 128, W4A8's)."""
    keys = get_scheme(scheme).quant_keys()
    if any(k is not None and k.scale is not None and k.scale.group_shape[1] > 1 for k in keys):
        return True
    try:
        w1, w2 = torch.zeros(1, 16, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 8, dtype=torch.bfloat16)
        quantize_weights(scheme, w1, w2)
    except ValueError:
        return True
    return False


@dataclass(frozen=True)
class FuzzCase:
    """One synthetic experts case. Weights ~ N(0, 1/fan_in), x ~ N(0, 1), softmax top-k of N(0, 1) logits, all
    seeded from ``id``; ``pad`` marks that many random slots -1 (weight kept non-zero: it must be ignored)."""

    E: int
    topk: int
    K: int
    I: int
    M: int
    scheme: str = "bf16"
    activation: str = "silu"
    dtype: str = "bfloat16"
    ep_size: int = 1
    ep_rank: int = 0
    placement: str = "linear"
    noncontiguous: bool = False
    pad: int = 0

    @property
    def id(self) -> str:
        s = (f"E{self.E}-k{self.topk}-K{self.K}-I{self.I}-M{self.M}-{self.scheme}-{self.activation}-{self.dtype}"
             f"-ep{self.ep_size}r{self.ep_rank}")
        s += "-rr" if self.placement != "linear" else ""
        s += "-nc" if self.noncontiguous else ""
        return s + (f"-pad{self.pad}" if self.pad else "")

    @property
    def act(self) -> MoEActivation:
        return MoEActivation.from_str(self.activation)

    def to_toml(self, note: str) -> str:
        fields = dataclasses.asdict(self)
        body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items())
        return f"\n[[experts]]\n# {note}\n{body}\n"

    def repro(self, backend: str) -> str:
        return f"python -m conformance.fuzz --backend {backend} --replay '{json.dumps(dataclasses.asdict(self))}'"


def make_config(fc: FuzzCase) -> FusedMoEConfig:
    """The ``FusedMoEConfig`` of ``fc`` (no weights: cheap, for the claim check before any input is built)."""
    return FusedMoEConfig(num_experts=fc.E, experts_per_token=fc.topk, hidden_dim=fc.K,
                          intermediate_size_per_partition=fc.I, num_local_experts=fc.E // fc.ep_size,
                          activation=fc.act, in_dtype=_DTYPES[fc.dtype],
                          moe_parallel_config=FusedMoEParallelConfig.make_ep(fc.ep_size, fc.ep_rank),
                          **situ_params(fc.act))


def claim_of(cls, fc: FuzzCase) -> tuple[bool, str | None]:
    """Whether ``cls`` claims ``fc`` (its support oracle on the scheme's quant keys, and its token range)."""
    wk, ak = get_scheme(fc.scheme).quant_keys()
    claimed, reason = cls.is_supported_config(cls, make_config(fc), wk, ak, cls.activation_format())
    rec = getattr(cls, "support", None)
    if claimed and rec is not None and (fc.M < rec.min_tokens or (rec.max_tokens is not None and fc.M > rec.max_tokens)):
        claimed, reason = False, f"{fc.M} tokens outside the claimed range {rec.min_tokens}..{rec.max_tokens}"
    return claimed, reason


def make_inputs(fc: FuzzCase, device: str):
    """``(hidden_states, w1q, w2q, topk_weights, topk_ids, expert_map, quant_config, moe_config)`` for ``fc``."""
    g = torch.Generator().manual_seed(seed_of("fuzz-" + fc.id))
    dtype = _DTYPES[fc.dtype]
    E_local = fc.E // fc.ep_size
    N = 2 * fc.I if fc.act.is_gated else fc.I
    w1 = (torch.randn(E_local, N, fc.K, generator=g) * fc.K**-0.5).to(dtype)
    w2 = (torch.randn(E_local, fc.K, fc.I, generator=g) * fc.I**-0.5).to(dtype)
    w1q, w2q, qc = quantize_weights(fc.scheme, w1, w2)
    x = torch.randn(fc.M, fc.K * (2 if fc.noncontiguous else 1), generator=g).to(dtype)
    x = x[:, ::2] if fc.noncontiguous else x
    w, ids = fused_topk(None, torch.randn(fc.M, fc.E, generator=g), fc.topk, True)[:2]
    if fc.pad and fc.M:
        flat = torch.randperm(fc.M * fc.topk, generator=g)[: fc.pad]
        ids = ids.clone().view(-1)
        ids[flat] = -1
        ids = ids.view(fc.M, fc.topk)
    _, expert_map, _ = determine_expert_map(fc.ep_size, fc.ep_rank, fc.E, fc.placement)
    cfg = make_config(fc)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w1q), to(w2q), to(w), to(ids), to(expert_map), to_device(qc, device), cfg


def case_bound(fc: FuzzCase, qc, ids: torch.Tensor, emap: torch.Tensor | None,
               router_weight_rounding: str = "reference", profile=None, heavy: torch.Tensor | None = None):
    """The error model's bound on ``fc``'s experts output (``reference.error_model.experts_error_bound``) over the
    routes held here: ids ``>= 0`` that ``emap`` maps to a local expert; ``profile``: the numerics profile judged
    under (its accumulation, where it names one; None: the default); ``heavy``: the call's own values at GEMM2's
    input (``conformance.experts_case.fused_experts_with_heavy``; the heavy event of step 7b)."""
    local = ids.long() >= 0 if emap is None else (ids.long() >= 0) & (emap[ids.long().clamp(min=0)] >= 0)
    return experts_error_bound(qc, act_dtype=_DTYPES[fc.dtype], K=fc.K, I=fc.I, activation=fc.act,
                               routed_rows=int(local.sum()), routes_per_row=max(int(local.sum()) / max(fc.M, 1), 1.0),
                               router_weight_rounding=router_weight_rounding,
                               accumulation=None if profile is None else profile.error_model_accumulation(qc),
                               heavy=heavy)


@dataclass
class Outcome:
    """``kind``: passed | refused (unclaimed, raised as required) | failed; ``detail``: the reason or the error."""

    kind: str
    detail: str = ""


def check_case(cls, fc: FuzzCase, device: str, profile=None) -> Outcome:
    """Run ``fc`` on ``cls`` against the reference (see the module docstring), judged under ``profile`` (a
    ``reference.profiles.NumericsProfile``; None: the one ``cls`` declares as ``numerics_profile``, else ``vllm``)."""
    from conformance.profile_match import declared_profile

    profile = declared_profile(None, cls) if profile is None else profile
    claimed, reason = claim_of(cls, fc)
    rec = getattr(cls, "support", None)
    variant = rec.variant_reason(fc.act, ue8m0=get_scheme(fc.scheme).use_ue8m0) if claimed and rec else None
    if variant is not None:  # the keys are claimed, a variant of them (UE8M0 scales) is not: not run
        return Outcome("refused", f"unclaimed variant, not run: {variant}")
    if not claimed and fc.M == 0:
        return Outcome("refused", f"{reason} (M == 0: nothing runs, so the refusal cannot be observed)")
    x, w1, w2, w, ids, emap, qc, cfg = make_inputs(fc, device)
    fmt = cls.activation_format()
    rec = getattr(cls, "support", None)
    batched = fmt == FusedMoEActivationFormat.BatchedExperts
    cap = max(fc.M, 1)
    kw = dict(activation=fc.act, global_num_experts=fc.E, expert_map=emap)

    def kernel(c):
        if batched:
            return FusedMoEKernel(BatchedPrepareAndFinalize(cap, cfg.num_local_experts),
                                  c(cfg, qc, max_num_tokens=cap, num_dispatchers=1), poison=float("nan"))
        return FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), c(cfg, qc), poison=float("nan"))

    try:
        out = kernel(cls).apply(x, w1, w2, w, ids, **kw)
    except Exception as exc:
        if not claimed:
            return Outcome("refused", reason or "unclaimed")
        return Outcome("failed", f"claimed but raised {type(exc).__name__}: {exc}")
    if not claimed:
        return Outcome("failed", f"not claimed ({reason}) yet returned a tensor instead of raising")
    if batched:
        if not profile.is_default:
            return Outcome("refused", f"unclaimed variant, not run: numerics profile {profile.name}: the batched "
                                      "format's reference is specified for the vllm profile only")
        ref = kernel(BatchedReferenceExperts).apply(x, w1, w2, w, ids, **kw)
        heavy = fused_experts_with_heavy(x, w1, w2, w, ids, quant_config=qc, **kw, **situ_params(fc.act))[1]
    else:
        ref, heavy = fused_experts_with_heavy(x, w1, w2, w, ids, quant_config=qc, **kw, **situ_params(fc.act),
                                          profile=profile)
    bound = case_bound(fc, qc, ids, emap, getattr(rec, "router_weight_rounding", "reference"), profile=profile,
                       heavy=heavy)
    s = error_stats(out, ref)
    over = [f"{k} {getattr(s, k):.3e} > {v:.1e}" for k, v in bound.as_tolerance().items()
            if not getattr(s, k) <= v]
    if s.nonfinite or over:
        return Outcome("failed", (f"{s.nonfinite} non-finite; " if s.nonfinite else "") + "; ".join(over))
    return Outcome("passed")


def _strategy(cls):
    """Hypothesis strategy of FuzzCases for ``cls``: most draws (``_INSIDE`` of 10) inside its claims (a claimed
    scheme and activation, on a device it supports), the rest anywhere, on small shapes (an unclaimed draw only has
    to raise, and quantizing a large layer for a refusal would spend the budget on nothing)."""
    from hypothesis import strategies as st

    from reference.activation import activation_defined

    rec = getattr(cls, "support", None)
    names = list(schemes())
    # Only the members of the semantics version in force (SITU and GELU_TANH_NO_MUL are 0.33's).
    acts = [a.value for a in MoEActivation if a is not MoEActivation.RELU2 and activation_defined(a)]
    inside_schemes = [n for n in names if rec is None or (rec.claims_quant(*get_scheme(n).quant_keys())
                                                          and (rec.ue8m0_scales or not get_scheme(n).use_ue8m0))]
    inside_acts = [a for a in acts if rec is None or rec.claims_activation(MoEActivation.from_str(a))]
    can_claim = bool(inside_schemes and inside_acts) and (rec is None or rec.device_reason() is None)

    @st.composite
    def case(draw):
        inside = can_claim and draw(st.integers(0, 9)) < _INSIDE  # shrinks toward 0: inside the claims
        scheme = draw(st.sampled_from(inside_schemes if inside else names))
        act = draw(st.sampled_from(inside_acts if inside else acts))
        blocked = _needs_k_multiple_of_128(scheme)
        if inside:
            E = draw(st.sampled_from([1, 2, 3, 8, 16, 60, 64]))
            K = draw(st.sampled_from([128, 256, 384, 1024, 2048] if blocked else [16, 64, 96, 200, 256, 1024, 2880]))
            I = draw(st.sampled_from([128, 256] if blocked else [8, 24, 64, 96, 128, 192]))
            M = draw(st.one_of(st.sampled_from([0, 1, 7, 33, 100, 257]), st.integers(2, 300),
                               st.just(4096) if K * I <= 256 * 256 else st.just(1)))
        else:
            E = draw(st.sampled_from([1, 2, 8]))
            K = draw(st.sampled_from([128, 256] if blocked else [16, 64, 96, 200]))
            I = draw(st.sampled_from([128] if blocked else [8, 24, 64]))
            M = draw(st.sampled_from([0, 1, 7, 33]))
        topk = draw(st.integers(1, min(E, 9)))
        dtypes = ["bfloat16"] if scheme not in UNQUANTIZED else sorted(
            str(d).removeprefix("torch.") for d in (rec.act_dtypes if rec else _DTYPES.values()))
        dtype = draw(st.sampled_from(dtypes))
        ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if E % e == 0]))
        rank = draw(st.integers(0, ep - 1))
        placement = draw(st.sampled_from(["linear", "round_robin"])) if ep > 1 else "linear"
        pad = draw(st.integers(0, min(M * topk, 8))) if draw(st.booleans()) else 0
        return FuzzCase(E, topk, K, I, M, scheme, act, dtype, ep, rank, placement, draw(st.booleans()), pad)

    return case()


def _append_regression(fc: FuzzCase, backend: str, detail: str, path: Path) -> None:
    note = f"found by conformance.fuzz on {backend} {time.strftime('%Y-%m-%d')}: {detail}"[:300].replace("\n", " ")
    if path.exists() and f'"{fc.scheme}"' in path.read_text() and fc.id in _regression_ids(path):
        return
    with path.open("a") as f:
        f.write(fc.to_toml(note))


def _regression_ids(path: Path) -> set[str]:
    import tomllib

    if not path.exists():
        return set()
    return {FuzzCase(**{k: v for k, v in e.items()}).id for e in tomllib.loads(path.read_text()).get("experts", [])}


def load_regressions(path: Path = REGRESSIONS) -> list[FuzzCase]:
    """The replayed cases of ``specs/regressions.toml``."""
    import tomllib

    if not path.exists():
        return []
    return [FuzzCase(**e) for e in tomllib.loads(path.read_text()).get("experts", [])]


def fuzz_class(cls, backend_name: str, device: str, budget_s: float, seed: int, regressions: Path | None,
               log=print) -> dict:
    """Fuzz one experts class for ``budget_s`` seconds; returns the figures (cases, passed, refused by reason,
    failed with their minimal cases)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Found  # noqa: F401  (hypothesis >= 6 keeps this name)

    counts = collections.Counter()
    refused = collections.Counter()
    failures: list[tuple[FuzzCase, str]] = []
    deadline = time.monotonic() + budget_s
    # Shrinking a failure may run past the budget, but not without end (hypothesis alone allows it 5 minutes).
    hard_deadline = deadline + max(30.0, 0.15 * budget_s)
    last: dict = {}

    class _OutOfTime(Exception):
        pass

    @settings(max_examples=10**6, deadline=None, database=None, derandomize=False, print_blob=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(_strategy(cls))
    def run(fc):
        now = time.monotonic()
        if now > deadline and (not last.get("shrinking") or now > hard_deadline):
            raise _OutOfTime()
        try:
            o = check_case(cls, fc, device)
        except Exception as exc:  # the reference or the harness itself: a finding too, never a crash of the run
            o = Outcome("failed", f"error outside the backend (reference or harness): {type(exc).__name__}: {exc}")
        counts["cases"] += 1
        counts[o.kind] += 1
        if o.kind == "refused":
            refused[o.detail.split(" (M == 0")[0][:110]] += 1
        if o.kind == "failed":
            last.update(case=fc, detail=o.detail, shrinking=True)
            raise AssertionError(o.detail)
        if counts["cases"] % 25 == 0:
            log(f"  [{cls.__name__}] {counts['cases']} cases: {counts['passed']} passed, {counts['refused']} refused, "
                f"{counts['failed']} failed; {budget_s - (deadline - time.monotonic()):.0f}/{budget_s:.0f} s")

    def record_failure(shrunk: bool) -> None:
        fc, detail = last["case"], last["detail"]  # the shrunk (last failing) example
        failures.append((fc, detail))
        log(f"FAILED {cls.__name__} {fc.id}: {detail}" + ("" if shrunk else " (shrinking cut short by the budget)")
            + f"\n  reproduce: {fc.repro(backend_name)}")
        if regressions is not None:
            _append_regression(fc, backend_name, f"{cls.__name__}: {detail}", regressions)
            log(f"  appended to {regressions}")

    import random

    random.seed(seed)
    interrupted = False
    while time.monotonic() < deadline:
        last.clear()
        try:
            run()
            break
        except _OutOfTime:
            if last.get("case") is not None:
                record_failure(shrunk=False)
            break
        except BaseExceptionGroup as group:
            # Hypothesis may report the deadline twice (once from a generated example, once from its replay) as a
            # group; only the deadline inside it means the budget is spent, anything else is a real error.
            if group.split(_OutOfTime)[1] is not None:
                raise
            if last.get("case") is not None:
                record_failure(shrunk=False)
            break
        except AssertionError:
            record_failure(shrunk=True)
            if len(failures) >= 5:
                break
        except KeyboardInterrupt:  # an outer time limit (SIGINT): report what ran
            interrupted = True
            if last.get("case") is not None:
                record_failure(shrunk=False)
            break
    return {"class": cls.__name__, "cases": counts["cases"], "passed": counts["passed"],
            "refused": dict(refused), "failed": len(failures), "interrupted": interrupted,
            "failures": [(fc.id, d) for fc, d in failures]}


def main(argv: list[str] | None = None) -> int:
    from backends import load_backend

    os.environ.setdefault("MOE_VALIDATE_ROUTES", "1")  # as the conformance suite (conformance/conftest.py)

    p = argparse.ArgumentParser(prog="python -m conformance.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="torch")
    p.add_argument("--budget", type=float, default=60.0, help="seconds of fuzzing, split across experts classes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--regressions", default=str(REGRESSIONS),
                   help="where shrunk failures are appended ('' to append nowhere)")
    p.add_argument("--replay", default=None, help="a case as JSON (the repro command of a failure)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    backend = load_backend(args.backend)
    reason = backend.unavailable_reason()
    if reason is not None:
        print(f"fuzz({backend.name}): skipped, backend unavailable: {reason}")
        return 0
    classes = list(backend.experts)
    if args.replay:
        fc = FuzzCase(**json.loads(args.replay))
        bad = 0
        for cls in classes:
            o = check_case(cls, fc, backend.device)
            print(f"{cls.__name__} {fc.id}: {o.kind} {o.detail}")
            bad += o.kind == "failed"
        return 1 if bad else 0
    print(f"fuzz({backend.name}): {len(classes)} experts classes, {args.budget:.0f} s, seed {args.seed}")
    # A class that runs on no device here can only refuse: a few seconds show that it does, and the rest of its
    # share goes to the classes that run.
    idle = [c for c in classes if getattr(c, "support", None) is not None and c.support.device_reason() is not None]
    idle_s = min(10.0, args.budget / max(len(classes), 1))
    share = (args.budget - idle_s * len(idle)) / max(len(classes) - len(idle), 1)
    figures = []
    for cls in classes:
        figures.append(fuzz_class(cls, args.backend, backend.device, idle_s if cls in idle else share, args.seed,
                                  Path(args.regressions) if args.regressions else None))
        if figures[-1]["interrupted"]:
            print("fuzz: interrupted; the figures below are of what ran")
            break
    for f in figures:
        refused = ", ".join(f"{n} x {r}" for r, n in sorted(f["refused"].items(), key=lambda kv: -kv[1])) or "-"
        print(f"{f['class']}: {f['cases']} cases, {f['passed']} passed, {f['failed']} failed; refused: {refused}")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": backend.name, "budget_s": args.budget,
                                               "classes": figures}, indent=1))
    failed = sum(f["failed"] for f in figures)
    passed = sum(f["passed"] for f in figures)
    refused = sum(sum(f["refused"].values()) for f in figures)
    print(f"fuzz: {passed} passed, {failed} failed, {refused} refused (unclaimed: raised as required)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
