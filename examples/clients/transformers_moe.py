"""Hugging Face transformers' MoE experts modules as out-of-tree backends (issue 39, "client adapters").

Each adapter plugs the *unmodified* experts module of a transformers model (``MixtralExperts``, ``Qwen3MoeExperts``,
``GptOssExperts``; transformers 5.x, ``config._experts_implementation = "eager"``: the per-expert loop) into the
suite as a ``FusedMoEExpertsModular``: the harness's weights become the module's parameters (no copy where the
layouts agree), its routes become the module's ``top_k_index`` / ``top_k_weights``, and the module's output is the
experts' reduced output. Nothing of the module's arithmetic is changed. Run one (transformers is the optional extra
``clients``: ``pip install -e .[clients]``)::

    python -m pytest conformance/test_experts.py --backend examples.clients.transformers_moe:MixtralBackend \\
        -k "mixtral_8x7b-bf16"
    nox -s clients          # all three, their verdicts into results/

The backends declare the numerics profile the eager loop implements (``reference.profiles``:
``transformers_eager``: the activation in the output dtype, biases added to the stored GEMM outputs, the router
weight applied to the stored GEMM2 output, the top-k routes summed in the act dtype in expert order by
``index_add_``), so the suite judges them against that profile's reference with the error model's bound.
docs/clients.md records the verdicts.

Layouts (vLLM -> transformers):
    Mixtral / Qwen3-MoE   w1 (E, 2I, K) [gate; up]  -> gate_up_proj (E, 2I, K)  (same)
                          w2 (E, K, I)              -> down_proj (E, K, I)      (same)
    gpt-oss               w1 (E, 2I, K) interleaved -> gate_up_proj (E, K, 2I)  (transposed view), bias (E, 2I)
                          w2 (E, K, I)              -> down_proj (E, I, K)      (transposed view), bias (E, K)
Expert parallelism: the module holds the rank's local experts; a route to an expert held elsewhere (or a padding
slot, -1) is given the sentinel index ``E_local``, as transformers' own expert-parallel router does
(``integrations/tensor_parallel.py`` RouterParallel: ``router_indices`` of other ranks' experts set to
``num_local_experts``), which Mixtral's and Qwen3's ``one_hot(..., num_classes=E + 1)`` then skip.
"""

from __future__ import annotations

import torch

from backends import Backend
from reference.activation import MoEActivation
from reference.modular import (FusedMoEActivationFormat, FusedMoEExpertsModular, SupportRecord,
                               TopKWeightAndReduceNoOP)

__all__ = ["MixtralBackend", "Qwen3MoeBackend", "GptOssBackend", "HFMixtralExperts", "HFQwen3MoeExperts",
           "HFGptOssExperts"]


def _transformers_missing() -> str | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install -e .[clients])"
    return None


def _version() -> str:
    try:
        import transformers

        return f"transformers {transformers.__version__}"
    except ImportError:
        return "transformers (not installed)"


def local_routes(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The module's ``top_k_index``: local expert of each route, ``num_local`` (the EP sentinel) where the expert is
    held elsewhere or the slot is padding (-1)."""
    ids = topk_ids.long()
    if expert_map is None:
        local = ids
    else:
        local = expert_map.long()[ids.clamp(0, expert_map.numel() - 1)]
    return torch.where((ids >= 0) & (local >= 0) & (local < num_local), local, torch.full_like(ids, num_local))


class _HFExperts(FusedMoEExpertsModular):
    """Base of the adapters: unquantized, Standard format, reduced output (the module sums the routes itself)."""

    numerics_profile = "transformers_eager"
    hf_activation = MoEActivation.SILU

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()  # the module's index_add_ writes the weighted, reduced output

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (M * topk, max(N, K)), (M * topk, N // 2), (M, K)

    def build(self, w1: torch.Tensor, w2: torch.Tensor) -> torch.nn.Module:  # pragma: no cover - per model
        raise NotImplementedError

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        qc = self.quant_config
        if qc.weight_key is not None or qc.activation_key is not None:
            raise NotImplementedError(f"{type(self).__name__}: transformers' eager experts are unquantized here, "
                                      f"got {qc.scheme_name()}")
        if activation != self.hf_activation:
            raise NotImplementedError(f"{type(self).__name__}: the module computes {self.hf_activation.name}, "
                                      f"not {activation.name}")
        module = self.build(w1, w2)
        idx = local_routes(topk_ids, w1.shape[0], expert_map)
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        with torch.no_grad():
            out = module(hidden_states, idx, weights)
        output.copy_(out)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class HFMixtralExperts(_HFExperts):
    """``transformers.models.mixtral.modeling_mixtral.MixtralExperts`` (eager)."""

    support = SupportRecord(FusedMoEActivationFormat.Standard, quant_schemes=frozenset({(None, None)}),
                            activations=frozenset({MoEActivation.SILU}), no_act_and_mul=False,
                            device=_transformers_missing,
                            finalize="(M, K) weighted and reduced by the module (index_add_)",
                            notes="transformers MixtralExperts, eager loop; numerics profile transformers_eager")

    def build(self, w1, w2):
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        cfg = MixtralConfig(hidden_size=w1.shape[2], intermediate_size=w2.shape[2], num_local_experts=w1.shape[0],
                            hidden_act="silu")
        cfg._experts_implementation = "eager"
        m = MixtralExperts(cfg)
        m.gate_up_proj, m.down_proj = _param(w1), _param(w2)
        return m


class HFQwen3MoeExperts(_HFExperts):
    """``transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts`` (eager)."""

    support = SupportRecord(FusedMoEActivationFormat.Standard, quant_schemes=frozenset({(None, None)}),
                            activations=frozenset({MoEActivation.SILU}), no_act_and_mul=False,
                            device=_transformers_missing,
                            finalize="(M, K) weighted and reduced by the module (index_add_)",
                            notes="transformers Qwen3MoeExperts, eager loop; numerics profile transformers_eager")

    def build(self, w1, w2):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = Qwen3MoeConfig(hidden_size=w1.shape[2], moe_intermediate_size=w2.shape[2], num_experts=w1.shape[0],
                             hidden_act="silu")
        cfg._experts_implementation = "eager"
        m = Qwen3MoeExperts(cfg)
        m.gate_up_proj, m.down_proj = _param(w1), _param(w2)
        return m


class HFGptOssExperts(_HFExperts):
    """``transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts`` (eager): interleaved gate/up, biases,
    the clamped SwiGLU (alpha 1.702, limit 7.0)."""

    hf_activation = MoEActivation.SWIGLUOAI
    support = SupportRecord(FusedMoEActivationFormat.Standard, quant_schemes=frozenset({(None, None)}),
                            activations=frozenset({MoEActivation.SWIGLUOAI}), no_act_and_mul=False,
                            device=_transformers_missing,
                            finalize="(M, K) weighted and reduced by the module (index_add_)",
                            notes="transformers GptOssExperts, eager loop; numerics profile transformers_eager")

    def build(self, w1, w2):
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        qc = self.quant_config
        E, N, K = w1.shape
        cfg = GptOssConfig(hidden_size=K, intermediate_size=N // 2, num_local_experts=E)
        if qc.gemm1_alpha is not None:
            cfg.swiglu_alpha = qc.gemm1_alpha
        if qc.gemm1_clamp_limit is not None:
            cfg.swiglu_limit = qc.gemm1_clamp_limit
        cfg._experts_implementation = "eager"
        m = GptOssExperts(cfg)
        b1 = qc.w1_bias if qc.w1_bias is not None else torch.zeros(E, N, dtype=w1.dtype, device=w1.device)
        b2 = qc.w2_bias if qc.w2_bias is not None else torch.zeros(E, K, dtype=w1.dtype, device=w1.device)
        m.gate_up_proj, m.down_proj = _param(w1.transpose(1, 2)), _param(w2.transpose(1, 2))
        m.gate_up_proj_bias, m.down_proj_bias = _param(b1.to(w1.dtype)), _param(b2.to(w1.dtype))
        return m


def _backend(name: str, cls: type) -> Backend:
    return Backend(name=name, version=_version(), experts=[cls], availability=_transformers_missing, device="cpu",
                   profile="transformers_eager",
                   description=f"transformers {cls.__doc__.split('``')[1].rsplit('.', 1)[-1]} (eager), adapted "
                               "(examples/clients/transformers_moe.py)")


MixtralBackend = _backend("hf_mixtral", HFMixtralExperts)
Qwen3MoeBackend = _backend("hf_qwen3_moe", HFQwen3MoeExperts)
GptOssBackend = _backend("hf_gpt_oss", HFGptOssExperts)
