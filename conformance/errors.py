"""Mutations that turn a valid small experts case into each bad input of ``specs/error_inputs.toml``.

Each takes the valid arguments (a dict for ``FusedMoEKernel.apply``) and returns the mutated dict.
"""

from __future__ import annotations

import torch

__all__ = ["MUTATIONS", "valid_args"]


def valid_args(device: str, M: int = 6, K: int = 256, I: int = 128, E: int = 8, topk: int = 2) -> dict:
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(M, K, generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, K, generator=g) / 16).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) / 11).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).int()
    w = torch.rand(M, topk, generator=g)
    args = dict(hidden_states=hidden, w1=w1, w2=w2, topk_weights=w / w.sum(1, keepdim=True), topk_ids=ids,
                global_num_experts=E, expert_map=None, apply_router_weight_on_input=False)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _with(args, **kw):
    return {**args, **kw}


MUTATIONS = {
    "hidden_states_3d": lambda a: _with(a, hidden_states=a["hidden_states"].unsqueeze(0)),
    "hidden_size_mismatch": lambda a: _with(a, hidden_states=a["hidden_states"][:, :128].contiguous()),
    "weight_dtype_mismatch": lambda a: _with(a, w1=a["w1"].half(), w2=a["w2"].half()),
    "integer_hidden_states": lambda a: _with(a, hidden_states=a["hidden_states"].to(torch.int32)),
    "topk_ids_float": lambda a: _with(a, topk_ids=a["topk_ids"].float()),
    "topk_ids_out_of_range": lambda a: _with(a, topk_ids=torch.where(a["topk_ids"] == a["topk_ids"].max(),
                                                                    a["global_num_experts"] + 5, a["topk_ids"])),
    "topk_ids_minus_one": lambda a: _with(a, topk_ids=torch.where(a["topk_ids"] % 3 == 0, -1, a["topk_ids"])),
    "topk_weights_shape": lambda a: _with(a, topk_weights=a["topk_weights"][:, :1].contiguous()),
    "expert_map_no_local_expert": lambda a: _with(
        a, w1=a["w1"][:2], w2=a["w2"][:2], global_num_experts=16,
        expert_map=torch.tensor([-1] * 14 + [0, 1], dtype=torch.int32, device=a["w1"].device),
        topk_ids=a["topk_ids"] % 8),  # ids 0..7: none of them held by this rank
    "router_weight_on_input_topk2": lambda a: _with(a, apply_router_weight_on_input=True),
    "zero_tokens": lambda a: _with(a, hidden_states=a["hidden_states"][:0], topk_ids=a["topk_ids"][:0],
                                   topk_weights=a["topk_weights"][:0]),
    "non_contiguous_hidden_states": lambda a: _with(
        a, hidden_states=torch.cat([a["hidden_states"], a["hidden_states"]], dim=1)[:, ::2]),
    "weights_on_cpu": lambda a: _with(a, w1=a["w1"].cpu(), w2=a["w2"].cpu()),
}
