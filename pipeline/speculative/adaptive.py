"""Adaptive draft length from a sliding-window acceptance estimate, down to plain decoding.

After every round alpha is re-estimated over the last ``window`` rounds (accepted / tested
positions, the truncated-geometric MLE, Laplace-smoothed) and the next gamma maximises
Leviathan et al.'s expected speed-up (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + v(gamma)))
with measured c and v (``pipeline.speculative.cost``): no thresholds to tune.

Gamma 0 is plain decoding (speed-up 1). With ``allow_plain`` it is chosen when no gamma in
[gamma_min, gamma_max] is expected to pay. Plain steps test no draft token, so after
``probe_every`` plain tokens one round is drafted at the best gamma to refresh alpha; each probe
that leaves decoding plain doubles that gap (up to ``MAX_BACKOFF`` times): a probe costs the
draft's catch-up and a round, 10-15% of plain decoding at a fixed 16-token gap for a draft that
costs near a target step. Speculating again resets the gap.

``timed``: the decoder reports each steady round's wall time (not a probe's: it includes the
draft's catch-up), and a gamma's expected speed-up is priced with the measured ``overhead``
(median round time / median plain-step time, over the model's gamma c + v), which covers each
round's fixed work the model leaves out. A timed controller takes a few one-off plain steps
early (``plain_samples``, one every fourth drafted round) to time the plain side.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping

from pipeline.speculative.metrics import theoretical_speedup

__all__ = ["AdaptiveGamma"]

MAX_BACKOFF = 16  # the longest gap between probes, in probe_every


class AdaptiveGamma:
    """Chooses the draft length for the next round from the last ``window`` rounds' acceptance.

    ``cost_ratio`` c and ``verify_cost`` {gamma: v} (default 1) are measured
    (``pipeline.speculative.cost``); a guessed c picks the wrong gamma. ``gamma`` 0 (only with
    ``allow_plain``) asks for a plain target step; after ``probe_every`` plain steps (more, as
    probes find nothing new) one speculative round at the best gamma probes the draft.
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
        allow_plain: bool = True,
        probe_every: int = 16,
        timed: bool = False,
        plain_samples: int = 3,
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
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.gamma_min = gamma_min
        self.gamma_max = gamma_max
        self.cost_ratio = cost_ratio
        self.verify_cost = dict(verify_cost or {})
        self.allow_plain = allow_plain
        self.probe_every = probe_every
        start = (gamma_min + gamma_max) // 2 if initial_gamma is None else initial_gamma
        self.gamma = min(max(start, gamma_min), gamma_max)
        self._rounds: deque[tuple[int, int]] = deque(maxlen=window)
        self._plain_run = 0  # plain steps since the last drafted round
        self._gap = probe_every  # plain steps before the next probe (backs off, see above)
        self._probing = False  # the current drafted round is a probe
        self.history: list[int] = []  # gamma used by each round (0: a plain step)
        self.timed, self.plain_samples = timed, plain_samples
        self._seconds: dict[int, deque[float]] = {}  # gamma (0: plain) -> recent round times
        self._drafted = 0  # drafted rounds so far
        self._timing_plain = False  # the current plain step is a one-off timing sample

    @property
    def alpha(self) -> float:
        """Smoothed acceptance estimate over the window."""
        accepted = sum(a for a, _ in self._rounds)
        verified = sum(v for _, v in self._rounds)
        return (accepted + 1.0) / (verified + 2.0)

    def speedup(self, gamma: int) -> float:
        """Expected speed-up of ``gamma`` at the current alpha (gamma 0: plain decoding, 1),
        priced with the measured overhead when ``timed``."""
        if gamma == 0:
            return 1.0
        v = self.verify_cost.get(gamma, 1.0)
        return float(theoretical_speedup(self.alpha, gamma, self.cost_ratio, v)) / self.overhead(
            gamma
        )

    def overhead(self, gamma: int) -> float:
        """What a ``gamma`` round really costs over the model's gamma c + v plain steps: from its
        own timed rounds, else the median over the timed gammas, else 1 (untimed)."""
        plain = self._median(0)
        if plain is None:
            return 1.0
        ratios = {
            g: self._median(g) / (plain * (g * self.cost_ratio + self.verify_cost.get(g, 1.0)))
            for g in self._seconds
            if g > 0
        }
        if gamma in ratios:
            return ratios[gamma]
        return statistics.median(ratios.values()) if ratios else 1.0

    def _median(self, gamma: int) -> float | None:
        times = self._seconds.get(gamma)
        return statistics.median(times) if times else None

    def best_gamma(self) -> int:
        """The draft length in [gamma_min, gamma_max] with the highest expected speed-up."""
        return max(range(self.gamma_min, self.gamma_max + 1), key=self.speedup)

    def update(self, accepted: int, verified: int, seconds: float | None = None) -> int:
        """Record one round (accepted drafts, positions tested, its wall time if timed) and
        return the next gamma; ``verified`` 0 is a plain step, which leaves the window alone."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"need 0 <= accepted <= verified, got {accepted}, {verified}")
        self.history.append(self.gamma)
        if self.timed and seconds is not None:
            self._seconds.setdefault(self.gamma, deque(maxlen=16)).append(seconds)
        if verified == 0:
            self._plain_run += 1
            if self._timing_plain:  # a one-off sample: back to the best choice
                self._timing_plain = False
                self.gamma = self._choose()
            elif self.gamma == 0 and self._plain_run >= self._gap:
                self.gamma = self.best_gamma()  # one probe round refreshes alpha
                self._probing = True
            return self.gamma
        self._plain_run = 0
        probe, self._probing = self._probing, False
        self._rounds.append((accepted, verified))
        self._drafted += 1
        # time a plain step now and then: the other side of every comparison
        sampled = len(self._seconds.get(0, ()))
        if (
            self.timed
            and self.allow_plain
            and sampled < self.plain_samples
            and self._drafted % 4 == 0
        ):
            self._timing_plain = True
            self.gamma = 0
            return self.gamma
        self.gamma = self._choose()
        back_off = probe and self.gamma == 0  # the probe changed nothing: wait longer
        longest = MAX_BACKOFF * self.probe_every
        self._gap = min(2 * self._gap, longest) if back_off else self.probe_every
        return self.gamma

    def _choose(self) -> int:
        best = self.best_gamma()
        return 0 if self.allow_plain and self.speedup(best) < 1.0 else best
