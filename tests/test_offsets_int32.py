"""The CPU proof of conformance/test_hygiene.py::test_offsets_past_int32, which runs on GPU backends only.

That case needs tens of GB on a CPU, so here:
- its parameters are built and checked: ONE experts call (the kernel it builds makes one chunk, whatever
  ``VLLM_FUSED_MOE_CHUNK_SIZE`` says) whose GEMM1 output holds more than 2^31 elements, where the default 16384-token
  chunking would have kept every call under 2^31 (why the old case could not catch the bug);
- the planted backend's offset helper (tests/broken_backends.py ``wrapped_offsets``) wraps at the case's sizes;
- the very check the GPU test runs (``check_offsets_case``) goes red on a small analogue against the planted backend
  whose offsets wrap at a tiny width (2^15 elements), stays green for the correct torch backend on the same
  analogue, and refuses (fails its own precondition) a chunked variant that never crosses the limit in one call.
Nothing here runs the 180000-token case itself; on a GPU, ``nox -s "conformance(triton)"`` does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.torch.experts import TorchExperts
from conformance.metrics import ConformanceFailure
from conformance.experts_case import moe_config_for
from conformance.hygiene import OFFSETS_PAST_INT32, OffsetsCase, check_offsets_case
from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from reference.schemes import quantize_weights
from specs import load_models
from tests import broken_backends as bb



def _analogue(limit: int = 2**15, tokens: int = 64) -> OffsetsCase:
    """Qwen3-30B-A3B's routing (topk 8 of 16 local experts) at K = 256, N = 2 * 128: 64 * 8 * 256 = 2^17 elements."""
    tiny = dataclasses.replace(load_models()["qwen3_30b_a3b"], name="qwen3_30b_a3b_tiny", hidden_size=256,
                               intermediate_size=128)
    return OffsetsCase(tiny, tokens, 16, limit=limit, checked_tokens=16)


def _unquantized_qc():
    return quantize_weights("bf16", torch.zeros(1, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 1, dtype=torch.bfloat16))[2]


def test_the_gpu_case_crosses_int32_in_one_experts_call(monkeypatch):
    oc = OFFSETS_PAST_INT32
    assert (oc.model.name, oc.tokens, oc.model.top_k, oc.N) == ("qwen3_30b_a3b", 180_000, 8, 1536)
    assert oc.limit == 2**31
    assert oc.largest_intermediate == 180_000 * 8 * 1536 > 2**31
    assert moe_config_for(oc.experts_case()).num_local_experts == oc.local_experts
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "1024")  # the case's kernel must not take the environment's
    kernel = oc.kernel(TorchExperts, moe_config_for(oc.experts_case()), _unquantized_qc())
    assert kernel._chunk_info(oc.tokens) == (1, oc.tokens)
    # The old case ran the modular kernel with its default (0.17) chunking: no single call came near 2^31.
    monkeypatch.delenv("VLLM_FUSED_MOE_CHUNK_SIZE")
    default = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), TorchExperts(moe_config_for(oc.experts_case()),
                                                                        _unquantized_qc()), semantics="0.17")
    n_chunks, chunk = default._chunk_info(oc.tokens)
    assert (n_chunks, chunk) == (11, 16384) and chunk * oc.model.top_k * oc.N < 2**31


def test_planted_offsets_wrap_at_the_gpu_case_sizes():
    oc = OFFSETS_PAST_INT32
    R = oc.tokens * oc.model.top_k  # GEMM1 output rows of the one call
    first_past = -(-(2**31) // oc.N)  # the first row that starts past 2^31 - 1
    rows = torch.tensor([0, first_past - 1, first_past, R - 1])
    off = bb.wrapped_offsets(rows, oc.N)
    assert off[:2].tolist() == (rows[:2] * oc.N).tolist()  # below 2^31: exact
    assert (off[2:] < 0).all()  # past it: negative, as int32 arithmetic gives
    # The tiny-width emulation is the same arithmetic: at 2^31 it agrees with the int32 cast.
    big = torch.tensor([0, 2**31 - 1, 2**31, 3 * 2**31 + 5])
    assert bb.wrapped_offsets(big, 1).tolist() == [0, 2**31 - 1, -(2**31), -(2**31) + 5]
    assert bb.wrapped_offsets(torch.tensor([2**15 - 1, 2**15]), 1, 2**15).tolist() == [2**15 - 1, -(2**15)]


def test_analogue_goes_red_on_offsets_that_wrap():
    oc = _analogue()
    assert oc.largest_intermediate == 2**17 >= oc.limit
    with pytest.raises(ConformanceFailure, match="_OffsetsWrap16: first and last 16 tokens"):
        check_offsets_case(bb.offsets_wrap_16bit.experts, oc, "cpu")


def test_analogue_stays_green_for_the_torch_backend():
    from backends.torch import backend

    assert check_offsets_case(backend.experts, _analogue(), "cpu") == ["TorchExperts"]


def test_planted_int32_backend_is_correct_below_its_limit():
    """The planted int32 backend only breaks past 2^31: on the analogue (2^17 elements) it matches the reference,
    so the red above comes from crossing the offset width, not from the planted code itself."""
    oc = dataclasses.replace(_analogue(), limit=2**17)
    assert check_offsets_case(bb.offsets_wrap.experts, oc, "cpu") == ["_OffsetsWrap"]


def test_a_chunked_variant_fails_the_precondition():
    """A case whose kernel chunks (no single call crosses the limit) is refused, not passed."""

    class Chunked(OffsetsCase):
        def kernel(self, cls, moe_config, qc):
            return FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, qc), chunk_size=16,
                                  semantics="0.17")

    oc = Chunked(**{f.name: getattr(_analogue(), f.name) for f in dataclasses.fields(OffsetsCase)})
    with pytest.raises(AssertionError, match="precondition: _OffsetsWrap16 was called with \\[16, 16, 16, 16\\]"):
        check_offsets_case(bb.offsets_wrap_16bit.experts, oc, "cpu")
    too_small = _analogue(tokens=8)  # 8 * 8 * 256 = 2^14 < 2^15
    with pytest.raises(AssertionError, match="does not reach 32768"):
        check_offsets_case(bb.offsets_wrap_16bit.experts, too_small, "cpu")
