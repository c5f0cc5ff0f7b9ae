"""Keep-best decisions that hold: a paired bootstrap of the trained model's gain over its input.

A training stage scores its input and every check on the same fixed validation windows, so the
two models' scores pair up window by window. Resampling the windows (Efron & Tibshirani's paired
bootstrap) and recomputing the mean gain each time gives the gain's spread from window-to-window
noise; the trained model replaces the input only when the one-sided lower bound of that gain is
above `min_gain`. A mean difference inside the noise keeps the input: handing on a model that
is worse on text the stage never saw costs more than a gain too small to measure.

Windows may come in groups that weigh alike (reinforce's scenarios): the statistic is the mean of
the group means, and each resample draws windows within each group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class KeepConfig:
    """`stage.<name>.keep`: when a trained check replaces the stage's input."""

    confidence: float = 0.95  # one-sided level of the gain's lower bound
    min_gain: float = 0.0  # the lower bound must exceed this (in the score's units)
    resamples: int = 2000

    def check(self, prefix: str) -> None:
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"{prefix}.confidence", f"is {self.confidence}", "0.5 <= c < 1")
        if self.min_gain < 0:
            raise ConfigError(f"{prefix}.min_gain", f"must be >= 0, got {self.min_gain}")
        if self.resamples < 100:
            # Fewer leave the tail quantile to a handful of draws.
            raise ConfigError(f"{prefix}.resamples", f"is {self.resamples}", ">= 100")


@dataclass(frozen=True)
class Margin:
    """The chosen check against the input: its mean gain (positive: better) and the bounds."""

    gain: float
    low: float  # one-sided `confidence` lower bound of the gain
    high: float  # one-sided `confidence` upper bound
    windows: int
    resamples: int
    confidence: float
    min_gain: float

    @property
    def trained(self) -> bool:
        """Whether the gain holds: its lower bound is above `min_gain` (NaN never holds)."""
        return self.low > self.min_gain

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    @property
    def unresolved(self) -> bool:
        """The noise is larger than the difference measured: more windows would tell."""
        return self.half_width > abs(self.gain)

    def metrics(self) -> dict[str, float]:
        """The stage metrics (`_done.json`, MLflow) of the decision."""
        return {
            "keep_gain": self.gain,
            "keep_ci_low": self.low,
            "keep_ci_high": self.high,
            "keep_windows": float(self.windows),
            "keep_resamples": float(self.resamples),
            "keep_confidence": self.confidence,
        }

    def describe(self) -> dict:
        return asdict(self) | {"trained": self.trained}

    @classmethod
    def load(cls, described: dict) -> Margin:
        """The margin `describe` wrote (in a report)."""
        return cls(**{f.name: described[f.name] for f in fields(cls)})

    def text(self) -> str:
        return (
            f"gain {self.gain:+.4g}, {self.confidence:.0%} bounds [{self.low:+.4g}, "
            f"{self.high:+.4g}] over {self.windows} windows ({self.resamples} paired resamples)"
        )


def paired_bootstrap(
    before: Sequence[float],
    after: Sequence[float],
    *,
    larger_is_better: bool,
    keep: KeepConfig,
    seed: int,
    groups: Sequence[int] | None = None,
) -> Margin:
    """The gain of `after` over `before` (scores of the same windows, in the same order) and its
    bounds from `keep.resamples` resamples of the windows, drawn with `seed`."""
    a, b = np.asarray(after, dtype=np.float64), np.asarray(before, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired scores need equal non-empty 1-D shapes, got {a.shape}, {b.shape}")
    diff = (a - b) if larger_is_better else (b - a)  # (W,) positive: the trained check is better
    labels = np.zeros(diff.size, dtype=np.int64) if groups is None else np.asarray(groups)
    rng = np.random.default_rng(seed)
    gain, draws = 0.0, np.zeros(keep.resamples)
    members = [np.flatnonzero(labels == g) for g in np.unique(labels)]
    for idx in members:
        gain += diff[idx].mean() / len(members)
        picks = rng.integers(0, idx.size, (keep.resamples, idx.size))  # (R, n_g)
        draws += diff[idx][picks].mean(axis=1) / len(members)
    tail = 1 - keep.confidence
    low, high = np.quantile(draws, [tail, keep.confidence])
    return Margin(
        float(gain),
        float(low),
        float(high),
        int(diff.size),
        keep.resamples,
        keep.confidence,
        keep.min_gain,
    )
