"""Speculative sampling: the verification step that keeps the target's distribution.

Leviathan et al. (2023), Chen et al. (2023): draft x_i ~ q_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); the first rejection samples from norm(max(0, p_i - q_i)), and a full
accept samples a bonus from p_{gamma+1}. Every token is then distributed exactly as p, whatever q:
a bad draft costs speed, never quality. Temperature 0: accept iff the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Verification", "logits_to_probs", "sample_tokens", "verify_draft", "verify_greedy"]


@dataclass(frozen=True)
class Verification:
    """Outcome of verifying one block of draft tokens per row."""

    n_accepted: torch.Tensor  # (B,) leading draft tokens accepted, in [0, gamma]
    next_token: torch.Tensor  # (B,) the correction (first rejection) or the bonus token
    accepted: torch.Tensor  # (B, gamma) bool, True for the accepted prefix only
    beta: torch.Tensor  # (B, gamma) expected acceptance sum_x min(p, q) at each position

    @property
    def n_verified(self) -> torch.Tensor:
        """(B,) positions whose acceptance test ran: the accepted ones plus the first rejection."""
        gamma = self.accepted.shape[-1]
        return torch.clamp(self.n_accepted + 1, max=gamma)


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> float32 softmax at ``temperature``; 0 gives the one-hot argmax."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    logits = logits.float()
    if temperature == 0:
        # One-hot: sum_x min(p, q) is then the greedy acceptance indicator.
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample_tokens(
    probs: torch.Tensor, generator: torch.Generator | None = None, greedy: bool = False
) -> torch.Tensor:
    """One token per row of ``probs`` (..., V) -> (...) int64, sampled on the generator's device."""
    if greedy:
        return probs.argmax(-1)
    shape = probs.shape[:-1]
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        flat = flat.to(generator.device)
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.to(probs.device).reshape(shape)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """(B, G) bool -> (B,) length of the all-True prefix of each row."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def verify_draft(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    *,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Verification:
    """Verify (B, G) drafts sampled from ``q_probs`` (B, G, V) against ``p_probs`` (B, G + 1, V)."""
    b, g = draft_tokens.shape
    if q_probs.shape[:2] != (b, g) or p_probs.shape[:2] != (b, g + 1):
        raise ValueError(
            "verify_draft expects draft_tokens (B, G), q_probs (B, G, V), p_probs (B, G+1, V); "
            f"got {tuple(draft_tokens.shape)}, {tuple(q_probs.shape)}, {tuple(p_probs.shape)}"
        )
    q_probs = q_probs.float()
    p_probs = p_probs.float()
    beta = torch.minimum(p_probs[:, :g], q_probs).sum(-1)  # (B, G)

    if greedy:
        accepted = p_probs[:, :g].argmax(-1) == draft_tokens  # (B, G)
    else:
        idx = draft_tokens.unsqueeze(-1)
        p_x = p_probs[:, :g].gather(-1, idx).squeeze(-1)  # (B, G)
        q_x = q_probs.gather(-1, idx).squeeze(-1)
        u = torch.rand((b, g), generator=generator, device=_rng_device(generator, p_probs))
        # u < p/q without the division (q_x may underflow to 0 at low temperature).
        accepted = u.to(p_probs.device) * q_x < p_x
    n_accepted = _leading_true(accepted)
    accepted = torch.arange(g, device=accepted.device) < n_accepted.unsqueeze(-1)

    # A zero q row makes "all accepted" the same formula: max(0, p_{G+1} - 0) = bonus.
    q_pad = torch.cat([q_probs, q_probs.new_zeros(b, 1, q_probs.shape[-1])], dim=1)
    rows = torch.arange(b, device=p_probs.device)
    p_n = p_probs[rows, n_accepted]  # (B, V)
    if greedy:
        next_token = p_n.argmax(-1)
    else:
        residual = torch.clamp(p_n - q_pad[rows, n_accepted], min=0.0)  # (B, V)
        mass = residual.sum(-1, keepdim=True)
        # A rejection implies mass > 0 in exact arithmetic; fall back to p if rounding left 0.
        residual = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-12), p_n)
        next_token = sample_tokens(residual, generator)
    return Verification(n_accepted, next_token, accepted, beta)


def verify_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> Verification:
    """``verify_draft(greedy=True)`` from (B, G) draft and (B, G + 1) target argmax tokens."""
    b, g = draft_tokens.shape
    match = target_tokens[:, :g] == draft_tokens  # (B, G)
    n_accepted = _leading_true(match)
    accepted = torch.arange(g, device=match.device) < n_accepted.unsqueeze(-1)
    next_token = target_tokens[torch.arange(b, device=match.device), n_accepted]
    return Verification(n_accepted, next_token, accepted, match.float())


def _rng_device(generator: torch.Generator | None, like: torch.Tensor) -> torch.device:
    return generator.device if generator is not None else like.device
