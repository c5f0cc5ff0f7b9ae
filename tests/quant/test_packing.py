"""Bit packing: round trips, the documented layouts, Ascend known answers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.quant.packing import (
    pack_bits,
    pack_int4_ascend,
    pack_int4_npu_int32,
    unpack_bits,
    unpack_int4_ascend,
    unpack_int4_npu_int32,
)


def _reference_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-endian bit stream of the codes, built with a Python integer."""
    stream = 0
    for i, c in enumerate(codes.reshape(-1).tolist()):
        stream |= int(c) << (bits * i)
    n = codes.numel()
    n_bytes = -(-n // 8) * 3 if bits == 3 else -(-n * bits // 8)
    return torch.tensor(list(stream.to_bytes(n_bytes, "little")), dtype=torch.uint8)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    shape=st.lists(st.integers(0, 70), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip(bits, shape, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert torch.equal(unpack_bits(packed, bits, codes.shape), codes)
    assert torch.equal(unpack_bits(packed, bits, codes.numel()), codes.reshape(-1))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 64, 131])
def test_layout_is_the_documented_bit_stream(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    assert torch.equal(pack_bits(codes, bits), _reference_stream(codes, bits))


def test_four_bit_low_nibble_first():
    assert pack_bits(torch.tensor([1, 2, 15, 0]), 4).tolist() == [0x21, 0x0F]
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]


def test_pack_rejects_out_of_range_codes():
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack_bits(torch.tensor([0, 4]), 2)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.tensor([0]), 5)


def test_unpack_rejects_short_input():
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 4, 5)


def test_ascend_known_answer():
    codes = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int8)
    packed = pack_int4_ascend(codes, per_group=True)
    assert packed.dtype == torch.int8
    assert packed.tolist() == [[81, 98, 115, -124]]


@pytest.mark.parametrize("per_group", [True, False])
def test_ascend_round_trip_and_shape(per_group):
    q = torch.randint(-8, 8, (6, 10), dtype=torch.int8)
    packed = pack_int4_ascend(q, per_group)
    assert packed.shape == ((3, 10) if per_group else (6, 5))
    assert torch.equal(unpack_int4_ascend(packed, per_group), q)
    # byte = (q_odd << 4) | (q_even & 0xF), pairs along the packed dim
    even, odd = (q[0::2], q[1::2]) if per_group else (q[:, 0::2], q[:, 1::2])
    expect = ((odd.int() & 0xF) << 4 | (even.int() & 0xF)).to(torch.uint8).view(torch.int8)
    assert torch.equal(packed, expect)


def test_ascend_odd_dim_is_rejected():
    with pytest.raises(ValueError, match="even"):
        pack_int4_ascend(torch.zeros(3, 4, dtype=torch.int8), per_group=True)


def test_npu_int32_layout():
    q = torch.randint(-8, 8, (3, 16), dtype=torch.int8)
    packed = pack_int4_npu_int32(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    for j in range(2):
        for i in range(8):  # element 8j+i sits at bits 4i..4i+3 of word j
            nib = (packed[:, j].long() >> (4 * i)) & 0xF
            assert torch.equal(nib, q[:, 8 * j + i].long() & 0xF)
    assert torch.equal(unpack_int4_npu_int32(packed), q)


def test_npu_int32_needs_multiple_of_eight():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4_npu_int32(torch.zeros(2, 12, dtype=torch.int8))
