# examples/my_backend.py: an out-of-tree backend in one file (README, "Adding a backend"). Run it:
#   python -m pytest conformance --backend examples.my_backend:backend -k "qwen3_30b_a3b-bf16-M4- or test_routing"
import torch

from backends import Backend
from reference.activation import MoEActivation, apply_moe_activation
from reference.modular import FusedMoEActivationFormat, FusedMoEExpertsModular, SupportRecord, TopKWeightAndReduceNoOP
from reference.routing import fused_topk


def my_fused_topk(hidden_states, gating_output, topk, renormalize, **kwargs):
    """Same signature as reference.routing.fused_topk; call your kernel here (this example calls the reference)."""
    return fused_topk(hidden_states, gating_output, topk, renormalize, **kwargs)


class MyExperts(FusedMoEExpertsModular):
    """Unquantized (bf16/fp16) SiLU experts, one expert at a time: fp32 GEMMs, outputs rounded to the
    activation dtype after each GEMM (the rounding points of reference/experts.py)."""

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    # The claims, as data: the suite derives its cases from them (every claimed scheme, activation, expert map and
    # token regime), runs every case they admit and checks that every other case raises.
    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        quant_schemes=frozenset({(None, None)}),  # unquantized only
        activations=frozenset({MoEActivation.SILU}),
        act_dtypes=frozenset({torch.bfloat16, torch.float16}),
        no_act_and_mul=False,
        finalize="(M, K) weighted and reduced: TopKWeightAndReduceNoOP",
        notes="the README's example: one expert at a time, fp32 GEMMs",
    )

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()  # apply() writes the weighted, reduced output itself

    def stages(self, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map):
        """Optional: the intermediates per route (gemm1, activation, gemm2), which the conformance diagnosis compares
        with the reference's stage by stage when a case fails (conformance/diagnose.py)."""
        out = {}
        my_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, expert_map=expert_map, stages=out)
        return out

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (M * topk, max(N, K)), (M * topk, N // 2), (M, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        qc = self.quant_config
        if qc.weight_key is not None or qc.w1_bias is not None or activation != MoEActivation.SILU:
            raise NotImplementedError(f"MyExperts: unquantized SiLU without bias only, got {qc.scheme_name()}")
        output.copy_(my_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, expert_map=expert_map,
                                      apply_router_weight_on_input=apply_router_weight_on_input))


def my_fused_experts(x, w1, w2, topk_weights, topk_ids, *, expert_map=None, apply_router_weight_on_input=False,
                     stages=None):
    """The "kernel": (M, K) output in x.dtype. With a dict ``stages``, also stores its intermediates per route,
    (M, topk, cols) like ``conformance.diagnose.reference_stages`` (gemm1, activation, gemm2), for a stage-by-stage
    comparison."""
    ids = topk_ids.long()
    # -1: no route (padding) or an expert held by another rank; never index expert_map with -1 (vLLM #48371)
    local = torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], -1) if expert_map is not None else ids
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        token, slot = (local == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = (x[token].float() @ w1[e].float().T).to(x.dtype)  # GEMM1, fp32 accumulation, rounded
        a = apply_moe_activation(MoEActivation.SILU, h)
        y2 = (a.float() @ w2[e].float().T).to(x.dtype)  # GEMM2, rounded
        y = y2.float()
        if not apply_router_weight_on_input:
            y = y * topk_weights[token, slot].float().unsqueeze(1)
        acc.index_add_(0, token, y)
        if stages is not None:
            for name, val in (("gemm1", h), ("activation", a), ("gemm2", y2)):
                buf = stages.setdefault(name, torch.zeros(*ids.shape, val.shape[1], dtype=val.dtype))
                buf[token, slot] = val
    return acc.to(x.dtype)

backend = Backend(
    name="mine", version="1.0",
    ops={"fused_topk": my_fused_topk},      # keyed by the reference function it replaces, same signature
    experts=[MyExperts],                     # plugged into reference.modular.FusedMoEKernel by the suite
    recipes={"per_token_group_quant_fp8": "vllm"},
    availability=lambda: None,               # or the reason it cannot run here (backends.Unavailable)
    device="cpu",
    description="README example: reference routing, per-expert loop experts",
)
