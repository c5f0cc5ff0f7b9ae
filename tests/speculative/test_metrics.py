"""Acceptance statistics: closed forms against direct computation and against sampling."""

import pytest
import torch

from pipeline.speculative.metrics import (
    align_vocab,
    expected_acceptance,
    teacher_forced_acceptance,
    theoretical_speedup,
    theoretical_tau,
    tvd,
)
from pipeline.speculative.sampling import verify_draft


def test_expected_acceptance_is_one_minus_tvd():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(3, 5, 11, generator=gen), torch.randn(3, 5, 11, generator=gen)
    mean, beta = expected_acceptance(p, q)
    assert beta.shape == (3, 5)
    assert torch.allclose(beta, 1 - tvd(p, q), atol=1e-6)
    assert torch.isclose(mean, beta.mean())
    assert torch.allclose(expected_acceptance(p, p)[1], torch.ones(3, 5))
    assert (beta > 0).all() and (beta < 1).all()


def test_expected_acceptance_mask_and_greedy():
    p = torch.tensor([[[3.0, 0.0], [0.0, 3.0], [1.0, 0.0]]])  # argmaxes 0, 1, 0
    q = torch.tensor([[[2.0, 0.0], [2.0, 0.0], [0.0, 9.0]]])  # argmaxes 0, 0, 1
    mean, beta = expected_acceptance(p, q, temperature=0.0)
    assert beta.tolist() == [[1.0, 0.0, 0.0]]
    mask = torch.tensor([[True, False, False]])
    assert expected_acceptance(p, q, temperature=0.0, mask=mask)[0].item() == 1.0
    assert mean.item() == pytest.approx(1 / 3)


def test_align_vocab_cuts_to_shared_prefix():
    p, q = align_vocab(torch.zeros(2, 10), torch.zeros(2, 8))
    assert p.shape == q.shape == (2, 8)


def test_theoretical_tau_and_speedup():
    assert theoretical_tau(0.0, 4) == 1.0
    assert theoretical_tau(1.0, 4) == 5.0
    assert theoretical_tau(0.7, 3) == pytest.approx((1 - 0.7**4) / (1 - 0.7))
    assert theoretical_speedup(0.7, 3, 0.1) == pytest.approx(theoretical_tau(0.7, 3) / 1.3)
    assert theoretical_speedup(0.9, 4, 0.0) > theoretical_speedup(0.9, 4, 0.5)
    assert theoretical_speedup(0.7, 3, 0.1, v=2.0) == pytest.approx(theoretical_tau(0.7, 3) / 2.3)
    with pytest.raises(ValueError, match="verification cost"):
        theoretical_speedup(0.5, 2, 0.1, v=0.0)
    with pytest.raises(ValueError):
        theoretical_speedup(0.5, 2, -1.0)


@pytest.mark.parametrize("gamma", [1, 4])
def test_closed_form_alpha_and_tau_match_sampling(gamma):
    """With the same p, q at every position, acceptance is i.i.d. with alpha = sum min(p, q)."""
    gen = torch.Generator().manual_seed(gamma)
    p = torch.softmax(torch.randn(8, generator=gen), -1)
    q = torch.softmax(torch.randn(8, generator=gen), -1)
    alpha = expected_acceptance(p.log(), q.log())[0].item()
    n = 30_000
    drafts = torch.multinomial(q, n * gamma, replacement=True, generator=gen).view(n, gamma)
    ver = verify_draft(drafts, q.expand(n, gamma, -1), p.expand(n, gamma + 1, -1), generator=gen)
    # Per-position acceptance among tested positions estimates alpha ...
    rate = ver.n_accepted.sum().item() / ver.n_verified.sum().item()
    assert rate == pytest.approx(alpha, abs=0.015)
    # ... and tokens per round (accepted + correction/bonus) estimate tau.
    tau = (ver.n_accepted + 1).double().mean().item()
    assert tau == pytest.approx(theoretical_tau(alpha, gamma), rel=0.02)


def test_teacher_forced_acceptance(target, stranger, make_llama):
    windows = [
        torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    assert teacher_forced_acceptance(target, target, windows) == pytest.approx(1.0, abs=1e-5)
    alpha = teacher_forced_acceptance(target, stranger, windows, temperature=1.0)
    with torch.no_grad():
        ids = torch.cat(windows)
        manual = expected_acceptance(target(input_ids=ids).logits, stranger(input_ids=ids).logits)[
            0
        ]
    assert alpha == pytest.approx(manual.item(), abs=1e-5)
    assert 0.0 < alpha < 1.0
    # One-dimensional windows and plain lists are accepted too.
    as_lists = [w.tolist() for batch in windows for w in batch]
    assert teacher_forced_acceptance(target, stranger, as_lists) == pytest.approx(alpha, abs=1e-5)
    # A draft with a padded (larger) vocabulary is compared on the shared prefix.
    wide = make_llama(1, vocab=80)
    assert 0.0 < teacher_forced_acceptance(target, wide, windows) < 1.0


def test_teacher_forced_acceptance_rejects_empty_input(target):
    with pytest.raises(ValueError, match="no token windows"):
        teacher_forced_acceptance(target, target, [])
