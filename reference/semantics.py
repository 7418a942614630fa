"""Versions of the contract: which vLLM release's semantics the reference specifies.

vLLM's fused-MoE layer changed between the releases the seeds describe (0.11-0.17) and today's (0.33): routing
gained scoring functions, padding rows and shared-expert slots, clamps non-finite router logits, renumbered
``RoutingMethodType``; the modular kernel dropped activation chunking; ... Every point where the reference's answer
depends on the release is a *named point* registered here, with what each version does and the upstream file that
says so. One semantics version selects the behaviour of every point at once (array-api-tests' API versions are the
model):

- the ``MOE_VLLM_SEMANTICS`` environment variable sets the process default (``"0.17"`` or ``"0.33"``; unset: the
  newest, ``"0.33"``);
- ``with use_semantics("0.17"): ...`` overrides it for a block (thread- and task-local, nests);
- a function whose behaviour differs takes an explicit ``semantics=`` keyword, which wins over both.

``python -m reference.semantics`` prints the table of points (``--markdown`` for a Markdown table).

Versions are the vLLM releases whose source distributions were read: ``"0.17"`` = vLLM 0.17.0 (the seeds' era),
``"0.33"`` = vLLM 0.33.0 (2026-11). A point's ``introduced`` names the first release where the 0.33 behaviour was
seen, where that was checked.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import importlib
import os
import pkgutil
import sys
from dataclasses import dataclass, field

__all__ = [
    "ENV_VAR",
    "SemanticsVersion",
    "SemanticsError",
    "SemanticsPoint",
    "current_semantics",
    "resolve_semantics",
    "use_semantics",
    "register_point",
    "points",
    "point",
    "format_table",
    "require",
]

ENV_VAR = "MOE_VLLM_SEMANTICS"


class SemanticsVersion(str, enum.Enum):
    """A vLLM release whose fused-MoE semantics the reference can specify. Compares by release order."""

    V0_17 = "0.17"
    V0_33 = "0.33"

    @classmethod
    def newest(cls) -> "SemanticsVersion":
        return max(cls)

    @classmethod
    def parse(cls, value: "SemanticsVersion | str") -> "SemanticsVersion":
        """``"0.33"``, ``"0.33.0"``, ``"v0.33"`` or a member -> the member. Raises ValueError naming the choices."""
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower().removeprefix("v")
        parts = text.split(".")
        if len(parts) >= 2:
            text = f"{parts[0]}.{parts[1]}"
            if len(parts) > 2 and any(p.strip("0") for p in parts[2:]):
                raise ValueError(f"semantics version {value!r}: only the .0 releases are specified "
                                 f"({', '.join(v.value for v in cls)})")
        for v in cls:
            if v.value == text:
                return v
        raise ValueError(f"unknown vLLM semantics version {value!r}; choose one of {', '.join(v.value for v in cls)}")

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.value.split("."))

    def __lt__(self, other):  # release order, not string order
        if not isinstance(other, SemanticsVersion):
            return NotImplemented
        return self.key < other.key

    def __le__(self, other):
        if not isinstance(other, SemanticsVersion):
            return NotImplemented
        return self.key <= other.key

    def __gt__(self, other):
        if not isinstance(other, SemanticsVersion):
            return NotImplemented
        return self.key > other.key

    def __ge__(self, other):
        if not isinstance(other, SemanticsVersion):
            return NotImplemented
        return self.key >= other.key

    def __str__(self) -> str:
        return self.value


class SemanticsError(ValueError):
    """A behaviour the selected semantics version does not define (e.g. a 0.33-only routing feature under 0.17)."""


_OVERRIDE: contextvars.ContextVar[SemanticsVersion | None] = contextvars.ContextVar("moe_vllm_semantics",
                                                                                   default=None)


def current_semantics() -> SemanticsVersion:
    """The version in force: the innermost ``use_semantics`` block, else ``$MOE_VLLM_SEMANTICS``, else the newest.

    Raises:
        ValueError: ``$MOE_VLLM_SEMANTICS`` names no known version.
    """
    v = _OVERRIDE.get()
    if v is not None:
        return v
    env = os.environ.get(ENV_VAR, "").strip()
    return SemanticsVersion.parse(env) if env else SemanticsVersion.newest()


def resolve_semantics(semantics: SemanticsVersion | str | None = None) -> SemanticsVersion:
    """An explicit ``semantics=`` argument if given, else ``current_semantics()``."""
    return current_semantics() if semantics is None else SemanticsVersion.parse(semantics)


@contextlib.contextmanager
def use_semantics(version: SemanticsVersion | str):
    """Select a semantics version for the block (context-local; nests; restores on exit)."""
    token = _OVERRIDE.set(SemanticsVersion.parse(version))
    try:
        yield _OVERRIDE.get()
    finally:
        _OVERRIDE.reset(token)


@dataclass(frozen=True)
class SemanticsPoint:
    """One named point where vLLM releases differ.

    name: stable identifier (``component.what``), e.g. ``"routing.nonfinite_logits"``.
    component: reference module that specifies it (``"routing"``, ``"modular"``, ...).
    behaviour: per version, one or two sentences of what the reference does under it.
    upstream: per version, the upstream file(s) (and release) the behaviour was read from.
    reference: where in the reference it is specified (``module.function``).
    introduced: first release seen with the newer behaviour, where it was checked ("" when not checked).
    """

    name: str
    component: str
    behaviour: dict[SemanticsVersion, str]
    upstream: dict[SemanticsVersion, str]
    reference: str
    introduced: str = ""
    notes: str = field(default="", compare=False)

    def describe(self, version: SemanticsVersion | str) -> str:
        return self.behaviour[SemanticsVersion.parse(version)]


_POINTS: dict[str, SemanticsPoint] = {}


def register_point(name: str, *, component: str, behaviour: dict, upstream: dict, reference: str,
                   introduced: str = "", notes: str = "") -> SemanticsPoint:
    """Register a point (idempotent for an identical re-registration; a different one under the same name raises).

    ``behaviour`` and ``upstream`` map every ``SemanticsVersion`` (or its string) to text.
    """
    beh = {SemanticsVersion.parse(k): v for k, v in behaviour.items()}
    up = {SemanticsVersion.parse(k): v for k, v in upstream.items()}
    missing = [v.value for v in SemanticsVersion if v not in beh or v not in up]
    if missing:
        raise ValueError(f"semantics point {name!r} does not say what versions {missing} do")
    p = SemanticsPoint(name, component, beh, up, reference, introduced, notes)
    old = _POINTS.get(name)
    if old is not None and old != p:
        raise ValueError(f"semantics point {name!r} is already registered differently (by {old.reference})")
    _POINTS[name] = p
    return p


def _load_all() -> None:
    """Import every ``reference`` module so that each registers its points."""
    import reference

    for info in pkgutil.walk_packages(reference.__path__, "reference."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)


def points(component: str | None = None) -> list[SemanticsPoint]:
    """All registered points (every reference module imported first), sorted by name; optionally one component's."""
    _load_all()
    return sorted((p for p in _POINTS.values() if component is None or p.component == component),
                  key=lambda p: p.name)


def point(name: str) -> SemanticsPoint:
    """One point by name (KeyError naming the known ones)."""
    if name not in _POINTS:
        _load_all()
    try:
        return _POINTS[name]
    except KeyError:
        raise KeyError(f"no semantics point {name!r}; known: {', '.join(sorted(_POINTS))}") from None


def require(feature: str, since: SemanticsVersion | str, semantics: SemanticsVersion | str | None = None,
            *, upstream: str = "") -> SemanticsVersion:
    """The resolved version, or SemanticsError if ``feature`` is not defined before ``since``."""
    v = resolve_semantics(semantics)
    since = SemanticsVersion.parse(since)
    if v < since:
        where = f" ({upstream})" if upstream else ""
        raise SemanticsError(f"{feature} is not defined under vLLM {v.value} semantics; vLLM {since.value}"
                             f"{where} defines it. Select it with semantics='{since.value}', "
                             f"use_semantics('{since.value}') or {ENV_VAR}={since.value}.")
    return v


def format_table(markdown: bool = False, component: str | None = None) -> str:
    """The points as text: one block per point (or one Markdown table row per point and version)."""
    pts = points(component)
    versions = list(SemanticsVersion)
    if markdown:
        lines = ["| point | version | behaviour | upstream | reference |", "|---|---|---|---|---|"]
        for p in pts:
            for v in versions:
                cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
                lines.append(f"| `{p.name}` | {v.value} | {cell(p.behaviour[v])} | {cell(p.upstream[v])} | "
                             f"`{p.reference}` |")
        return "\n".join(lines)
    out = [f"vLLM semantics versions: {', '.join(v.value for v in versions)} (default {current_semantics().value}; "
           f"${ENV_VAR}, reference.semantics.use_semantics, semantics=)", ""]
    for p in pts:
        intro = f"  (changed by {p.introduced})" if p.introduced else ""
        out.append(f"{p.name}  [{p.reference}]{intro}")
        for v in versions:
            out.append(f"  {v.value}: {p.behaviour[v]}")
            out.append(f"        upstream: {p.upstream[v]}")
        if p.notes:
            out.append(f"  note: {p.notes}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------------------
# The modular kernel's points (reference.modular; strategies in reference.modular.modular_kernel)
# ------------------------------------------------------------------------------------------------------------

_MK017 = "vLLM 0.17.0 fused_moe/modular_kernel.py"
_MK033 = "vLLM 0.33.0 fused_moe/modular_kernel.py"

register_point(
    "modular.activation_chunking", component="modular",
    behaviour={"0.17": "FusedMoEKernel chunks the experts over tokens (chunk_size, VLLM_FUSED_MOE_CHUNK_SIZE default "
                       "16*1024, VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING, supports_chunking); per-chunk "
                       "ExpertTokensMetadata; a dynamic per-tensor a2 scale is one per chunk; inplace allowed.",
               "0.33": "no chunking: one experts call over all M tokens (chunk_size raises, the environment "
                       "variables are not read); a dynamic per-tensor a2 scale spans the whole call; no inplace."},
    upstream={"0.17": _MK017 + " (FusedMoEModularKernel._chunk_info, _slice_*)",
              "0.33": _MK033 + " (FusedMoEKernelModularImpl._fused_experts: M_chunk == M_full)"},
    reference="reference.modular.FusedMoEKernel")
register_point(
    "modular.supports_expert_map", component="modular",
    behaviour={"0.17": "FusedMoEExperts.supports_expert_map() (from SupportRecord.expert_map); the kernel raises "
                       "ValueError for an expert_map given to experts that do not support it.",
               "0.33": "not in the base class and never called by the kernel; the reference keeps the claim as "
                       "SupportRecord.expert_map (conformance derives EP cases from it) and the 0.33 kernel does not "
                       "check it."},
    upstream={"0.17": _MK017 + " (FusedMoEExperts.supports_expert_map)",
              "0.33": _MK033 + " (absent; kept unused by experts/cpu_moe.py, b12x.py, trtllm_mxint4_moe.py, ...)"},
    reference="reference.modular.FusedMoEExperts.supports_expert_map")
register_point(
    "modular.deferred_finalize", component="modular",
    behaviour={"0.17": "experts always write their output; an UnfinalizedMoEOutput raises SemanticsError.",
               "0.33": "experts may return an UnfinalizedMoEOutput (permuted unweighted GEMM2 rows, weights, int32 "
                       "permute map, -1 = not local) or hand it to post_gemm2_hook; the kernel returns it when "
                       "prepare_finalize.supports_deferred_moe_finalize() (NoEP: True), else raises; "
                       "UnfinalizedMoEOutput.finalize is the top-k reduction the consumer owes."},
    upstream={"0.17": _MK017 + " (absent)",
              "0.33": _MK033 + ", fused_moe/moe_output.py, prepare_finalize/no_dp_ep.py"},
    reference="reference.moe_output.UnfinalizedMoEOutput / reference.modular.FusedMoEKernel")
register_point(
    "modular.output_hidden_dim", component="modular",
    behaviour={"0.17": "the output is (M, K) like hidden_states (or hidden_states itself when inplace).",
               "0.33": "the output is (M, fused_experts.output_hidden_dim(K)) (experts may drop a hidden padding); "
                       "prepare_finalize.allocate_fused_expert_output may supply the experts' output buffer; the "
                       "caller's output is the experts' buffer when the shapes match."},
    upstream={"0.17": _MK017,
              "0.33": _MK033 + " (output_hidden_dim, _allocate_buffers), experts/trtllm_mxfp4_moe.py, "
                               "prepare_finalize/naive_dp_ep.py"},
    reference="reference.modular.FusedMoEExpertsModular.output_hidden_dim")
register_point(
    "modular.empty_batch", component="modular",
    behaviour={"0.17": "M == 0: zero chunks, no experts call; finalize only when num_dispatchers() > 1.",
               "0.33": "M == 0: _fused_experts returns an empty (0, output_hidden_dim(K)) tensor before allocating "
                       "or calling the experts; finalize still runs."},
    upstream={"0.17": _MK017, "0.33": _MK033 + " (_fused_experts: 'if M_full == 0')"},
    reference="reference.modular.FusedMoEKernel (UnchunkedExperts)")
register_point(
    "modular.shared_experts_order", component="modular",
    behaviour={"0.17": "a shared-experts callable given to the kernel runs after the routed experts; apply returns "
                       "(shared, routed).",
               "0.33": "SharedExperts picks one order per call (NO_OVERLAP when overlap is disabled, else "
                       "MK_INTERNAL_OVERLAPPED when the prepare/finalize supports async, else "
                       "MULTI_STREAM_OVERLAPPED on a CUDA-like aux stream for M <= 256, else NO_OVERLAP) and runs "
                       "once at that site; the runner adds shared + routed (routed scaled, fp16: shared divided)."},
    upstream={"0.17": _MK017 + " (FusedMoEModularKernel shared_experts)",
              "0.33": "vLLM 0.33.0 fused_moe/runner/shared_experts.py, runner/moe_runner.py, " + _MK033},
    reference="reference.shared_experts.SharedExperts / FusedMoEKernel.forward_with_shared_experts")
register_point(
    "modular.supports_dbo", component="modular",
    behaviour={"0.17": "no supports_dbo: under DBO (dual-batch overlap) the prepare/finalize must be async "
                       "(supports_async); a synchronous prepare/finalize under DBO fails (assert not dbo_enabled()).",
               "0.33": "FusedMoEPrepareAndFinalize.supports_dbo() (default supports_async()): a synchronous "
                       "prepare/finalize runs under DBO when it says supports_dbo() (it hands the collective to the "
                       "comm stream itself: MoEPrepareAndFinalizeNaiveDPEP on ROCm); else it fails. The async "
                       "hook/receiver protocol (prepare_async / finalize_async, the hook registered in the next "
                       "ubatch under DBO) is the same in both versions."},
    upstream={"0.17": _MK017 + " (FusedMoEModularKernel._prepare / _finalize), vllm/v1/worker/ubatching.py",
              "0.33": _MK033 + " (FusedMoEPrepareAndFinalize.supports_dbo, FusedMoEKernelModularImpl._prepare / "
                               "_finalize), prepare_finalize/naive_dp_ep.py"},
    reference="reference.modular.FusedMoEPrepareAndFinalize.supports_dbo / FusedMoEKernel._prepare")
register_point(
    "modular.apply_monolithic", component="modular",
    behaviour={"0.17": "apply_monolithic(..., topk_group): prepare -> experts.apply -> finalize; the experts return "
                       "the reduced output.",
               "0.33": "apply_monolithic(..., topk_group, *, routing_sink, input_ids, hash_indices_table): with a "
                       "routing sink the experts must supports_routing_replay_capture (else ValueError, per call), "
                       "get routing_replay_out = sink.buffer[:M] (int16 routed ids) and sink.capture_fn(it) runs "
                       "after them; input_ids / hash_indices_table reach the experts only with a table; an "
                       "UnfinalizedMoEOutput passes through when prepare_finalize.supports_deferred_moe_finalize() "
                       "(NoDPEPMonolithic: True), else raises."},
    upstream={"0.17": _MK017 + " (FusedMoEKernelMonolithicImpl.apply)",
              "0.33": _MK033 + " (FusedMoEKernelMonolithicImpl.apply, FusedMoEExpertsMonolithic."
                               "supports_routing_replay_capture), fused_moe/routed_experts_capturer.py"},
    reference="reference.modular.FusedMoEKernel.apply_monolithic")
register_point(
    "modular.is_supported_config", component="modular",
    behaviour={"0.17": "is_supported_config: device, act_and_mul, activation, quant scheme, parallel config, "
                       "routing method, router logits dtype, shape, activation format.",
               "0.33": "adds, in vLLM's order: hash routing (a layer with a hash table and monolithic experts that "
                       "do not _supports_hash_routing) and a decomposed backend (require_decomposed_backend: no "
                       "monolithic experts) after the parallel config; batch invariance (VLLM_BATCH_INVARIANT=1 "
                       "needs _supports_batch_invariance) and LoRA (is_lora_enabled needs supports_lora) after the "
                       "activation format."},
    upstream={"0.17": _MK017 + " (FusedMoEExperts.is_supported_config)",
              "0.33": _MK033 + " (FusedMoEExperts.is_supported_config), fused_moe/config.py (FusedMoEConfig."
                               "has_hash_routing, require_decomposed_backend, is_lora_enabled), fused_moe/layer.py"},
    reference="reference.modular.FusedMoEExperts.is_supported_config")
register_point(
    "modular.expert_tokens_metadata_fields", component="modular",
    behaviour={"0.17": "ExpertTokensMetadata(expert_num_tokens, expert_num_tokens_cpu); expert_num_tokens is always "
                       "set; no 0.17 path reads psum_recv_per_rank / rank_expert_offset (the reference keeps them "
                       "None).",
               "0.33": "adds psum_recv_per_rank (int32 inclusive prefix sum of the rows received per source rank; "
                       "[-1:] = valid rows, num_valid_tokens()) and rank_expert_offset (deferred globalization, "
                       "fused_globalize_align_block_size); expert_num_tokens may be None (a CUDA-graph decode "
                       "carrier: consumers count locally)."},
    upstream={"0.17": _MK017 + " (ExpertTokensMetadata)",
              "0.33": _MK033 + " (ExpertTokensMetadata), all2all_utils.py, deep_gemm_utils.py "
                               "(deepgemm_moe_permute: count_expert_num_tokens when None)"},
    reference="reference.modular.ExpertTokensMetadata")
register_point(
    "modular.naive_batched_reduce", component="modular",
    behaviour={"0.17": "TopKWeightAndReduceNaiveBatched: per local expert in id order, rhs.mul_(fp32 weights) "
                       "rounded into the experts' buffer (mutating it), then output[rows] += rhs in the output "
                       "dtype. The reference specifies the fp32 weighted sum rounded once (the error model's bound "
                       "admits the output-dtype accumulation); the rank's own expert range as 0.33.",
               "0.33": "vectorized: gathered * weights.to(output dtype) (the weights rounded first), index_add_ in "
                       "the output dtype; the buffer is not mutated. The reference: the same fp32-once "
                       "specification as under 0.17 (TopKWeightAndReduce.__eq__ and the rank's range "
                       "[rank * E_local, (rank + 1) * E_local) are identical in both releases)."},
    upstream={"0.17": "vLLM 0.17.0 fused_moe/topk_weight_and_reduce.py (TopKWeightAndReduceNaiveBatched.apply)",
              "0.33": "vLLM 0.33.0 fused_moe/topk_weight_and_reduce.py (TopKWeightAndReduceNaiveBatched.apply)"},
    reference="reference.modular.TopKWeightAndReduceNaiveBatched")
register_point(
    "modular.consumes_expert_mask", component="modular",
    behaviour={"0.17": "the layer hands its experts the AITER 0/1 expert_mask when the global "
                       "rocm_aiter_fmoe_enabled switch is on, else the -1/local-slot expert_map; no "
                       "consumes_expert_mask attribute.",
               "0.33": "FusedMoEExperts.consumes_expert_mask (default False; True for the ROCm AITER classes): "
                       "RoutedExperts.expert_map is the expert_mask ((E + n_shared + 1,) int32, 1 = local, trailing "
                       "0) when the selected experts consume it, else the canonical expert_map."},
    upstream={"0.17": "vLLM 0.17.0 fused_moe/layer.py (FusedMoE.expert_map, determine_expert_map)",
              "0.33": _MK033 + " (FusedMoEExperts.consumes_expert_mask), fused_moe/routed_experts.py "
                               "(RoutedExperts.expert_map), fused_moe/expert_map_manager.py"},
    reference="reference.modular.layer_expert_map / FusedMoEExperts.consumes_expert_mask")
register_point(
    "modular.moe_fused_mul_sum", component="modular",
    behaviour={"0.17": "not defined (the experts' moe_sum / TopKWeightAndReduce reduce over top-k).",
               "0.33": "moe_fused_mul_sum: fp32 weighted top-k sum in slot order, skipping -1 and non-local slots; "
                       "all-padding rows and rows past num_valid_tokens are left untouched."},
    upstream={"0.17": "vLLM 0.17.0 (absent)", "0.33": "vLLM 0.33.0 fused_moe/moe_fused_mul_sum.py"},
    reference="reference.moe_output.moe_fused_mul_sum")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    md = "--markdown" in argv
    rest = [a for a in argv if a != "--markdown"]
    sys.stdout.write(format_table(markdown=md, component=rest[0] if rest else None))
    if md:
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    # Run through the imported module so that the points the reference modules register (into
    # ``reference.semantics``, not this ``__main__`` copy) are the ones printed.
    from reference.semantics import main as _main

    raise SystemExit(_main())
