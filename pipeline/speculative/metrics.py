"""Acceptance statistics of a draft/target pair, and what they predict for speed.

beta = sum_x min(p, q) = 1 - TVD(p, q) is a draft token's acceptance probability; alpha = E[beta]
gives tau = (1 - alpha^(gamma+1)) / (1 - alpha) tokens per target call (Leviathan et al. 2023).
``teacher_forced_acceptance`` estimates alpha on corpus text, not the draft's own samples.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pipeline.speculative.sampling import logits_to_probs

__all__ = [
    "align_vocab",
    "expected_acceptance",
    "masked_mean",
    "teacher_forced_acceptance",
    "theoretical_speedup",
    "theoretical_tau",
    "tvd",
]


def align_vocab(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cut both logits to their common vocabulary prefix (padded rows are never real tokens)."""
    v = min(p_logits.shape[-1], q_logits.shape[-1])
    return p_logits[..., :v], q_logits[..., :v]


def expected_acceptance(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected acceptance sum_x min(p, q) per position and its (masked) mean; differentiable.

    (..., V) target and draft logits -> (mean, per-position beta in [0, 1]); temperature 0
    compares argmaxes.
    """
    p_logits, q_logits = align_vocab(p_logits, q_logits)
    p = logits_to_probs(p_logits, temperature)
    q = logits_to_probs(q_logits, temperature)
    beta = torch.minimum(p, q).sum(-1)  # (...)
    return masked_mean(beta, mask), beta


def tvd(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Total variation distance 0.5 * sum_x |p - q| per position, (..., V) -> (...)."""
    p_logits, q_logits = align_vocab(p_logits, q_logits)
    p = logits_to_probs(p_logits, temperature)
    q = logits_to_probs(q_logits, temperature)
    return 0.5 * (p - q).abs().sum(-1)


def theoretical_tau(alpha: float | torch.Tensor, gamma: int) -> float | torch.Tensor:
    """Expected tokens per target call, sum_{k=0}^{gamma} alpha^k (exact at alpha = 1)."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return sum(alpha**k for k in range(gamma + 1))


def theoretical_speedup(
    alpha: float | torch.Tensor, gamma: int, c: float, v: float = 1.0
) -> float | torch.Tensor:
    """Expected speed-up over plain decoding, tau / (gamma * c + v); v = 1 if memory-bound."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    if v <= 0:
        raise ValueError(f"verification cost v must be > 0, got {v}")
    return theoretical_tau(alpha, gamma) / (gamma * c + v)


@torch.no_grad()
def teacher_forced_acceptance(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    token_batches: Iterable[torch.Tensor | list],
    temperature: float = 1.0,
) -> float:
    """Alpha = mean beta over every position of held-out (B, T) token windows, no generation."""
    total, count = 0.0, 0
    for batch in token_batches:
        ids = torch.as_tensor(batch, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.numel() == 0:
            raise ValueError(
                f"token batches must be (B, T) token ids, got shape {tuple(ids.shape)}"
            )
        p_logits = target(input_ids=ids.to(_device_of(target))).logits
        q_logits = draft(input_ids=ids.to(_device_of(draft))).logits
        _, beta = expected_acceptance(p_logits, q_logits.to(p_logits.device), temperature)
        total += beta.sum().item()
        count += beta.numel()
    if count == 0:
        raise ValueError("teacher_forced_acceptance got no token windows")
    return total / count


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is True (all of them if None)."""
    if mask is None:
        return x.mean()
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
