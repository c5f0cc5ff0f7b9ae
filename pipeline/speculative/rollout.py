"""Batched on-policy rollouts: one speculative round on many contexts at once.

No gradients: the training step re-runs the draft on ``sequences`` in one batched forward
instead of keeping autograd state across the gamma sampling steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.speculative.decoding import CachedLM, draft_probs, vocab_size
from pipeline.speculative.sampling import Verification, logits_to_probs, sample_tokens, verify_draft

__all__ = ["Rollout", "draft_rollout"]


@dataclass(frozen=True)
class Rollout:
    """One speculative round on a batch of contexts."""

    sequences: torch.Tensor  # (B, T + G) contexts followed by the draft's proposals
    tokens: torch.Tensor
    p_logits: torch.Tensor  # (B, G + 1, V) target logits at each proposal and the bonus
    q_logits: torch.Tensor  # (B, G, V_q) draft logits the proposals were sampled from
    verification: Verification
    context_len: int
    p_context: torch.Tensor | None = None  # (B, K, V) target logits at context_positions

    def draft_positions(self) -> slice:
        """Positions of ``sequences`` whose logits predict the proposals (T - 1 .. T + G - 2)."""
        t, g = self.context_len, self.tokens.shape[1]
        return slice(t - 1, t + g - 1)


@torch.no_grad()
def draft_rollout(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    contexts: torch.Tensor,
    gamma: int,
    *,
    temperature: float = 1.0,
    draft_temperature: float | None = None,
    generator: torch.Generator | None = None,
    context_positions: torch.Tensor | None = None,
) -> Rollout:
    """Propose ``gamma`` tokens per (B, T) context with the draft and verify them with the target.

    ``draft_temperature`` (None: ``temperature``) changes the draft's sampling only: verification
    tests against the distribution sampled; at ``temperature`` 0 it accepts a token iff it is the
    target's argmax, whatever the draft sampled (so a training draft may explore while the
    target verifies greedily, as it serves). ``context_positions`` (K,) < T - 1: target logits to
    return too from the same forward (for a teacher-forced loss).
    """
    contexts = torch.as_tensor(contexts, dtype=torch.long)
    if contexts.dim() != 2 or contexts.shape[1] == 0:
        raise ValueError(f"contexts must be (B, T) token ids, got {tuple(contexts.shape)}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    greedy = temperature == 0
    t_draft = temperature if draft_temperature is None else draft_temperature
    drf = CachedLM(draft)
    vocab = vocab_size(target)
    feed, tokens, q_logits, q_probs = contexts, [], [], []
    for _ in range(gamma):
        logits = drf.forward(feed, keep=1)[:, -1]  # (B, V_q)
        q = draft_probs(logits, vocab, t_draft)  # (B, V)
        tok = sample_tokens(q, generator, t_draft == 0)  # (B,)
        tokens.append(tok)
        q_logits.append(logits)
        q_probs.append(q)
        feed = tok[:, None]
    tokens_t = torch.stack(tokens, dim=1)  # (B, G)
    sequences = torch.cat([contexts.to(tokens_t.device), tokens_t], dim=1)  # (B, T + G)
    # The target reads every proposal in one forward; a fresh cache, so positions start at 0.
    t = contexts.shape[1]
    keep: int | torch.Tensor = gamma + 1
    if context_positions is not None:
        keep = torch.cat([context_positions.cpu(), torch.arange(t - 1, t + gamma)])
    p_all = CachedLM(target).forward(sequences, keep=keep)  # (B, K + G + 1, V)
    p_logits = p_all[:, -gamma - 1 :]  # (B, G + 1, V)
    p_context = None if context_positions is None else p_all[:, : -gamma - 1]
    p = logits_to_probs(p_logits, temperature)
    verification = verify_draft(
        tokens_t.to(p.device),
        torch.stack(q_probs, dim=1).to(p.device),
        p,
        greedy=greedy,
        generator=generator,
    )
    return Rollout(
        sequences=sequences,
        tokens=tokens_t,
        p_logits=p_logits,
        q_logits=torch.stack(q_logits, dim=1),
        verification=verification,
        context_len=t,
        p_context=p_context,
    )
