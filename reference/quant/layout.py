"""Scale-factor memory layouts: MN-major TMA-aligned (DeepGEMM SM90/SM100) and the CUTLASS 128x4
block-scale swizzle (MXFP4 / MXFP8 / NVFP4 on SM100).

Layouts change where a scale lives, never its value: every function here is a pure permutation
plus zero padding, and each has an inverse (or is checked against the strides it promises).
"""

from __future__ import annotations

import torch

from ._common import align, cdiv, check_tensor

__all__ = [
    "get_tma_aligned_size",
    "get_mn_major_tma_aligned_tensor",
    "mn_major_scales",
    "swizzle_mxfp4_scales",
    "swizzle_block_scales",
    "unswizzle_block_scales",
]

# TMA needs 16-byte aligned strides.
_TMA_ALIGNMENT_BYTES = 16


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """Round ``x`` elements up so ``x * element_size`` is a multiple of 16 bytes.

    Mirrors ``deep_gemm`` / ``vllm/utils/deep_gemm.py::get_tma_aligned_size``: fp32 and int32
    (4 bytes) -> multiple of 4. Raises ValueError if 16 is not a multiple of ``element_size``.
    """
    if element_size <= 0 or _TMA_ALIGNMENT_BYTES % element_size != 0:
        raise ValueError(f"element_size must divide {_TMA_ALIGNMENT_BYTES}, got {element_size}")
    return align(x, _TMA_ALIGNMENT_BYTES // element_size)


def mn_major_scales(scales: torch.Tensor, mn_stride: int | None = None) -> torch.Tensor:
    """Copy ``(..., MN, G)`` scales into MN-major storage with column stride ``mn_stride``.

    Returns a tensor with the same shape and values whose strides are ``(1, mn_stride)`` for 2-D
    input and ``(G * mn_stride, 1, mn_stride)`` for 3-D input. ``mn_stride`` defaults to MN
    (vLLM ``column_major_scales=True`` without TMA alignment: strides ``(1, M)``). Storage between
    MN and ``mn_stride`` is zero. Raises ValueError for other ranks or ``mn_stride < MN``.
    """
    check_tensor(scales, "scales")
    if scales.dim() not in (2, 3):
        raise ValueError(f"scales must be 2-D (MN, G) or 3-D (B, MN, G), got shape {tuple(scales.shape)}")
    mn, g = scales.shape[-2], scales.shape[-1]
    stride = mn if mn_stride is None else mn_stride
    if stride < mn:
        raise ValueError(f"mn_stride={stride} is smaller than MN={mn}")
    batch = scales.shape[:-2]
    storage = torch.zeros(*batch, g, stride, dtype=scales.dtype, device=scales.device)
    storage[..., :mn] = scales.transpose(-1, -2)
    return storage[..., :mn].transpose(-1, -2)


def get_mn_major_tma_aligned_tensor(scales: torch.Tensor) -> torch.Tensor:
    """MN-major, TMA-aligned copy of ``(MN, G)`` or ``(B, MN, G)`` fp32 / int32 scales.

    Mirrors ``deep_gemm::get_mn_major_tma_aligned_tensor`` (``csrc/apis/layout.hpp``; vLLM's
    ``get_col_major_tma_aligned_tensor``): same shape and values, strides
    ``(1, align(MN, 16 // element_size))`` (fp32 / int32: MN rounded up to a multiple of 4), and
    ``(G * aligned_MN, 1, aligned_MN)`` when batched. Padding rows of the storage are zero.

    Raises TypeError for dtypes other than float32 / int32, ValueError for other ranks.
    """
    check_tensor(scales, "scales")
    if scales.dtype not in (torch.float32, torch.int32):
        raise TypeError(f"scales must be float32 or int32 (packed UE8M0), got {scales.dtype}")
    if scales.dim() not in (2, 3):
        raise ValueError(f"scales must be 2-D (MN, G) or 3-D (B, MN, G), got shape {tuple(scales.shape)}")
    mn = scales.shape[-2]
    return mn_major_scales(scales, get_tma_aligned_size(mn, scales.element_size()))


def _as_bytes_if_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    # zero-padding and permutes of 1-byte float types go through uint8 so no float op touches them
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        return t.contiguous().view(torch.uint8), t.dtype
    return t, None


def swizzle_mxfp4_scales(scales: torch.Tensor) -> torch.Tensor:
    """CUTLASS 128x4 block-scale swizzle of row-major ``(M, S)`` (or ``(B, M, S)``) scales.

    Mirrors ``vllm/model_executor/layers/fused_moe/cutlass_moe.py::swizzle_mxfp4_scales`` (CUTLASS
    ``sm100_blockscaled_layout.hpp``; torchao ``to_blocked``). ``S`` is the number of scale
    columns (K // 32 for MX, K // 16 for NVFP4; the layout itself does not depend on the block).

    Returns a contiguous tensor of shape ``(numMTiles, numKTiles, 32, 4, 4)`` (batch dims
    prepended), same dtype, with ``numMTiles = ceil(M / 128)``, ``numKTiles = ceil(S / 4)``.
    Scale ``(m, k)`` sits at flat element offset
    ``(m // 128 * numKTiles + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4``
    (a byte offset for 1-byte scales). Padding entries are zero.

    Raises ValueError for ranks other than 2 or 3.
    """
    check_tensor(scales, "scales")
    if scales.dim() not in (2, 3):
        raise ValueError(f"scales must be 2-D (M, S) or 3-D (B, M, S), got shape {tuple(scales.shape)}")
    src, orig_dtype = _as_bytes_if_fp8(scales)
    m, s = src.shape[-2], src.shape[-1]
    mt, kt = cdiv(m, 128), cdiv(s, 4)
    batch = src.shape[:-2]
    padded = torch.zeros(*batch, mt * 128, kt * 4, dtype=src.dtype, device=src.device)
    padded[..., :m, :s] = src
    # row = mTile*128 + innerM*32 + outerM ; col = kTile*4 + innerK
    t = padded.reshape(*batch, mt, 4, 32, kt, 4)
    nb = len(batch)
    perm = tuple(range(nb)) + tuple(nb + i for i in (0, 3, 2, 1, 4))  # mTile, kTile, outerM, innerM, innerK
    out = t.permute(perm).contiguous()
    return out.view(orig_dtype) if orig_dtype is not None else out


#: The swizzle is the same for every block size (MX 32, NVFP4 16).
swizzle_block_scales = swizzle_mxfp4_scales


def unswizzle_block_scales(swizzled: torch.Tensor, M: int, K_scale_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_mxfp4_scales`: back to row-major ``(M, K_scale_cols)``.

    ``swizzled`` is the 5-D ``(numMTiles, numKTiles, 32, 4, 4)`` tensor, the 6-D batched one
    ``(B, numMTiles, numKTiles, 32, 4, 4)``, a flat 1-D buffer (unbatched) or a 2-D ``(B, n)``
    buffer, as a kernel may hold it. Mirrors vLLM's ``recover_swizzled_scales`` test helper.
    Padding is dropped. Returns a contiguous ``(M, K_scale_cols)`` (or ``(B, M, K_scale_cols)``)
    tensor of the same dtype.

    Raises ValueError for another rank or if the element count does not match
    ``ceil(M/128) * ceil(K_scale_cols/4) * 512`` per batch.
    """
    check_tensor(swizzled, "swizzled")
    src, orig_dtype = _as_bytes_if_fp8(swizzled)
    mt, kt = cdiv(M, 128), cdiv(K_scale_cols, 4)
    per = mt * kt * 512
    if src.dim() in (1, 5):
        batch: tuple[int, ...] = ()
    elif src.dim() in (2, 6):
        batch = (src.shape[0],)
    else:
        raise ValueError(f"swizzled must be 1-D, 2-D, 5-D or 6-D, got shape {tuple(src.shape)}")
    if src.numel() != per * (batch[0] if batch else 1):
        raise ValueError(
            f"swizzled has {src.numel()} elements, expected {per} per batch for M={M}, "
            f"K_scale_cols={K_scale_cols} (numMTiles={mt}, numKTiles={kt})"
        )
    t = src.reshape(*batch, mt, kt, 32, 4, 4)
    nb = len(batch)
    perm = tuple(range(nb)) + tuple(nb + i for i in (0, 3, 2, 1, 4))  # mTile, innerM, outerM, kTile, innerK
    out = t.permute(perm).reshape(*batch, mt * 128, kt * 4)[..., :M, :K_scale_cols].contiguous()
    return out.view(orig_dtype) if orig_dtype is not None else out
