"""The route-validation switch shared by the GPU backends (``deep_gemm``, ``cuda``) and the ``topk_ids`` range check
the ``cuda`` and ``triton`` experts run when it is on.

Checking ``topk_ids`` (ids outside the id space, counts that overflow a layout) on the host costs a device->host
copy, which the hot path of a MoE layer must not pay. The backends therefore validate only on request and otherwise
poison the output row of a token with a bad route (NaN): never a plausible wrong number, never an out-of-bounds
read. The conformance suite requests validation (``conformance/__init__.py``), so a bad input raises a clear error
there.
"""

from __future__ import annotations

import os

import torch

#: The environment switch: ``MOE_VALIDATE_ROUTES=1`` turns host-side validation on.
VALIDATE_ENV = "MOE_VALIDATE_ROUTES"


def validate_routes_requested(flag: bool | None, t: torch.Tensor) -> bool:
    """Whether to validate on the host now: ``flag`` (an experts class's own setting), or the environment switch
    when it is None; never while a CUDA graph is captured on ``t``'s device (a device->host copy cannot be
    recorded)."""
    on = flag
    if on is None:
        on = os.environ.get(VALIDATE_ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")
    return bool(on) and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_topk_ids_range(topk_ids: torch.Tensor, num_ids: int) -> None:
    """Reject ids outside [-1, num_ids) with a clear error (-1 = no route).

    Args:
        topk_ids: ``(M, topk)`` integer ids, any device.
        num_ids: the size of the id space (``expert_map.numel()`` or the local expert count).

    Raises:
        ValueError: an id below -1 or at or above ``num_ids``.

    Costs one device-to-host copy, so it returns at once while a CUDA graph is being captured (the kernels drop
    such ids rather than read out of bounds), and on an empty tensor.
    """
    if topk_ids.numel() == 0 or (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    lo, hi = (int(v) for v in torch.aminmax(topk_ids))
    if lo < -1 or hi >= num_ids:
        raise ValueError(f"topk_ids must lie in [0, {num_ids}) (or be -1 for no route), got [{lo}, {hi}]: check the "
                         "routing (non-finite router logits produce such ids, vLLM #39391)")
