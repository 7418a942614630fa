"""Backends that emulate a kernel's accumulator on the CPU: the reference's per-expert loop with its GEMMs replaced by
an emulation of a narrower (truncating) accumulator, so the error model and the accumulation probe can be shown, without a GPU,
to accept what a conforming kernel does and to reject reduced-precision accumulation.

- ``mma_accumulate``: a GEMM whose products are summed ``chunk`` at a time (one MMA instruction: exact), added into
  a partial accumulator rounded to ``mantissa_bits`` bits after every chunk, and the partial added into an fp32
  accumulator every ``promote_every`` K elements (None: never, i.e. fast accumulation).
- ``emulate_mma16`` (reference.error_model): a bf16 / fp16 tensor core that aligns every 16 products with its
  accumulator, truncates, and
  normalizes toward zero (``reference/error_model.py`` step 1b).
- Backends (``--backend tests.emulated_backends:NAME``): ``promoted`` (14 bits, promoted every 128 K elements, as
  DeepGEMM on Hopper: must pass), ``mma16`` (the SM90 16-bit MMA: must pass), ``inplace_13bit`` (13 bits every 32 products, never promoted: the planted
  reduced-precision accumulator of issue 22, must fail), ``extra_rounding`` (the reference plus one more bf16
  rounding of every GEMM output element: split-K with bf16 partials, must fail), ``dropped_weight`` (the router
  weight of the last top-k slot dropped: must fail), ``noisy`` (conforming but noisy: every GEMM accumulates in
  fp32 over K tiles of 64 summed last tile first, another order than the reference's, so the act-dtype roundings
  after it flip; the conforming kernel the one rule must pass in every test that compares an output: experts,
  padding, hygiene, distributed; tests/test_one_rule.py), ``h_flip`` (GEMM1's output rounded to the other
  neighbouring act-dtype value at the element under the largest activation output of each expert's rows: Mixtral
  bf16 M1's heavy event), ``a2_flip`` (one requantized FP8 a2 code moved one step away from zero at the call's
  largest |code| x router weight: the fp8_tensor_static gelu_tanh regression's heavy event; step 7b covers the flip
  at the largest code alone, ``A2FlipCodeExperts``, not this one: tests/test_error_model.py).
"""

from __future__ import annotations

import dataclasses

import torch

from backends import Backend
from backends.torch import backend as _torch
from reference.experts import ReferenceExperts, experts_unreduced
from reference.error_model import emulate_mma16
from reference.modular import TopKWeightAndReduceContiguous


def _round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Truncate float64 ``x`` to ``bits`` mantissa bits, toward zero: the bits an MMA's alignment shift drops."""
    mag = x.abs().clamp_min(1e-300)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - bits)
    return torch.where(x == 0, x, torch.trunc(x / ulp) * ulp)


def mma_accumulate(a: torch.Tensor, w: torch.Tensor, *, mantissa_bits: int, promote_every: int | None,
                   chunk: int = 32) -> torch.Tensor:
    """``a (R, K) @ w (N, K).T`` with an emulated ``mantissa_bits`` partial accumulator (see the module docstring).

    Returns fp32 ``(R, N)``. ``promote_every`` must be a multiple of ``chunk``.
    """
    a64, w64 = a.double(), w.double()
    K = a.shape[1]
    master = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64)
    partial = torch.zeros_like(master)
    for k0 in range(0, K, chunk):
        partial = _round_mantissa(partial + a64[:, k0:k0 + chunk] @ w64[:, k0:k0 + chunk].T, mantissa_bits)
        if promote_every is not None and ((k0 + chunk) % promote_every == 0 or k0 + chunk >= K):
            master = (master + partial).float().double()
            partial.zero_()
    return (master + partial).float()


class _EmulatedExperts(ReferenceExperts):
    """The reference loop with an emulated GEMM accumulator (``gemm``) and optionally an extra rounding."""

    gemm = None

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        y = experts_unreduced(hidden_states, a1q_scale, w1, w2, topk_ids, expert_map, self.quant_config,
                               activation, output.dtype, gemm=type(self).gemm)
        output.copy_(y.view(output.shape))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceContiguous()


def _experts_class(name: str, gemm) -> type:
    # __module__ and __qualname__ name this module: the distributed suite pickles the class to its rank processes.
    return type(name, (_EmulatedExperts,), {"gemm": staticmethod(gemm), "__module__": __name__, "__qualname__": name})


PromotedExperts = _experts_class(
    "PromotedExperts", lambda a, w: mma_accumulate(a, w, mantissa_bits=14, promote_every=128))
InplaceExperts = _experts_class(
    "Inplace13BitExperts", lambda a, w: mma_accumulate(a, w, mantissa_bits=13, promote_every=None))


# The SM90 bf16 / fp16 tensor core as the error model describes it (step 1b): must pass. It claims what that
# MMA computes: unquantized bf16 / fp16 (fp32 operands take no tensor core, FP8 ones have their own model).
Mma16Experts = _experts_class("Mma16Experts", lambda a, w: emulate_mma16(a, w))
Mma16Experts.support = dataclasses.replace(ReferenceExperts.support, quant_schemes=frozenset({(None, None)}),
                                           act_dtypes=frozenset({torch.bfloat16, torch.float16}),
                                           notes="emulated SM90 16-bit MMA (tests/emulated_backends.py)")


def _other_neighbour(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``h`` placed on the neighbour of ``dtype`` that round-to-nearest did not pick (away from zero where ``h``
    is on the grid): the same accumulator rounded the other way."""
    r = h.to(dtype)
    bits = r.view(torch.int16)
    beyond = (h.abs() > r.float().abs()) | (h == r.float())  # h above its rounding (or on it): the next value up
    step = torch.where(beyond, 1, -1).to(torch.int16)  # sign-magnitude: +1 on the bits moves away from zero
    return (bits + step).view(dtype).float()


class HFlipExperts(_EmulatedExperts):
    """The reference with GEMM1's output rounded the other way at one element per expert: the gate or up element
    under the largest |activation| of that expert's rows (a conforming accumulation that lands on the other side of
    a rounding boundary there; Mixtral bf16 M1's heavy event). Gated activations with bf16 / fp16 outputs only."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        from reference.activation import apply_moe_activation

        dtype = output.dtype
        N = w1.shape[1]

        def gemm(a, w):
            h = a.to(torch.float32) @ w.to(torch.float32).T
            if w.shape[0] != N or not activation.is_gated:
                return h
            act = apply_moe_activation(activation, h.to(dtype)).float().abs()
            r, i = divmod(int(act.argmax()), act.shape[1])
            j = 2 * i if activation.name == "SWIGLUOAI" else i  # the gate element (interleaved halves)
            h = h.clone()
            h[r, j] = _other_neighbour(h[r, j:j + 1], dtype)[0]
            return h

        y = experts_unreduced(hidden_states, a1q_scale, w1, w2, topk_ids, expert_map, self.quant_config,
                               activation, output.dtype, gemm=gemm)
        output.copy_(y.view(output.shape))


class A2FlipExperts(_EmulatedExperts):
    """The reference with one requantized FP8 a2 code moved one step away from zero where it weighs most in the
    output: the largest |code| x router weight of the call (a conforming activation that landed on the other side of
    an FP8 rounding boundary there; the fp8_tensor_static gelu_tanh regression's heavy event). FP8 a2 only.
    ``by_router_weight = False`` (``A2FlipCodeExperts``): at the largest |code| alone."""

    by_router_weight = True

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        import reference.experts as rx

        quantize = rx.moe_kernel_quantize_input
        local = rx.local_expert_ids(topk_ids, w1.size(0), expert_map)
        # the router weight of each row of a2, in experts_unreduced's order (expert by expert, routes by nonzero)
        row_w = torch.cat([topk_weights[local == e] for e in range(w1.size(0))]).float()
        if not self.by_router_weight:
            row_w = torch.ones_like(row_w)

        def flipped(A, scale, qc, name="a1"):
            q, s = quantize(A, scale, qc, name)
            if name == "a2" and q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                b = q.view(torch.uint8).flatten().clone()
                i = int((q.float().abs() * row_w[:, None]).flatten().argmax())
                b[i] += 1  # sign-magnitude: one code away from zero
                q = b.view(q.dtype).view(q.shape)
            return q, s

        rx.moe_kernel_quantize_input = flipped
        try:
            y = experts_unreduced(hidden_states, a1q_scale, w1, w2, topk_ids, expert_map, self.quant_config,
                                   activation, output.dtype)
        finally:
            rx.moe_kernel_quantize_input = quantize
        output.copy_(y.view(output.shape))


def _extra_rounding_gemm(a, w):
    # Split-K with bf16 partials: each half of the reduction is rounded to bf16 before the two are added, one more
    # rounding of every output element than the reference's single rounding point after the fp32 sum.
    h = a.shape[1] // 2
    lo = (a[:, :h] @ w[:, :h].T).to(torch.bfloat16).float()
    hi = (a[:, h:] @ w[:, h:].T).to(torch.bfloat16).float()
    return lo + hi


ExtraRoundingExperts = _experts_class("ExtraRoundingExperts", _extra_rounding_gemm)


class A2FlipCodeExperts(A2FlipExperts):
    """``A2FlipExperts`` at the call's largest |code| whatever its route's weight."""

    by_router_weight = False


class DroppedWeightExperts(ReferenceExperts):
    """Drops the router weight of the last top-k slot of every token (an off-by-one in the top-k loop)."""

    def finalize_weight_and_reduce_impl(self):
        return _DropLastSlot()


class _DropLastSlot(TopKWeightAndReduceContiguous):
    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        w = topk_weights.clone()
        w[:, -1] = 0
        return super().apply(output, fused_expert_output, w, topk_ids, apply_router_weight_on_input)


def tile_reversed_gemm(a: torch.Tensor, w: torch.Tensor, tile: int = 64) -> torch.Tensor:
    """``a (R, K) @ w (N, K).T`` in fp32, each K tile of ``tile`` elements summed on its own and the tiles' partial
    sums added last tile first (a GPU kernel's split over K tiles, in the order of a reversed K loop): the reference's
    fp32 sum in another order, exactly what the error model's step 1 allows. Returns fp32 ``(R, N)``."""
    a32, w32 = a.float(), w.float()
    K = a32.shape[1]
    out = torch.zeros(a32.shape[0], w32.shape[0], dtype=torch.float32)
    for k0 in reversed(range(0, K, tile)):
        out = out + a32[:, k0:k0 + tile] @ w32[:, k0:k0 + tile].T
    return out


NoisyExperts = _experts_class("NoisyExperts", tile_reversed_gemm)


def _backend(name, cls):
    return dataclasses.replace(_torch, name=name, experts=[cls], description=f"emulation: {cls.__name__}")


promoted = _backend("emulated_promoted", PromotedExperts)
mma16 = _backend("emulated_mma16", Mma16Experts)
inplace_13bit = _backend("emulated_inplace_13bit", InplaceExperts)
extra_rounding = _backend("emulated_extra_rounding", ExtraRoundingExperts)
dropped_weight = _backend("emulated_dropped_weight", DroppedWeightExperts)
h_flip = _backend("emulated_h_flip", HFlipExperts)
a2_flip = _backend("emulated_a2_flip", A2FlipExperts)
noisy = _backend("emulated_noisy", NoisyExperts)
# Two classes, one named after a model (as an adapter of transformers' experts would be): case selection by
# --model / --scheme must not match class names (tests/test_variant_claims.py).
hf_named = dataclasses.replace(_torch, name="emulated_hf_named",
                               experts=[_torch.experts[0], type("HFMixtralExperts", (ReferenceExperts,), {"__module__": __name__})])
