"""Batched on-policy rollouts feed the reinforce losses."""

import pytest
import torch

from pipeline.speculative.rewards import (
    MovingAverageBaseline,
    policy_gradient_loss,
    sampled_logprobs,
    speculative_reward,
    tvd_loss,
)
from pipeline.speculative.rollout import draft_rollout


@pytest.fixture
def contexts():
    return torch.randint(0, 64, (5, 10), generator=torch.Generator().manual_seed(0))


def test_greedy_rollout_matches_teacher_forced_argmaxes(target, near_draft, contexts):
    ro = draft_rollout(target, near_draft, contexts, gamma=4, temperature=0)
    assert ro.sequences.shape == (5, 14) and ro.p_logits.shape == (5, 5, 64)
    with torch.no_grad():
        full_q = near_draft(input_ids=ro.sequences).logits
        full_p = target(input_ids=ro.sequences).logits
    # Cached batched proposals equal the argmax of an uncached forward on the same rows.
    assert torch.equal(ro.tokens, full_q[:, ro.draft_positions()].argmax(-1))
    assert torch.allclose(ro.p_logits, full_p[:, -5:], atol=1e-5)
    agree = (full_p[:, ro.draft_positions()].argmax(-1) == ro.tokens).long()
    assert torch.equal(ro.verification.n_accepted, agree.cumprod(-1).sum(-1))


def test_self_rollout_accepts_everything(target, contexts):
    ro = draft_rollout(target, target, contexts, gamma=3, temperature=0)
    assert ro.verification.n_accepted.tolist() == [3] * 5


def test_rollout_drives_a_training_step(target, near_draft, perturb, contexts):
    draft = perturb(near_draft, 0.0, seed=0)  # trainable copy
    gen = torch.Generator().manual_seed(1)
    ro = draft_rollout(target, draft, contexts, gamma=3, temperature=1.0, generator=gen)
    reward = speculative_reward(ro.verification.n_accepted, 3, cost_ratio=0.2)
    adv = MovingAverageBaseline().advantages(reward)
    q_logits = draft(input_ids=ro.sequences).logits[:, ro.draft_positions()]  # (B, G, V)
    assert torch.allclose(q_logits.detach(), ro.q_logits, atol=1e-5)
    loss = policy_gradient_loss(sampled_logprobs(q_logits, ro.tokens), adv) + tvd_loss(
        ro.p_logits[:, :-1], q_logits
    )
    loss.backward()
    assert draft.lm_head.weight.grad.abs().sum() > 0


def test_rollout_rejects_bad_contexts(target):
    with pytest.raises(ValueError, match="contexts"):
        draft_rollout(target, target, torch.zeros(3, dtype=torch.long), gamma=2)


def test_rollout_returns_the_target_logits_at_requested_context_positions(
    target, near_draft, contexts
):
    rows = torch.tensor([0, 3, 8])  # < T - 1 = 9: each predicts a context token
    ro = draft_rollout(target, near_draft, contexts, gamma=2, temperature=0, context_positions=rows)
    with torch.no_grad():
        full_p = target(input_ids=ro.sequences).logits
    assert torch.allclose(ro.p_context, full_p[:, rows], atol=1e-5)
    assert torch.allclose(ro.p_logits, full_p[:, -3:], atol=1e-5)  # unchanged by the extra rows
    assert draft_rollout(target, near_draft, contexts, gamma=2, temperature=0).p_context is None
