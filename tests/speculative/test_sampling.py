"""The speculative sampling step reproduces the target distribution exactly."""

import pytest
import torch
from scipy.stats import chisquare

from pipeline.speculative.sampling import (
    logits_to_probs,
    sample_tokens,
    verify_draft,
    verify_greedy,
)

N = 40_000  # independent rows, all verified in one vectorised call

# Fixed distributions over a 6-token vocabulary with the edge cases the rule must handle:
# token 4 has p > 0 but q = 0 (only reachable through the residual), token 5 has p = 0, q > 0
# (a draft proposal that must always be rejected).
P = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.30, 0.00])
Q = torch.tensor([0.10, 0.40, 0.25, 0.15, 0.00, 0.10])
P_BONUS = torch.tensor([0.05, 0.15, 0.20, 0.25, 0.15, 0.20])


def _run(gamma: int, seed: int = 0, p_last: torch.Tensor = P):
    gen = torch.Generator().manual_seed(seed)
    q_probs = Q.expand(N, gamma, -1)  # (N, G, V)
    p_probs = torch.cat([P.expand(N, gamma, -1), p_last.expand(N, 1, -1)], dim=1)  # (N, G+1, V)
    drafts = torch.multinomial(Q, N * gamma, replacement=True, generator=gen).view(N, gamma)
    return drafts, verify_draft(drafts, q_probs, p_probs, generator=gen)


def _assert_distributed_as(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    target = probs.double()[support]
    expected = target / target.sum() * counts[support].sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 0.01


@pytest.mark.parametrize("gamma", [1, 3])
def test_first_emitted_token_is_distributed_as_target(gamma):
    drafts, ver = _run(gamma)
    first = torch.where(ver.n_accepted >= 1, drafts[:, 0], ver.next_token)
    _assert_distributed_as(first, P)


def test_second_emitted_token_is_distributed_as_target():
    drafts, ver = _run(3, seed=1)
    rows = ver.n_accepted >= 1  # the second token exists in the same round
    second = torch.where(ver.n_accepted >= 2, drafts[:, 1], ver.next_token)[rows]
    _assert_distributed_as(second, P)


def test_bonus_token_is_sampled_from_last_target_position():
    _, ver = _run(2, seed=2, p_last=P_BONUS)
    bonus = ver.next_token[ver.n_accepted == 2]
    assert bonus.numel() > 1000
    _assert_distributed_as(bonus, P_BONUS)


def test_acceptance_frequency_matches_sum_of_minima():
    _, ver = _run(1, seed=3)
    beta = torch.minimum(P, Q).sum().item()
    rate = ver.n_accepted.double().mean().item()
    sigma = (beta * (1 - beta) / N) ** 0.5
    assert abs(rate - beta) < 4 * sigma
    assert torch.allclose(ver.beta, torch.full_like(ver.beta, beta))


def test_accepted_mask_is_the_leading_prefix():
    _, ver = _run(4, seed=4)
    assert torch.equal(ver.accepted.sum(-1), ver.n_accepted)
    assert torch.equal(ver.accepted, ver.accepted.long().cummin(-1).values.bool())
    assert torch.equal(ver.n_verified, torch.clamp(ver.n_accepted + 1, max=4))


def test_same_generator_seed_gives_same_outcome():
    a, va = _run(3, seed=5)
    b, vb = _run(3, seed=5)
    assert torch.equal(a, b) and torch.equal(va.next_token, vb.next_token)
    assert torch.equal(va.n_accepted, vb.n_accepted)


def test_greedy_accepts_iff_target_argmax_and_corrects_with_it():
    # Target argmaxes per position: 2, 0, 3, then bonus position 1.
    p_logits = torch.tensor([[[0, 0, 5, 0.0], [5, 0, 0, 0], [0, 0, 0, 5], [0, 5, 0, 0]]])
    p = logits_to_probs(p_logits, 0.0)
    q = logits_to_probs(torch.zeros(1, 3, 4), 0.0)  # values irrelevant in greedy mode
    cases = {(2, 0, 3): (3, 1), (2, 0, 1): (2, 3), (1, 0, 3): (0, 2)}
    for drafts, (n, nxt) in cases.items():
        ver = verify_draft(torch.tensor([drafts]), q, p, greedy=True)
        assert ver.n_accepted.item() == n and ver.next_token.item() == nxt


@pytest.mark.parametrize("g", [0, 1, 4])
def test_verify_greedy_equals_greedy_verify_draft_on_one_hots(g):
    # many rows, each draft agreeing with the target for a random prefix
    gen = torch.Generator().manual_seed(g)
    p_logits = torch.randn(64, g + 1, 50, generator=gen)
    target = p_logits.argmax(-1)  # (64, g + 1)
    drafts = torch.where(torch.rand(64, g, generator=gen) < 0.7, target[:, :g], 7)
    q = logits_to_probs(torch.nn.functional.one_hot(drafts, 50).float(), 0.0)
    want = verify_draft(drafts, q, logits_to_probs(p_logits, 0.0), greedy=True)
    got = verify_greedy(drafts, target)
    for field in ("n_accepted", "next_token", "accepted", "beta"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_zero_gamma_is_a_plain_target_sample():
    gen = torch.Generator().manual_seed(6)
    ver = verify_draft(
        torch.zeros(N, 0, dtype=torch.long),
        torch.zeros(N, 0, 6),
        P.expand(N, 1, -1),
        generator=gen,
    )
    assert ver.n_accepted.max() == 0
    _assert_distributed_as(ver.next_token, P)


def test_logits_to_probs_temperature():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.equal(logits_to_probs(logits, 0.0), torch.tensor([[0.0, 1.0, 0.0]]))
    hot, cold = logits_to_probs(logits, 2.0), logits_to_probs(logits, 0.5)
    assert torch.allclose(hot.sum(-1), torch.ones(1))
    assert cold[0, 1] > hot[0, 1]  # lower temperature sharpens
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(logits, -1.0)


def test_sample_tokens_greedy_and_shape():
    probs = torch.softmax(torch.randn(2, 3, 7), -1)
    assert torch.equal(sample_tokens(probs, greedy=True), probs.argmax(-1))
    assert sample_tokens(probs, torch.Generator().manual_seed(0)).shape == (2, 3)


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="p_probs"):
        verify_draft(
            torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)
        )
