"""Exponential 4-bit codes: sign + 3-bit index on a geometric grid, decoded through a LUT.

``code = sign << 3 | m``; ``m = 0`` is zero, ``m = k + 1`` is ``s * r**k`` (k = 0..6): a group's LUT
is ``[0, s, s*r, ..., s*r**6]`` then the same negated (code 8 a second zero). Rounding is to the
nearest level in the linear domain; the log grid puts levels near zero, where weights are dense.
Fit: a grid search over ratios and clips with the fp16 base; QAT trains ``s`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pipeline.quant.codec.base import SCALE_BITS, Fp16STE, row_chunks, to_fp16, to_groups

EXP_RATIOS = (1.1875, 1.25, 1.3125, 1.375, 1.4375, 1.5, 1.625, 1.75, 2.0, 2.5)  # exact in fp16
EXP_CLIPS = (1.0, 0.925, 0.85, 0.775, 0.7, 0.6)
EXP_LEVELS = 8  # magnitudes per sign: zero + s * r**k, k = 0..6


def exp_powers(ratio: Tensor) -> Tensor:
    """(...,) ratios -> (..., 8) ``[0, 1, r, ..., r**6]`` by cumprod: bit-identical in any shape."""
    r = ratio.unsqueeze(-1).expand(*ratio.shape, EXP_LEVELS - 2)
    one = torch.ones_like(ratio).unsqueeze(-1)
    return torch.cat([torch.zeros_like(one), one, torch.cumprod(r, dim=-1)], dim=-1)


def exp_bounds(powers: Tensor) -> Tensor:
    """(..., 8) normalised magnitudes -> (..., 7) midpoints between neighbouring levels."""
    return (powers[..., 1:] + powers[..., :-1]) * 0.5


def exp_lut(base: Tensor, ratio: Tensor) -> Tensor:
    """(...,) base and ratio -> (..., 16) decoded value of every code."""
    mags = base.unsqueeze(-1) * exp_powers(ratio)
    return torch.cat([mags, -mags], dim=-1)


def _encode_bounds(w: Tensor, base: Tensor, bounds: Tensor) -> Tensor:
    """Codes (int64) of ``w`` given ``bounds = exp_bounds(exp_powers(ratio))`` (..., 7)."""
    x = w.abs() / base
    m = torch.zeros_like(x, dtype=torch.int64)
    for j in range(EXP_LEVELS - 1):
        m += x > bounds[..., j]
    return torch.where((w < 0) & (m > 0), m + EXP_LEVELS, m)


def _levels(m: Tensor, base: Tensor, ratio: Tensor) -> Tensor:
    """Magnitudes ``s * r**(m-1)`` (0 for m = 0) of indices m (out, n_groups, G); gathering
    powers times the base, not the LUT, gives the base its gradient per weight."""
    powers = exp_powers(ratio)[:, :, None, :]  # (out, n_groups, 1, 8)
    return base * torch.gather(powers.expand(*m.shape, -1), -1, m[..., None]).squeeze(-1)


@dataclass(frozen=True)
class ExpCodec:
    """4-bit exponential codes; ``(p1, p2) = (base, ratio)``."""

    kind: ClassVar[str] = "exp"
    bits: ClassVar[int] = 4

    @property
    def param_bits(self) -> int:
        """fp16 base ``s`` and fp16 ratio ``r`` (the LUT is derived from them, not stored)."""
        return 2 * SCALE_BITS

    @property
    def lsq_levels(self) -> int:
        return EXP_LEVELS - 1

    def fit(self, wg: Tensor, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Grid-search fp16 ``(base, ratio)`` per group (..., G); top level = clip * max|w|."""
        a = wg.abs()
        amax = a.amax(-1)
        best_err = torch.full_like(amax, float("inf"))
        best_s, best_r = torch.ones_like(amax), torch.ones_like(amax)
        for r in EXP_RATIOS:
            rt = torch.tensor(r, dtype=wg.dtype, device=wg.device)
            powers = exp_powers(rt)
            levels, bounds = powers.tolist(), exp_bounds(powers).tolist()
            for clip in EXP_CLIPS:
                s = to_fp16(amax * clip / powers[-1])
                err = torch.empty_like(s)
                for rows, ach, weight_ch in row_chunks(a, weight):
                    s_ = s[rows, ..., None]
                    x = torch.div(ach, s_)
                    mag, step = torch.zeros_like(x), torch.empty_like(x)
                    for j, bound in enumerate(bounds):
                        # step = [x > bound] * level with float ops (faster than masks);
                        # bounds ascend, so the running max is the level encode picks.
                        torch.sub(x, bound, out=step).clamp_(0, 1).ceil_().mul_(levels[j + 1])
                        torch.maximum(mag, step, out=mag)
                    mag.mul_(s_).sub_(ach).square_()
                    if weight_ch is not None:
                        mag.mul_(weight_ch)
                    err[rows] = mag.sum(-1)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s = torch.where(better, s, best_s)
                best_r = torch.where(better, rt, best_r)
        return best_s, best_r

    def encode(self, w: Tensor, base: Tensor, ratio: Tensor) -> Tensor:
        return _encode_bounds(w, base, exp_bounds(exp_powers(ratio)))

    def decode(self, codes: Tensor, base: Tensor, ratio: Tensor) -> Tensor:
        lut = exp_lut(base, ratio)
        shape = torch.broadcast_shapes(codes.shape, lut.shape[:-1])
        idx = codes.expand(shape)[..., None]
        return torch.gather(lut.expand(*shape, -1), -1, idx).squeeze(-1)

    def rounder(self, base: Tensor, ratio: Tensor) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
        bounds, lut = exp_bounds(exp_powers(ratio)), exp_lut(base, ratio)

        def round_(w: Tensor) -> tuple[Tensor, Tensor]:
            codes = _encode_bounds(w, base, bounds)
            return codes, torch.gather(lut, -1, codes[..., None]).squeeze(-1)

        return round_

    def store(self, base: Tensor, ratio: Tensor) -> tuple[Tensor, None, Tensor]:
        return base.half(), None, ratio.half()

    def load(
        self, scales: Tensor, zeros: Tensor | None, ratios: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        return scales.float(), ratios.float()

    def dequantize(self, codes: Tensor, base: Tensor, ratio: Tensor, group_len: int) -> Tensor:
        idx = to_groups(codes.long(), group_len)  # (out, n_groups, G)
        w = torch.gather(exp_lut(base, ratio), -1, idx)
        return w.flatten(1)[:, : codes.shape[1]]

    def lut(self, base: Tensor, ratio: Tensor) -> Tensor:
        return exp_lut(base, ratio)

    def trained(
        self, scale: Tensor, zero: Tensor | None, ratio: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """fp16 base by STE; the ratio as fitted."""
        return Fp16STE.apply(scale), ratio

    def fake_quant(self, wg: Tensor, base: Tensor, ratio: Tensor) -> Tensor:
        """Nearest level forward; the base gets ``W_hat / s``, the weight a straight-through
        gradient up to the top level (none past it, as for a clipped int weight)."""
        s = base[..., None]
        with torch.no_grad():
            m = self.encode(wg, s, ratio[..., None]) % EXP_LEVELS
        mag = _levels(m, s, ratio)
        top = s * exp_powers(ratio)[..., -1:]  # (out, n_groups, 1)
        inside = (wg.abs() <= top).float()
        return torch.where(wg < 0, -mag, mag) + (wg - wg.detach()) * inside

    def fake_decode(self, cg: Tensor, base: Tensor, ratio: Tensor) -> Tensor:
        c = cg.long()
        w = _levels(c % EXP_LEVELS, base[..., None], ratio)
        return torch.where(c >= EXP_LEVELS, -w, w)
