"""W4A8 matmul on AVX-512 VNNI CPUs for the few rows of decoding and speculative verification.

torch's ``_weight_int4pack_mm_for_cpu`` dequantizes its weights per row block, so its cost grows
with the rows: verifying 5 draft tokens costs 2-3 single-token steps and eats most of what
speculative decoding gains. Here the idea of llama.cpp's Q4 x Q8 dot product: activations are
quantized per 32 columns to int8 (Q8_0, ``scale = max|x| / 127``), weights stay 4-bit codes
``u = q + 8`` in [0, 15], and ``vpdpbusd`` multiplies u8 codes by s8 activations. A block of
weights is read and unpacked once for up to 6 activation rows (``csrc/w4a8.cpp`` has the
layout): 5 rows cost ~1.7 single rows, bound by vpdpbusd throughput, where int4pack's cost
2.7. Trade-off: the int8 activations add ~0.5% relative error on top of the weights' own, where
the bf16 path adds ~0.3%.

The extension is compiled at first use (``torch.utils.cpp_extension``, cached under
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). Without VNNI :func:`extension`
returns None; where the build fails (no compiler) too, after one warning. The caller then keeps
its other kernels.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from pipeline.artifact.lowbit_format import LinearCodes

log = logging.getLogger(__name__)

BLOCK = 32  # columns per activation scale and per packed weight block
TILE = 16  # output rows per packed tile: the int32 lanes of one AVX-512 register
_OFFSET = 8  # u = q + 8: signed int4 codes as the unsigned operand of vpdpbusd
_SOURCE = Path(__file__).parent / "csrc" / "w4a8.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]


def cpu_has_vnni() -> bool:
    """Whether this CPU executes AVX-512 VNNI (Linux: its /proc/cpuinfo flags)."""
    try:
        return "avx512_vnni" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernel, or None (with one warning) where it cannot run or build."""
    if not cpu_has_vnni():
        return None
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for is an OpenMP region compiled into this extension
        return load(
            name="lowbit_w4a8",
            sources=[str(_SOURCE)],
            extra_cflags=[*_FLAGS, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # a missing compiler, ninja or source: any is a reason to fall back
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        log.warning("runtime: the W4A8 CPU kernel did not build (%s: %s)", type(e).__name__, first)
        return None


def fits(codes: LinearCodes) -> bool:
    """Whether the layer's shape and codes suit the packing (the CPU is not checked)."""
    info = codes.info
    n, k = info.shape
    return (
        info.type != "W4A16_EXP"
        and info.bits <= 4
        and n % TILE == 0
        and k % BLOCK == 0
        and codes.group_len % BLOCK == 0
        and k % codes.group_len == 0
    )


def pack(codes: LinearCodes) -> tuple[Tensor, Tensor, Tensor]:
    """(packed codes, scale, zero) in the kernel's layout; see ``csrc/w4a8.cpp``.

    Returns:
        packed: (n / 16, k / 32, 256) uint8, byte ``64c + 4r + i`` of a block holding
            ``u[r, 8c + i] | u[r, 8c + 4 + i] << 4``.
        scale: (n / 16, n_groups, 16) float16 (a 0.05% rounding, float32 doubles the bytes
            of the group parameters: 1 bit per weight at 64-column groups).
        zero: (n / 16, n_groups, 16) float16, ``(8 + offset) * scale``.
    """
    n, k = codes.info.shape
    u = (codes.q.to(torch.int16) + _OFFSET).to(torch.uint8)  # (n, k) in [0, 15]
    # (tile, r, block, c, half, i) -> (tile, block, c, r, i, half)
    u = u.view(n // TILE, TILE, k // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    packed = (u[..., 0] | (u[..., 1] << 4)).reshape(n // TILE, k // BLOCK, 256).contiguous()

    def tiles(t: Tensor) -> Tensor:  # (n, n_groups) -> (n / 16, n_groups, 16)
        return t.float().view(n // TILE, TILE, -1).transpose(1, 2).half().contiguous()

    zero = (codes.offset.float() + _OFFSET) * codes.scale.float()
    return packed, tiles(codes.scale), tiles(zero)


def matmul(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_len: int) -> Tensor:
    """(..., k) -> (..., n) float32 with :func:`pack`'s tensors; needs :func:`extension`."""
    ext = extension()
    if ext is None:
        raise RuntimeError("the W4A8 CPU kernel is unavailable here (no AVX-512 VNNI or no build)")
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()  # (tokens, k)
    y = ext.w4a8_mm(x2, packed, scale, zero, group_len)  # (tokens, n)
    return y.view(*x.shape[:-1], y.shape[-1])
