"""The method's literal exponential grid (scale = 2/3·max, exp_base = log2(scale)/14, exponents in
[-6, 7]) in exp4's ``base * ratio**k`` layout, so storage, QAT and the LUT kernel are exp4's.

A 4-bit code holds zero and seven levels: the exponent the group's largest weight rounds to and
the six below it; ratios on a 1/256 grid (the LUT kernel's 256 tables). docs/method.md compares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.quant.codec.base import FP16_TINY, to_fp16
from pipeline.quant.codec.exponential import EXP_LEVELS, ExpCodec

DESIGN_SCALE = 2.0 / 3.0  # scale = max * 2/3
DESIGN_STEPS = 14  # exp_base = log2(scale) / 14
DESIGN_EXPONENTS = (-6, 7)  # exponents clamped to this range
RATIO_STEP = 1.0 / 256  # ratios on this grid: at most 256 per layer (the LUT kernel's tables)


def design_grid(amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(scale, ratio, top exponent) of groups whose largest magnitude is ``amax`` (...,).

    ``ratio`` is ``2**(|log2 scale| / 14)`` on the 1/256 grid; the top exponent is where
    ``amax`` rounds to on that ratio's log2 grid, within ``DESIGN_EXPONENTS``.
    """
    lo, hi = DESIGN_EXPONENTS
    s = to_fp16(amax.clamp_min(FP16_TINY) * DESIGN_SCALE)
    step = torch.log2(s).abs() / DESIGN_STEPS
    ratio = torch.round((torch.exp2(step) - 1) / RATIO_STEP).clamp(1, 1 / RATIO_STEP)
    ratio = 1 + ratio * RATIO_STEP  # exact in fp16
    log_top = torch.log2(amax.clamp_min(FP16_TINY) / s) / torch.log2(ratio)
    top = torch.round(log_top).clamp(lo + EXP_LEVELS - 2, hi)
    return s, ratio, top


@dataclass(frozen=True)
class ExpDesignCodec(ExpCodec):
    """exp4 codes on the method's formula grid; ``(p1, p2) = (base, ratio)`` as exp4's."""

    def fit(self, wg: Tensor, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """fp16 ``(base, ratio)`` per group (..., G) by the formula; ``weight`` is not used."""
        s, ratio, top = design_grid(wg.abs().amax(-1))
        lowest = top - (EXP_LEVELS - 2)  # seven magnitudes: exponents lowest .. top
        return to_fp16(s * ratio.pow(lowest)), ratio
