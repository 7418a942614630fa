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
