"""lowbit layout: row bit packing and exact pack/unpack of every format."""

from __future__ import annotations

import pytest
import torch

from pipeline.artifact.lowbit_format import (
    from_field,
    pack_linear,
    pack_rows,
    plan_layer,
    to_field,
    unpack_linear,
    unpack_rows,
)
from pipeline.quant.rtn import quantize_rtn


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [64, 70])
def test_pack_rows_roundtrip_and_size(bits, k):
    codes = torch.randint(0, 1 << bits, (5, k), dtype=torch.uint8)
    packed = pack_rows(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, -(-k // 8) * bits)
    assert torch.equal(unpack_rows(packed, bits, k), codes)


def test_two_bit_layout_four_per_byte_lowest_first():
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 3, 3]], dtype=torch.uint8)
    assert pack_rows(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 255]]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_twos_complement_fields(bits):
    q = torch.arange(-(1 << (bits - 1)), 1 << (bits - 1), dtype=torch.int8)
    f = to_field(q, bits)
    assert int(f.max()) < 1 << bits
    assert torch.equal(from_field(f, bits), q)


FORMATS = [
    "int2g64",
    "int3g128",
    "int3g64-sym",
    "int4g128",
    "int4g128-sym",
    "int4",
    "int8",
    "int8g64",
    "exp4g128",
    "exp4g64",
]
TYPES = {"int2": "W2A16", "int3": "W3A16", "int4": "W4A16", "int8": "W8A16", "exp4": "W4A16_EXP"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_unpack_is_exact(fmt):
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.linspace(0.1, 2.0, 256)  # uneven column scales
    qt = quantize_rtn(w, fmt)
    info = plan_layer("l", qt.fmt, qt.shape, "lowbit")
    assert info.type == TYPES[fmt[:4]]
    stored = pack_linear(qt, info)
    got = unpack_linear(stored, info)
    assert torch.equal(got.dequantize(), qt.dequantize())
    n_bytes = stored["weight"].numel() * stored["weight"].element_size()
    assert n_bytes == 64 * 256 * info.bits // 8  # codes take exactly their bits
    if info.type in ("W2A16", "W3A16"):
        assert stored["weight_scale"].dtype == torch.float16
        assert ("weight_offset" in stored) == (not qt.fmt.symmetric)


def test_partial_last_group_roundtrip():
    qt = quantize_rtn(torch.randn(8, 200), "int3g64")  # 200 = 3 * 64 + 8
    info = plan_layer("l", qt.fmt, qt.shape, "lowbit")
    assert torch.equal(unpack_linear(pack_linear(qt, info), info).dequantize(), qt.dequantize())
