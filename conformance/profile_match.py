"""Which numerics profile (``reference.profiles``) a backend is judged under, and which known profile a failing
output matches.

A backend declares the profile its experts implement (``Backend.profile``, or an experts class's
``numerics_profile`` attribute; default ``vllm``); ``--numerics-profile NAME`` (or ``$MOE_NUMERICS_PROFILE``)
judges it under NAME instead. When an output fails under that profile, ``profile_verdict`` compares it with every
other known profile's reference under the same derived bound and says which it matches, if any: a kernel that
implements the transformers rounding hears so, and one that implements the in-place FP8 accumulation hears it
implements a named accuracy defect. A match never turns the failure into a pass.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from conformance.metrics import ConformanceFailure, assert_close
from reference.profiles import ENV_VAR, PROFILES, NumericsProfile, get_profile

__all__ = ["declared_profile", "judged_profile", "matching_profiles", "profile_verdict"]


def declared_profile(backend, experts_cls=None) -> NumericsProfile:
    """The profile the backend declares for ``experts_cls``: the class's ``numerics_profile``, else
    ``backend.profile``, else ``vllm``. Raises ValueError for an unknown name."""
    name = getattr(experts_cls, "numerics_profile", None) or getattr(backend, "profile", None) or "vllm"
    return get_profile(name)


def judged_profile(config, backend, experts_cls=None) -> NumericsProfile:
    """The profile a run judges ``experts_cls`` under: ``--numerics-profile``, else ``$MOE_NUMERICS_PROFILE``, else
    the declared one."""
    chosen = (config.getoption("--numerics-profile", default=None) if config is not None else None) \
        or os.environ.get(ENV_VAR, "").strip()
    return get_profile(chosen) if chosen else declared_profile(backend, experts_cls)


def matching_profiles(out: torch.Tensor, reference_for: Callable[[NumericsProfile], torch.Tensor],
                      tol_for: Callable[[NumericsProfile], dict], *, skip: NumericsProfile | None = None,
                      case: str = "") -> list[tuple[NumericsProfile, object]]:
    """``[(profile, ErrorStats)]`` of every known profile (but ``skip``) whose reference ``out`` matches within
    ``tol_for(profile)``; a profile whose reference cannot be computed for the case (e.g. no per-op form of the
    activation) is left out."""
    found, seen = [], []
    for p in sorted(PROFILES.values(), key=lambda p: p != skip):  # the judged one first: its twins are dropped
        try:
            expected = reference_for(p)
        except (ValueError, NotImplementedError):
            continue
        # A profile whose reference is the judged one's, or an earlier one's, bit for bit (a point the case does not
        # touch: the FP8 accumulation on a bf16 case) says nothing new.
        duplicate = any(torch.equal(expected, e) for e in seen)
        seen.append(expected)
        if duplicate or (skip is not None and p == skip):
            continue
        try:
            stats = assert_close(out, expected, tol_for(p), case=case, what=f"output vs the {p.name} profile")
        except ConformanceFailure:
            continue
        found.append((p, stats))
    return found


def profile_verdict(out, reference_for, tol_for, judged: NumericsProfile, *, case: str = "") -> str:
    """One line for a failure under ``judged``: which known profiles the output matches within bound, if any, the
    closest (smallest rms_norm) first."""
    try:
        found = matching_profiles(out, reference_for, tol_for, skip=judged, case=case)
    except Exception as exc:  # best effort: never hide the failure itself
        return f"numerics profile: judged under {judged.name}; matching other profiles failed ({type(exc).__name__}: {exc})"
    if not found:
        return (f"numerics profile: judged under {judged.name} (declared or selected); the output matches no known "
                f"profile ({', '.join(PROFILES)}) within bound: a real divergence, not a known rounding choice")
    found = sorted(found, key=lambda f: f[1].rms_norm)  # the closest match first: the one to declare
    parts = []
    for p, stats in found:
        what = "a named ACCURACY DEFECT" if p.defect else "a known rounding choice"
        diff = "; ".join(p.differences(judged)) or "-"
        parts.append(f"{p.name} ({what}; rms_norm {stats.rms_norm:.3g}; differs from {judged.name} at: {diff})")
    return (f"numerics profile: judged under {judged.name}, but the output matches profile "
            + " and ".join(parts) + f". If that is what the kernel implements, declare it (Backend.profile / "
            f"numerics_profile) or run with --numerics-profile {found[0][0].name}.")
