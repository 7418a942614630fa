"""The reference's mirrored functions use vLLM's argument names: each vLLM function's signature is read from the
unpacked source distribution (``ast``, nothing imported) and every parameter name it has must be a parameter of the
reference function that mirrors it. The reference may have more (``check_finite``, ``semantics``, recipes) and may
make vLLM's optional arguments keyword-only; a name vLLM has and the reference lacks or spells differently fails,
naming both. A vLLM parameter the reference deliberately does not take is listed in ``NOT_TAKEN`` with the reason.

Skips with the reason where the sdist is absent (``nox -s parity -- --vllm 0.33.0`` sets ``$MOE_VLLM_SRC``)."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from tests.parity._vllm_src import version

FMOE = "vllm/model_executor/layers/fused_moe/"

# (reference module, reference function, vLLM file, vLLM function); the function named in the reference's docstring.
MIRRORED = [
    ("reference.routing", "fused_topk", FMOE + "router/fused_topk_router.py", "fused_topk"),
    ("reference.routing", "fused_topk_bias", FMOE + "router/fused_topk_bias_router.py", "fused_topk_bias"),
    ("reference.routing", "grouped_topk", FMOE + "router/grouped_topk_router.py", "grouped_topk"),
    ("reference.routing", "determine_expert_map", FMOE + "expert_map_manager.py", "determine_expert_map"),
    ("reference.routing", "get_routing_method_type", FMOE + "config.py", "get_routing_method_type"),
    ("reference.routing", "token_choice_with_bias", "vllm/model_executor/models/cohere2_moe.py",
     "token_choice_with_bias"),
    ("reference.routing", "musespark1x_routing", "vllm/models/muse_spark/common/ops/fused_routing.py",
     "fused_musespark1x_routing"),
    ("reference.align", "moe_align_block_size", FMOE + "moe_align_block_size.py", "moe_align_block_size"),
    ("reference.align", "count_expert_num_tokens", FMOE + "utils.py", "count_expert_num_tokens"),
    ("reference.align", "compute_aligned_M_and_alignment", FMOE + "deep_gemm_utils.py",
     "compute_aligned_M_and_alignment"),
    ("reference.align", "deepgemm_moe_permute", FMOE + "deep_gemm_utils.py", "deepgemm_moe_permute"),
    ("reference.align", "deepgemm_unpermute_and_reduce", FMOE + "deep_gemm_utils.py",
     "deepgemm_unpermute_and_reduce"),
    ("reference.quant", "per_token_group_quant_fp8", "vllm/model_executor/layers/quantization/utils/fp8_utils.py",
     "per_token_group_quant_fp8"),
    # issue 41 (block INT8 W8A8)
    ("reference.quant", "per_token_group_quant_int8", "vllm/model_executor/layers/quantization/utils/int8_utils.py",
     "per_token_group_quant_int8"),
    ("reference.config", "refine_fp8_moe_block_shape", FMOE + "oracle/fp8.py", "refine_fp8_moe_block_shape"),
]

# vLLM parameters the reference does not take, keyed by (reference function, vLLM name), with the reason.
NOT_TAKEN: dict[tuple[str, str], str] = {
    ("musespark1x_routing", "topk_weights"): "a preallocated output buffer (CUDA-graph capture); changes no value",
    ("musespark1x_routing", "topk_ids"): "a preallocated output buffer (CUDA-graph capture); changes no value",
}

# Known drifts (vLLM 0.33.0 has the name, the reference does not yet): each test with one is a strict xfail naming
# them, so fixing one (or vLLM dropping it) turns the test red until the entry goes. Read from vllm-0.33.0.
DRIFT: dict[tuple[str, str], str] = {
}


def _vllm_params(root, relpath: str, name: str) -> list[str]:
    path = root / relpath
    if not path.exists():
        pytest.skip(f"{relpath} is not in vLLM {version(root)}")
    defs = [n for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.FunctionDef) and n.name == name]
    if not defs:
        pytest.skip(f"{relpath} of vLLM {version(root)} has no {name}")
    # overloads (typing.overload stubs) come first; the implementation is the last definition
    a = defs[-1].args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


@pytest.mark.parametrize("ref_mod,ref_name,relpath,vllm_name", MIRRORED, ids=[f"{m[1]}" for m in MIRRORED])
def test_reference_takes_vllms_argument_names(vllm_tree, ref_mod, ref_name, relpath, vllm_name):
    try:
        fn = getattr(importlib.import_module(ref_mod), ref_name)
    except AttributeError:
        pytest.fail(f"{ref_mod} has no {ref_name} (mirrors {relpath}::{vllm_name})")
    ours = list(inspect.signature(fn).parameters)
    theirs = _vllm_params(vllm_tree, relpath, vllm_name)
    missing = [p for p in theirs if p not in ours and (ref_name, p) not in NOT_TAKEN]
    known = {p: DRIFT[(ref_name, p)] for p in missing if (ref_name, p) in DRIFT}
    stale = [p for (r, p) in DRIFT if r == ref_name and p not in missing]
    assert not stale, f"DRIFT entries of {ref_name} no longer drift (fixed, or gone from vLLM): {stale}"
    if known and set(known) == set(missing):
        pytest.xfail(f"known drift from vLLM {version(vllm_tree)}'s {vllm_name}: {known}")
    assert not missing, (
        f"{ref_mod}.{ref_name}{tuple(ours)} lacks vLLM {version(vllm_tree)}'s argument name(s) {missing} of "
        f"{relpath}::{vllm_name}{tuple(theirs)}")


def test_not_taken_entries_are_still_vllm_parameters(vllm_tree):
    """A stale ``NOT_TAKEN`` entry (vLLM dropped or renamed the parameter) fails rather than hiding a drift."""
    by_ref = {m[1]: m for m in MIRRORED}
    for (ref_name, p), reason in NOT_TAKEN.items():
        _, _, relpath, vllm_name = by_ref[ref_name]
        assert p in _vllm_params(vllm_tree, relpath, vllm_name), f"{ref_name}: {p} ({reason}) is no longer vLLM's"
