"""W4A8 (and W8A8) matmul on AVX-512 VNNI and AVX2 CPUs for the few rows of decoding and
verification.

torch's ``_weight_int4pack_mm_for_cpu`` dequantizes its weights per row block, so its cost grows
with the rows: verifying 5 draft tokens costs 2-3 single-token steps and eats most of what
speculative decoding gains. Here the idea of llama.cpp's Q4 x Q8 dot product: activations are
quantized per 32 columns to int8 (Q8_0, ``scale = max|x| / 127``), weights stay 4-bit codes
``u = q + 8`` in [0, 15], and ``vpdpbusd`` (AVX-512 VNNI; on AVX2 ``vpmaddubsw`` + ``vpmaddwd``)
multiplies u8 codes by s8 activations. A block of weights is read and unpacked once for all the
activation rows of a pass (``csrc/w4a8.cpp`` has the layout), so more rows cost multiplies, not
memory traffic. Trade-off: the int8 activations add ~0.5% relative error on top of the weights'
own, where the bf16 path adds ~0.3%.

8-bit codes take the same kernel as ``u = q + 128`` (llama.cpp's Q8_0 x Q8_0), unpacked by a
plain load: torch's ``_weight_int8pack_mm`` reaches a third of the memory-bandwidth limit on a
1B model at one thread, this path more than half (``docs/benchmarks.md``).

Both ISAs read the same packed layout and compute the same integer dot products, so a packed
layer runs on either. The kernel lives in lowbit's CPU extension (``cpu_ext``, which picks the
ISA); where :func:`~pipeline.runtime.cpu_ext.extension` is None the caller keeps its other
kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.artifact.lowbit_format import LinearCodes
from pipeline.runtime import cpu_ext

BLOCK = 32  # columns per activation scale and per packed weight block
TILE = 16  # output rows per packed tile: the int32 lanes of one AVX-512 register (two AVX2)


def base(codes: LinearCodes) -> int:
    """u = q + base: signed codes as vpdpbusd's unsigned operand (2/3/4-bit codes lie in the
    int4 range [-8, 7], 8-bit ones in [-128, 127])."""
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
        scale: (n / 16, n_groups, 16) float16 (a 0.05% rounding, float32 doubles the bytes
            of the group parameters: 1 bit per weight at 64-column groups).
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
    """(..., k) -> (..., n) float32 with :func:`pack`'s tensors, on ``isa``'s kernel ("avx512",
    "avx2"; default: ``cpu_ext.isa()``)."""
    isa = isa or cpu_ext.isa()
    if isa is None:
        raise RuntimeError("the W4A8 CPU kernel does not run here (no AVX2 or LOWBIT_CPU_ISA=none)")
    ext = cpu_ext.loaded()
    if ext is None:
        raise RuntimeError("the W4A8 CPU kernel is unavailable: the CPU extension did not build")
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()  # (tokens, k)
    y = ext.w4a8_mm(x2, packed, scale, zero, group_len, isa)  # (tokens, n)
    return y.view(*x.shape[:-1], y.shape[-1])
