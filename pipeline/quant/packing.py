"""Bit packing of quantized codes (lowbit layout, Ascend int4 layouts); little-endian hosts only.

lowbit (``pack_bits``): codes in row-major order into 1-D uint8, lowest bits first:
* 8-bit: a code per byte; 4-bit: ``byte[k] = c[2k] | c[2k+1] << 4``; 2-bit: ``sum_j c[4k+j] << 2j``.
* 3-bit: a little-endian bit stream, code i at bits 3i..3i+2: 8 codes fill 3 bytes.
The tail is zero-padded to whole bytes (3-byte triples for 3-bit); ``unpack_bits`` drops it.

Ascend: signed int4 as two's-complement nibbles, ``byte = (q_odd << 4) | (q_even & 0xF)``
(only the low nibble is kept; callers pass q in [-8, 7]):
* ``pack_int4_ascend``: int8 ``[n/2, k]`` per_group (msModelSlim W4A16), else ``[n, k/2]``.
* ``pack_int4_npu_int32``: the along-k bytes read as little-endian int32, element 8j+i at bits
  4i..4i+3 (``torch_npu.npu_convert_weight_to_int4pack``).
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


# A stage moves a bit field up by k in one fused multiply-add (the moved bits land on zeros):
# x + (x & mask) * (2**k - 1) == (x & ~mask) | (x & mask) << k. Packing runs the stages in reverse.
_SPREAD4 = ((0xF0, 4),)  # int16 lane: byte b -> (b & 15) | (b >> 4) << 8
_SPREAD2 = ((0x0C, 6),)  # int16 lane: nibble -> two 2-bit codes in two bytes
_SPREAD3 = ((0xFFF000, 20), (0x00000FC000000FC0, 10), (0x0038003800380038, 5))  # int64 lane
_M24 = 0xFFFFFF
CHUNK = 1 << 20  # packed bytes per chunk: temporaries stay in cache


def _spread_(x: Tensor, stages: tuple[tuple[int, int], ...]) -> Tensor:
    """In place: move each stage's masked field up by k."""
    for mask, k in stages:
        x.add_(x & mask, alpha=(1 << k) - 1)
    return x


def _gather(x: Tensor, stages: tuple[tuple[int, int], ...]) -> Tensor:
    """Inverse of ``_spread_``; the first stage allocates, so ``x`` is left untouched."""
    for i, (mask, k) in enumerate(reversed(stages)):
        moved = (x & (mask << k)).bitwise_right_shift_(k)
        alpha = (1 << k) - 1
        x = torch.sub(x, moved, alpha=alpha) if i == 0 else x.sub_(moved, alpha=alpha)
    return x


def _chunks(n_units: int, unit_in: int, unit_out: int):
    """Yield (in_slice, out_slice) of about CHUNK packed bytes, in whole units."""
    step = max(1, CHUNK // unit_in)
    for u in range(0, n_units, step):
        v = min(u + step, n_units)
        yield slice(u * unit_in, v * unit_in), slice(u * unit_out, v * unit_out)


def _padded(flat: Tensor, multiple: int) -> Tensor:
    pad = (-flat.numel()) % multiple
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack unsigned codes (any shape, values in [0, 2**bits)) into a 1-D uint8 tensor."""
    _check_bits(bits)
    _require_little_endian()
    flat = codes.reshape(-1)
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0 or int(hi) >= 1 << bits:
            raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing")
    flat = flat.to(torch.uint8).contiguous()
    if bits == 8:
        return flat.clone()
    per = {2: 4, 3: 64, 4: 2}[bits]  # codes per packing unit
    n_bytes = math.ceil(flat.numel() / 8) * 3 if bits == 3 else math.ceil(flat.numel() * bits / 8)
    flat = _padded(flat, per)
    out = torch.empty(flat.numel() * bits // 8, dtype=torch.uint8, device=flat.device)
    unit_out = per * bits // 8
    kernel = {2: _pack2_into, 3: _pack3_into, 4: _pack4_into}[bits]
    for src, dst in _chunks(flat.numel() // per, per, unit_out):
        kernel(flat[src], out[dst])
    return out if out.numel() == n_bytes else out[:n_bytes].clone()


def _pack4_into(c: Tensor, out: Tensor) -> None:
    """Even number of 4-bit values (uint8) -> bytes, low nibble first."""
    out.copy_(_gather(c.view(torch.int16), _SPREAD4))  # copy_ narrows to uint8


def _pack2_into(c: Tensor, out: Tensor) -> None:
    nibbles = _gather(c.view(torch.int16), _SPREAD2).to(torch.uint8)
    _pack4_into(nibbles, out)


def _pack3_into(c: Tensor, out: Tensor) -> None:
    v = _gather(c.view(torch.int64), _SPREAD3).view(-1, 8)  # 24-bit values
    w = out.view(torch.int64).view(-1, 3)  # 8 x 24 bits -> 3 x 64 bits, little-endian stream
    torch.bitwise_or(v[:, 0] | (v[:, 1] << 24), (v[:, 2] & 0xFFFF) << 48, out=w[:, 0])
    b = (v[:, 2] >> 16) | (v[:, 3] << 8) | (v[:, 4] << 32)
    torch.bitwise_or(b, (v[:, 5] & 0xFF) << 56, out=w[:, 1])
    torch.bitwise_or((v[:, 5] >> 8) | (v[:, 6] << 16), v[:, 7] << 40, out=w[:, 2])


def unpack_bits(packed: Tensor, bits: int, numel_or_shape: int | tuple[int, ...]) -> Tensor:
    """Inverse of ``pack_bits``: uint8 codes of the given numel (1-D) or shape."""
    _check_bits(bits)
    _require_little_endian()
    shape, numel = _shape(numel_or_shape)
    packed = packed.reshape(-1)
    if packed.dtype == torch.int8:
        packed = packed.view(torch.uint8)
    need = math.ceil(numel / 8) * 3 if bits == 3 else math.ceil(numel * bits / 8)
    if packed.dtype != torch.uint8 or packed.numel() < need:
        raise ValueError(
            f"expected at least {need} uint8 bytes for {numel} {bits}-bit codes, "
            f"got {packed.numel()} {packed.dtype}"
        )
    p = packed[:need].contiguous()
    if bits == 8:
        return p.clone().view(shape)
    unit_in = 24 if bits == 3 else 1  # packed bytes per unit
    p = _padded(p, unit_in)
    unit_out = unit_in * 8 // bits
    out = torch.empty(p.numel() * 8 // bits, dtype=torch.uint8, device=p.device)
    kernel = {2: _unpack2_into, 3: _unpack3_into, 4: _unpack4_into}[bits]
    for src, dst in _chunks(p.numel() // unit_in, unit_in, unit_out):
        kernel(p[src], out[dst])
    out = out if out.numel() == numel else out[:numel].clone()
    return out.view(shape)


def _unpack4_into(p: Tensor, out: Tensor) -> None:
    """Bytes -> two 4-bit values each (uint8), low nibble first."""
    lanes = out.view(torch.int16)
    lanes.copy_(p)  # widen each byte into its own 16-bit lane
    _spread_(lanes, _SPREAD4)


def _unpack2_into(p: Tensor, out: Tensor) -> None:
    nibbles = torch.empty(2 * p.numel(), dtype=torch.uint8, device=p.device)
    _unpack4_into(p, nibbles)
    lanes = out.view(torch.int16)
    lanes.copy_(nibbles)
    _spread_(lanes, _SPREAD2)


def _unpack3_into(p: Tensor, out: Tensor) -> None:
    w = p.view(torch.int64).view(-1, 3)  # 3 words = 64 codes
    a, b, c = w[:, 0], w[:, 1], w[:, 2]
    v = out.view(torch.int64).view(-1, 8)  # 24-bit values, spread in place below
    # arithmetic shifts sign-extend, hence a mask on every field
    torch.bitwise_and(a, _M24, out=v[:, 0])
    torch.bitwise_and(a >> 24, _M24, out=v[:, 1])
    torch.bitwise_or((a >> 48) & 0xFFFF, (b & 0xFF) << 16, out=v[:, 2])
    torch.bitwise_and(b >> 8, _M24, out=v[:, 3])
    torch.bitwise_and(b >> 32, _M24, out=v[:, 4])
    torch.bitwise_or((b >> 56) & 0xFF, (c & 0xFFFF) << 8, out=v[:, 5])
    torch.bitwise_and(c >> 16, _M24, out=v[:, 6])
    torch.bitwise_and(c >> 40, _M24, out=v[:, 7])
    _spread_(v, _SPREAD3)


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
