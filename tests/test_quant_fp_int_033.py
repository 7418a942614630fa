"""Issue 41's FP8 / INT scheme pairs of vLLM 0.33: the quantizers against independent oracles (numpy float32
arithmetic written from vLLM's kernels, vLLM's own test vector, and PyTorch's ``_dyn_quant_matmul_4bit`` kernel, which
vLLM's CPU INT4 W4A8 experts call), the schemes' configs, the torch backend's own quantizers bit for bit, the error
model's bounds, and the GPU backends' claims."""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
import torch

import reference.quant as rq
from reference.config import FusedMoEQuantDesc
from reference.error_model import experts_error_bound
from reference.schemes import get_scheme, quantize_weights, schemes

NEW_SCHEMES = ["fp8_tensor_w8a16", "fp8_tensor_block", "fp8_channel_block", "fp8_channel_tensor_static",
               "fp8_block128_w8a16", "fp8_block128_token", "fp8_block128x64", "fp8_block64x128", "fp8_block32",
               "int8_block128", "int8_w8a16_fp8_token", "int8_channel_w8a16", "int4_w4a8_int8_g128",
               "int4_w4a8_int8_g64", "int4_w4a8_int8_g32", "int4_w4a8_int8_channel"]


def _np_group_int8(x: np.ndarray, g: int, divide: bool = False):
    """numpy float32 re-derivation of vLLM's per_token_group_quant_8bit_kernel with DST_DTYPE = int8_t."""
    xg = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // g, g)
    absmax = np.maximum(np.abs(xg).max(-1), np.float32(1e-10)).astype(np.float32)
    s = (absmax / np.float32(127.0)).astype(np.float32)
    if divide:
        y = (xg / s[..., None]).astype(np.float32)
    else:
        y = (xg * (np.float32(1.0) / s)[..., None]).astype(np.float32)
    return np.trunc(np.clip(y, -128, 127)).astype(np.int8).reshape(x.shape), s


def test_schemes_registered_with_their_upstream():
    for name in NEW_SCHEMES:
        s = get_scheme(name)
        assert s.since == "0.33" and s.upstream, name


def test_per_token_group_quant_int8_truncates_like_vllms_test():
    """vLLM 0.33 tests/kernels/moe/test_block_int8.py::test_block_int8_quantization_truncates_fractional_values."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.tensor([[-127, -1.75, -0.75, 0.75, 1.75, 127] + [0] * 122], dtype=dtype)
        q, s = rq.per_token_group_quant_int8(x, 128)
        assert q[0, :6].tolist() == [-127, -1, 0, 0, 1, 127] and not q[0, 6:].any()
        assert torch.equal(s, torch.ones(1, 1))


@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_per_token_group_quant_int8_matches_the_numpy_kernel(group, divide):
    g = torch.Generator().manual_seed(group)
    x = (torch.randn(33, 512, generator=g) * torch.rand(33, 1, generator=g) * 9).bfloat16()
    x[3] = 0  # all-zero groups: s = 1e-10 / 127, codes 0
    q, s = rq.per_token_group_quant_int8(x, group, quant_op="divide" if divide else "reciprocal_multiply")
    qn, sn = _np_group_int8(x.float().numpy(), group, divide)
    assert np.array_equal(q.numpy(), qn) and np.array_equal(s.numpy(), sn)
    assert s.dtype == torch.float32 and s.shape == (33, 512 // group)


def test_per_token_group_quant_int8_errors():
    with pytest.raises(ValueError, match="multiple"):
        rq.per_token_group_quant_int8(torch.randn(2, 100), 64)
    with pytest.raises(ValueError, match="NaN"):
        rq.per_token_group_quant_int8(torch.tensor([[float("nan")] * 32]), 32)
    with pytest.raises(ValueError, match="quant_op"):
        rq.per_token_group_quant_int8(torch.randn(2, 64), 32, quant_op="round")
    with pytest.raises(ValueError, match="only torch.int8"):
        rq.per_token_group_quant_int8(torch.randn(2, 64), 32, dtype=torch.uint8)


def test_per_block_quant_int8_numpy_and_round_trip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 200, 136, generator=g).bfloat16()  # partial blocks at both edges
    q, s = rq.per_block_quant_int8(w, (128, 64))
    assert q.shape == w.shape and s.shape == (2, 2, 3)
    wn = np.zeros((2, 256, 192), np.float32)
    wn[:, :200, :136] = w.float().numpy()
    blocks = wn.reshape(2, 2, 128, 3, 64)
    sn = (np.maximum(np.abs(blocks).max((2, 4)), np.float32(1e-10)) / np.float32(127)).astype(np.float32)
    qn = np.clip(np.round(blocks / sn[:, :, None, :, None]), -127, 127).reshape(2, 256, 192)[:, :200, :136]
    assert np.array_equal(s.numpy(), sn) and np.array_equal(q.numpy(), qn.astype(np.int8))
    step = torch.from_numpy(sn).repeat_interleave(128, 1).repeat_interleave(64, 2)[:, :200, :136]
    err = (q.float() * step - w.float()).abs()
    assert bool((err <= step / 2 + 1e-7).all())


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] (N, K) -> the uint8 (N, K / 2) layout _dyn_quant_pack_4bit_weight reads (v + 8, even k
    in the low nibble)."""
    u = (q.to(torch.int32) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def _torch_kernel(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int | None) -> torch.Tensor:
    """PyTorch's at::_dyn_quant_matmul_4bit (vLLM csrc/cpu/dynamic_4bit_int_moe_cpu.cpp's mm), fp32 in and out."""
    N, K = q.shape
    bs = K if group is None else group
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(_pack_nibbles(q), s.float().reshape(N, -1), None, bs, K, N)
    return torch.ops.aten._dyn_quant_matmul_4bit(x.float().contiguous(), packed, bs, K, N)


@pytest.mark.parametrize("group", [None, 32, 64, 128])
def test_cpu_w4a8_int8_matches_pytorchs_dyn_quant_matmul_4bit(group):
    """The reference's asymmetric INT8 rows and INT4 weights, combined as the kernel does (exact integer dot product,
    then x weight scale per group, summed in fp32, then x recip), give PyTorch's kernel's output bit for bit."""
    if not hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit"):
        pytest.skip("this torch has no _dyn_quant_matmul_4bit")
    g = torch.Generator().manual_seed(7)
    M, N, K = 9, 48, 256
    x = (torch.randn(M, K, generator=g) * 3 + 0.4).bfloat16().float()
    x[2] = x[2].abs()  # an all-positive row: rmin = 0
    x[5] = 0  # a zero row: scale 1, zero point 127
    q, s = rq.int4_w4a8_int8_quantize_weight(torch.randn(N, K, generator=g), group)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    assert s.dtype == (torch.float32 if group is None else torch.bfloat16)
    qa, recip, zp = rq.dyn_quant_int8_per_row_asym(x)
    G = 1 if group is None else K // group
    iacc = ((qa.long() - zp.long()).reshape(M, 1, G, -1) * q.long().reshape(1, N, G, -1)).sum(-1)
    acc = torch.zeros(M, N)
    for b in range(G):
        acc = acc + iacc[:, :, b].float() * s.float().reshape(N, G)[:, b]
    assert torch.equal(acc * recip, _torch_kernel(x, q, s, group))
    # the dequantized rows lie on the multiples of recip: (q - zp) * recip
    assert torch.equal(rq.dequant_int8_per_row_asym(qa, recip, zp), (qa.float() - zp.float()) * recip)


def test_asymmetric_rows_hand_table():
    x = torch.tensor([[1.0, -1.0, 0.5, 0.0], [2.0, 1.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0]])
    q, recip, zp = rq.dyn_quant_int8_per_row_asym(x)
    # row 0: range [-1, 1], scale 127.5, zp: (-128 - -127.5) = -0.5 -> lrintf -> -0 (ties to even); x*scale 127.5 ->
    # std::round half away: 128 -> clamp 127, -127.5 -> -128, 63.75 -> 64
    assert q[0].tolist() == [127, -128, 64, 0] and int(zp[0]) == 0
    # row 1: range [0, 2], scale 127.5, zp = -128; codes round(x * 127.5) - 128
    assert int(zp[1]) == -128 and q[1].tolist() == [127, 0, -64, -96]
    assert float(recip[1]) == float(torch.tensor(1.0) / torch.tensor(127.5))
    # row 2: zero row
    assert int(zp[2]) == 127 and q[2].tolist() == [127] * 4 and float(recip[2]) == 1.0


def test_reference_gemm1_of_the_cpu_w4a8_scheme_is_the_kernels_within_its_rounding():
    """The reference loop's GEMM1 (input rows quantized in the GEMM) equals PyTorch's kernel up to the fp32
    accumulation order, i.e. within one bf16 step of its rounded output."""
    from reference.activation import MoEActivation
    from reference.experts import experts_unreduced

    g = torch.Generator().manual_seed(3)
    E, I, K, M = 2, 64, 256, 6
    w1 = (torch.randn(E, 2 * I, K, generator=g) / 16).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) / 16).bfloat16()
    w1q, w2q, qc = quantize_weights("int4_w4a8_int8_g64", w1, w2)
    x = torch.randn(M, K, generator=g).bfloat16()
    ids = torch.tensor([[0], [1], [0], [1], [0], [1]])
    stages: dict = {}
    experts_unreduced(x, None, w1q, w2q, ids, None, qc, MoEActivation.SILU, torch.bfloat16, stages=stages)
    for e in range(E):
        rows = (ids[:, 0] == e).nonzero().squeeze(1)
        want = _torch_kernel(x[rows].float(), w1q[e], qc.w1.scale[e], 64)
        got = stages["gemm1"][rows, 0].float()
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert bool(((got - want).abs() <= ulp).all())


@pytest.mark.parametrize("name", NEW_SCHEMES)
def test_new_scheme_configs(name):
    """Each new scheme builds the descriptors its keys say; the block shape of an FP8 block scheme is its weight
    key's group shape, the activations per 1 x block_k."""
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(2, 256, 256, generator=g) / 16).bfloat16()
    w2 = (torch.randn(2, 256, 128, generator=g) / 16).bfloat16()
    w1q, w2q, qc = quantize_weights(name, w1, w2)
    wk, ak = get_scheme(name).quant_keys()
    assert (qc.weight_key, qc.activation_key) == (wk, ak)
    if name.startswith("fp8_block") and ak == rq.kFp8Dynamic128Sym:
        bn, bk = wk.scale.group_shape
        assert qc.w1.shape == (bn, bk) and qc.a1.shape == (1, bk) and qc.w1.scale.shape == (2, 256 // bn, 256 // bk)
    if name.startswith("int4_w4a8_int8"):
        assert qc.a1.dtype is None and qc.a2.dtype is None and w1q.dtype == torch.int8


def test_torch_backend_quantizers_are_the_references_bit_for_bit():
    from backends.torch import quant as tq

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(40, 768, generator=g) * torch.rand(40, 1, generator=g) * 4).bfloat16()
    x[7] = 0
    x[9] = x[9].abs()
    for group in (32, 128):
        assert all(torch.equal(a, b) for a, b in zip(tq.per_token_group_quant_int8(x, group),
                                                      rq.per_token_group_quant_int8(x, group)))
    assert torch.equal(tq.int8_asym_rows(x), rq.dequant_int8_per_row_asym(*rq.dyn_quant_int8_per_row_asym(x)))


def _bound(qc, **kw):
    return experts_error_bound(qc, act_dtype=torch.bfloat16, K=2048, I=768, routed_rows=64, **kw)


@pytest.mark.parametrize("name", NEW_SCHEMES)
def test_error_model_bounds_every_new_scheme(name):
    g = torch.Generator().manual_seed(0)
    _, _, qc = quantize_weights(name, (torch.randn(2, 256, 256, generator=g) / 16).bfloat16(),
                                (torch.randn(2, 256, 128, generator=g) / 16).bfloat16())
    b = _bound(qc)
    assert 0 < b.rms_norm < 0.2 and 0 < b.max_norm < 1.0 and b.calc_diff > 0


def test_error_model_counts_the_in_gemm_int8_rows():
    """The CPU W4A8 GEMM2 quantizes its rows: its bound is the INT8 per-token bound's (two scale extremes: not
    smaller), far above the same weights with unquantized rows."""
    import dataclasses

    g = torch.Generator().manual_seed(0)
    _, _, qc = quantize_weights("int4_w4a8_int8_g128", (torch.randn(2, 256, 256, generator=g) / 16).bfloat16(),
                                (torch.randn(2, 256, 128, generator=g) / 16).bfloat16())
    token = dataclasses.replace(qc, w1=FusedMoEQuantDesc(torch.int8, (1, -1), qc.w1.scale),
                                w2=FusedMoEQuantDesc(torch.int8, (1, -1), qc.w2.scale),
                                a1=FusedMoEQuantDesc(torch.int8, (1, -1)), a2=FusedMoEQuantDesc(torch.int8, (1, -1)))
    unquantized_rows = dataclasses.replace(qc, w1=FusedMoEQuantDesc(torch.int8, (1, -1), qc.w1.scale),
                                           w2=FusedMoEQuantDesc(torch.int8, (1, -1), qc.w2.scale))
    b, bt, bu = _bound(qc), _bound(token), _bound(unquantized_rows)
    assert b.rms_norm >= bt.rms_norm * 0.999 and b.rms_norm > 2 * bu.rms_norm
    assert any("quantized in GEMM2" in line for line in b.derivation)


def test_gpu_backends_decline_the_new_pairs_they_do_not_implement():
    """triton, cuda and deep_gemm claim none of the new pairs but (kFp8StaticChannelSym, kFp8StaticTensorSym), which
    Triton's fused_moe_kernel and the CUTLASS FP8 experts already implement; is_supported_config gives a reason."""
    from reference.config import FusedMoEConfig

    claims = {}
    for mod in ("backends.triton.experts", "backends.cuda.experts", "backends.deep_gemm.experts"):
        m = importlib.import_module(mod)
        for cname, cls in vars(m).items():
            if inspect.isclass(cls) and cls.__module__ == mod and getattr(cls, "support", None) is not None:
                for name in NEW_SCHEMES:
                    keys = schemes()[name].quant_keys()
                    if cls.support.claims_quant(*keys):
                        claims.setdefault(name, set()).add(cname)
                    elif hasattr(cls, "activation_format") and not cname.startswith("_"):
                        cfg = FusedMoEConfig(num_experts=8, experts_per_token=2, hidden_dim=256,
                                             intermediate_size_per_partition=128, num_local_experts=8,
                                             in_dtype=torch.bfloat16)
                        ok, reason = cls.is_supported_config(cls, cfg, *keys, cls.activation_format())
                        assert not ok and reason, (cname, name)
    assert claims == {"fp8_channel_tensor_static": {"TritonExperts", "CutlassExpertsFp8"}}


@pytest.mark.parametrize("ispp,tp,hidden,block,want", [
    (768, 1, 2048, [128, 128], None),        # Qwen3-30B-A3B, TP 1: whole blocks
    (64, 32, 7168, [128, 128], [64, 64]),    # DeepSeek-V3 I = 2048 at TP 32: the 64x64 blocks of fp8_block64
    (32, 64, 7168, [128, 128], [32, 32]),    # TP 64: fp8_block32
    (16, 128, 7168, [128, 128], None),       # gcd 16 < 32: no refinement (vLLM pads the shard instead)
    (192, 4, 2048, [128, 64], [64, 64]),     # a 128x64 checkpoint: 192 % 128 != 0
    (256, 2, 2048, [128, 64], None),         # 256 % 128 == 0 and 256 % 64 == 0
])
def test_refine_fp8_moe_block_shape_hand_table(ispp, tp, hidden, block, want):
    """vLLM 0.33 oracle/fp8.py::refine_fp8_moe_block_shape, by hand: gcd(block_n, block_k, ispp, hidden) >= 32."""
    from reference.config import FusedMoEConfig, FusedMoEParallelConfig, refine_fp8_moe_block_shape

    cfg = FusedMoEConfig(num_experts=8, experts_per_token=2, hidden_dim=hidden, intermediate_size_per_partition=ispp,
                         num_local_experts=8, moe_parallel_config=FusedMoEParallelConfig(tp_size=tp))
    assert refine_fp8_moe_block_shape(cfg, block) == want
