"""``TorchExperts``: a vectorized PyTorch MoE experts step, independent of the reference's per-expert loop.

Algorithm (how a real grouped-GEMM kernel works, in torch ops): map global ids to local ids, stable-sort the
(token, k) routes by local expert, gather the routed rows, run both GEMMs as one padded ``torch.bmm`` each over the
experts that received tokens, apply the activation, multiply each row by its router weight in fp32, and
scatter-add the rows back to their tokens (``index_add_``). The output is ``(M, K)``, already weighted and reduced,
so the finalize step is ``TopKWeightAndReduceNoOP``. Runs on any device torch supports.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from backends.torch import quant as tq
from backends.torch.quant import FP8, dequant, quantize_activation
from reference.activation import GATED_ACTIVATIONS, NO_MUL_ACTIVATIONS, MoEActivation
from reference.modular import ACTIVATION_PARAMS, FusedMoEActivationFormat, FusedMoEExpertsModular, SupportRecord, \
    TopKWeightAndReduceNoOP
from reference.quant import keys as K

_GATED = frozenset(GATED_ACTIVATIONS)
_MX = ("mxfp8", "mxfp4", "mxfp6_e3m2", "mxfp6_e2m3")  # E8M0-per-32 formats (tq.mx_values / tq.fake_quant_mx)
_MXFP6 = ("mxfp6_e3m2", "mxfp6_e2m3")
_NO_MUL = frozenset(NO_MUL_ACTIVATIONS)


def torch_activation(act: MoEActivation, h: torch.Tensor, alpha=None, beta=None, limit=None, situ_beta=None,
                     situ_linear_beta=None) -> torch.Tensor:
    """The activations in fp32, rounded once to ``h.dtype`` (own code; see reference.activation for the spec)."""
    x = h.float()
    if act in _NO_MUL:
        y = {MoEActivation.SILU_NO_MUL: F.silu, MoEActivation.GELU_NO_MUL: F.gelu,
             MoEActivation.GELU_TANH_NO_MUL: lambda v: F.gelu(v, approximate="tanh"),
             MoEActivation.RELU2_NO_MUL: lambda v: F.relu(v) ** 2}[act](x)
        return y.to(h.dtype)
    if act is MoEActivation.SITU:
        if situ_beta is None or situ_beta <= 0:
            raise ValueError(f"TorchExperts: SITU needs a positive activation_situ_beta, got {situ_beta!r}")
        gate, up = x.chunk(2, dim=-1)
        # The CUDA kernel's form: sigmoid(g) = (1 + tanh(g / 2)) / 2.
        gate = (0.5 * situ_beta) * torch.tanh(gate * (1.0 / situ_beta)) * (1.0 + torch.tanh(gate * 0.5))
        if situ_linear_beta is not None and situ_linear_beta > 0:
            up = situ_linear_beta * torch.tanh(up * (1.0 / situ_linear_beta))
        return (gate * up).to(h.dtype)
    if act is MoEActivation.SWIGLUOAI:
        gate, up = x[..., ::2], x[..., 1::2]
    else:
        gate, up = x.chunk(2, dim=-1)
    if act is MoEActivation.SWIGLUOAI or (limit is not None and act is not MoEActivation.SWIGLUSTEP):
        lim = 7.0 if limit is None else limit
        gate, up = gate.clamp(max=lim), up.clamp(-lim, lim)
    if act is MoEActivation.SILU:
        y = gate * torch.sigmoid(gate) * up
    elif act is MoEActivation.GELU:
        y = F.gelu(gate) * up
    elif act is MoEActivation.GELU_TANH:
        y = F.gelu(gate, approximate="tanh") * up
    elif act is MoEActivation.SWIGLUOAI:
        a = 1.702 if alpha is None else alpha
        y = gate * torch.sigmoid(a * gate) * (up + 1)
    elif act is MoEActivation.SWIGLUOAI_UNINTERLEAVE:
        y = gate * torch.sigmoid((1.0 if alpha is None else alpha) * gate) * (up + (0.0 if beta is None else beta))
    elif act is MoEActivation.SWIGLUSTEP:
        lim = 7.0 if limit is None else limit
        y = torch.minimum(F.silu(gate), torch.tensor(lim)) * up.clamp(-lim, lim)
    else:
        raise ValueError(f"TorchExperts does not implement activation {act}")
    return y.to(h.dtype)


def torch_activation_into(act: MoEActivation, output: torch.Tensor, input: torch.Tensor, *, activation_config=None,
                          topk_ids=None, expert_map=None, valid_token_counts=None) -> torch.Tensor:
    """vLLM 0.33's ``apply_moe_activation(activation, output, input, *, ...)`` (own code, vectorized: the written rows
    are a boolean mask; spec: reference.activation.apply_moe_activation_into)."""
    cfg = activation_config
    clamp = None if cfg is None else cfg.clamp_limit
    alpha, beta = (1.0, 0.0) if cfg is None else (cfg.alpha, cfg.beta)
    situ = {} if cfg is None else dict(situ_beta=cfg.activation_situ_beta,
                                       situ_linear_beta=cfg.activation_situ_linear_beta)
    A = MoEActivation
    masked = valid_token_counts is not None
    if act is A.RELU2:
        raise (NotImplementedError if masked else ValueError)(f"TorchExperts: gated {act.value} is not supported")
    if act is A.SWIGLUOAI_UNINTERLEAVE and clamp is None:
        raise ValueError("SWIGLUOAI_UNINTERLEAVE requires clamp_limit")
    # Parameters per path (vLLM 0.33 csrc/activation_kernels.cu, fused_moe/activation.py).
    if act is A.SILU and clamp is not None:
        if masked:
            eff, kw = A.SWIGLUOAI_UNINTERLEAVE, dict(alpha=alpha, beta=beta, limit=clamp)
        elif topk_ids is not None and expert_map is not None:
            eff, kw = A.SILU, dict(limit=clamp if clamp > 0 else None)
        else:
            eff, kw = A.SILU, dict(limit=clamp)
    elif act is A.SWIGLUOAI_UNINTERLEAVE:
        eff, kw = act, dict(alpha=alpha, beta=beta, limit=clamp)
    elif act is A.SITU:
        eff, kw = act, situ
    else:  # SWIGLUOAI / SWIGLUSTEP take their fixed defaults, the rest no parameter
        eff, kw = act, {}
    if masked:
        lead = input.shape[:-1]
        T = lead[-1]
        counts = valid_token_counts.to(input.device, torch.int64).clamp(0, T)
        rows = torch.arange(T, device=input.device) < counts.reshape(-1, 1)  # (E or 1, T)
        rows = rows.reshape(lead)
    elif act is A.SILU and clamp is not None and topk_ids is not None and expert_map is not None:
        ids = topk_ids.reshape(-1).long()
        emap = expert_map.long().to(ids.device)
        rows = (ids >= 0) & (emap[ids.clamp(min=0)] != -1)
        rows = rows.to(input.device)
    else:
        rows = torch.ones(input.shape[:-1], dtype=torch.bool, device=input.device)
    vals = torch_activation(eff, input[rows], **kw)
    if act is A.RELU2_NO_MUL and not masked:
        input.clamp_(min=0)
    output[rows] = vals
    return output


def padded_grouped_mm(rows: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor, w: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """Grouped GEMM ``rows[i] @ w[e(i)].T`` for rows sorted by expert: pad to ``(E_active, max_rows, K)``, one bmm.

    rows: ``(R, K)``; counts: rows per active expert (sum R); experts: ``(E_active,)`` indices into ``w (E, N, K)``.
    The bmm accumulates in fp32 and returns ``(R, N)`` rounded once to ``out_dtype``.
    """
    n_exp = counts.numel()
    max_rows = int(counts.max())
    offsets = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(n_exp, device=rows.device), counts)
    pos = torch.arange(rows.shape[0], device=rows.device) - offsets[group]
    padded = rows.new_zeros(n_exp, max_rows, rows.shape[1])
    padded[group, pos] = rows
    wsel = w if n_exp == w.shape[0] and bool((experts == torch.arange(n_exp, device=experts.device)).all()) \
        else w.index_select(0, experts)
    if rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float16):
        out = torch.bmm(padded, wsel.transpose(1, 2), out_dtype=torch.float32)
    else:  # CPU has no bf16 -> fp32 bmm: upcast (exact) and accumulate in fp32
        out = torch.bmm(padded.float(), wsel.transpose(1, 2).float())
    return out[group, pos].to(out_dtype)


def _check_inputs(hidden_states, w1, topk_ids, global_num_experts, expert_map, qc) -> None:
    """What this backend's kernels need; clear errors instead of garbage."""
    if topk_ids.is_floating_point():
        raise ValueError(f"TorchExperts: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if qc.a1.dtype is None and not hidden_states.is_floating_point():
        raise ValueError(f"TorchExperts: hidden_states must be floating point, got {hidden_states.dtype}")
    if qc.w1.dtype is None and w1.dtype != hidden_states.dtype:
        raise ValueError(f"TorchExperts: w1 is {w1.dtype} but hidden_states is {hidden_states.dtype}")
    n = expert_map.numel() if expert_map is not None else (global_num_experts if global_num_experts > 0
                                                          else w1.shape[0])
    if topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= n):
        raise ValueError(f"TorchExperts: topk_ids outside [-1, {n})")


def _expert_scales(scale: torch.Tensor | None, experts: torch.Tensor) -> torch.Tensor | None:
    if scale is None or scale.numel() == 1:
        return scale
    return scale.index_select(0, experts)


def _requantize(g: torch.Tensor, qc) -> torch.Tensor:
    """The activation between the GEMMs after the a2 quantization the config asks for, as values (unchanged when a2
    is not quantized; fp32 otherwise)."""
    desc = qc.a2
    if desc.dtype is None:
        return g
    if desc.dtype in _MX:
        return tq.fake_quant_mx(g, desc.dtype)
    if desc.dtype == "nvfp4" and desc.per_token_gscale:
        return tq.fake_quant_nvfp4_per_token(g)
    if desc.dtype == torch.int8 and desc.shape == (-1, -1) and desc.scale is None:
        gq, gs = tq.int8_quant_per_tensor(g)
        return dequant(gq, gs, None)
    gq, gs = quantize_activation(g, desc, qc.use_ue8m0)
    return dequant(gq, gs, desc.shape)


class TorchExperts(FusedMoEExpertsModular):
    """Vectorized experts: bf16/fp16/fp32, FP8 (per-tensor x per-tensor static/dynamic or per-token, per-channel x
    per-token, 128x128 or 64x64 blocks x 1 x block_k groups, fp32 or UE8M0 scales, W8A16), INT8 W8A8 (per-channel x
    per-token, per-tensor x dynamic per-tensor), weight-only INT4 / INT8 (groups of 128 or 32, zero points), MXFP8
    W8A8, MXFP4 W4A4, NVFP4 with per-token global scales, and the microscaling cross pairs of vLLM 0.33 (MXFP4 weights
    x FP8 static / per-token / 1x128 or MXFP6 activations, MXFP8 weights x bf16 / FP8 per-token, NVFP4 weights x bf16
    / MXFP8 / FP8 per-token, OCP MXFP6 E3M2 / E2M3 W6A6, the MXFP6 weights rounded to bf16 as vLLM's emulation
    does). Quantized weights are dequantized per expert in fp32 (the
    GEMMs run on exact fp32 products of codes and scales); activations are requantized between the GEMMs with this
    backend's own quantizers (``backends.torch.quant``, vllm recipe)."""

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        quant_schemes=frozenset({
            (None, None),
            (K.kFp8StaticTensorSym, K.kFp8DynamicTensorSym),
            (K.kFp8StaticTensorSym, K.kFp8StaticTensorSym),
            (K.kFp8StaticChannelSym, K.kFp8DynamicTokenSym),
            (K.kFp8Static128BlockSym, K.kFp8Dynamic128Sym),
            (K.kInt8StaticChannelSym, K.kInt8DynamicTokenSym),
            # vLLM 0.33's schemes (specs/schemes.toml since = "0.33" and the FP8 tensor pairs)
            (K.kFp8StaticTensorSym, K.kFp8DynamicTokenSym),
            (K.kFp8Static64BlockSym, K.kFp8Dynamic128Sym),
            (K.kFp8StaticChannelSym, None),
            (K.kInt8StaticTensorSym, K.kInt8DynamicTensorSym),
            (K.kInt4Static, None),
            (K.kInt4StaticAsym, None),
            (K.kInt4Static32, None),
            (K.kInt8Static, None),
            (K.kMxfp8Static, K.kMxfp8Dynamic),
            (K.kMxfp4Static, K.kMxfp4Dynamic),
            (K.kNvfp4Static, K.kNvfp4DynamicToken),
            # issue 41 (FP8 / INT pairs): Humming / XPU FP8 cross pairs, FP8 block shapes, block INT8 W8A8, Humming
            # INT8, CPU INT4 W4A8 (its channel key equals kInt8StaticChannelSym: the config's format tells them apart)
            (K.kFp8StaticTensorSym, None),
            (K.kFp8StaticTensorSym, K.kFp8Dynamic128Sym),
            (K.kFp8StaticChannelSym, K.kFp8Dynamic128Sym),
            (K.kFp8StaticChannelSym, K.kFp8StaticTensorSym),
            (K.kFp8Static128BlockSym, None),
            (K.kFp8Static128BlockSym, K.kFp8DynamicTokenSym),
            (K.kFp8Static128x64BlockSym, K.kFp8Dynamic128Sym),
            (K.kFp8Static64x128BlockSym, K.kFp8Dynamic128Sym),
            (K.kFp8Static32BlockSym, K.kFp8Dynamic128Sym),
            (K.kInt8Static128BlockSym, K.kInt8Dynamic128Sym),
            (K.kInt8Static, K.kFp8DynamicTokenSym),
            (K.kInt8StaticChannelSym, None),
            (K.kInt4W4A8StaticGroup128Sym, None),
            (K.kInt4W4A8StaticGroup64Sym, None),
            (K.kInt4W4A8StaticGroup32Sym, None),
            (K.kInt4W4A8StaticGroupSym, None),
            # the microscaling cross pairs of vLLM 0.33 (specs/schemes.toml, issue 41 item 5)
            (K.kMxfp4Static, K.kFp8StaticTensorSym),
            (K.kMxfp4Static, K.kFp8Dynamic128Sym),
            (K.kMxfp4Static, K.kFp8DynamicTokenSym),
            (K.kMxfp8Static, None),
            (K.kMxfp8Static, K.kFp8DynamicTokenSym),
            (K.kNvfp4Static, None),
            (K.kNvfp4Static, K.kMxfp8Dynamic),
            (K.kNvfp4Static, K.kFp8DynamicTokenSym),
            (K.kMxfp6E3M2Static, K.kMxfp6E3M2Dynamic),
            (K.kMxfp6E2M3Static, K.kMxfp6E2M3Dynamic),
            (K.kMxfp4Static, K.kMxfp6E3M2Dynamic),
            (K.kMxfp4Static, K.kMxfp6E2M3Dynamic),
        }),
        activations=frozenset(_GATED | _NO_MUL),
        finalize="(M, K) weighted and reduced: TopKWeightAndReduceNoOP",
        deferred_finalize=True,
        hidden_padding=True,
        activation_params=ACTIVATION_PARAMS, ue8m0_scales=True,  # every variant, as before the claims had them
        notes="vectorized torch (padded bmm); vllm recipe",
    )

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def _input_rows(self, a1q: torch.Tensor, a1q_scale: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
        """Routed input rows, dequantized to fp32 when prepare quantized them."""
        desc = self.quant_config.a1
        if desc.dtype is None:
            return a1q[tokens]
        rows = a1q[tokens]
        if desc.dtype in _MX:
            return tq.mx_values(rows, a1q_scale[tokens], desc.dtype)
        if desc.dtype == "nvfp4":  # per-token global scale: prepare hands on SF / gs_token per 16 elements
            return tq.nvfp4_values(rows, a1q_scale[tokens])
        if a1q_scale is None or a1q_scale.numel() == 1:
            return dequant(rows, a1q_scale, None)
        return dequant(rows, a1q_scale[tokens], self.quant_config.a1.shape)

    @staticmethod
    def _weights(w: torch.Tensor, desc, experts: torch.Tensor) -> torch.Tensor:
        """The active experts' weights: as stored when unquantized, else dequantized to fp32."""
        # `experts` is sorted and unique, so when every expert is active it is arange(E): no copy needed.
        wsel = w if len(experts) == w.shape[0] else w.index_select(0, experts)
        if desc.dtype is None:
            return wsel
        scale = _expert_scales(desc.scale, experts)
        if desc.shape is not None and desc.shape[0] == 0:  # weight-only INT4 / INT8 groups along K
            return tq.wna16_weights(wsel, scale, _expert_scales(desc.zp, experts), 4 if desc.dtype == "int4" else 8,
                                    desc.shape[1])
        if desc.dtype in _MXFP6:  # the OCP MX emulation dequantizes the weights to bf16 (exact for FP6 x 2^k)
            return tq.mx_values(wsel, scale, desc.dtype).to(torch.bfloat16).float()
        if desc.dtype in _MX:
            return tq.mx_values(wsel, scale, desc.dtype)
        if desc.dtype == "nvfp4":  # E4M3 block scales over the expert's fp32 encode scale
            gs = _expert_scales(desc.alpha_or_gscale, experts).float().reshape(-1, 1, 1)
            return tq.nvfp4_values(wsel, scale.float() / gs)
        if scale is not None and scale.numel() > 1 and scale.dim() == 1:
            scale = scale.reshape(-1, 1, 1)  # one scale per expert
        if scale is not None and scale.dim() == 3 and desc.shape in ((-1, -1), (1, -1)):
            return wsel.float() * scale.float()  # (E, 1, 1) per tensor or (E, N, 1) per channel broadcast
        return dequant(wsel, scale, desc.shape)

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        E, M, N, K, topk = super().moe_problem_size(a1, w1, w2, topk_ids)
        if self.quant_config.a1.dtype in ("mxfp4", "nvfp4"):
            K *= 2  # packed E2M1 activations: two elements per byte
        return E, M, N, K, topk

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        n_act = N // 2 if activation.is_gated else N
        return (M * topk, max(N, K)), (M * topk, n_act), (M, self.output_hidden_dim(K))

    def output_hidden_dim(self, hidden_dim: int) -> int:
        """vLLM 0.33: drops a hidden padding: a layer whose ``moe_config.hidden_dim`` is smaller than the K the kernel
        runs at gets outputs of the unpadded size (the padded columns are computed, then dropped)."""
        return min(hidden_dim, getattr(self.moe_config, "hidden_dim", hidden_dim))

    def _require_claimed(self) -> None:
        """Raise NotImplementedError unless the support record claims this quant config's scheme."""
        qc = self.quant_config
        claimed, _ = self.is_supported_config(type(self), self.moe_config, qc.weight_key, qc.activation_key,
                                              self.activation_format())
        if not claimed:
            raise NotImplementedError(f"{type(self).__name__} does not implement the quantization scheme "
                                      f"{qc.scheme_name()}")

    def _situ(self) -> tuple:
        cfg = self.moe_config
        return getattr(cfg, "activation_situ_beta", None), getattr(cfg, "activation_situ_linear_beta", None)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        qc = self.quant_config
        self._require_claimed()
        _check_inputs(hidden_states, w1, topk_ids, global_num_experts, expert_map, qc)
        M, topk = topk_ids.shape
        E_local = w1.shape[0]
        ids = topk_ids.reshape(-1).long()
        if expert_map is not None:
            in_range = (ids >= 0) & (ids < expert_map.numel())
            local = torch.where(in_range, expert_map.long()[ids.clamp(0, expert_map.numel() - 1)], -1)
        else:
            local = torch.where((ids >= 0) & (ids < E_local), ids, -1)
        acc = torch.zeros(M, output.shape[-1], dtype=torch.float32, device=hidden_states.device)  # K unpacked
        defer = self._uses_post_gemm2_hook(M)  # vLLM 0.33 deferred finalize: one unweighted row per route
        if defer:
            routes = torch.zeros(M * topk, acc.shape[1], dtype=output.dtype, device=hidden_states.device)
        keep = (local >= 0).nonzero().squeeze(1)
        if keep.numel():
            order = keep[torch.argsort(local[keep], stable=True)]
            experts, counts = torch.unique_consecutive(local[order], return_counts=True)
            tokens = order // topk
            act_dtype = output.dtype
            rows = self._input_rows(hidden_states, a1q_scale, tokens)
            if qc.w1.dtype == "int4_w4a8_int8":  # CPU INT4 W4A8: the GEMM quantizes its own rows (issue 41)
                rows = tq.int8_asym_rows(rows)
            w1x = self._weights(w1, qc.w1, experts)
            h = padded_grouped_mm(rows, counts, torch.arange(len(experts), device=rows.device), w1x, torch.float32)
            if qc.w1_bias is not None:  # the bias joins the fp32 accumulator before the store rounds it
                h = h + qc.w1_bias[torch.repeat_interleave(experts, counts)].float()
            h = h.to(act_dtype)
            g = torch_activation(activation, h, qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit, *self._situ())
            g = _requantize(g, qc)
            if qc.w2.dtype == "int4_w4a8_int8":
                g = tq.int8_asym_rows(g)
            w2x = self._weights(w2, qc.w2, experts)
            y = padded_grouped_mm(g, counts, torch.arange(len(experts), device=rows.device), w2x, torch.float32)
            if qc.w2_bias is not None:
                y = y + qc.w2_bias[torch.repeat_interleave(experts, counts)].float()
            y = y.to(act_dtype).float()  # GEMM2 output rounds to the activation dtype, like a kernel's store
            y = y[:, : acc.shape[1]]  # drops a hidden padding (output_hidden_dim)
            if defer:
                routes[order] = y.to(act_dtype)
            if not apply_router_weight_on_input:
                y = y * topk_weights.reshape(-1)[order].float().unsqueeze(1)
            acc.index_add_(0, tokens, y)
        if defer:
            from reference.moe_output import route_major_moe_output

            w = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
            self._run_post_gemm2_hook(route_major_moe_output(routes, w, topk_ids, expert_map), output)
            return None
        output.copy_(acc)


class TorchBatchedExperts(TorchExperts):
    """The batched activation format (``(E_local, max_tokens, K)`` slots with ``expert_num_tokens``): one fp32 bmm
    per GEMM over all slots, activations requantized per slot with this backend's own quantizers. Output is the
    unweighted ``(E_local, max_tokens, K)`` buffer (padding rows zero), reduced by the prepare/finalize."""

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.BatchedExperts

    # Packed E2M1 activations (MXFP4 W4A4, NVFP4 per-token) are not implemented in the batched slots.
    support = dataclasses.replace(TorchExperts.support, activation_format=FusedMoEActivationFormat.BatchedExperts,
                                  quant_schemes=TorchExperts.support.quant_schemes - {
                                      (K.kMxfp4Static, K.kMxfp4Dynamic), (K.kNvfp4Static, K.kNvfp4DynamicToken)},
                                  chunking=False, deferred_finalize=False, hidden_padding=False,
                                  finalize="(E_local, max_tokens, K) unweighted: TopKWeightAndReduceDelegate")

    def finalize_weight_and_reduce_impl(self):
        from reference.modular import TopKWeightAndReduceDelegate

        return TopKWeightAndReduceDelegate()

    def output_hidden_dim(self, hidden_dim: int) -> int:
        return hidden_dim  # the batched format keeps K (no hidden padding claimed)

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        # Each slot receives up to max_num_tokens rows from every dispatcher (seed 002 BatchedExperts).
        E, T = local_num_experts, self.max_num_tokens * self.num_dispatchers
        n_act = N // 2 if activation.is_gated else N
        return (E, T, max(N, K)), (E, T, n_act), (E, T, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        qc = self.quant_config
        self._require_claimed()
        if expert_tokens_meta is None:
            raise ValueError("TorchBatchedExperts needs expert_num_tokens from the prepare step")
        E, T, _ = hidden_states.shape
        counts = expert_tokens_meta.expert_num_tokens.to(hidden_states.device).long()
        valid = torch.arange(T, device=hidden_states.device)[None, :] < counts[:, None]  # (E, T)
        act_dtype = output.dtype
        rows = torch.zeros(E, T, output.shape[-1], dtype=torch.float32, device=hidden_states.device)
        for e in range(E):
            n = int(counts[e])
            if n:
                s = None if a1q_scale is None else (a1q_scale[e, :n] if a1q_scale[e].numel() > 1 else a1q_scale[e])
                if qc.a1.dtype in _MX:
                    rows[e, :n] = tq.mx_values(hidden_states[e, :n], a1q_scale[e, :n], qc.a1.dtype)
                elif qc.a1.dtype == "nvfp4":
                    rows[e, :n] = tq.nvfp4_values(hidden_states[e, :n], a1q_scale[e, :n])
                else:
                    rows[e, :n] = dequant(hidden_states[e, :n], s, qc.a1.shape if qc.a1.dtype is not None else None)
        all_e = torch.arange(E, device=hidden_states.device)
        if qc.w1.dtype == "int4_w4a8_int8":  # CPU INT4 W4A8: each GEMM quantizes its own rows (zero rows stay zero)
            rows = tq.int8_asym_rows(rows)
        h = torch.bmm(rows, self._weights(w1, qc.w1, all_e).float().transpose(1, 2))
        if qc.w1_bias is not None:
            h = h + qc.w1_bias.float().unsqueeze(1)
        g = torch_activation(activation, h.to(act_dtype), qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit,
                             *self._situ())
        gd = torch.zeros(g.shape, dtype=torch.float32, device=g.device)
        for e in range(E):
            n = int(counts[e])
            if n:
                gd[e, :n] = _requantize(g[e, :n], qc).float()
                if qc.w2.dtype == "int4_w4a8_int8":
                    gd[e, :n] = tq.int8_asym_rows(gd[e, :n])
        y = torch.bmm(gd, self._weights(w2, qc.w2, all_e).float().transpose(1, 2))
        if qc.w2_bias is not None:
            y = y + qc.w2_bias.float().unsqueeze(1)
        output.copy_(torch.where(valid.unsqueeze(-1), y, torch.zeros_like(y)).to(act_dtype))

