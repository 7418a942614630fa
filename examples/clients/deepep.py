"""DeepEP's intranode ``dispatch`` / ``combine`` as a backend's ``prepare_finalize`` (the out-of-tree route, README
"Adding a backend"): a real EP library through ``conformance/test_distributed.py``.

    # on a machine with N NVLink-connected GPUs and deep_ep built (tools/gpu/deepep_build.sh):
    python -m pytest conformance/test_distributed.py --backend examples.clients.deepep:backend --world-size 2,4 \
        -k DeepEPIntranode
    MOE_DEEPEP_BASE=cuda python -m pytest ...     # the experts of another backend (default: triton)

``backend()`` is the backend named by ``$MOE_DEEPEP_BASE`` (default ``triton``) with
``DeepEPIntranodePrepareAndFinalize`` added to its ``prepare_finalize``; its name is ``<base>_deepep``.

Source mirrored: DeepEP v1 ``deep_ep/buffer.py`` (``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine``, the
intranode path; commit 567632d, the last before EPv2, whose ``setup.py`` still builds without NVSHMEM) and vLLM
``model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py`` (``DeepEPHTPrepareAndFinalize``), whose layout
``reference.distributed.DeepEPHTPrepareAndFinalize`` specifies:

- prepare: (topk == 1 with ``apply_router_weight_on_input``: weight the input first), quantize before dispatch
  (codes + row-aligned fp32 scales ``(M, G)`` travel together; a static per-tensor scale stays) or move bf16 rows and
  quantize after; ``get_dispatch_layout`` + ``dispatch`` send each token once to every rank holding one of its
  experts. Returns ``(recv_x (R, K), recv_scale (R, G) | static | None, ExpertTokensMetadata (routes per local
  expert), recv_topk_ids (R, topk) int64 global ids with -1 for routes held elsewhere, recv_topk_weights (R, topk)
  fp32, 0 there)``.
- finalize: the experts' ``TopKWeightAndReduce`` (``Delegate`` -> ``Contiguous``) gives the bf16 partial ``(R, K)``;
  ``combine`` sums the ranks' partials of each source token (DeepEP reduces in fp32 and rounds once) into
  ``output (M, K)``.

Layout conversion (the only logic of the adapter; CPU-tested in tests/test_deepep_adapter.py without DeepEP):
DeepEP places experts linearly (rank r holds ``[r * E_local, (r + 1) * E_local)``) and returns *local* ids
(``id - r * E_local``, -1 elsewhere, weight 0 there). The suite's placements (``determine_expert_map``: "linear" or
"round_robin") are mapped onto DeepEP's by ``deepep_expert_ids`` (global id -> ``owner * E_local + local_index``)
before the dispatch, and DeepEP's local ids back to global ids by ``global_expert_ids`` after it.

Claims (``is_supported_config``): bf16 activations (DeepEP's combine is bf16), E divisible by the ranks, hidden
bytes a multiple of 16, activation scales float32 and row-aligned or static per-tensor; a dynamic per-tensor scale
only after dispatch.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from reference.modular import (
    ExpertTokensMetadata,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalizeModular,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    apply_router_weight_to_input,
    moe_kernel_quantize_input,
)

__all__ = ["DeepEPIntranodePrepareAndFinalize", "backend", "deepep_expert_ids", "global_expert_ids",
           "held_experts", "deepep_unavailable", "nvl_buffer_bytes"]


# ------------------------------------------------------------------------------------------------------------
# Layout conversion (pure torch, any device)
# ------------------------------------------------------------------------------------------------------------


def deepep_expert_ids(topk_ids: torch.Tensor, owner: torch.Tensor, local_index: torch.Tensor,
                      num_local: int) -> torch.Tensor:
    """Global expert ids ``(M, topk)`` (any int dtype, -1 or out of range: no route) -> DeepEP's linear ids, int64:
    ``owner[e] * num_local + local_index[e]``, -1 kept. ``owner`` / ``local_index``: int64 ``(E,)``
    (``reference.distributed.expert_placement``)."""
    E = owner.numel()
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    e = ids.clamp(0, E - 1)
    lin = owner.to(ids.device)[e] * num_local + local_index.to(ids.device)[e]
    return torch.where(valid, lin, torch.full_like(lin, -1))


def held_experts(owner: torch.Tensor, local_index: torch.Tensor, rank: int) -> torch.Tensor:
    """int64 ``(E_local,)``: the global id of each local expert index on ``rank``."""
    mine = (owner == rank).nonzero().squeeze(1)
    held = torch.empty(mine.numel(), dtype=torch.int64)
    held[local_index[mine]] = mine
    return held


def global_expert_ids(recv_local_ids: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """DeepEP's received ids ``(R, topk)`` (local index on this rank, -1: held elsewhere) -> global ids, int64, -1
    kept."""
    ids = recv_local_ids.long()
    g = held.to(ids.device)[ids.clamp(min=0)]
    return torch.where(ids >= 0, g, torch.full_like(g, -1))


def nvl_buffer_bytes(hidden_bytes: int, num_ranks: int) -> int:
    """NVLink buffer size for DeepEP's default dispatch and combine configs (``Config.get_nvl_buffer_size_hint``,
    as DeepEP's tests size it), at least 64 MiB."""
    from deep_ep import Buffer

    hints = [Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
             Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks)]
    return max(max(hints), 64 * 2**20)


def deepep_unavailable() -> str | None:
    """None when ``deep_ep`` imports and a CUDA GPU is present, else why not."""
    if not torch.cuda.is_available():
        return "DeepEP needs CUDA GPUs connected by NVLink"
    try:
        import deep_ep  # noqa: F401
    except Exception as exc:
        return (f"deep_ep does not import ({type(exc).__name__}: {exc}); build it on the GPU machine with "
                "tools/gpu/deepep_build.sh")
    return None


# ------------------------------------------------------------------------------------------------------------
# The prepare/finalize
# ------------------------------------------------------------------------------------------------------------

_BUFFERS: dict = {}


def _buffer(group, num_bytes: int):
    """One ``deep_ep.Buffer`` per process group, grown when a layer needs more (construction is a collective: every
    rank asks for the same size, so every rank takes the same branch)."""
    import torch.distributed as dist
    from deep_ep import Buffer

    group = group if group is not None else dist.group.WORLD
    key = id(group)
    buf = _BUFFERS.get(key)
    if buf is None or buf.num_nvl_bytes < num_bytes:
        _BUFFERS[key] = buf = Buffer(group, num_nvl_bytes=num_bytes)
    return buf


class DeepEPIntranodePrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """DeepEP intranode (NVLink) high-throughput dispatch/combine, standard activation format.

    Constructed as every pair of the suite (``reference.distributed``)::

        DeepEPIntranodePrepareAndFinalize(group=None, *, moe_config, max_num_tokens=None,
                                          expert_placement_strategy="linear", quantize_after_dispatch=False)

    ``moe_config`` is required (the buffer is sized from its hidden size). Raises RuntimeError without an
    initialized ``torch.distributed`` or without ``deep_ep``.
    """

    def __init__(self, group=None, *, moe_config=None, max_num_tokens=None, expert_placement_strategy="linear",
                 quantize_after_dispatch=False):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DeepEPIntranodePrepareAndFinalize needs torch.distributed: call init_process_group")
        if moe_config is None:
            raise ValueError("DeepEPIntranodePrepareAndFinalize needs moe_config (the buffer is sized from it)")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.moe_config = moe_config
        self.max_num_tokens = max_num_tokens
        self.expert_placement_strategy = expert_placement_strategy
        self.quantize_after_dispatch = quantize_after_dispatch
        self.buffer = _buffer(group, nvl_buffer_bytes(moe_config.hidden_dim * 2, self.world_size))
        self._handle = None

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self):
        return torch.int64  # deep_ep.topk_idx_t of a default build

    def max_num_tokens_per_rank(self):
        return None

    def num_dispatchers(self) -> int:
        return self.world_size

    def output_is_reduced(self) -> bool:
        return True

    @classmethod
    def is_supported_config(cls, moe_config, quant_config, quantize_after_dispatch: bool):
        if moe_config.in_dtype != torch.bfloat16:
            return False, f"DeepEP's combine moves bf16 only, got {moe_config.in_dtype}"
        W = moe_config.moe_parallel_config.ep_size
        if moe_config.num_experts % max(W, 1):
            return False, f"DeepEP needs E divisible by the ranks ({moe_config.num_experts} over {W})"
        if (moe_config.hidden_dim * 2) % 16:
            return False, "DeepEP moves rows in 16-byte units: hidden * 2 bytes must be a multiple of 16"
        if quantize_after_dispatch or quant_config.a1.dtype is None:
            return True, None
        probe = torch.randn(2, moe_config.hidden_dim).to(torch.bfloat16)
        try:
            from reference.distributed import per_tensor_dynamic

            if per_tensor_dynamic(quant_config):
                return False, "a dynamic per-tensor a1 scale cannot be quantized before dispatch (one scale per rank)"
            q, s = moe_kernel_quantize_input(probe, quant_config.a1_scale, quant_config, "a1")
        except Exception as exc:
            return False, f"the a1 quantizer does not run here: {type(exc).__name__}: {exc}"
        if (q.shape[1] * q.element_size()) % 16:
            return False, "DeepEP moves rows in 16-byte units: the quantized row is not a multiple of 16 bytes"
        if s is None or (quant_config.a1_scale is not None and s.numel() == 1):
            return True, None
        if s.dtype != torch.float32 or s.dim() != 2 or s.shape[0] != 2:
            return False, (f"DeepEP moves fp32 row-aligned scales (M, G) only, got {tuple(s.shape)} {s.dtype}; "
                           "quantize after dispatch instead")
        return True, None

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        from reference.distributed import expert_placement

        W = self.world_size
        num_local = num_experts // W
        owner, local_index = expert_placement(num_experts, W, self.expert_placement_strategy)
        if expert_map is not None:  # the suite's expert_map must be this rank's placement
            emap = expert_map.long().cpu()
            if not torch.equal(emap >= 0, owner == self.rank):
                raise ValueError(f"rank {self.rank}'s expert_map is not its {self.expert_placement_strategy!r} "
                                 f"placement of {num_experts} experts over {W} ranks")
        if apply_router_weight_on_input:
            a1 = apply_router_weight_to_input(a1, topk_weights)
        scale = None
        if defer_input_quant or self.quantize_after_dispatch or quant_config.a1.dtype is None:
            x = a1
        else:
            x, scale = moe_kernel_quantize_input(a1, quant_config.a1_scale, quant_config, "a1")
        static = scale is not None and quant_config.a1_scale is not None and scale.numel() == 1
        lin = deepep_expert_ids(topk_ids, owner, local_index, num_local).contiguous()
        w32 = topk_weights.float().contiguous()
        n_rank, _, n_expert, in_rank, _ = self.buffer.get_dispatch_layout(lin, num_experts)
        payload = x.contiguous() if scale is None or static else (x.contiguous(), scale.float().contiguous())
        recv, recv_ids, recv_w, counts, handle, _ = self.buffer.dispatch(
            payload, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
            topk_idx=lin, topk_weights=w32)
        recv_x, recv_scale = recv if isinstance(recv, tuple) else (recv, scale if static else None)
        self._handle = handle
        held = held_experts(owner, local_index, self.rank)
        g_ids = global_expert_ids(recv_ids, held)
        recv_w = torch.where(g_ids >= 0, recv_w, torch.zeros_like(recv_w))
        if self.quantize_after_dispatch and not defer_input_quant and quant_config.a1.dtype is not None:
            recv_x, recv_scale = moe_kernel_quantize_input(recv_x, quant_config.a1_scale, quant_config, "a1")
        meta = ExpertTokensMetadata.make_from_list(list(counts), a1.device)
        return recv_x, recv_scale, meta, g_ids, recv_w

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        if self._handle is None:
            raise RuntimeError("DeepEPIntranodePrepareAndFinalize.finalize called without a prepare on this rank")
        handle, self._handle = self._handle, None
        if isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            weight_and_reduce_impl = TopKWeightAndReduceContiguous()
        partial = weight_and_reduce_impl.apply(None, fused_expert_output, topk_weights, topk_ids,
                                               apply_router_weight_on_input)
        combined, _, _ = self.buffer.combine(partial.to(torch.bfloat16).contiguous(), handle)
        output.copy_(combined)


def backend():
    """The backend ``$MOE_DEEPEP_BASE`` (default triton) with DeepEP's intranode pair as its own prepare/finalize."""
    from backends import load_backend

    base = load_backend(os.environ.get("MOE_DEEPEP_BASE", "triton"))

    def availability():
        return base.unavailable_reason() or deepep_unavailable()

    return dataclasses.replace(base, name=f"{base.name}_deepep", availability=availability,
                               prepare_finalize=[*base.prepare_finalize, DeepEPIntranodePrepareAndFinalize],
                               description=f"{base.description} + DeepEP intranode dispatch/combine")
