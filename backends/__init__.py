"""Backend registry: every implementation the conformance suite can check against the reference.

A backend is a ``Backend`` object. Built-in ones live in sub-packages of ``backends/`` (``torch``, ``triton``,
``deep_gemm``, ``cuda``); an installed package registers its own under the entry-point group
``moe_conformance.backends`` (``name = "pkg.module:attribute"``), and any importable ``module:attribute`` works
with ``--backend`` without registration. Backends import ``reference`` (ABCs, configs, enums), never each other.

Resolution happens in one place, ``load_backend``; a backend whose dependencies are missing still loads and reports
*why* it is unavailable through ``unavailable_reason()``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Callable, Mapping, Sequence

__all__ = ["Backend", "BackendNotFound", "load_backend", "registered_backends", "ENTRY_POINT_GROUP", "BUILTIN",
           "Unavailable", "BuiltinNeeds", "BUILTIN_NEEDS", "patch_triton_interpreter"]

ENTRY_POINT_GROUP = "moe_conformance.backends"

BUILTIN: dict[str, str] = {
    "torch": "backends.torch:backend",
    "triton": "backends.triton:backend",
    "deep_gemm": "backends.deep_gemm:backend",
    "cuda": "backends.cuda:backend",
}


class Unavailable(str):
    """Why a backend cannot run here: a ``str`` (the message every existing caller prints) with a typed ``kind``.

    Kinds: ``"missing_package"`` (``extra`` names the pyproject extra that installs it), ``"no_device"`` (no CUDA
    GPU), ``"capability"`` (a GPU of the wrong compute capability), ``"toolchain"`` / ``"other"`` (anything else,
    e.g. a plain string returned by a backend's own availability callable).
    """

    KINDS = ("missing_package", "no_device", "capability", "toolchain", "other")
    kind: str
    extra: str | None

    def __new__(cls, message: str, kind: str = "other", extra: str | None = None) -> "Unavailable":
        if kind not in cls.KINDS:
            raise ValueError(f"unknown unavailability kind {kind!r}; one of {cls.KINDS}")
        obj = super().__new__(cls, message)
        obj.kind, obj.extra = kind, extra
        return obj

    @classmethod
    def of(cls, reason: str | None) -> "Unavailable | None":
        """``reason`` as an ``Unavailable`` (a plain string becomes kind ``"other"``); None stays None."""
        if reason is None or isinstance(reason, Unavailable):
            return reason
        return cls(str(reason), "other")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "extra": self.extra, "reason": str(self)}


@dataclass(frozen=True)
class BuiltinNeeds:
    """What a built-in backend needs before it can run, known without importing it (nox decides from this whether
    a session can skip before installing anything): a CUDA GPU, and the pyproject extra holding its packages."""

    cuda: bool = False
    extra: str | None = None


BUILTIN_NEEDS: dict[str, BuiltinNeeds] = {
    "torch": BuiltinNeeds(),
    "triton": BuiltinNeeds(cuda=True, extra="triton"),
    "deep_gemm": BuiltinNeeds(cuda=True, extra="deep_gemm"),
    "cuda": BuiltinNeeds(cuda=True),
}


class BackendNotFound(LookupError):
    """``--backend`` named nothing loadable; the message lists the registered names."""


@dataclass
class Backend:
    """What a backend offers the harness.

    Attributes:
        name: registry name (``--backend NAME``).
        version: version string of the implementation (package version, git hash...).
        ops: implementations keyed by the reference name they replace (``"fused_topk"``,
            ``"per_token_group_quant_fp8"``, ``"moe_align_block_size"``, ...), with the reference's signature.
        experts: ``reference.modular.FusedMoEExpertsModular`` subclasses, each declaring support through the
            seed's ``_supports_*`` predicates.
        recipes: quantizer recipe per op name (``{"per_token_group_quant_fp8": "vllm"}``); ops not listed use
            the reference default (``"vllm"``).
        availability: callable returning None when usable here, else the reason (missing package, no GPU, compute
            capability) — shown as the skip reason of every case.
        device: ``"cpu"`` or ``"cuda"``: where the harness places inputs.
        deterministic: repeated runs are bitwise equal (checked by the hygiene tests).
        gate_platforms: callable returning the ``reference.gate.Platform`` values whose gate-tier dispatch the
            backend implements (its ``"gate_linear"`` op computes the tier ``select_gate_tier`` picks there), or
            None if it implements no gate tier.
        description: one line for the report header.
        prepare_finalize: the backend's own ``reference.modular.FusedMoEPrepareAndFinalizeModular`` classes for
            expert parallelism across processes (e.g. over DeepEP buffers), run by ``conformance/test_distributed.py``
            through the same cases as the reference pairs of ``reference.distributed``; each is constructed as
            ``cls(group=None, moe_config=..., max_num_tokens=..., expert_placement_strategy=...,
            quantize_after_dispatch=...)`` inside an initialized ``torch.distributed`` process group.
        profile: the numerics profile its experts implement (``reference.profiles``: ``"vllm"``,
            ``"torch_native_activation"``, ``"transformers_eager"``, ``"fp8_inplace_accumulation"``); conformance
            judges its experts against that profile's reference. An experts class may override it with a
            ``numerics_profile`` class attribute.
    """

    name: str
    version: str
    ops: Mapping[str, Callable] = field(default_factory=dict)
    experts: Sequence[type] = ()
    recipes: Mapping[str, str] = field(default_factory=dict)
    availability: Callable[[], str | None] = lambda: None
    device: str = "cpu"
    deterministic: bool = True
    gate_platforms: Callable[[], Sequence] | None = None
    description: str = ""
    prepare_finalize: Sequence[type] = ()
    profile: str = "vllm"

    def unavailable_reason(self) -> str | None:
        """None if the backend can run on this machine, else why not (never raises). The string is an
        ``Unavailable`` (``.kind``, ``.extra``) when the backend's probe used the shared helpers below."""
        try:
            return self.availability()
        except Exception as exc:  # an availability probe must never crash the harness
            return Unavailable(f"availability check of backend {self.name!r} failed: {type(exc).__name__}: {exc}")

    def availability_status(self) -> Unavailable | None:
        """``unavailable_reason()`` typed: None, or an ``Unavailable`` (kind ``"other"`` for a plain string)."""
        return Unavailable.of(self.unavailable_reason())

    def recipe(self, op: str) -> str:
        return self.recipes.get(op, "vllm")


def registered_backends() -> dict[str, str]:
    """Name -> ``module:attribute`` of every built-in and entry-point backend (entry points may not shadow
    built-ins)."""
    names = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.value)
    return names


def _import_target(target: str) -> Backend:
    module_name, _, attr = target.partition(":")
    if not attr:
        raise BackendNotFound(f"{target!r} is not of the form 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendNotFound(f"cannot import backend module {module_name!r}: {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise BackendNotFound(f"module {module_name!r} has no attribute {attr!r}") from None
    if callable(obj) and not isinstance(obj, Backend):
        obj = obj()
    if not isinstance(obj, Backend):
        raise BackendNotFound(f"{target!r} is a {type(obj).__name__}, not a backends.Backend")
    return obj


def load_backend(spec: str) -> Backend:
    """Resolve ``--backend``: a registered name or an importable ``module:attribute`` (a ``Backend`` or a
    zero-argument callable returning one).

    Raises:
        BackendNotFound: unknown name or failed import; the message lists the registered backends.
    """
    names = registered_backends()
    target = names.get(spec, spec if ":" in spec else None)
    if target is None:
        raise BackendNotFound(
            f"unknown backend {spec!r}; registered: {', '.join(sorted(names))}, or pass 'module:attribute'"
        )
    return _import_target(target)


def cuda_unavailable_reason(min_capability: tuple[int, int] | None = None,
                            max_capability: tuple[int, int] | None = None) -> str | None:
    """Shared availability probe for GPU backends: None if a CUDA device in the capability range is present."""
    import torch

    if not torch.cuda.is_available():
        return Unavailable("no CUDA GPU on this machine (torch.cuda.is_available() is False)", "no_device")
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if min_capability is not None and cap < min_capability:
        return Unavailable(f"{name} is sm_{cap[0]}{cap[1]}; needs sm_{min_capability[0]}{min_capability[1]} or newer",
                           "capability")
    if max_capability is not None and cap > max_capability:
        return Unavailable(f"{name} is sm_{cap[0]}{cap[1]}; supported up to sm_{max_capability[0]}{max_capability[1]}",
                           "capability")
    return None


def package_unavailable_reason(module: str, extra: str) -> str | None:
    """None if ``module`` imports, else ``Unavailable('<module> is not installed (pip install -e .[extra])',
    'missing_package', extra)`` (nox installs the extra on that kind)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return Unavailable(f"{module} is not installed (pip install -e '.[{extra}]')", "missing_package", extra)
    return None


def patch_triton_interpreter() -> None:
    """Under ``TRITON_INTERPRET=1``, let Triton 3.6's interpreter run loops with a runtime bound under numpy >= 2.3
    (``backends._triton_interpreter.patch_interpreter_index``); nothing otherwise. For Triton kernels that do not
    come from a backend of this project (``benchmarks.peer_vllm`` loads vLLM's)."""
    from backends._triton_interpreter import INTERPRET, patch_interpreter_index

    if INTERPRET:
        patch_interpreter_index()
