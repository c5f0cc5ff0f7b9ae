"""lowbit's CPU kernels on 2- and 3-bit codes packed at their own width: against the reference
on every group size, odd shapes, 1-12 rows, on each ISA; and the bytes the packing holds."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime import cpu_w4a8, kernels
from pipeline.runtime.kernels import relative_error
from tests.runtime.test_kernels import ISAS, W4A8_TOL, _codes, needs_kernels

# (format, (n, k)): every group size the kernels take (32, 64, 128, per channel), with n and k
# that are multiples of the tile and the group but not powers of two.
LOW_BIT = [
    ("int2g32", (48, 160)),
    ("int2g64", (48, 192)),
    ("int2g128", (32, 384)),
    ("int2", (48, 96)),
    ("int3g32", (48, 96)),
    ("int3g64", (48, 192)),
    ("int3g128", (32, 384)),
    ("int3", (48, 160)),
    ("int3g32-sym", (16, 160)),
    ("int2g64-sym", (16, 192)),
]


def _exact_reference(codes, x):
    """x @ W.T with W as the kernel holds it: u * scale - zero, zero rounded to float16 as
    packed (the only rounding besides the activations')."""
    (n, k), g = codes.info.shape, codes.group_len
    base = cpu_w4a8.base(codes)
    u = (codes.q.double() + base).view(n, k // g, g)
    zero = ((codes.offset.float() + base) * codes.scale.float()).half().double()
    w = u * codes.scale.double()[..., None] - zero[..., None]
    return (x.double() @ w.view(n, k).T).float()


def _int8_exact(rows: int, k: int) -> torch.Tensor:
    """Activations int8 quantization keeps exactly: integers with 127 in every 32-column block."""
    x = torch.randint(-127, 128, (rows, k)).float()
    x[:, ::32] = 127.0
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("fmt", "shape"), LOW_BIT)
def test_low_bit_kernels_match_the_reference(fmt, shape, isa):
    _, codes = _codes(fmt, shape)
    n, k = shape
    layer = kernels.W4A8(codes, isa)
    assert layer.name == f"w{codes.info.bits}a8pack" and layer.isa == isa
    torch.manual_seed(2)
    for rows in range(1, 13):  # one pass of rows and two (AVX-512 takes 6 a pass, AVX2 5)
        # Activations int8 represents exactly: only float summation order is left, so one
        # misplaced code (a swapped shift, a lost high bit) shows far above the tolerance.
        x = _int8_exact(rows, k)
        want = _exact_reference(codes, x)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        # Gaussian activations: within int8 rounding of the dequantize-then-matmul reference
        x = torch.randn(rows, k)
        got = layer(x)
        assert got.shape == (rows, n)
        assert relative_error(got, kernels.Reference(codes)(x)) < W4A8_TOL


@pytest.mark.parametrize("fmt", ["int2g64", "int3g64", "int4g64", "int8g64"])
def test_packed_codes_hold_their_bits_per_weight(fmt):
    _, codes = _codes(fmt, (48, 192))
    packed, scale, zero = cpu_w4a8.pack(codes)
    bits = codes.info.bits
    assert packed.dtype == torch.uint8
    assert packed.numel() == 48 * 192 * bits // 8  # 2-bit: a quarter of a byte per weight
    assert packed.shape == (3, 6, cpu_w4a8.block_bytes(bits))
    assert scale.shape == zero.shape == (3, 3, 16)


def test_three_bit_layout_places_each_bit():
    # one code set: row 5, column 4j + i with j = 6, i = 1 -> u = 7 (every other u = 0)
    _, codes = _codes("int3g32-sym", (16, 32))
    codes.q.fill_(-4)
    codes.q[5, 4 * 6 + 1] = 3
    packed = cpu_w4a8.pack(codes)[0].view(-1)  # (192,)
    want = torch.zeros(192, dtype=torch.uint8)
    want[64 * 1 + 4 * 5 + 1] = 0b11 << 4  # 2-bit plane: line 6 = 4c + s, c = 1, s = 2
    want[128 + 4 * 5 + 1] = 1 << 6  # 1-bit plane: bit j = 6
    assert torch.equal(packed, want)


@needs_kernels
def test_a_block_size_of_no_layout_is_refused():
    _, codes = _codes("int2g64", (16, 64))
    packed, scale, zero = cpu_w4a8.pack(codes)
    cut = packed[..., :96].contiguous()  # 96 bytes a block: no width packs that
    with pytest.raises(RuntimeError, match=r"128\|192\|256\|512\): see cpu_w4a8.pack"):
        cpu_w4a8.matmul(torch.randn(1, 64), cut, scale, zero, 64)
