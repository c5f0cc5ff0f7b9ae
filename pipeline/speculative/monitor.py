"""Sliding-window acceptance monitor: the reinforce stage's "dynamic strategy".

Acceptance can fall while the loss looks fine. A fall of the newer half of the window's mean
below the older half's (halves: one step's batch swings with its scenario) by more than
``threshold`` tells the caller to lower the learning rate; the window then starts over.
"""

from __future__ import annotations

from collections import deque

__all__ = ["AcceptanceMonitor"]


class AcceptanceMonitor:
    """Windowed acceptance (``window`` >= 2 steps) and the fall detector (``threshold``)."""

    def __init__(self, window: int, threshold: float | None = None) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if threshold is not None and threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self.threshold = threshold
        self.values: deque[float] = deque(maxlen=window)
        self.drops = 0  # drops detected so far

    @property
    def mean(self) -> float:
        """Mean acceptance over the window (0 while it is empty)."""
        return sum(self.values) / len(self.values) if self.values else 0.0

    @property
    def fall(self) -> float:
        """Older-half mean minus newer-half mean of a full window (positive = falling), else 0."""
        if len(self.values) < self.values.maxlen:
            return 0.0
        vals = list(self.values)
        half = len(vals) // 2
        return sum(vals[:half]) / half - sum(vals[-half:]) / half

    def update(self, alpha: float) -> bool:
        """Record one step's acceptance; True on a drop (the window then starts over)."""
        self.values.append(float(alpha))
        if self.threshold is None or self.fall <= self.threshold:
            return False
        self.drops += 1
        self.values.clear()
        return True

    def state_dict(self) -> dict:
        return {"window": list(self.values), "drops": self.drops}

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.extend(state.get("window", []))
        self.drops = state.get("drops", 0)
