"""The ``triton`` backend: Triton kernels for the fused-MoE layer, written from the reference's definitions.

Ops (keyed by the reference name they replace, same signatures):
    ``moe_align_block_size``      exact layout of ``reference.align.moe_align_block_size`` (deterministic order)
    ``count_expert_num_tokens``   routes per local expert (``reference.align.count_expert_num_tokens``)
    ``fused_topk``                softmax / sigmoid scores, top-k, renormalize (``reference.routing.fused_topk``)
    ``per_token_group_quant_fp8`` bit-exact to ``reference.quant.per_token_group_quant_fp8`` under every recipe
    ``scaled_fp8_quant``          per-tensor (static/dynamic) and per-token FP8, bit-exact to the reference
    ``int8_quant_per_token``      dynamic per-token INT8, bit-exact to the reference
    ``fused_experts``             the whole experts step (``reference.experts.fused_experts``'s contract)
Experts: ``TritonExperts`` (``FusedMoEExpertsModular``, Standard format).

Availability: a CUDA GPU (sm_80+; FP8 schemes need sm_89+) and an importable ``triton``; or ``TRITON_INTERPRET=1``
(set before triton is imported), in which case the kernels run on CPU tensors in Triton's interpreter and the
backend's device is ``"cpu"``.
"""

from __future__ import annotations

import importlib.util
import os

from backends import Backend, cuda_unavailable_reason, package_unavailable_reason

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _availability() -> str | None:
    reason = package_unavailable_reason("triton", "triton")
    if reason is not None:
        return reason
    if _INTERPRET:
        return None
    return cuda_unavailable_reason((8, 0))


def _version() -> str:
    if not _HAVE_TRITON:
        return "triton not installed"
    from importlib.metadata import PackageNotFoundError, version

    try:
        tv = version("triton")
    except PackageNotFoundError:  # pragma: no cover
        tv = "?"
    return f"0.1 (triton {tv}{', interpreter' if _INTERPRET else ''})"


_ops: dict = {}
_experts: list = []
if _HAVE_TRITON:
    try:
        from backends.triton.align import count_expert_num_tokens, moe_align_block_size
        from backends.triton.experts import TritonExperts, fused_experts
        from backends.triton.quant import int8_quant_per_token, per_token_group_quant_fp8, scaled_fp8_quant
        from backends.triton.routing import fused_topk

        _ops = {
            "moe_align_block_size": moe_align_block_size,
            "count_expert_num_tokens": count_expert_num_tokens,
            "fused_topk": fused_topk,
            "per_token_group_quant_fp8": per_token_group_quant_fp8,
            "scaled_fp8_quant": scaled_fp8_quant,
            "int8_quant_per_token": int8_quant_per_token,
            "fused_experts": fused_experts,
        }
        _experts = [TritonExperts]
    except ImportError as exc:  # a broken triton install: report it through availability
        _IMPORT_ERROR = f"triton backend failed to import: {exc}"

        def _availability() -> str | None:  # noqa: F811
            return _IMPORT_ERROR

backend = Backend(
    name="triton",
    version=_version(),
    ops=_ops,
    experts=_experts,
    recipes={"per_token_group_quant_fp8": "vllm"},
    availability=lambda: _availability(),
    device="cpu" if _INTERPRET else "cuda",
    deterministic=True,
    description="Triton fused MoE kernels (grouped GEMM with fused activation/requant, align, top-k, fp8 quant)"
    + (" [TRITON_INTERPRET=1: CPU interpreter]" if _INTERPRET else ""),
)
