"""The draft's sampling temperature schedule, shared by training rollouts and decoding.

T(step) = T0 * (1 + 0.1 * cos(step / 1000)): the draft samples slightly hotter or colder than
T0 over a slow period (~6300 steps). In the reinforce stage it varies how sharp the on-policy
proposals are; at decode time it does the same over the decoding steps of a generation.
Verification stays exact either way: each proposal is tested against the distribution it was
actually drawn from (``pipeline.speculative.sampling.verify_draft``), so only acceptance, never
the output distribution, depends on it. T0 = 0 (greedy) stays 0 at every step.
"""

from __future__ import annotations

import math

__all__ = ["draft_temperature"]


def draft_temperature(step: int, t0: float = 1.0) -> float:
    """Draft sampling temperature schedule T = T0 * (1 + 0.1 * cos(step / 1000))."""
    return t0 * (1.0 + 0.1 * math.cos(step / 1000.0))
