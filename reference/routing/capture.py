"""Routed-expert capture (routing replay): the ids a layer routed each token to, handed to a callback.

Mirrors vLLM's ``fused_moe/router/base_router.py`` (``BaseRouter.set_capture_fn`` / ``capture_fn``, 0.17.0 and
0.33.0 alike) and ``fused_moe/routed_experts_capturer.py`` (``RoutedExpertsSink``, 0.33.0; ``bind_routed_experts_
capturer``):

- a modular layer's router calls ``capture_fn(topk_ids)`` with the **logical** ids, after routing and before the EPLB
  logical -> physical mapping and the cast to the kernel's index dtype (``reference.routing.route(capture_fn=...)``);
- a monolithic kernel routes itself: the layer owns a ``RoutedExpertsSink`` (an int16 buffer of
  ``(max_num_tokens * group_size, experts_per_token)`` rows, ``group_size`` = EP size with EP else DP size, and the
  callback); ``FusedMoEKernel.apply_monolithic(routing_sink=...)`` hands the experts ``routing_replay_out =
  buffer[:M]`` (only experts that ``supports_routing_replay_capture``; else ValueError), they write each token's
  routed ids there, and the kernel then calls ``capture_fn(routing_replay_out)``.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["RoutedExpertsSink"]


class RoutedExpertsSink:
    """Layer-owned buffer and callback for the expert ids a monolithic kernel routes to (vLLM 0.33
    ``RoutedExpertsSink``).

    Args:
        moe_config: a ``reference.config.FusedMoEConfig`` (``max_num_tokens``, ``experts_per_token``, and the EP / DP
            size of its parallel config size the buffer).
        capture_fn: called with ``buffer[:M]`` (int16 ``(M, experts_per_token)``) after each monolithic call.
        device: where the buffer lives.
    """

    def __init__(self, moe_config, capture_fn: Callable[[torch.Tensor], None], device: torch.device | str = "cpu"):
        pc = moe_config.moe_parallel_config
        group_size = pc.ep_size if pc.use_ep else pc.dp_size
        self.buffer = torch.empty((moe_config.max_num_tokens * group_size, moe_config.experts_per_token),
                                  dtype=torch.int16, device=device)
        self.capture_fn = capture_fn
