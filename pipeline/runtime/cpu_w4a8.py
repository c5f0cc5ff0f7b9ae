"""W2/W3/W4/W8 x A8 matmul on AVX-512 VNNI and AVX2 CPUs for the few rows of decoding and
verification: llama.cpp's Q4 x Q8 dot product, with codes packed at their own width.

Activations are quantized per 32 columns to int8 (``max|x| / 127``), weights stay codes
``u = q + 2**(bits - 1)``, and ``vpdpbusd`` (AVX2: ``vpmaddubsw`` + ``vpmaddwd``) multiplies
them. Each width has its layout (``csrc/w4a8.cpp``) holding bits / 8 bytes per weight, so 2-bit
codes read half the memory of 4-bit ones; the kernel rebuilds bytes with shifts and masks in
registers. A weight block is unpacked once for all rows, so more rows cost multiplies, not
memory traffic. Both ISAs read the same layouts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline import cpu_ext
from pipeline.artifact.lowbit_format import LinearCodes

BLOCK = 32  # columns per activation scale and per packed weight block
TILE = 16  # output rows per packed tile: the int32 lanes of one AVX-512 register (two AVX2)
BITS = (2, 3, 4, 8)  # code widths with a layout: each stores only its bits


def base(codes: LinearCodes) -> int:
    """u = q + base, base = 2**(bits - 1): signed codes as vpdpbusd's unsigned operand."""
    return 1 << (codes.info.bits - 1)


def fits(codes: LinearCodes) -> bool:
    """Whether the layer's shape and codes suit the packing (the CPU is not checked)."""
    info = codes.info
    n, k = info.shape
    return (
        info.type != "W4A16_EXP"
        and info.bits in BITS
        and n % TILE == 0
        and k % BLOCK == 0
        and codes.group_len % BLOCK == 0
        and k % codes.group_len == 0
    )


def block_bytes(bits: int) -> int:
    """Bytes of one (16-row tile, 32-column block) of ``bits``-bit codes: bits / 8 per weight."""
    return TILE * BLOCK * bits // 8


def _lines(u: Tensor, width: int) -> Tensor:
    """(n, k) codes of ``width`` bits -> (n / 16, k / 32, 64 * width) uint8 of vpdpbusd lines.

    Line j (columns 4j..4j+3 of each row r, in bytes 4r + i) is stored in 64-byte line
    ``j // per_byte`` at bits ``width * (j % per_byte)``, ``per_byte = 8 / width``.
    """
    n, k = u.shape
    per_byte = 8 // width
    # (tile, r, block, c, s, i) -> (tile, block, c, r, i, s): line j = per_byte * c + s
    u = u.view(n // TILE, TILE, k // BLOCK, 8 // per_byte, per_byte, 4).permute(0, 2, 3, 1, 5, 4)
    packed = torch.zeros(u.shape[:-1], dtype=torch.uint8)
    for s in range(per_byte):
        packed |= u[..., s] << (width * s)
    return packed.reshape(n // TILE, k // BLOCK, 64 * width)


def pack(codes: LinearCodes) -> tuple[Tensor, Tensor, Tensor]:
    """(packed codes, scale, zero) in the kernel's layout; see ``csrc/w4a8.cpp``.

    Returns:
        packed: (n / 16, k / 32, :func:`block_bytes`) uint8: 8-, 4- and 2-bit codes as
            :func:`_lines` of their width; 3-bit codes as their low two bits' 2-bit lines
            followed by their high bits' 1-bit lines (192 bytes a block).
        scale: (n / 16, n_groups, 16) float16.
        zero: (n / 16, n_groups, 16) float16, ``(base + offset) * scale``.
    """
    n, k = codes.info.shape
    bits, b = codes.info.bits, base(codes)
    u = (codes.q.to(torch.int16) + b).to(torch.uint8)  # (n, k) in [0, 2**bits)
    if bits == 3:
        packed = torch.cat([_lines(u & 3, 2), _lines(u >> 2, 1)], dim=-1)
    else:
        packed = _lines(u, bits)

    def tiles(t: Tensor) -> Tensor:  # (n, n_groups) -> (n / 16, n_groups, 16)
        return t.float().view(n // TILE, TILE, -1).transpose(1, 2).half().contiguous()

    zero = (codes.offset.float() + b) * codes.scale.float()
    return packed.contiguous(), tiles(codes.scale), tiles(zero)


def matmul(
    x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_len: int, isa: str | None = None
) -> Tensor:
    """(..., k) -> (..., n) float32 with :func:`pack`'s tensors on ``isa`` (default: cpu_ext's)."""
    ext, isa = cpu_ext.runnable(isa)
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()  # (tokens, k)
    y = ext.w4a8_mm(x2, packed, scale, zero, group_len, isa)  # (tokens, n)
    return y.view(*x.shape[:-1], y.shape[-1])
