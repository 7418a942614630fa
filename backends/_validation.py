"""The route-validation switch shared by the GPU backends (``deep_gemm``, ``cuda``).

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
