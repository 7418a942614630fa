"""Claims as data (issue 23 item 4): every experts class declares a ``reference.modular.SupportRecord``, and the seed's
predicates derived from it answer exactly as the predicate code they replaced.

The old answers are computed, not hard-coded: the pre-change modules are read from git (``BASELINE``), executed as
throw-away modules (relative imports resolve against the real package), and both classes are asked the same
questions on a grid: every ``(weight_key, activation_key)`` pair of ``reference.quant.keys`` (and None) x every
``MoEActivation`` x parallel configs x hidden sizes x expert_map / chunking, plus ``is_supported_config`` on layer
configs. Runs on CPU: the device probes are compared as they answer here (their reason strings), and under
pretended devices (SM90, SM100, SM80) where every probe is replaced the same way for the old and the new code, so the
device-dependent claims (Triton's FP8 pairs on sm_89+, DeepGEMM's MXFP8 pair on SM100) are compared too.

If a claim is changed on purpose later, move ``BASELINE`` to the commit before that change (the test proves one
refactor, not that claims never change).
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import backends.cuda.experts as cuda_experts
import backends.deep_gemm.experts as dg_experts
import backends.torch.experts as torch_experts
import backends.triton.experts as triton_experts
import tests.broken_backends as broken
from backends import load_backend
from backends.deep_gemm import platform as dg_platform
from reference.activation import MoEActivation
from reference.batched import BatchedReferenceExperts
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, FusedMoEParallelConfig
from reference.experts import ReferenceExperts
from reference.modular import FusedMoEActivationFormat, FusedMoEExperts, SupportRecord
from reference.monolithic import ReferenceMonolithicExperts
from reference.quant import keys as qk
from reference.routing import RoutingMethodType

ROOT = Path(__file__).resolve().parents[1]
#: The last commit whose experts classes carried the hand-written predicates (the parent of 7c7a29c, which added
#: SupportRecord and converted the reference and torch classes; the other classes were unchanged by it).
BASELINE = "7c7a29c^"

KEYS = [None, *qk.QUANT_KEYS.values()]
PAIRS = list(itertools.product(KEYS, KEYS))
# The baseline predates vLLM 0.33's SITU and GELU_TANH_NO_MUL: claiming them is new (the torch classes do), so the
# comparison with the baseline leaves them out; tests/test_activation.py and conformance cover them.
ACTIVATIONS = [a for a in MoEActivation if a not in (MoEActivation.SITU, MoEActivation.GELU_TANH_NO_MUL)]
# The torch classes claim vLLM 0.33's schemes since issue 29 part 3 (specs/schemes.toml): new claims on purpose, left
# out of their baseline comparison (conformance's claim cases exercise them); every other class is compared on them.
TORCH_033_PAIRS = {
    (qk.kFp8StaticTensorSym, qk.kFp8DynamicTokenSym), (qk.kFp8Static64BlockSym, qk.kFp8Dynamic128Sym),
    (qk.kFp8StaticChannelSym, None), (qk.kInt8StaticTensorSym, qk.kInt8DynamicTensorSym), (qk.kInt4Static, None),
    (qk.kInt4StaticAsym, None), (qk.kInt4Static32, None), (qk.kInt8Static, None),
    (qk.kMxfp8Static, qk.kMxfp8Dynamic), (qk.kMxfp4Static, qk.kMxfp4Dynamic), (qk.kNvfp4Static, qk.kNvfp4DynamicToken),
}
# issue 41 (FP8 / INT pairs): the torch classes claim the Humming / XPU FP8 cross pairs, FP8 block shapes 128x64 /
# 64x128 / 32x32, block INT8 W8A8, the Humming INT8 pairs and the CPU INT4 W4A8 keys.
TORCH_033_PAIRS |= {
    (qk.kFp8StaticTensorSym, None), (qk.kFp8StaticTensorSym, qk.kFp8Dynamic128Sym),
    (qk.kFp8StaticChannelSym, qk.kFp8Dynamic128Sym), (qk.kFp8StaticChannelSym, qk.kFp8StaticTensorSym),
    (qk.kFp8Static128BlockSym, None), (qk.kFp8Static128BlockSym, qk.kFp8DynamicTokenSym),
    (qk.kFp8Static128x64BlockSym, qk.kFp8Dynamic128Sym), (qk.kFp8Static64x128BlockSym, qk.kFp8Dynamic128Sym),
    (qk.kFp8Static32BlockSym, qk.kFp8Dynamic128Sym), (qk.kInt8Static128BlockSym, qk.kInt8Dynamic128Sym),
    (qk.kInt8Static, qk.kFp8DynamicTokenSym), (qk.kInt8StaticChannelSym, None),
    (qk.kInt4W4A8StaticGroup128Sym, None), (qk.kInt4W4A8StaticGroup64Sym, None),
    (qk.kInt4W4A8StaticGroup32Sym, None), (qk.kInt4W4A8StaticGroupSym, None),
}
# The microscaling cross pairs of vLLM 0.33 (issue 41 item 5, specs/schemes.toml's microscaling block): new torch
# claims on purpose, as above.
TORCH_033_PAIRS = TORCH_033_PAIRS | {
    (qk.kMxfp4Static, qk.kFp8StaticTensorSym), (qk.kMxfp4Static, qk.kFp8Dynamic128Sym),
    (qk.kMxfp4Static, qk.kFp8DynamicTokenSym), (qk.kMxfp8Static, None), (qk.kMxfp8Static, qk.kFp8DynamicTokenSym),
    (qk.kNvfp4Static, None), (qk.kNvfp4Static, qk.kMxfp8Dynamic), (qk.kNvfp4Static, qk.kFp8DynamicTokenSym),
    (qk.kMxfp6E3M2Static, qk.kMxfp6E3M2Dynamic), (qk.kMxfp6E2M3Static, qk.kMxfp6E2M3Dynamic),
    (qk.kMxfp4Static, qk.kMxfp6E3M2Dynamic), (qk.kMxfp4Static, qk.kMxfp6E2M3Dynamic),
}
#: Claims added on purpose since the baseline: (class, pair) -> the new answer, each with why.
INTENDED = {
    # vLLM 0.33 pairs every FP8 block shape with kFp8Dynamic128Sym; the Triton kernels computed 64x64 blocks but did
    # not claim them (the fuzz found a tensor returned for an unclaimed draw, 2026-11-26).
    ("triton.TritonExperts", qk.kFp8Static64BlockSym, qk.kFp8Dynamic128Sym): True,
}
FORMATS = list(FusedMoEActivationFormat)
PARALLEL = [
    FusedMoEParallelConfig(),
    FusedMoEParallelConfig.make_ep(4, 1),
    FusedMoEParallelConfig(tp_size=2, tp_rank=1),
    FusedMoEParallelConfig(use_fi_nvl_two_sided_kernels=True),
    FusedMoEParallelConfig(use_fi_nvl_one_sided_kernels=True),
    FusedMoEParallelConfig(ep_size=8, use_ep=True, all2all_backend="deepep_low_latency"),
]
HIDDEN = [1, 7, 8, 16, 24, 64, 100, 128, 256, 2048, 2880, 4096, 7000, 7168]
LOGITS_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]


# ------------------------------------------------------------------------------------------------------------
# the pre-change modules
# ------------------------------------------------------------------------------------------------------------


def _git_show(path: str) -> str:
    try:
        r = subprocess.run(["git", "show", f"{BASELINE}:{path}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:  # no git here
        pytest.skip(f"cannot read {BASELINE}:{path} ({exc})")
    if r.returncode != 0:
        pytest.skip(f"cannot read {BASELINE}:{path} (not a git checkout with that history?): {r.stderr.strip()}")
    return r.stdout


def _load_old(path: str, package: str, stand_ins: dict[str, types.ModuleType] | None = None) -> types.ModuleType:
    """Execute ``BASELINE:path`` as a module of ``package`` (so its relative imports resolve), with ``stand_ins``
    in ``sys.modules`` while it runs (old base classes for old subclasses)."""
    name = f"{package}._baseline_{Path(path).stem}"
    mod = types.ModuleType(name)
    mod.__package__ = package
    mod.__file__ = f"<{BASELINE}:{path}>"
    saved = {k: sys.modules.get(k) for k in stand_ins or {}}
    sys.modules[name] = mod  # dataclasses look their module up while the class is created
    sys.modules.update(stand_ins or {})
    try:
        exec(compile(_git_show(path), mod.__file__, "exec"), mod.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


_OLD: dict[str, types.ModuleType] = {}


def _baseline_modular() -> types.ModuleType:
    """``reference.modular`` under the names the baseline's reference modules import (one was private then)."""
    import reference.modular as modular

    mod = types.ModuleType("reference.modular")
    mod.__dict__.update(modular.__dict__)
    mod._apply_router_weight_on_input = modular.apply_router_weight_to_input
    return mod


def _old(which: str) -> types.ModuleType:
    if which not in _OLD:
        if which == "torch":
            _OLD[which] = _load_old("backends/torch/experts.py", "backends.torch")
        elif which == "triton":
            # The baseline imported its host helpers as the private ._host (public backends.triton.host since)
            import backends.triton.jit as jit

            host = _load_old("backends/triton/_host.py", "backends.triton", {"backends.triton._jit": jit})
            _OLD[which] = _load_old("backends/triton/experts.py", "backends.triton", {"backends.triton._host": host})
        elif which == "cuda":
            _OLD[which] = _load_old("backends/cuda/experts.py", "backends.cuda")
        elif which == "deep_gemm":
            _OLD[which] = _load_old("backends/deep_gemm/experts.py", "backends.deep_gemm")
        elif which == "broken":
            _OLD[which] = _load_old("tests/broken_backends.py", "tests", {"backends.torch.experts": _old("torch")})
        elif which == "reference":
            _OLD[which] = _load_old("reference/experts.py", "reference", {"reference.modular": _baseline_modular()})
        elif which == "batched":
            _OLD[which] = _load_old("reference/batched.py", "reference", {"reference.experts": _old("reference"),
                                                                          "reference.modular": _baseline_modular()})
        elif which == "monolithic":
            _OLD[which] = _load_old("reference/monolithic.py", "reference", {"reference.experts": _old("reference"),
                                                                                "reference.modular": _baseline_modular()})
    return _OLD[which]


def _broken_classes() -> list[str]:
    return sorted(n for n, v in vars(broken).items()
                  if isinstance(v, type) and issubclass(v, FusedMoEExperts) and v.__module__ == broken.__name__)


def _old_broken(name: str) -> type:
    """The baseline of a broken class: itself at BASELINE, or (a class new since) its base class there."""
    if hasattr(_old("broken"), name):
        return getattr(_old("broken"), name)
    base = getattr(broken, name).__mro__[1].__name__
    return {"TorchExperts": lambda: _old("torch").TorchExperts,
            "ReferenceExperts": lambda: _old("reference").ReferenceExperts}[base]()


def _emulated_classes() -> list[tuple[str, type]]:
    try:
        import tests.emulated_backends as emulated
    except ImportError:  # not in this checkout
        return []
    return sorted((n, v) for n, v in vars(emulated).items()
                  if isinstance(v, type) and issubclass(v, FusedMoEExperts) and v.__module__ == emulated.__name__)


def _old_batched_deep_gemm() -> type:
    from reference.modular import FusedMoEActivationFormat

    class OldBatchedDeepGemm(_old("deep_gemm").DeepGemmExperts):
        @staticmethod
        def activation_format():
            return FusedMoEActivationFormat.BatchedExperts

        def supports_chunking(self):
            return False

    return OldBatchedDeepGemm


#: (id, new class, old class factory)
PAIRS_OF_CLASSES = [
    ("torch.TorchExperts", torch_experts.TorchExperts, lambda: _old("torch").TorchExperts),
    ("torch.TorchBatchedExperts", torch_experts.TorchBatchedExperts, lambda: _old("torch").TorchBatchedExperts),
    ("triton.TritonExperts", triton_experts.TritonExperts, lambda: _old("triton").TritonExperts),
    *[(f"cuda.{n}", getattr(cuda_experts, n), (lambda n=n: getattr(_old("cuda"), n)))
      for n in ("CutlassExpertsBf16", "CutlassExpertsFp8", "CutlassExpertsFp4", "CutlassExpertsMxfp4")],
    ("deep_gemm.DeepGemmExperts", dg_experts.DeepGemmExperts, lambda: _old("deep_gemm").DeepGemmExperts),
    ("deep_gemm.DeepGemmFP4Experts", dg_experts.DeepGemmFP4Experts, lambda: _old("deep_gemm").DeepGemmFP4Experts),
    # new since the baseline: vLLM's BatchedDeepGemmExperts claims what DeepGemmExperts claimed, in the batched
    # format and without chunking
    ("deep_gemm.BatchedDeepGemmExperts", dg_experts.BatchedDeepGemmExperts, lambda: _old_batched_deep_gemm()),
    *[(f"broken.{n}", getattr(broken, n), (lambda n=n: _old_broken(n))) for n in _broken_classes()],
    ("reference.ReferenceExperts", ReferenceExperts, lambda: _old("reference").ReferenceExperts),
    ("reference.BatchedReferenceExperts", BatchedReferenceExperts, lambda: _old("batched").BatchedReferenceExperts),
    ("reference.ReferenceMonolithicExperts", ReferenceMonolithicExperts,
     lambda: _old("monolithic").ReferenceMonolithicExperts),
    # The emulated backends (new since BASELINE) inherit ReferenceExperts: they claim what it claimed, except the
    # emulated 16-bit MMA, which claims only what that MMA computes (unquantized bf16 / fp16; a narrower record).
    *[(f"emulated.{n}", cls, lambda: _old("reference").ReferenceExperts) for n, cls in _emulated_classes()
      if n != "Mma16Experts"],
]


# ------------------------------------------------------------------------------------------------------------
# devices: replace every probe the same way for the old and the new modules
# ------------------------------------------------------------------------------------------------------------


def _pretend(monkeypatch, device: str) -> None:
    if device == "here":
        return
    cap = {"sm90": (9, 0), "sm100": (10, 0), "sm80": (8, 0)}[device]
    for mod in (cuda_experts, _old("cuda")):
        monkeypatch.setattr(mod, "_device_capability", lambda cap=cap: cap)
    # deep_gemm: the probes of backends.deep_gemm.platform are shared by the old and new modules
    monkeypatch.setattr(dg_platform, "current_capability", lambda: cap)
    monkeypatch.setattr(dg_platform, "device_name", lambda: f"pretended sm_{cap[0]}{cap[1]}")
    monkeypatch.setattr(dg_platform, "deep_gemm_installed", lambda: True)
    monkeypatch.setattr(dg_platform, "deep_gemm_abi_error", lambda: None)
    # triton: the availability (looked up at call time by both) and the FP8 capability (imported by each module)
    import backends.triton as triton_pkg

    monkeypatch.setattr(triton_pkg, "_availability", lambda: None)
    for mod in (triton_experts, _old("triton")):
        monkeypatch.setattr(mod, "fp8_capable", lambda device=None, ok=cap >= (8, 9): ok)


# ------------------------------------------------------------------------------------------------------------
# the comparison
# ------------------------------------------------------------------------------------------------------------


def _answers(cls: type) -> dict:
    """Every predicate answer of ``cls`` on the grid (keyed by question)."""
    out: dict = {"activation_format": cls.activation_format()}
    out["device"] = dev = bool(cls._supports_current_device())
    if not dev:  # the detail is only meaningful (and only used) when the device is refused
        out["device detail"] = cls._current_device_unsupported_detail()
    out["no_act_and_mul"] = bool(cls._supports_no_act_and_mul())
    for w, a in PAIRS:
        out["quant", w, a] = bool(cls._supports_quant_scheme(w, a))
    for act in ACTIVATIONS:
        out["activation", act] = bool(cls._supports_activation(act))
    for i, pc in enumerate(PARALLEL):
        out["parallel", i] = bool(cls._supports_parallel_config(pc))
    for h in HIDDEN:
        out["shape", h] = bool(cls._supports_shape(h))
    for rm in RoutingMethodType:
        out["routing", rm] = bool(cls._supports_routing_method(rm, None, None))
        for dt in LOGITS_DTYPES:
            out["logits", rm, dt] = bool(cls._supports_router_logits_dtype(dt, rm))
    inst = cls.__new__(cls)  # without __init__ (some constructors refuse on purpose)
    out["chunking"] = bool(inst.supports_chunking())
    out["expert_map"] = bool(inst.supports_expert_map())
    return out


def _layer_configs():
    for act in ACTIVATIONS:
        yield FusedMoEConfig(num_experts=64, experts_per_token=4, hidden_dim=2048, intermediate_size_per_partition=768,
                             num_local_experts=64, activation=act)
        yield FusedMoEConfig(num_experts=64, experts_per_token=4, hidden_dim=2880, intermediate_size_per_partition=776,
                             num_local_experts=16, activation=act, in_dtype=torch.float16, has_bias=True,
                             moe_parallel_config=FusedMoEParallelConfig(use_fi_nvl_two_sided_kernels=True))
        yield FusedMoEConfig(num_experts=2048, experts_per_token=8, hidden_dim=7168,
                             intermediate_size_per_partition=512, num_local_experts=1024, activation=act,
                             in_dtype=torch.float32,
                             moe_parallel_config=FusedMoEParallelConfig.make_ep(2, 0))


def _oracle(cls: type, pairs) -> dict:
    return {(i, w, a, fmt): cls.is_supported_config(cls, cfg, w, a, fmt)
            for i, cfg in enumerate(_layer_configs()) for w, a in pairs for fmt in FORMATS}


def _diff(new: dict, old: dict) -> list[str]:
    return [f"{k}: new {new.get(k, '<missing>')!r}, old {old.get(k, '<missing>')!r}"
            for k in sorted(set(new) | set(old), key=repr) if new.get(k) != old.get(k)]


#: Classes with a device probe are compared here and on every pretended device; the others only here.
CASES = [pytest.param(name, new, old, dev, id=f"{name}-{dev}")
         for name, new, old in PAIRS_OF_CLASSES
         for dev in (("here", "sm90", "sm100", "sm80") if new.support.device is not None else ("here",))]


@pytest.mark.parametrize("name, new_cls, old_factory, device", CASES)
def test_record_preserves_the_old_predicates(monkeypatch, name, new_cls, old_factory, device):
    old_cls = old_factory()
    assert isinstance(new_cls.support, SupportRecord), f"{name} declares no SupportRecord"
    _pretend(monkeypatch, device)
    new, old = _answers(new_cls), _answers(old_cls)
    if issubclass(new_cls, torch_experts.TorchExperts):  # the torch classes and the broken ones built on them
        for w, a in TORCH_033_PAIRS:
            old["quant", w, a] = new["quant", w, a]
    for (cls_name, w, a), answer in INTENDED.items():
        if cls_name == name and new.get(("quant", w, a)) == answer:  # where the device claims FP8 at all
            old["quant", w, a] = answer
    assert not _diff(new, old), f"{name} on {device}: claims changed:\n" + "\n".join(_diff(new, old)[:40])
    # The oracle on layer configs (covers overrides such as the cuda classes' layer checks): the pairs the class
    # claims (a spread of 24 of them when it claims more), plus unquantized and two common FP8 pairs.
    pairs = sorted(((k[1], k[2]) for k, v in new.items() if isinstance(k, tuple) and k[0] == "quant" and v), key=repr)
    pairs = set(pairs[:: max(1, len(pairs) // 24)])
    pairs |= {(None, None), (qk.kFp8StaticTensorSym, qk.kFp8DynamicTensorSym),
              (qk.kFp8Static128BlockSym, qk.kFp8Dynamic128Sym)}
    if issubclass(new_cls, torch_experts.TorchExperts):  # the torch classes and the broken ones built on them
        pairs -= TORCH_033_PAIRS
    pairs -= {(w, a) for (cls_name, w, a) in INTENDED if cls_name == name}  # their claim is checked above
    new_o, old_o = _oracle(new_cls, pairs), _oracle(old_cls, pairs)
    # One intended change since the baseline: is_supported_config refuses an activation dtype outside the record's
    # act_dtypes (DeepGemmExperts claimed fp16/fp32 layers and then raised in apply). Such a layer must be refused
    # now; where the old code refused it for another reason first, the reason may differ.
    for i, cfg in enumerate(_layer_configs()):
        if cfg.in_dtype not in new_cls.support.act_dtypes:
            for k in [k for k in new_o if k[0] == i]:
                assert new_o[k][0] is False, (name, k, new_o[k])
                new_o.pop(k), old_o.pop(k)
    d = _diff(new_o, old_o)
    assert not d, f"{name} on {device}: is_supported_config changed:\n" + "\n".join(d[:40])


def test_every_builtin_experts_class_is_compared():
    compared = {p[1] for p in PAIRS_OF_CLASSES}
    for name in ("torch", "triton", "cuda", "deep_gemm"):
        for cls in load_backend(name).experts:
            assert cls in compared, f"{name}: {cls.__name__} has no baseline comparison here"
            assert isinstance(cls.__dict__.get("support"), SupportRecord), f"{cls.__name__} declares no record"
    # the experts modules' other classes too (not registered: declared-only ones are)
    for mod in (torch_experts, triton_experts, cuda_experts, dg_experts):
        for cls in vars(mod).values():
            if (isinstance(cls, type) and issubclass(cls, FusedMoEExperts) and cls.__module__ == mod.__name__
                    and not cls.__name__.startswith("_")):
                assert cls in compared, f"{mod.__name__}.{cls.__name__} has no baseline comparison here"


def test_records_describe():
    """The records print (conformance reports) and list what the classes claim."""
    for name in ("torch", "triton", "cuda", "deep_gemm"):
        for cls in load_backend(name).experts:
            d = cls.support.describe()
            assert d["format"] == cls.activation_format().name and d["finalize"] != "-", (cls.__name__, d)
    assert triton_experts.TritonExperts.support.describe()["quant schemes"].count(";") == 11  # 12 pairs
    assert dg_experts.DeepGemmExperts.support.hidden_dim_multiple == 128
    assert dg_experts.DeepGemmExperts.support.act_dtypes == {torch.bfloat16}
    assert cuda_experts.CutlassExpertsFp8.support.hidden_dim_multiple == 16
    assert cuda_experts.CutlassExpertsBf16.support.act_dtypes == {torch.bfloat16}


def test_triton_fp8_pairs_follow_the_capability(monkeypatch):
    """The record lists the FP8 pairs; the predicate claims them only on an FP8-capable device."""
    cls = triton_experts.TritonExperts
    fp8 = (qk.kFp8Static128BlockSym, qk.kFp8Dynamic128Sym)
    int8 = (qk.kInt8StaticChannelSym, qk.kInt8DynamicTokenSym)
    assert cls.support.claims_quant(*fp8) and cls.support.claims_quant(*int8)
    monkeypatch.setattr(triton_experts, "fp8_capable", lambda device=None: False)
    assert not cls._supports_quant_scheme(*fp8) and cls._supports_quant_scheme(*int8)
    assert cls._supports_quant_scheme(None, None)
    monkeypatch.setattr(triton_experts, "fp8_capable", lambda device=None: True)
    assert cls._supports_quant_scheme(*fp8)
    # compared by signature: an equal key built elsewhere matches
    same = qk.QuantKey(torch.float8_e4m3fn, qk.ScaleDesc(torch.float32, True, qk.GroupShape(128, 128)))
    assert cls._supports_quant_scheme(same, qk.kFp8Dynamic128Sym)


def test_claims_nothing_still_computes_and_keeps_claiming_nothing():
    """The planted fault: no scheme claimed (not even unquantized), yet apply computes what TorchExperts computes;
    the temporary claim made inside apply does not leak."""
    cls = broken._ClaimsNothing
    cfg = FusedMoEConfig(num_experts=4, experts_per_token=2, hidden_dim=16, intermediate_size_per_partition=8,
                         num_local_experts=4)
    fmt = FusedMoEActivationFormat.Standard
    ok, reason = cls.is_supported_config(cls, cfg, None, None, fmt)
    assert not ok and "quantization scheme" in reason
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g).bfloat16()
    w1 = (torch.randn(4, 16, 16, generator=g) / 4).bfloat16()
    w2 = (torch.randn(4, 16, 8, generator=g) / 4).bfloat16()
    ids = torch.randint(0, 4, (5, 2), generator=g, dtype=torch.int32)
    tw = torch.rand(5, 2, generator=g)
    outs = []
    for c in (cls, torch_experts.TorchExperts):
        out = torch.full_like(x, float("nan"))
        c(cfg, FUSED_MOE_UNQUANTIZED_CONFIG).apply(out, x, w1, w2, tw, ids, MoEActivation.SILU, 4, None, None, None,
                                                   None, None, None, False)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert cls.support.quant_schemes == frozenset() and not cls._supports_quant_scheme(None, None)
    assert cls.is_supported_config(cls, cfg, None, None, fmt) == (ok, reason)


def test_record_fields_match_the_runtime_errors(monkeypatch):
    """Restrictions that exist as runtime errors are in the records too (and the errors stay)."""
    # DeepGEMM: K multiple of 128 (record) and the apply check
    assert not dg_experts.DeepGemmExperts._supports_shape(7000)
    # cuda: the layer check reads the record's act dtypes
    monkeypatch.setattr(cuda_experts, "_device_capability", lambda: (9, 0))
    cfg = FusedMoEConfig(num_experts=8, experts_per_token=2, hidden_dim=256, intermediate_size_per_partition=128,
                         num_local_experts=8, in_dtype=torch.float16)
    ok, reason = cuda_experts.CutlassExpertsBf16.is_supported_config(
        cuda_experts.CutlassExpertsBf16, cfg, None, None, FusedMoEActivationFormat.Standard)
    assert not ok and "activation dtype torch.float16" in reason
    ok, _ = cuda_experts.CutlassExpertsBf16.is_supported_config(
        cuda_experts.CutlassExpertsBf16, dataclasses.replace(cfg, in_dtype=torch.bfloat16), None, None,
        FusedMoEActivationFormat.Standard)
    assert ok


# The microscaling cross pairs of vLLM 0.33 (issue 41 item 5): the torch backend claims every one; each GPU backend's
# experts class refuses each one it does not claim with the reason of backends/_declined.py (an SM100 / SM120 / ROCm /
# XPU-only kernel, Humming, or the OCP MX emulation), shown by is_supported_config once the device probe passes.
_MX_CROSS_SCHEMES = ["mxfp4_fp8_static", "mxfp4_fp8_block128", "mxfp4_fp8_token", "mxfp8_w8a16", "mxfp8_fp8_token",
                     "nvfp4_w4a16", "nvfp4_mxfp8", "nvfp4_fp8_token", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_mxfp6_e3m2",
                     "mxfp4_mxfp6_e2m3"]


@pytest.mark.parametrize("scheme", _MX_CROSS_SCHEMES)
def test_microscaling_cross_pairs_claimed_by_torch_declined_with_reasons_by_gpu_backends(scheme):
    from backends._declined import MICROSCALING_DECLINED
    from reference.schemes import get_scheme

    wk, ak = get_scheme(scheme).quant_keys()
    assert (wk, ak) in MICROSCALING_DECLINED
    mc = FusedMoEConfig(num_experts=8, experts_per_token=2, hidden_dim=2048, intermediate_size_per_partition=768,
                        num_local_experts=8)
    for cls in (torch_experts.TorchExperts, torch_experts.TorchBatchedExperts):
        assert cls.is_supported_config(cls, mc, wk, ak, cls.activation_format()) == (True, None)
    gpu = [triton_experts.TritonExperts, cuda_experts.CutlassExpertsBf16, cuda_experts.CutlassExpertsFp8,
           cuda_experts.CutlassExpertsFp4, cuda_experts.CutlassExpertsMxfp4, dg_experts.DeepGemmExperts,
           dg_experts.BatchedDeepGemmExperts, dg_experts.DeepGemmFP4Experts]
    refused = 0
    for cls in gpu:
        if cls.support.claims_quant(wk, ak):  # DeepGemmFP4Experts: the seed's SM100 claim (its device probe refuses)
            assert cls.support.device_reason() is not None
            continue
        # past the device probe (this machine may have no GPU), the refusal names the pair and why
        here = type(f"{cls.__name__}OnItsDevice", (cls,), {"support": dataclasses.replace(cls.support, device=None)})
        ok, reason = here.is_supported_config(here, mc, wk, ak, cls.activation_format())
        assert not ok and MICROSCALING_DECLINED[(wk, ak)] in reason, (cls.__name__, reason)
        refused += 1
    assert refused >= len(gpu) - 1
