"""W4A8 (and W8A8) matmul on AVX-512 VNNI and AVX2 CPUs for the few rows of decoding and
verification: llama.cpp's Q4 x Q8 dot product.

Activations are quantized per 32 columns to int8 (``max|x| / 127``), weights stay codes
``u = q + 8`` (8-bit: ``q + 128``), and ``vpdpbusd`` (AVX2: ``vpmaddubsw`` + ``vpmaddwd``)
multiplies them; a weight block is unpacked once for all rows, so more rows cost multiplies,
not memory traffic. Both ISAs read the layout of ``csrc/w4a8.cpp``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.artifact.lowbit_format import LinearCodes
from pipeline.runtime import cpu_ext

BLOCK = 32  # columns per activation scale and per packed weight block
TILE = 16  # output rows per packed tile: the int32 lanes of one AVX-512 register (two AVX2)


def base(codes: LinearCodes) -> int:
    """u = q + base: signed codes (int4 range for 2/3/4 bits) as vpdpbusd's unsigned operand."""
    return 8 if codes.info.bits <= 4 else 128


def fits(codes: LinearCodes) -> bool:
    """Whether the layer's shape and codes suit the packing (the CPU is not checked)."""
    info = codes.info
    n, k = info.shape
    return (
        info.type != "W4A16_EXP"
        and info.bits in (2, 3, 4, 8)
        and n % TILE == 0
        and k % BLOCK == 0
        and codes.group_len % BLOCK == 0
        and k % codes.group_len == 0
    )


def pack(codes: LinearCodes) -> tuple[Tensor, Tensor, Tensor]:
    """(packed codes, scale, zero) in the kernel's layout; see ``csrc/w4a8.cpp``.

    Returns:
        packed: (n / 16, k / 32, 256) uint8 for 2/3/4-bit codes, byte ``64c + 4r + i`` of a
            block holding ``u[r, 8c + i] | u[r, 8c + 4 + i] << 4``; (n / 16, k / 32, 512) for
            8-bit codes, byte ``64j + 4r + i`` holding ``u[r, 4j + i]``.
        scale: (n / 16, n_groups, 16) float16.
        zero: (n / 16, n_groups, 16) float16, ``(base + offset) * scale``.
    """
    n, k = codes.info.shape
    b = base(codes)
    u = (codes.q.to(torch.int16) + b).to(torch.uint8)  # (n, k) in [0, 2 * base)
    if b == 8:  # (tile, r, block, c, half, i) -> (tile, block, c, r, i, half)
        u = u.view(n // TILE, TILE, k // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        packed = (u[..., 0] | (u[..., 1] << 4)).reshape(n // TILE, k // BLOCK, 256)
    else:  # (tile, r, block, j, i) -> (tile, block, j, r, i)
        u = u.view(n // TILE, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
        packed = u.reshape(n // TILE, k // BLOCK, 512)

    def tiles(t: Tensor) -> Tensor:  # (n, n_groups) -> (n / 16, n_groups, 16)
        return t.float().view(n // TILE, TILE, -1).transpose(1, 2).half().contiguous()

    zero = (codes.offset.float() + b) * codes.scale.float()
    return packed.contiguous(), tiles(codes.scale), tiles(zero)


def matmul(
    x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_len: int, isa: str | None = None
) -> Tensor:
    """(..., k) -> (..., n) float32 with :func:`pack`'s tensors on ``isa`` (default: cpu_ext's)."""
    isa = isa or cpu_ext.isa()
    if isa is None:
        raise RuntimeError("the W4A8 CPU kernel does not run here (no AVX2 or LOWBIT_CPU_ISA=none)")
    ext = cpu_ext.loaded()
    if ext is None:
        raise RuntimeError("the W4A8 CPU kernel is unavailable: the CPU extension did not build")
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()  # (tokens, k)
    y = ext.w4a8_mm(x2, packed, scale, zero, group_len, isa)  # (tokens, n)
    return y.view(*x.shape[:-1], y.shape[-1])
