"""Integer codes: uniform quantization with a per-group scale and zero point (GPTQ/AWQ style).

``c = clamp(round(w / s) + z, 0, 2**b - 1)``, decoded as ``(c - z) * s``. Asymmetric formats fit
``z`` per group and store it as a b-bit code; symmetric ones fix ``z = 2**(b-1)``, so ``c - z``
spans ``[-2**(b-1), 2**(b-1) - 1]``. Fit: min-max, or with an importance weighting the clipping
ratio minimising ``sum_j h_j (w_j - q_j)^2``. Candidates are scored with the scale as stored
(fp16, rounded toward zero so the largest magnitude lands on the extreme code), so weights
already on a grid re-quantize to themselves (that candidate has error exactly zero).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pipeline.quant.codec.base import (
    SCALE_BITS,
    Fp16STE,
    RoundSTE,
    expand_groups,
    row_chunks,
    to_fp16,
)

INT_CLIPS = tuple(1.0 - 0.025 * i for i in range(21))  # 1.0 .. 0.5


def _cols(p: Tensor) -> Tensor:
    """(out, n_groups) -> (out, n_groups, 1) to broadcast over a group; a 0-dim zero as is."""
    return p[..., None] if p.dim() else p


@dataclass(frozen=True)
class IntCodec:
    """``bits``-bit unsigned codes; ``(p1, p2) = (scale, zero)``, zero in code units."""

    bits: int
    symmetric: bool
    kind: ClassVar[str] = "int"

    @property
    def maxq(self) -> int:
        """Largest code (``2**bits - 1``)."""
        return (1 << self.bits) - 1

    @property
    def origin(self) -> int:
        """The fixed zero point of symmetric formats, ``2**(bits-1)``: signed code 0."""
        return 1 << (self.bits - 1)

    @property
    def param_bits(self) -> int:
        """fp16 scale, plus a ``bits``-bit zero point for asymmetric formats."""
        return SCALE_BITS + (0 if self.symmetric else self.bits)

    @property
    def lsq_levels(self) -> int:
        return self.origin - 1 if self.symmetric else self.maxq

    def fit(self, wg: Tensor, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Scale and zero per group (..., G): min-max, or with ``weight`` the clipping that
        minimises the weighted error.

        Returns ``(scale, zero)`` of shape ``wg.shape[:-1]``: fp16-representable float32 scales and
        integer-valued float32 zero points (the origin for symmetric formats).
        """
        half, maxq = float(self.origin), self.maxq
        # Unweighted, the weight-MSE optimum clips the largest weights, which matter most.
        clips = INT_CLIPS if weight is not None else (1.0,)
        xmin = wg.amin(-1).clamp_max(0)  # the grid always contains 0
        xmax = wg.amax(-1).clamp_min(0)
        if self.symmetric:
            base = torch.maximum(xmax / (half - 1), -xmin / half)
        else:
            base = (xmax - xmin) / maxq
        best_err = torch.full_like(xmax, float("inf"))
        best_s, best_z = torch.ones_like(xmax), torch.full_like(xmax, half)
        for clip in clips:
            s = to_fp16(base * clip, round_down=True)
            if self.symmetric:
                z = torch.full_like(s, half)
            else:
                z = torch.round(-xmin * clip / s).clamp(0, maxq)
            err = torch.empty_like(s)
            for rows, wch, weight_ch in row_chunks(wg, weight):
                s_, z_ = s[rows, ..., None], z[rows, ..., None]
                buf = torch.div(wch, s_)
                # same operations, in the same order, as decode(encode(...)):
                buf.round_().add_(z_).clamp_(0, maxq).sub_(z_).mul_(s_).sub_(wch).square_()
                if weight_ch is not None:
                    buf.mul_(weight_ch)
                err[rows] = buf.sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s, best_s)
            best_z = torch.where(better, z, best_z)
        return best_s, best_z

    def encode(self, w: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        return torch.clamp(torch.round(w / scale) + zero, 0, self.maxq).long()

    def decode(self, codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        return (codes.float() - zero) * scale

    def rounder(self, scale: Tensor, zero: Tensor) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
        def round_(w: Tensor) -> tuple[Tensor, Tensor]:
            codes = self.encode(w, scale, zero)
            return codes, self.decode(codes, scale, zero)

        return round_

    def store(self, scale: Tensor, zero: Tensor) -> tuple[Tensor, Tensor | None, None]:
        return scale.half(), None if self.symmetric else zero.to(torch.uint8), None

    def load(
        self, scales: Tensor, zeros: Tensor | None, ratios: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        if zeros is not None:
            return scales.float(), zeros.float()
        return scales.float(), torch.tensor(float(self.origin), device=scales.device)

    def dequantize(self, codes: Tensor, scale: Tensor, zero: Tensor, group_len: int) -> Tensor:
        n_in = codes.shape[1]
        scale = expand_groups(scale, group_len, n_in)
        zero = expand_groups(zero, group_len, n_in) if zero.dim() else zero
        return (codes.float() - zero) * scale

    def lut(self, scale: Tensor, zero: Tensor) -> None:
        return None

    def signed(self, codes: Tensor, scale: Tensor, zero: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Ascend convention ``W = (q - offset) * scale``, q signed int8: an exact re-centering."""
        q = (codes.to(torch.int16) - self.origin).to(torch.int8)
        offset = (zero - self.origin).expand(scale.shape).float().contiguous()
        return q, scale, offset

    def trained(
        self, scale: Tensor, zero: Tensor | None, ratio: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """fp16 scale and integer zero (learned in code units, LSQ+ style), by STE."""
        s = Fp16STE.apply(scale)
        if zero is None:
            return s, torch.tensor(float(self.origin), device=s.device)
        return s, RoundSTE.apply(zero).clamp(0, self.maxq)

    def fake_quant(self, wg: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        """LSQ: with ``v = w / s``, ``d W_hat / d s = round(v) - v`` inside the clip range and
        the clip point's code distance from the zero outside; weight gradient passed inside."""
        s, z = scale[..., None], _cols(zero)
        codes = torch.clamp(RoundSTE.apply(wg / s) + z, 0, self.maxq)
        return (codes - z) * s

    def fake_decode(self, cg: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        """``(codes - z) * s``: the scale gets the exact gradient ``codes - z``."""
        return (cg.float() - _cols(zero)) * scale[..., None]
