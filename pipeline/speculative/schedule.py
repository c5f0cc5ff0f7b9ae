"""The draft's sampling temperature schedule, shared by training rollouts and decoding.

Verification tests each proposal against the distribution it was drawn from, so the schedule
changes acceptance only, never the output distribution.
"""

from __future__ import annotations

import math

__all__ = ["draft_temperature"]


def draft_temperature(step: int, t0: float = 1.0) -> float:
    """Draft sampling temperature schedule T = T0 * (1 + 0.1 * cos(step / 1000))."""
    return t0 * (1.0 + 0.1 * math.cos(step / 1000.0))
