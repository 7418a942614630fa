"""The environment variables of vLLM's ``envs.py`` that the modular kernel reads: 0.17's chunking variables (not read
under 0.33) and 0.33's ``VLLM_BATCH_INVARIANT`` (read by ``is_supported_config``)."""

from __future__ import annotations

import os

__all__ = ["DEFAULT_CHUNK_SIZE", "chunk_size_from_env", "chunking_enabled_from_env", "batch_invariant_from_env"]

DEFAULT_CHUNK_SIZE = 16 * 1024

def chunk_size_from_env() -> int:
    """``VLLM_FUSED_MOE_CHUNK_SIZE`` (default 16*1024), as vLLM 0.17's ``envs`` reads it."""
    value = int(os.environ.get("VLLM_FUSED_MOE_CHUNK_SIZE", DEFAULT_CHUNK_SIZE))
    if value < 1:
        raise ValueError(f"VLLM_FUSED_MOE_CHUNK_SIZE must be >= 1, got {value}")
    return value


def chunking_enabled_from_env() -> bool:
    """``VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING`` (default on; "0"/"false" switch it off)."""
    return os.environ.get("VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING", "1").lower() not in ("0", "false", "no")


def batch_invariant_from_env() -> bool:
    """vLLM 0.33 ``VLLM_BATCH_INVARIANT``: ``bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))`` (ValueError for a
    value that is not an integer, as upstream)."""
    return bool(int(os.environ.get("VLLM_BATCH_INVARIANT", "0")))
