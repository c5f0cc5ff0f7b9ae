"""The two training stages' losses, pure tensor math (the LightningModules wrap them).

Distillation (Hinton et al. 2015; OneBit): τ²·KL(p_teacher ‖ p_student) at temperature τ (τ² keeps
the gradient's size; forward KL is mode-covering, as perplexity is) plus β·Σ_l w_l·d_l: d_l the
layer's attention-map or hidden-state distance, w_l larger where quantization hurt more.

Reinforce: the frozen target verifies the draft's gamma tokens as speculative decoding would
(:func:`pipeline.speculative.rollout.draft_rollout`); the loss is

    pg_weight * -(A * sum_k log q_T(x_k))             A = R - moving baseline,
  + tvd_weight * TVD(p, q) on the verified positions   (= 1 - expected acceptance there),
  + context_tvd_weight * TVD(p, q) on K context positions (teacher-forced),
  + kl_weight * KL(q || q_start)                        (anchor to the starting draft),

with R = w_a * accepted / gamma + w_t * (accepted + 1) / ((gamma * c + 1) * (gamma + 1)).
Position k is verified with probability prod_{j<k} beta_j, so the TVD over verified positions is
an unbiased pathwise gradient of the expected accepted length; the policy gradient carries the part
through the sampled tokens. Tokens after the first rejection affect no reward and are left out.

Serving greedily (T = 0), acceptance is argmax agreement, which TVD at any T > 0 only loosely
tracks: the target verifies greedily (the reward counts greedily accepted tokens), the draft still
samples at its schedule temperature (the policy gradient needs a stochastic policy), and both TVD
terms become the hinge of :func:`pipeline.speculative.rewards.greedy_margin_loss`, the on-policy
one weighted toward a round's early positions (:func:`round_weights`). DistillSpec's finding
(Zhou et al. 2024): the divergence that pays is the one matching the decoding mode.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.speculative.metrics import align_vocab
from pipeline.speculative.rewards import (
    greedy_margin_loss,
    kl_to_reference,
    policy_gradient_loss,
    sampled_logprobs,
    speculative_reward,
    tvd_loss,
)
from pipeline.speculative.rollout import draft_rollout

# Decoder-layer index in a linear's name: "model.layers.3.…", "transformer.h.3.…", "block.3".
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


def kl_divergence(
    teacher_logits: Tensor, student_logits: Tensor, temperature: float = 1.0
) -> Tensor:
    """τ²·KL(softmax(t/τ) ‖ softmax(s/τ)), averaged over tokens."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # (B, T)
    return kl.mean() * temperature**2


def attention_distances(teacher: Sequence[Tensor], student: Sequence[Tensor]) -> Tensor:
    """Per-layer ‖A_t − A_s‖² of attention probabilities."""
    _same_length(teacher, student, "attention maps")
    return torch.stack(
        [(a_t.float() - a_s.float()).square().sum(-1).mean() for a_t, a_s in zip(teacher, student)]
    )


def hidden_distances(teacher: Sequence[Tensor], student: Sequence[Tensor]) -> Tensor:
    """Per-layer relative squared error ‖h_t − h_s‖² / ‖h_t‖² of decoder-layer outputs."""
    _same_length(teacher, student, "hidden states")
    out = []
    for h_t, h_s in zip(teacher, student):
        h_t, h_s = h_t.float(), h_s.float()
        err = (h_t - h_s).square().sum(-1)  # (B, T)
        out.append((err / h_t.square().sum(-1).clamp_min(1e-12)).mean())
    return torch.stack(out)


def _same_length(a: Sequence[Tensor], b: Sequence[Tensor], what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"teacher has {len(a)} {what}, student {len(b)}")


def layer_of(name: str) -> int | None:
    """Decoder-layer index of a module name, or None (embeddings, lm_head, ...)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def layer_weights(errors: Mapping[str, float], num_layers: int) -> Tensor:
    """w_l ∝ mean quantization error of the linears of decoder layer l, normalised to Σ w_l = 1."""
    total = torch.zeros(num_layers)
    count = torch.zeros(num_layers)
    for name, err in errors.items():
        idx = layer_of(name)
        if idx is None or not 0 <= idx < num_layers:
            continue
        if not err >= 0:  # NaN or negative: a broken report, not a weight
            raise ValueError(f"quantization error of {name} is {err}; expected a value >= 0")
        total[idx] += float(err)
        count[idx] += 1
    return normalised(total / count.clamp_min(1))


def normalised(errors: Tensor) -> Tensor:
    """Errors (L,) -> weights e_l / Σ e (uniform when none is positive), for every weighting."""
    errors = errors.detach().float()
    if not errors.sum() > 0:
        return torch.full_like(errors, 1.0 / errors.numel())
    return errors / errors.sum()


def distill_loss(
    teacher_logits: Tensor,
    student_logits: Tensor,
    weights: Tensor,
    alpha: float,
    beta: float,
    temperature: float,
    teacher_attn: Sequence[Tensor] | None = None,
    student_attn: Sequence[Tensor] | None = None,
    teacher_hidden: Sequence[Tensor] | None = None,
    student_hidden: Sequence[Tensor] | None = None,
    ce: float = 0.0,
    ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """α·KL + β·Σ_l w_l·d_l + ce·CE, with d_l from attention maps and/or hidden states."""
    zero = student_logits.new_zeros((), dtype=torch.float32)
    weights = weights.to(zero.device)
    kl = kl_divergence(teacher_logits, student_logits, temperature) if alpha else zero
    attn = hidden = zero
    per_layer = torch.zeros_like(weights, dtype=torch.float32)
    if beta and teacher_attn is not None and student_attn is not None:
        d = attention_distances(teacher_attn, student_attn)
        attn, per_layer = (weights * d).sum(), per_layer + d.detach()
    if beta and teacher_hidden is not None and student_hidden is not None:
        d = hidden_distances(teacher_hidden, student_hidden)
        hidden, per_layer = (weights * d).sum(), per_layer + d.detach()
    nll = zero
    if ce and ids is not None:  # the window's own next tokens
        nll = F.cross_entropy(student_logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    total = alpha * kl + beta * (attn + hidden) + ce * nll
    return {
        "kl": kl.detach(),
        "ce": nll.detach(),
        "attn": attn.detach(),
        "hidden": hidden.detach(),
        "total": total,
        "layers": per_layer,
    }


@dataclass(frozen=True)
class LossWeights:
    """The weights of the reinforce loss's terms and of the reward's two parts."""

    pg: float
    tvd: float
    kl: float
    w_acceptance: float
    w_throughput: float
    context_tvd: float


def logits_at(model: torch.nn.Module, sequences: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logits of ``sequences`` (B, S) at the positions ``rows`` (K,) -> (B, K, V)."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(input_ids=sequences, logits_to_keep=rows.to(sequences.device)).logits
    return model(input_ids=sequences).logits[:, rows.to(sequences.device)]


def proposal_logits(model: torch.nn.Module, sequences: torch.Tensor, gamma: int) -> torch.Tensor:
    """Logits predicting the last gamma tokens of ``sequences`` (B, T + G) -> (B, G, V)."""
    s = sequences.shape[1]
    return logits_at(model, sequences, torch.arange(s - gamma - 1, s - 1))


def acceptance_term(
    p_logits: Tensor, q_logits: Tensor, weights: Tensor | None, temperature: float, margin: float
) -> Tensor:
    """The serving mode's dense term over (B, K, V) logits: TVD at T > 0 (1 - expected
    acceptance), the greedy margin at T = 0; ``weights`` (B, K) weigh the positions."""
    if temperature == 0:
        return greedy_margin_loss(p_logits, q_logits, weights, margin)
    return tvd_loss(p_logits, q_logits, weights, temperature)


def round_weights(mask: Tensor, temperature: float) -> Tensor:
    """(B, G) verified positions -> their weights in the on-policy term.

    Greedy: (G - k) / G at position k. A greedy mismatch at k ends the round and forfeits up to
    the G - k tokens from k on, so an early disagreement costs more accepted tokens per call.
    """
    if temperature > 0:
        return mask
    gamma = mask.shape[1]
    return mask * (gamma - torch.arange(gamma, device=mask.device)) / gamma


def _context_rows(t: int, count: int, generator: torch.Generator | None) -> Tensor | None:
    """(K,) sorted random context positions of the teacher-forced term, or None."""
    if count <= 0 or t <= 1:
        return None
    device = generator.device if generator is not None else "cpu"
    perm = torch.randperm(t - 1, generator=generator, device=device)
    return perm[:count].sort().values.cpu()


def reinforce_loss(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    reference: torch.nn.Module,
    contexts: torch.Tensor,
    *,
    gamma: int,
    temperature: float,
    draft_temp: float,
    cost_ratio: float,
    weights: LossWeights,
    advantages: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator | None = None,
    context_positions: int = 0,
    greedy_margin: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One on-policy round on ``contexts`` (B, T) and the loss of the module docstring;
    ``temperature`` is the serving one (0: greedy, with ``greedy_margin`` in nats)."""
    t = contexts.shape[1]
    # (K,) context positions of the context term, each predicting the next token
    rows = _context_rows(t, context_positions if weights.context_tvd > 0 else 0, generator)
    ro = draft_rollout(
        target,
        draft,
        contexts,
        gamma,
        temperature=temperature,
        draft_temperature=draft_temp,
        generator=generator,
        context_positions=rows,
    )
    ver = ro.verification
    mask = torch.arange(gamma, device=ver.n_verified.device) < ver.n_verified[:, None]
    proposed = torch.arange(t - 1, t + gamma - 1)
    keep = proposed if rows is None else torch.cat([rows, proposed])
    q_all = logits_at(draft, ro.sequences, keep)  # (B, K + G, V_q)
    q_logits = q_all[:, -gamma:]
    context_term = (
        torch.zeros((), device=q_all.device)
        if rows is None
        else acceptance_term(
            ro.p_context.to(q_all.device), q_all[:, :-gamma], None, temperature, greedy_margin
        )
    )
    with torch.no_grad():
        ref_logits = proposal_logits(reference, ro.sequences, gamma)
    vocab = min(q_logits.shape[-1], ro.p_logits.shape[-1])  # proposals come from the shared rows
    # At T = 0 the target accepted greedily: the reward counts the tokens a greedy round keeps.
    reward = speculative_reward(
        ver.n_accepted, gamma, cost_ratio, weights.w_acceptance, weights.w_throughput
    )  # (B,)
    adv = advantages(reward)
    logq = sampled_logprobs(q_logits[..., :vocab], ro.tokens.to(q_logits.device), draft_temp)
    pg = policy_gradient_loss(logq, adv.to(logq.device), mask)
    p_logits = ro.p_logits[:, :gamma].to(q_logits.device)
    on_policy = acceptance_term(
        p_logits, q_logits, round_weights(mask, temperature), temperature, greedy_margin
    )
    kl = kl_to_reference(q_logits, ref_logits, mask)
    loss = (
        weights.pg * pg
        + weights.tvd * on_policy
        + weights.kl * kl
        + weights.context_tvd * context_term
    )
    term = "margin" if temperature == 0 else "tvd"
    stats = {
        "reward": reward.mean().item(),
        "acceptance": ver.n_accepted.float().mean().item() / gamma,
        "alpha": (ver.beta * mask).sum().item() / mask.sum().clamp_min(1).item(),
        "greedy_match": _agreement(p_logits, q_logits, mask),
        term: on_policy.item(),
        f"context_{term}": context_term.item(),
        "kl": kl.item(),
        "pg": pg.item(),
        "draft_temperature": draft_temp,
    }
    return loss, stats


def _agreement(p_logits: Tensor, q_logits: Tensor, mask: Tensor) -> float:
    """Share of the verified positions where the draft's argmax is the target's."""
    p_logits, q_logits = align_vocab(p_logits, q_logits)
    agree = (p_logits.argmax(-1) == q_logits.argmax(-1)) & mask.to(p_logits.device)
    return agree.sum().item() / mask.sum().clamp_min(1).item()
