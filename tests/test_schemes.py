"""The scheme registry (``reference.schemes``) against its data (``specs/schemes.toml``)."""

from __future__ import annotations

import pytest
import torch

from reference import quant as rq
from reference.schemes import UNQUANTIZED, get_scheme, quantize_weights, schemes
from specs import load_schemes


def test_registry_matches_specs():
    assert list(schemes()) == list(load_schemes())
    for name, s in schemes().items():
        for key in (s.weight_key, s.activation_key):
            assert key == "none" or isinstance(getattr(rq, key, None), rq.QuantKey), f"{name}: unknown key {key}"


def test_unknown_scheme_names_the_known_ones():
    with pytest.raises(ValueError, match="fp8_block128"):
        get_scheme("fp9")
    with pytest.raises(ValueError, match="unknown scheme 'fp9'"):
        quantize_weights("fp9", torch.zeros(1, 256, 128), torch.zeros(1, 128, 128))


@pytest.mark.parametrize("name", list(load_schemes()))
def test_declared_keys_are_the_configs_keys(name):
    """The QuantKeys a scheme declares (which experts classes must claim) are those of the config it builds."""
    g = torch.Generator().manual_seed(0)
    E, I, K = 2, 128, 256
    w1 = (torch.randn(E, 2 * I, K, generator=g) / 16).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) / 16).bfloat16()
    _, _, qc = quantize_weights(name, w1, w2)
    wkey, akey = get_scheme(name).quant_keys()
    assert (qc.weight_key, qc.activation_key) == (wkey, akey)
    assert get_scheme(name).quantized == (name not in UNQUANTIZED)


# --- the microscaling cross pairs (issue 41 item 5)
_MX_CROSS = ["mxfp4_fp8_static", "mxfp4_fp8_block128", "mxfp4_fp8_token", "mxfp8_w8a16", "mxfp8_fp8_token",
             "nvfp4_w4a16", "nvfp4_mxfp8", "nvfp4_fp8_token", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_mxfp6_e3m2",
             "mxfp4_mxfp6_e2m3"]


@pytest.mark.parametrize("name", _MX_CROSS)
def test_microscaling_cross_pair_configs_name_their_scheme(name):
    """The config each builds carries the scheme's name (case ids, reports) and the vLLM 0.33 semantics version."""
    g = torch.Generator().manual_seed(1)
    w1 = (torch.randn(2, 256, 128, generator=g) / 16).bfloat16()
    w2 = (torch.randn(2, 128, 128, generator=g) / 16).bfloat16()
    assert quantize_weights(name, w1, w2)[2].scheme_name() == name
    assert get_scheme(name).since == "0.33" and get_scheme(name).upstream


@pytest.mark.parametrize("fmt,element", [("mxfp6_e3m2", "e3m2"), ("mxfp6_e2m3", "e2m3")])
def test_mxfp6_activations_are_vllms_emulated_quant_dequant(fmt, element):
    """moe_kernel_quantize_input hands on FP6 codes and E8M0 scales whose dequantization is vLLM 0.33's fake-quantized
    activation (``_mxfp6_*_quantize``: Quark's qdq, "even" scale, cast to the activation dtype), compared with the
    torch backend's own table rounding (an independent implementation), and is exact in bf16."""
    from backends.torch import quant as tq
    from reference.config import mx_moe_quant_config
    from reference.quant.moe import dequant_activation, moe_kernel_quantize_input

    x = (torch.randn(8, 256, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    qc = mx_moe_quant_config("mxfp4", torch.zeros(1), torch.zeros(1), activation=fmt)
    codes, scales = moe_kernel_quantize_input(x, None, qc, "a1")
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scales.shape == (8, 8)
    deq = dequant_activation(codes, scales, qc.a1)
    assert torch.equal(deq, tq.fake_quant_mx(x, fmt))
    assert torch.equal(deq.bfloat16().float(), deq)
    assert torch.equal(deq, rq.mxfp6_dequantize(*rq.mxfp6_quantize(x, element), element))


def test_microscaling_config_errors():
    from reference.config import microscaling_activation_desc, mx_moe_quant_config

    s = torch.zeros(1)
    with pytest.raises(ValueError, match="a1_scale and a2_scale"):
        microscaling_activation_desc("fp8_static")
    with pytest.raises(ValueError, match="unknown microscaling activation"):
        microscaling_activation_desc("int8")
    with pytest.raises(ValueError, match="g1_gscale"):
        mx_moe_quant_config("nvfp4", s, s, activation=None)
    with pytest.raises(ValueError, match="unknown weight format"):
        mx_moe_quant_config("mxfp5", s, s, activation=None)
