"""Readable pure-torch reference of vLLM's fused Mixture-of-Experts layer.

The reference *defines* the expected numerics of every component (routing, activations, quantization formats,
the modular prepare -> experts -> finalize kernel): where every rounding happens, in which dtype, with which
scale rule. It imports nothing from ``backends`` or ``conformance``.

Modules: ``activation``, ``routing``, ``experts``, ``modular``, ``config``, ``align``, ``gate``, ``quant``.
"""
