"""Reward and loss terms for acceptance-oriented training of the draft (reinforce stage).

The draft is trained on its own proposals (on-policy, DistillSpec, Zhou et al. 2024) with a
policy-gradient term on R = 0.7 * acceptance + 0.3 * throughput minus a moving-average
baseline (TVD++, Goel et al. 2024), the dense TVD term (expected acceptance is exactly
1 - TVD), and a KL anchor to the starting draft. Serving greedily, a draft token is accepted iff
it is the target's argmax: the dense term is then a hinge on the draft's log-odds of that token
(:func:`greedy_margin_loss`). Pure functions of tensors.
"""

from __future__ import annotations

import torch

from pipeline.speculative.cost import measure_cost_ratio
from pipeline.speculative.metrics import align_vocab, masked_mean
from pipeline.speculative.schedule import draft_temperature

__all__ = [
    "MovingAverageBaseline",
    "draft_temperature",
    "greedy_margin_loss",
    "kl_to_reference",
    "measure_cost_ratio",
    "policy_gradient_loss",
    "sampled_logprobs",
    "speculative_reward",
    "tvd_loss",
]


def speculative_reward(
    n_accepted: torch.Tensor,
    gamma: int,
    cost_ratio: float,
    w_acceptance: float = 0.7,
    w_throughput: float = 0.3,
) -> torch.Tensor:
    """Per-round reward R = w_a * acceptance + w_t * throughput, both in [0, 1], shape (B,).

    acceptance = n_accepted / gamma; throughput = (n_accepted + 1) / (gamma * c + 1), the
    round's speed-up, divided by its maximum gamma + 1 to stay in [0, 1].
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    n = n_accepted.float()
    throughput = (n + 1) / ((gamma * cost_ratio + 1) * (gamma + 1))
    return w_acceptance * n / gamma + w_throughput * throughput


class MovingAverageBaseline:
    """Exponential moving average of the reward (``momentum``: weight of the past)."""

    def __init__(self, momentum: float = 0.9) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.value: float | None = None

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Rewards minus the baseline before this batch (the first: its own mean), detached."""
        rewards = rewards.detach().float()
        mean = rewards.mean().item()
        base = mean if self.value is None else self.value
        self.value = (
            mean if self.value is None else self.momentum * self.value + (1 - self.momentum) * mean
        )
        return rewards - base

    def state_dict(self) -> dict:
        return {"momentum": self.momentum, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.momentum = state["momentum"]
        self.value = state["value"]


def sampled_logprobs(
    q_logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of sampled tokens under the tempered draft, (B, G, V), (B, G) -> (B, G)."""
    if temperature <= 0:
        raise ValueError(f"policy gradients need a sampling temperature > 0, got {temperature}")
    logp = torch.log_softmax(q_logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def policy_gradient_loss(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE loss -E[A * sum_k log q(x_k)] over (B, G) log-probs and (B,) advantages."""
    if mask is not None:
        logprobs = logprobs * mask.to(logprobs.dtype)
    return -(advantages.detach().unsqueeze(-1) * logprobs).sum(-1).mean()


def tvd_loss(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean TVD(p, q) = 1 - expected acceptance over the (masked) positions; no grad into p."""
    if temperature <= 0:
        raise ValueError(
            f"tvd_loss needs a temperature > 0 to be differentiable, got {temperature}"
        )
    p_logits, q_logits = align_vocab(p_logits.detach(), q_logits)
    p = torch.softmax(p_logits.float() / temperature, dim=-1)
    q = torch.softmax(q_logits.float() / temperature, dim=-1)
    return masked_mean(0.5 * (p - q).abs().sum(-1), mask)


def greedy_margin_loss(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    weights: torch.Tensor | None = None,
    margin: float = 1.0,
) -> torch.Tensor:
    """Weighted mean of max(0, margin - (z_q[y] - max_{x != y} z_q[x])), y the target's argmax.

    (..., V) target and draft logits, (...) weights (None: all 1); no grad into p. Zero exactly
    where the draft's argmax is the target's by at least ``margin`` nats of log-odds.
    """
    # Greedy verification accepts iff argmax q = argmax p, so only positions that disagree (or
    # agree narrowly) carry gradient, as OSD learns from rejections; cross-entropy to the argmax
    # would keep sharpening agreeing positions toward one-hot rows, spending the KL anchor's
    # budget and alpha at T > 0 without accepting one more greedy token.
    p_logits, q_logits = align_vocab(p_logits.detach(), q_logits)
    y = p_logits.argmax(-1, keepdim=True)  # (..., 1)
    z = q_logits.float()
    z_y = z.gather(-1, y).squeeze(-1)
    z_other = z.scatter(-1, y, float("-inf")).amax(-1)
    hinge = torch.relu(margin - (z_y - z_other))  # (...)
    if weights is None:
        return hinge.mean()
    weights = weights.to(hinge.device, hinge.dtype)
    return (hinge * weights).sum() / weights.sum().clamp_min(1e-12)


def kl_to_reference(
    q_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reverse KL(q || q_ref), the anchor to the starting draft, exact over the vocabulary."""
    logq = torch.log_softmax(q_logits.float() / temperature, dim=-1)
    logr = torch.log_softmax(ref_logits.detach().float() / temperature, dim=-1)
    return masked_mean((logq.exp() * (logq - logr)).sum(-1), mask)
