"""Bad inputs (``specs/error_inputs.toml``): each must give a clear error or the defined result — never garbage,
never a crash of the run (the worker processes isolate crashes; see noxfile.py)."""

from __future__ import annotations

import pytest
import torch

from conformance.errors import MUTATIONS, valid_args
from conformance.experts_case import routes_error_bound
from conformance.metrics import assert_close
from reference.activation import MoEActivation
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig
from reference.experts import fused_experts
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from specs import load_error_inputs


def _standard_class(backend):
    cfg = FusedMoEConfig(8, 2, 256, 128, 8)
    for cls in backend.experts:
        ok, _ = cls.is_supported_config(cls, cfg, None, None, FusedMoEActivationFormat.Standard)
        if ok:
            return cls, cfg
    pytest.skip(f"backend {backend.name} has no standard-format experts class claiming bf16")


def _run_reference(args):
    return fused_experts(args["hidden_states"], args["w1"], args["w2"], args["topk_weights"], args["topk_ids"],
                         global_num_experts=args["global_num_experts"], expert_map=args["expert_map"],
                         apply_router_weight_on_input=args["apply_router_weight_on_input"])


@pytest.mark.parametrize("entry", load_error_inputs(), ids=lambda e: e["id"])
def test_bad_input(backend, entry, repro, record):
    if entry.get("needs_cuda") and backend.device != "cuda":
        pytest.skip("needs a CUDA backend (inputs on two devices)")
    cls, cfg = _standard_class(backend)
    record(component="errors", scheme=entry["id"])
    args = MUTATIONS[entry["mutation"]](valid_args(backend.device))
    expect = entry["expect"]
    # The reference itself follows the spec: it raises exactly where an error is required.
    try:
        ref = _run_reference(args)
    except Exception:
        ref = None
    assert (ref is None) == (expect == "raises") or expect == "raises_or_reference", (
        f"the reference does not follow specs/error_inputs.toml for {entry['id']}")
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(cfg, FUSED_MOE_UNQUANTIZED_CONFIG), poison=float("nan"))
    try:
        out = kernel.apply(**args)
    except Exception as exc:
        if expect == "reference":
            raise AssertionError(f"{entry['id']}: the input is legal (defined result) but {cls.__name__} raised "
                                 f"{type(exc).__name__}: {exc}\n  reproduce: {repro}") from exc
        if not str(exc).strip():
            raise AssertionError(f"{entry['id']}: {cls.__name__} raised {type(exc).__name__} without a message; "
                                 f"errors must say what is wrong\n  reproduce: {repro}") from exc
        record(error=f"{type(exc).__name__}: {str(exc)[:200]}")
        return
    if expect == "raises":
        raise AssertionError(f"{entry['id']}: {cls.__name__} returned a tensor {tuple(out.shape)} instead of raising "
                             f"a clear error\n  reproduce: {repro}")
    bound = routes_error_bound(FUSED_MOE_UNQUANTIZED_CONFIG, act_dtype=args["hidden_states"].dtype,
                               K=cfg.hidden_dim, I=cfg.intermediate_size_per_partition, activation=MoEActivation.SILU,
                               topk_ids=args["topk_ids"], expert_map=args["expert_map"], experts_cls=cls)
    assert_close(out, ref, bound.as_tolerance(), case=entry["id"], what=f"{cls.__name__} output", repro=repro)
