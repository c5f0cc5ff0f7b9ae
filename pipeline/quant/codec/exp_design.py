"""The method's own exponential grid: ``scale = max * 2/3``, ``exp_base = log2(scale) / 14``,
exponents clamped to [-6, 7], as an option beside :class:`ExpCodec`'s searched grid.

Per group, ``s = 2/3 * max|w|`` and the log2 step between levels is ``b = |log2 s| / 14`` (the
formula's ``log2(scale)``, negative for weights below 1, taken by magnitude): level ``e`` is
``s * 2**(b * e)``, ``-6 <= e <= 7``. A 4-bit code holds a sign and eight magnitudes, zero and
seven levels, not the formula's fourteen exponents: the grid keeps the exponent the group's
largest weight rounds to (``round(log2(max / s) / b)``, clamped to 7) and the six below it.
That is exp4's layout, ``base * ratio**k`` with ``ratio = 2**b``, so storage, rounding (nearest
level), QAT and the runtime's 16-entry LUT kernel are exp4's unchanged. The ratio is rounded to
1/256 (between 1 + 1/256 and 2): a layer then holds at most 256 distinct tables, the LUT
kernel's byte index. Trade-off: no search, and a grid whose span follows the weights' absolute
magnitude (``b`` shrinks as ``s`` nears 1), not their shape.
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
