"""Bit packing of quantized codes (lowbit layout, Ascend int4 layouts).

lowbit layout (``pack_bits``), codes taken in row-major (flattened) order, result 1-D uint8:

* 8-bit: one code per byte.
* 4-bit: two per byte, low nibble first: ``byte[k] = c[2k] | c[2k+1] << 4``.
* 2-bit: four per byte, lowest bits first: ``byte[k] = sum_j c[4k+j] << 2j``.
* 3-bit: a dense little-endian bit stream, code i at stream bits 3i..3i+2, i.e. every 8 codes
  fill 3 bytes: ``byte[3k+b] = bits 8b..8b+7 of sum_j c[8k+j] << 3j``.

The tail is zero-padded to whole bytes (whole 3-byte triples for 3-bit); ``unpack_bits``
takes the original numel or shape to drop it.

Speed: codes are moved between packed and byte positions with full-width integer ops on
16/64-bit lanes (see ``_spread``), never byte-wise shuffles; see ``bench/packing.py``. These
lane views assume a little-endian host (x86, Arm), as the int32 NPU layout does anyway.

Ascend layouts (signed int4, two's-complement nibbles, low nibble first,
``byte = (q_odd << 4) | (q_even & 0xF)``):

* ``pack_int4_ascend(q, per_group=True)``: pairs along the output dim, int8 ``[n/2, k]``
  (msModelSlim W4A16 per-group); ``per_group=False``: pairs along k, ``[n, k/2]``.
* ``pack_int4_npu_int32(q)``: eight nibbles per int32 along the last dim, element 8j+i at
  bits 4i..4i+3 (``torch_npu.npu_convert_weight_to_int4pack``): the bytes of the per-k
  int8 packing read as little-endian int32.

Only the low nibble of each value is kept (as msModelSlim does); callers pass q in [-8, 7].
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

PACKED_BITS = (2, 3, 4, 8)


def _shape(numel_or_shape: int | tuple[int, ...] | torch.Size) -> tuple[tuple[int, ...], int]:
    if isinstance(numel_or_shape, int):
        return (numel_or_shape,), numel_or_shape
    shape = tuple(int(d) for d in numel_or_shape)
    return shape, math.prod(shape)


def _check_bits(bits: int) -> None:
    if bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")


# A "stage" moves a bit field up by k inside wider lanes with one mask and one fused
# multiply-add: x + (x & mask) * (2**k - 1) == (x & ~mask) | (x & mask) << k when the moved
# bits land on zeros. Unpacking spreads codes into whole bytes stage by stage (each stage
# halves the field width); packing runs the inverse stages. This keeps every step a
# full-width vectorised op on 16/64-bit words instead of byte-wise shuffles.
_SPREAD4 = ((0xF0, 4),)  # int16 lane: byte b -> (b & 15) | (b >> 4) << 8
_SPREAD2 = ((0x0C, 6),)  # int16 lane: nibble -> two 2-bit codes in two bytes
_SPREAD3 = ((0xFFF000, 20), (0x00000FC000000FC0, 10), (0x0038003800380038, 5))  # int64 lane
_M24 = 0xFFFFFF


def _spread(x: Tensor, stages: tuple[tuple[int, int], ...]) -> Tensor:
    m = torch.empty_like(x)
    out = None
    for mask, k in stages:  # the first stage allocates the result, the rest run in place
        torch.bitwise_and(x, mask, out=m)
        x = torch.add(x, m, alpha=(1 << k) - 1) if out is None else x.add_(m, alpha=(1 << k) - 1)
        out = x
    return x


def _gather(x: Tensor, stages: tuple[tuple[int, int], ...]) -> Tensor:
    m = torch.empty_like(x)
    out = None
    for mask, k in reversed(stages):
        torch.bitwise_and(x, mask << k, out=m).bitwise_right_shift_(k)
        x = torch.sub(x, m, alpha=(1 << k) - 1) if out is None else x.sub_(m, alpha=(1 << k) - 1)
        out = x
    return x


def _padded(flat: Tensor, multiple: int) -> Tensor:
    pad = (-flat.numel()) % multiple
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack unsigned codes (any shape, values in [0, 2**bits)) into a 1-D uint8 tensor."""
    _check_bits(bits)
    _require_little_endian()
    flat = codes.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing")
    flat = flat.to(torch.uint8).contiguous()
    if bits == 8:
        return flat.clone()
    if bits == 4:
        return _pack4(_padded(flat, 2))
    if bits == 2:
        nibbles = _gather(_padded(flat, 4).view(torch.int16), _SPREAD2).to(torch.uint8)
        return _pack4(nibbles)
    return _pack3(flat)


def _pack4(flat: Tensor) -> Tensor:
    """Even number of 4-bit values (uint8) -> bytes, low nibble first."""
    return _gather(flat.view(torch.int16), _SPREAD4).to(torch.uint8)


def _pack3(flat: Tensor) -> Tensor:
    n_bytes = math.ceil(flat.numel() / 8) * 3
    v = _gather(_padded(flat, 64).view(torch.int64), _SPREAD3).view(-1, 8)  # 24-bit values
    words = torch.stack(
        [  # 8 x 24 bits -> 3 x 64 bits, little-endian bit stream
            v[:, 0] | (v[:, 1] << 24) | ((v[:, 2] & 0xFFFF) << 48),
            (v[:, 2] >> 16) | (v[:, 3] << 8) | (v[:, 4] << 32) | ((v[:, 5] & 0xFF) << 56),
            (v[:, 5] >> 8) | (v[:, 6] << 16) | (v[:, 7] << 40),
        ],
        dim=-1,
    )
    return words.view(torch.uint8).reshape(-1)[:n_bytes]


def unpack_bits(packed: Tensor, bits: int, numel_or_shape: int | tuple[int, ...]) -> Tensor:
    """Inverse of ``pack_bits``: uint8 codes of the given numel (1-D) or shape."""
    _check_bits(bits)
    _require_little_endian()
    shape, numel = _shape(numel_or_shape)
    packed = (
        packed.reshape(-1).view(torch.uint8) if packed.dtype == torch.int8 else packed.reshape(-1)
    )
    need = math.ceil(numel / 8) * 3 if bits == 3 else math.ceil(numel * bits / 8)
    if packed.dtype != torch.uint8 or packed.numel() < need:
        raise ValueError(
            f"expected at least {need} uint8 bytes for {numel} {bits}-bit codes, "
            f"got {packed.numel()} {packed.dtype}"
        )
    p = packed[:need].contiguous()
    if bits == 8:
        out = p.clone()
    elif bits == 4:
        out = _unpack4(p)
    elif bits == 2:
        out = _spread(_unpack4(p).to(torch.int16), _SPREAD2).view(torch.uint8)
    else:
        out = _unpack3(p)
    return out[:numel].view(shape)


def _unpack4(p: Tensor) -> Tensor:
    """Bytes -> two 4-bit values each (uint8), low nibble first."""
    return _spread(p.to(torch.int16), _SPREAD4).view(torch.uint8)


def _unpack3(p: Tensor) -> Tensor:
    w = _padded(p, 24).view(torch.int64).view(-1, 3)  # 3 words = 64 codes
    a, b, c = w[:, 0], w[:, 1], w[:, 2]
    v = torch.stack(
        [  # arithmetic shifts sign-extend, hence a mask on every field
            a & _M24,
            (a >> 24) & _M24,
            ((a >> 48) & 0xFFFF) | ((b & 0xFF) << 16),
            (b >> 8) & _M24,
            (b >> 32) & _M24,
            ((b >> 56) & 0xFF) | ((c & 0xFFFF) << 8),
            (c >> 16) & _M24,
            (c >> 40) & _M24,
        ],
        dim=-1,
    )  # (units, 8) 24-bit values
    return _spread(v.reshape(-1), _SPREAD3).view(torch.uint8)


def _nibble_pairs(lo: Tensor, hi: Tensor) -> Tensor:
    byte = ((hi.to(torch.int16) & 0xF) << 4) | (lo.to(torch.int16) & 0xF)
    return byte.to(torch.uint8).view(torch.int8)


def _sign_nibbles(packed: Tensor) -> tuple[Tensor, Tensor]:
    x = packed.view(torch.uint8).to(torch.int16)
    lo = ((x & 0xF) ^ 8) - 8  # sign-extend a 4-bit two's-complement value
    hi = (((x >> 4) & 0xF) ^ 8) - 8
    return lo.to(torch.int8), hi.to(torch.int8)


def pack_int4_ascend(q_signed: Tensor, per_group: bool) -> Tensor:
    """Signed int4 [n, k] -> int8 [n/2, k] (per_group) or [n, k/2] (per channel)."""
    if q_signed.dim() != 2:
        raise ValueError(f"expected a 2-D [n, k] tensor, got shape {tuple(q_signed.shape)}")
    dim = 0 if per_group else 1
    if q_signed.shape[dim] % 2:
        raise ValueError(
            f"int4 packing along dim {dim} needs an even size, got shape {tuple(q_signed.shape)}"
        )
    if per_group:
        return _nibble_pairs(q_signed[0::2], q_signed[1::2])
    return _nibble_pairs(q_signed[:, 0::2], q_signed[:, 1::2])


def unpack_int4_ascend(packed: Tensor, per_group: bool) -> Tensor:
    """Inverse of ``pack_int4_ascend``: int8 codes in [-8, 7]."""
    lo, hi = _sign_nibbles(packed)
    dim = 0 if per_group else 1
    out = torch.stack([lo, hi], dim=dim + 1)  # interleave even/odd along `dim`
    shape = list(packed.shape)
    shape[dim] *= 2
    return out.reshape(shape)


def pack_int4_npu_int32(q_signed: Tensor) -> Tensor:
    """Signed int4 [..., k] (k % 8 == 0) -> int32 [..., k/8], element 8j+i at bits 4i..4i+3."""
    if q_signed.shape[-1] % 8:
        raise ValueError(f"last dim must be a multiple of 8, got shape {tuple(q_signed.shape)}")
    _require_little_endian()
    b = _nibble_pairs(q_signed[..., 0::2], q_signed[..., 1::2])  # (..., k/2)
    return b.contiguous().view(torch.int32)


def unpack_int4_npu_int32(packed: Tensor) -> Tensor:
    """Inverse of ``pack_int4_npu_int32``: int8 [..., 8 * k/8] in [-8, 7]."""
    _require_little_endian()
    lo, hi = _sign_nibbles(packed.contiguous().view(torch.uint8))
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("lowbit packing assumes a little-endian host (x86, Arm)")
