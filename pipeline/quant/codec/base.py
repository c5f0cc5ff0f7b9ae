"""What every codec shares: fp16 group parameters, the group layout, chunked search, STE rounding.

Column ``j`` of an ``(out, in)`` weight is in group ``j // G``. Parameters are stored in fp16, so
searches round candidates to fp16 (``to_fp16``) before scoring: what is scored is what is stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol

import torch
from torch import Tensor

SCALE_BITS = 16  # every group parameter (int scale, exp base and ratio) is one fp16
FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal); scales never go below it
FP16_MAX = 65504.0
CHUNK = 1 << 18  # elements per search chunk (1 MiB of float32)


class Codec(Protocol):
    """One format family's math. ``p1, p2``: a group's float32 ``(scale, zero)`` or ``(base,
    ratio)``, broadcast against ``w``/``codes``; ``(out, in)`` methods take ``(out, n_groups)``."""

    kind: ClassVar[str]  # the Format.kind it serves: "int" or "exp"

    @property
    def param_bits(self) -> int:
        """Stored bits of one group's parameters."""
        ...

    @property
    def lsq_levels(self) -> int:
        """Positive code levels ``Q_P``, for LSQ's step-size gradient scale."""
        ...

    def fit(self, wg: Tensor, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Parameters of groups ``wg`` (..., G), each of shape ``wg.shape[:-1]``."""
        ...

    def encode(self, w: Tensor, p1: Tensor, p2: Tensor) -> Tensor:
        """int64 codes of ``w``."""
        ...

    def decode(self, codes: Tensor, p1: Tensor, p2: Tensor) -> Tensor:
        """float32 weights of ``codes``."""
        ...

    def rounder(self, p1: Tensor, p2: Tensor) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
        """``w -> (codes, decoded)`` for fixed parameters, tables built once (GPTQ's columns)."""
        ...

    def store(self, p1: Tensor, p2: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """QTensor's ``(scales, zeros, ratios)`` of the parameters."""
        ...

    def load(
        self, scales: Tensor, zeros: Tensor | None, ratios: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Inverse of ``store``: float32 ``(p1, p2)`` (a symmetric int zero is 0-dim)."""
        ...

    def dequantize(self, codes: Tensor, p1: Tensor, p2: Tensor, group_len: int) -> Tensor:
        """(out, in) float32 weight of (out, in) codes under (out, n_groups) parameters."""
        ...

    def lut(self, p1: Tensor, p2: Tensor) -> Tensor | None:
        """(..., 2**bits) decoded value of every code, for table-driven families; else None."""
        ...

    def trained(
        self, scale: Tensor, zero: Tensor | None, ratio: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(p1, p2)`` of FakeQuantLinear's trainable state, differentiable by STE."""
        ...

    def fake_quant(self, wg: Tensor, p1: Tensor, p2: Tensor) -> Tensor:
        """Quantize-dequantize float groups (out, n_groups, G); STE/LSQ gradients."""
        ...

    def fake_decode(self, cg: Tensor, p1: Tensor, p2: Tensor) -> Tensor:
        """Decode frozen code groups (out, n_groups, G), differentiable in the parameters."""
        ...


def to_fp16(x: Tensor, round_down: bool = False) -> Tensor:
    """Round to the nearest (or the next lower) positive fp16 value, returned in float32."""
    h = x.clamp(FP16_TINY, FP16_MAX).to(torch.float16)
    if round_down:  # for positive floats, bit pattern - 1 is the next lower value
        lower = (h.view(torch.int16) - 1).view(torch.float16)
        h = torch.where(h.float() > x, lower, h)
    return h.float().clamp_min(FP16_TINY)


def to_groups(w: Tensor, group_len: int) -> Tensor:
    """(out, in) -> (out, n_groups, group_len), zero-padded (harmless: every grid holds 0)."""
    out, n_in = w.shape
    pad = (-n_in) % group_len
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out, -1, group_len)


def expand_groups(p: Tensor, group_len: int, n_in: int) -> Tensor:
    """(out, n_groups) group parameters -> (out, n_in), one value per column."""
    return p.repeat_interleave(group_len, dim=-1)[..., :n_in]


def row_chunks(wg: Tensor, weight: Tensor | None) -> Iterator[tuple[slice, Tensor, Tensor | None]]:
    """Yield ``(rows, wg_chunk, weight_chunk)`` slices of about ``CHUNK`` elements (cache-sized)."""
    per_row = max(1, wg[0].numel()) if wg.dim() > 1 else 1
    step = max(1, CHUNK // per_row)
    for i in range(0, wg.shape[0], step):
        rows = slice(i, i + step)
        wch = None
        if weight is not None:
            wch = weight if weight.dim() < wg.dim() or weight.shape[0] == 1 else weight[rows]
        yield rows, wg[rows], wch


class RoundSTE(torch.autograd.Function):
    """round() forward (bit exact), identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class Fp16STE(torch.autograd.Function):
    """Round to the nearest positive fp16 value forward (what is stored), identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return to_fp16(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad
