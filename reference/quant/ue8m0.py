"""UE8M0 (unsigned power-of-two) scales: DeepGEMM's ceil rounding, exponent bytes, and the packed
int32 format DeepGEMM reads on SM100.
"""

from __future__ import annotations

import enum

import torch

from ._common import (
    bits_f32,
    cdiv,
    check_dtype,
    check_positive_int,
    check_tensor,
    e8m0_to_fp32,
    f32_bits,
    fp32_pow2_to_e8m0,
)
from .layout import get_mn_major_tma_aligned_tensor

__all__ = [
    "ceil_to_ue8m0",
    "ue8m0_byte",
    "pack_ue8m0",
    "unpack_ue8m0",
    "DeepGemmQuantScaleFMT",
]


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round ``|x|`` up to a power of two with DeepGEMM's bit formula (bit-exact).

    Mirrors ``deep_gemm/utils/math.py::ceil_to_ue8m0``::

        bits = |x|.float().view(int32)
        exp  = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF != 0)
        out  = (exp.clamp(1, 254) << 23).view(float32)

    Shapes: any; returns float32 of the same shape. The result is the smallest power of two
    ``>= |x|`` clamped to ``[2^-126, 2^127]``: zero and subnormals give ``2^-126`` (byte 1), and
    +-inf / NaN give ``2^127`` (byte 254) - DeepGEMM's formula never produces byte 0 or 255.
    This is NOT ``exp2(ceil(log2(x)))``: for ``x`` a few ULPs above ``2^k``, fp32 ``log2`` rounds
    to ``k`` and that formula returns ``2^k`` (SGLang #29954).

    Raises TypeError for a non-floating tensor.
    """
    check_tensor(x, "x")
    if not x.dtype.is_floating_point:
        raise TypeError(f"ceil_to_ue8m0 expects a floating tensor, got {x.dtype}")
    bits = f32_bits(x.abs())
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return bits_f32(exp.clamp(1, 254) << 23)


def ue8m0_byte(x: torch.Tensor) -> torch.Tensor:
    """Exponent byte of fp32 power-of-two scales: ``2^e -> e + 127`` as uint8 (same shape).

    ``2^-127`` (fp32 subnormal) -> 0, ``2^127`` -> 254, NaN -> 255 (E8M0's NaN; a group poisoned
    by a non-finite input keeps its NaN scale). Matches vLLM's packed kernel
    ``(uint8)((int)log2f(y_s) + 127)`` on powers of two.

    Raises TypeError for a non-floating tensor and ValueError for any value that is not NaN
    and not a power of two in ``[2^-127, 2^127]`` (zero, negatives, inf, 1.5, ...).
    """
    check_tensor(x, "x")
    if not x.dtype.is_floating_point:
        raise TypeError(f"ue8m0_byte expects a floating tensor, got {x.dtype}")
    return fp32_pow2_to_e8m0(x, "ue8m0_byte")


def pack_ue8m0(scales_fp32: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two fp32 scales into DeepGEMM's packed-UE8M0 int32, MN-major, TMA-aligned.

    Mirrors vLLM ``per_token_group_quant_fp8_packed_for_deepgemm`` / DeepGEMM
    ``get_mn_major_tma_aligned_packed_ue8m0_tensor``.

    Args:
        scales_fp32: ``(MN, G)`` or ``(B, MN, G)`` float32 powers of two (NaN allowed -> 0xFF),
            any strides.

    Returns:
        int32 ``(MN, ceil(G/4))`` with strides ``(1, align(MN, 4))`` (batched:
        ``(B, MN, ceil(G/4))`` with strides ``(ceil(G/4) * align(MN, 4), 1, align(MN, 4))``).
        Word ``j`` of row ``m`` holds ``byte(g=4j) | byte(4j+1) << 8 | byte(4j+2) << 16 |
        byte(4j+3) << 24`` (group 4j in the least significant byte). Padding bytes (groups
        ``>= G``) and padding rows of the storage are 0 (vLLM; DeepGEMM's fp4 helper pads 127).

    Raises:
        TypeError: not float32.
        ValueError: rank not 2/3, or a value without a UE8M0 encoding (see :func:`ue8m0_byte`).
    """
    check_dtype(scales_fp32, "scales_fp32", (torch.float32,))
    if scales_fp32.dim() not in (2, 3):
        raise ValueError(
            f"scales_fp32 must be 2-D (MN, G) or 3-D (B, MN, G), got shape {tuple(scales_fp32.shape)}"
        )
    g = scales_fp32.shape[-1]
    gp = cdiv(g, 4)
    b = fp32_pow2_to_e8m0(scales_fp32, "pack_ue8m0").to(torch.int64)
    pad = torch.zeros(*b.shape[:-1], gp * 4 - g, dtype=torch.int64, device=b.device)
    b = torch.cat([b, pad], dim=-1).reshape(*b.shape[:-1], gp, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    # reinterpret the unsigned 32-bit word as two's-complement int32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return get_mn_major_tma_aligned_tensor(words)


def unpack_ue8m0(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``(..., MN, ceil(G/4))`` -> float32 ``(..., MN, G)``.

    Any strides are accepted. Byte ``b`` decodes to ``2^(b-127)`` (byte 0 -> ``2^-127``, 255 ->
    NaN); only the first ``num_groups`` bytes of each row are returned (padding dropped).
    Returns a contiguous row-major tensor.

    Raises TypeError if not int32; ValueError if ``num_groups`` exceeds ``4 * packed.shape[-1]``
    or is not positive.
    """
    check_dtype(packed, "packed", (torch.int32,))
    check_positive_int(num_groups, "num_groups")
    if packed.dim() < 1 or num_groups > 4 * packed.shape[-1] or num_groups <= 4 * (packed.shape[-1] - 1):
        raise ValueError(
            f"num_groups={num_groups} does not fit packed words of shape {tuple(packed.shape)} "
            f"(expected ceil(num_groups / 4) == {packed.shape[-1] if packed.dim() else 0})"
        )
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=packed.device)
    b = (w.unsqueeze(-1) >> shifts) & 0xFF
    b = b.reshape(*packed.shape[:-1], packed.shape[-1] * 4)[..., :num_groups]
    return e8m0_to_fp32(b.to(torch.uint8)).contiguous()


class DeepGemmQuantScaleFMT(enum.Enum):
    """Which scale format DeepGEMM expects for FP8 activations.

    Mirrors ``vllm/utils/deep_gemm.py::DeepGemmQuantScaleFMT``:

    - ``FLOAT32``: plain fp32 scales (E8M0 off).
    - ``FLOAT32_CEIL_UE8M0``: fp32 scales rounded up to powers of two (SM90 with E8M0 on).
    - ``UE8M0``: packed UE8M0 int32 (SM100 / SM120 with E8M0 on), see :func:`pack_ue8m0`.
    """

    FLOAT32 = 0
    FLOAT32_CEIL_UE8M0 = 1
    UE8M0 = 2

    @classmethod
    def from_capability(cls, major: int | tuple[int, int], *, use_e8m0: bool = True) -> "DeepGemmQuantScaleFMT":
        """Scale format for a GPU of compute capability ``major`` (or ``(major, minor)``).

        The platform is a parameter (vLLM reads it from the current device via ``from_oracle``).
        ``use_e8m0`` stands for ``VLLM_USE_DEEP_GEMM_E8M0`` (default on).

        Returns FLOAT32 when ``use_e8m0`` is False; otherwise FLOAT32_CEIL_UE8M0 on SM90 and UE8M0
        on SM100 / SM120.

        Raises ValueError for a capability DeepGEMM does not support (anything but 9, 10, 12).
        """
        if isinstance(major, tuple):
            major = major[0]
        if isinstance(major, bool) or not isinstance(major, int):
            raise TypeError(f"major must be an int compute-capability major, got {major!r}")
        if major not in (9, 10, 12):
            raise ValueError(
                f"DeepGEMM supports compute capability majors 9 (SM90), 10 (SM100) and 12 (SM120); got {major}"
            )
        if not use_e8m0:
            return cls.FLOAT32
        return cls.FLOAT32_CEIL_UE8M0 if major == 9 else cls.UE8M0
