"""Adaptive draft length from a sliding-window acceptance estimate.

After every round alpha is re-estimated over the last ``window`` rounds (accepted / tested
positions, the truncated-geometric MLE, Laplace-smoothed) and the next gamma maximises
Leviathan et al.'s expected speed-up (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + v(gamma)))
with measured c and v (``pipeline.speculative.cost``): no thresholds to tune.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from pipeline.speculative.metrics import theoretical_speedup

__all__ = ["AdaptiveGamma"]


class AdaptiveGamma:
    """Chooses the draft length for the next round from the last ``window`` rounds' acceptance.

    ``cost_ratio`` c and ``verify_cost`` {gamma: v} (default 1) are measured
    (``pipeline.speculative.cost``); a guessed c picks the wrong gamma.
    """

    def __init__(
        self,
        gamma_min: int = 2,
        gamma_max: int = 5,
        window: int = 64,
        *,
        cost_ratio: float,
        initial_gamma: int | None = None,
        verify_cost: Mapping[int, float] | None = None,
    ) -> None:
        if not 1 <= gamma_min <= gamma_max:
            raise ValueError(
                f"need 1 <= gamma_min <= gamma_max, got gamma_min={gamma_min}, "
                f"gamma_max={gamma_max}"
            )
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if cost_ratio < 0:
            raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
        self.gamma_min = gamma_min
        self.gamma_max = gamma_max
        self.cost_ratio = cost_ratio
        self.verify_cost = dict(verify_cost or {})
        start = (gamma_min + gamma_max) // 2 if initial_gamma is None else initial_gamma
        self.gamma = min(max(start, gamma_min), gamma_max)
        self._rounds: deque[tuple[int, int]] = deque(maxlen=window)
        self.history: list[int] = []  # gamma used by each round

    @property
    def alpha(self) -> float:
        """Smoothed acceptance estimate over the window."""
        accepted = sum(a for a, _ in self._rounds)
        verified = sum(v for _, v in self._rounds)
        return (accepted + 1.0) / (verified + 2.0)

    def update(self, accepted: int, verified: int) -> int:
        """Record one round (accepted drafts, positions tested) and return the next gamma."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"need 0 <= accepted <= verified, got {accepted}, {verified}")
        self.history.append(self.gamma)
        self._rounds.append((accepted, verified))
        alpha = self.alpha
        self.gamma = max(
            range(self.gamma_min, self.gamma_max + 1),
            key=lambda g: theoretical_speedup(
                alpha, g, self.cost_ratio, self.verify_cost.get(g, 1.0)
            ),
        )
        return self.gamma
