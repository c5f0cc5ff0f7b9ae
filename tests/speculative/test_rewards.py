"""Reward and loss terms of the reinforce stage."""

import math

import pytest
import torch

from pipeline.speculative.metrics import expected_acceptance
from pipeline.speculative.rewards import (
    MovingAverageBaseline,
    draft_temperature,
    greedy_margin_loss,
    kl_to_reference,
    measure_cost_ratio,
    policy_gradient_loss,
    sampled_logprobs,
    speculative_reward,
    tvd_loss,
)


def test_reward_bounds_and_monotonicity():
    n = torch.arange(5)  # 0..gamma accepted, gamma = 4
    r = speculative_reward(n, gamma=4, cost_ratio=0.25)
    assert (r[1:] > r[:-1]).all()
    assert r[0].item() == pytest.approx(0.3 * 1 / (2 * 5))
    assert speculative_reward(torch.tensor([4]), 4, 0.0).item() == pytest.approx(1.0)
    assert speculative_reward(n, 4, 0.5)[2] < speculative_reward(n, 4, 0.1)[2]
    with pytest.raises(ValueError):
        speculative_reward(n, 0, 0.1)


def test_baseline_centres_then_tracks_the_mean():
    baseline = MovingAverageBaseline(momentum=0.5)
    adv = baseline.advantages(torch.tensor([1.0, 3.0]))
    assert adv.tolist() == [-1.0, 1.0]
    assert baseline.value == 2.0
    adv = baseline.advantages(torch.tensor([4.0, 4.0]))
    assert adv.tolist() == [2.0, 2.0] and baseline.value == 3.0
    clone = MovingAverageBaseline()
    clone.load_state_dict(baseline.state_dict())
    assert clone.value == 3.0 and clone.momentum == 0.5


def test_policy_gradient_step_raises_probability_of_rewarded_tokens():
    logits = torch.zeros(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 1]])
    advantages = torch.tensor([1.0, -1.0])
    loss = policy_gradient_loss(sampled_logprobs(logits, tokens), advantages)
    loss.backward()
    with torch.no_grad():
        after = sampled_logprobs(logits - 0.5 * logits.grad, tokens)
        before = sampled_logprobs(logits, tokens)
    assert (after[0] > before[0]).all() and (after[1] < before[1]).all()
    mask = torch.tensor([[True, False, False], [False, False, False]])
    masked = policy_gradient_loss(sampled_logprobs(logits, tokens), advantages, mask)
    assert masked.item() == pytest.approx(math.log(5) / 2)


def test_one_tvd_step_increases_expected_acceptance():
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(6, 20, generator=gen) * 2
    q_logits = torch.randn(6, 20, generator=gen).requires_grad_()
    before = expected_acceptance(p_logits, q_logits)[0].item()
    loss = tvd_loss(p_logits, q_logits)
    assert loss.item() == pytest.approx(1 - before, abs=1e-6)
    loss.backward()
    with torch.no_grad():
        after = expected_acceptance(p_logits, q_logits - 1.0 * q_logits.grad)[0].item()
    assert after > before + 1e-3


def test_tvd_loss_respects_mask_and_does_not_train_the_target():
    p = torch.randn(2, 4, 7, requires_grad=True)
    q = torch.randn(2, 4, 7, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 1] = True
    loss = tvd_loss(p, q, mask)
    loss.backward()
    assert p.grad is None
    assert q.grad[0, 1].abs().sum() > 0 and q.grad[1].abs().sum() == 0


def test_greedy_margin_is_zero_exactly_where_the_draft_argmax_agrees_by_the_margin():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(4, 6, 9, generator=gen)
    q = torch.randn(4, 6, 9, generator=gen)
    y = p.argmax(-1, keepdim=True)
    q[0] = p[0] + 3.0 * torch.nn.functional.one_hot(y[0, :, 0], 9)  # row 0 agrees by > 1 nat
    q.requires_grad_()
    gap = q.gather(-1, y).squeeze(-1) - q.scatter(-1, y, -1e9).amax(-1)  # (4, 6) log-odds
    per_position = torch.clamp(1.0 - gap, min=0.0)
    assert greedy_margin_loss(p, q).item() == pytest.approx(per_position.mean().item(), rel=1e-6)
    w = torch.rand(4, 6, generator=gen)
    expected = (per_position * w).sum() / w.sum()
    assert greedy_margin_loss(p, q, w).item() == pytest.approx(expected.item(), rel=1e-6)
    greedy_margin_loss(p, q).backward()
    grad = q.grad.abs().sum(-1)  # (4, 6)
    assert ((grad > 0) == (gap < 1.0)).all() and (gap >= 1.0).any()
    # A draft agreeing everywhere by the margin scores 0, one disagreeing anywhere above 0.
    agreeing = 4.0 * torch.nn.functional.one_hot(p.argmax(-1), 9).float()
    assert greedy_margin_loss(p, agreeing).item() == 0.0
    agreeing[0, 0] = agreeing[0, 0].roll(1)
    assert greedy_margin_loss(p, agreeing).item() > 0.0


def test_a_tvd_step_at_t1_can_raise_alpha_and_lose_the_argmax_the_margin_step_keeps_it():
    """Greedy serving needs argmax agreement. A draft over-predicting the target's top token
    (0.45 vs 0.40) with the runner-up under-predicted: one TVD step at T = 1 moves mass from the
    top token to the runner-up, which raises alpha(T = 1) and flips the draft's argmax, so greedy
    verification rejects; the same step on the margin loss widens the agreeing gap."""
    p = torch.tensor([[0.40, 0.35, 0.25]]).log()
    start = torch.tensor([[0.45, 0.33, 0.22]]).log()

    def step(loss_fn):
        q = start.clone().requires_grad_()
        loss_fn(p, q).backward()
        return (q - 1.0 * q.grad).detach()

    def alpha(q):
        return expected_acceptance(p, q)[0].item()

    def agrees(q):
        return bool((q.argmax(-1) == p.argmax(-1)).all())

    tvd_step, margin_step = step(tvd_loss), step(greedy_margin_loss)
    assert agrees(start)
    assert alpha(tvd_step) > alpha(start) and not agrees(tvd_step)
    assert agrees(margin_step)
    gap = (margin_step[0, 0] - margin_step[0, 1:].max()).item()
    assert gap > (start[0, 0] - start[0, 1]).item()


def test_kl_to_reference():
    ref = torch.randn(3, 9)
    assert kl_to_reference(ref.clone(), ref).item() == pytest.approx(0.0, abs=1e-6)
    q = (ref + torch.randn(3, 9)).requires_grad_()
    kl = kl_to_reference(q, ref)
    assert kl.item() > 0
    kl.backward()
    assert q.grad.abs().sum() > 0


def test_temperature_schedule():
    assert draft_temperature(0, 0.8) == pytest.approx(0.88)
    assert draft_temperature(round(1000 * math.pi), 1.0) == pytest.approx(0.9, abs=1e-6)


def test_measure_cost_ratio_ranks_a_small_draft_below_a_large_target(make_llama):
    big = make_llama(0, layers=6, hidden=256)
    small = make_llama(1, layers=1, hidden=16)
    c = measure_cost_ratio(big, small, context_len=32, n_iters=7)
    assert 0.0 < c < 1.0


def test_measure_verify_cost_prices_each_gamma(make_llama):
    from pipeline.speculative.cost import measure_verify_cost

    big = make_llama(0, layers=2, hidden=256)
    v = measure_verify_cost(big, [1, 4, 63], context_len=16, n_iters=3)
    assert set(v) == {1, 4, 63} and all(x > 0 for x in v.values())
    assert v[63] > v[1]  # 64 tokens through 2 layers of 256: more work than 2 tokens
