"""Counters of a speculative (or plain) decoding run and the rates derived from them.

``acceptance_rate`` (accepted / drafted) counts drafts after the first rejection, never
tested; ``alpha_hat`` averages beta over tested positions, an unbiased estimate of alpha.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["SpecStats", "decode_prompts", "pair_name"]


def pair_name(draft: str, target: str) -> str:
    """The key of a (draft, target) pair in every table of results: ``<draft>@<target>``."""
    return f"{draft}@{target}"


@dataclass
class SpecStats:
    """Counters of one or more decoding runs (merge runs with :meth:`merge`).

    ``target_calls`` excludes the prompt prefill; ``seconds`` includes it, and
    ``prefill_seconds`` is the target's forward of the prompt alone (plain decoding: with its
    first token), so ``seconds - prefill_seconds`` times the decoding of one pass. ``beta_*`` sum
    beta over tested positions; ``position_*`` count accepted / tested per draft position.
    """

    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    beta_sum: float = 0.0
    beta_count: int = 0
    position_accepted: list[int] = field(default_factory=list)
    position_verified: list[int] = field(default_factory=list)
    gammas: list[int] = field(default_factory=list)

    def record_round(self, gamma: int, n_accepted: int, n_new: int, betas: list[float]) -> None:
        """Add one round: ``gamma`` drafted (0: a plain step), ``n_accepted``, ``n_new`` emitted
        and beta at each of the min(n_accepted + 1, gamma) tested positions.
        """
        self.drafted += gamma
        self.draft_calls += gamma
        self.accepted += n_accepted
        self.target_calls += 1
        self.new_tokens += n_new
        self.beta_sum += float(sum(betas))
        self.beta_count += len(betas)
        if gamma:
            self.gammas.append(gamma)
        grow = len(betas) - len(self.position_verified)
        if grow > 0:
            self.position_verified.extend([0] * grow)
            self.position_accepted.extend([0] * grow)
        for k in range(len(betas)):
            self.position_verified[k] += 1
            self.position_accepted[k] += int(k < n_accepted)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha_hat(self) -> float:
        """Mean expected acceptance over verified positions."""
        return self.beta_sum / self.beta_count if self.beta_count else 0.0

    @property
    def tau(self) -> float:
        """New tokens per target forward (acceptance length, bonus token included)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Emitted tokens per wall-clock second."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """Empirical acceptance probability at each draft position, given it was tested."""
        return [a / v if v else 0.0 for a, v in zip(self.position_accepted, self.position_verified)]

    def merge(self, other: SpecStats) -> SpecStats:
        """Sum of two runs' counters (e.g. over the prompts of a scenario)."""
        out = SpecStats(
            **{
                k: getattr(self, k) + getattr(other, k)
                for k in ("drafted", "accepted", "target_calls", "draft_calls", "new_tokens")
            },
            seconds=self.seconds + other.seconds,
            prefill_seconds=self.prefill_seconds + other.prefill_seconds,
            beta_sum=self.beta_sum + other.beta_sum,
            beta_count=self.beta_count + other.beta_count,
            gammas=self.gammas + other.gammas,
        )
        n = max(len(self.position_verified), len(other.position_verified))

        def add(a: list[int], b: list[int]) -> list[int]:
            return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]

        out.position_accepted = add(self.position_accepted, other.position_accepted)
        out.position_verified = add(self.position_verified, other.position_verified)
        return out


def decode_prompts(fn, prompts: Iterable[torch.Tensor], seed: int) -> SpecStats:
    """Merged stats of ``fn(prompt, generator)`` over the prompts, prompt i seeded seed + i."""
    total = SpecStats()
    for i, prompt in enumerate(prompts):
        # The same seed per prompt for every model, so plain and speculative runs draw alike.
        _, stats = fn(prompt, torch.Generator(device=prompt.device).manual_seed(seed + i))
        total = total.merge(stats)
    return total
