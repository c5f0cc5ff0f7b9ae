"""Exponential 4-bit codes on AVX-512 and AVX2 CPUs without a float copy: a 16-entry LUT lookup
per code inside the kernel (AVX-512: float32 products; AVX2: an int16 table times activations
rounded to int16 per group).

An exponential group decodes as ``base * P(ratio)[code]``, ``P`` the normalised 16-level table
(:func:`~pipeline.quant.codec.exponential.exp_lut` with base 1). A layer's groups share few
ratios (the fit picks from ``EXP_RATIOS``), so the kernel gets the layer's distinct tables and a
byte per (row, group) naming one, and multiplies the base in once per group. The codes stay at
4 bits a weight: a quarter of the bytes of the bf16 copy they replace. Layout:
``csrc/lut16.cpp``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline import cpu_ext
from pipeline.artifact.lowbit_format import LinearCodes
from pipeline.quant.codec.exponential import exp_lut

BLOCK = 32  # columns per 16 packed bytes
MAX_TABLES = 256  # distinct ratios per layer: a byte indexes them


def fits(codes: LinearCodes) -> bool:
    """Whether the layer's shape and codes suit the packing (the CPU is not checked)."""
    n, k = codes.info.shape
    return (
        codes.info.type == "W4A16_EXP"
        and k % BLOCK == 0
        and codes.group_len % BLOCK == 0
        and k % codes.group_len == 0
        and codes.ratio.unique().numel() <= MAX_TABLES
    )


def pack(codes: LinearCodes) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(packed codes, base, table index, tables) in the kernel's layout.

    Returns:
        packed: (n, k / 2) uint8; per 32 columns, byte i holds column i's code in its low
            nibble and column 16 + i's in its high nibble.
        base: (n, n_groups) float16, each group's base (stored in float16: exact).
        ridx: (n, n_groups) uint8, the row of ``tables`` holding the group's levels.
        tables: (T, 16) float32, ``exp_lut(1, ratio)`` of each distinct ratio.
    """
    n, k = codes.info.shape
    u = codes.q.to(torch.uint8).view(n, k // BLOCK, 2, 16)
    packed = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2)
    ratios, ridx = codes.ratio.float().unique(return_inverse=True)
    tables = exp_lut(torch.ones_like(ratios), ratios)  # (T, 16)
    return packed.contiguous(), codes.scale.half(), ridx.to(torch.uint8), tables.contiguous()


def matmul(x: Tensor, packed: Tensor, base: Tensor, ridx: Tensor, tables: Tensor,
           group_len: int, isa: str | None = None) -> Tensor:  # fmt: skip
    """(..., k) -> (..., n) float32 with :func:`pack`'s tensors on ``isa`` (default: cpu_ext's)."""
    ext, isa = cpu_ext.runnable(isa)
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()  # (tokens, k)
    y = ext.lut16_mm(x2, packed, base, ridx, tables, group_len, isa)
    return y.view(*x.shape[:-1], y.shape[-1])
