"""Adaptive decoding that falls back to plain steps (gamma 0): exact output, draft caught up."""

import torch

from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.decoding import speculative_generate
from tests.speculative.conftest import N_NEW


def test_a_disagreeing_draft_settles_on_plain_decoding(target, stranger, prompt, greedy_reference):
    adaptive = AdaptiveGamma(1, 5, window=8, cost_ratio=0.2, probe_every=8)
    out, stats = speculative_generate(
        target, stranger, prompt, N_NEW, adaptive=adaptive, temperature=0
    )
    assert torch.equal(out, greedy_reference)
    first = adaptive.history.index(0)
    after = adaptive.history[first:]  # from the first plain step on: plain, and lone probes
    assert after.count(0) >= 0.8 * len(after) >= N_NEW // 2
    assert all(a == 0 or b == 0 for a, b in zip(after, after[1:]))
    # One target call per plain step, and the probes kept testing the draft.
    assert stats.target_calls == len(adaptive.history) and 0 < stats.drafted < N_NEW


def test_an_agreeing_draft_never_goes_plain(target, prompt, greedy_reference):
    # The target drafting for itself: alpha = 1; c = 0.1 prices a draft ten times cheaper.
    adaptive = AdaptiveGamma(1, 5, cost_ratio=0.1)
    out, stats = speculative_generate(
        target, target, prompt, N_NEW, adaptive=adaptive, temperature=0
    )
    assert torch.equal(out, greedy_reference)
    assert 0 not in adaptive.history and stats.acceptance_rate == 1.0


def test_the_draft_catches_up_on_the_tokens_it_skipped(target, prompt, greedy_reference):
    # A self-draft priced as it really costs (c = 1, verification 1.2 steps): speculation cannot
    # pay, so decoding goes plain and probes. Every probe drafts after tokens the draft never
    # read; only a draft cache holding exactly the committed prefix accepts all of them.
    adaptive = AdaptiveGamma(1, 3, cost_ratio=1.0, verify_cost=dict.fromkeys(range(1, 4), 1.2),
                             probe_every=4)  # fmt: skip
    out, stats = speculative_generate(
        target, target, prompt, N_NEW, adaptive=adaptive, temperature=0
    )
    assert torch.equal(out, greedy_reference)
    assert adaptive.history.count(0) >= N_NEW // 2
    assert stats.drafted >= 3 and stats.accepted == stats.drafted


def test_plain_steps_and_a_returning_draft(target, stranger, prompt, greedy_reference):
    # One controller across requests, as the runtime keeps it: a stranger drives it to plain
    # decoding, then an agreeing draft (the target itself, priced as a 5x cheaper one) brings
    # gamma back.
    adaptive = AdaptiveGamma(1, 5, window=8, cost_ratio=0.2, probe_every=4)
    out, _ = speculative_generate(target, stranger, prompt, N_NEW, adaptive=adaptive, temperature=0)
    assert torch.equal(out, greedy_reference) and adaptive.history[-8:].count(0) >= 6
    before = len(adaptive.history)
    out, stats = speculative_generate(
        target, target, prompt, N_NEW, adaptive=adaptive, temperature=0
    )
    assert torch.equal(out, greedy_reference)
    # (after the stranger's probes backed off: the first probe comes late, the switch soon after)
    assert all(g >= 1 for g in adaptive.history[-5:]) and stats.accepted >= N_NEW // 8
    assert adaptive.history[before] == 0  # it started plain and switched back on its own


def test_sampled_plain_steps_are_reproducible(target, stranger, prompt):
    def run():
        adaptive = AdaptiveGamma(1, 5, cost_ratio=0.2, probe_every=4)
        gen = torch.Generator().manual_seed(0)
        return speculative_generate(
            target, stranger, prompt, 24, adaptive=adaptive, temperature=1.0, generator=gen
        )[0]

    assert torch.equal(run(), run())


def test_the_decoder_times_each_round_for_a_timed_controller(target, prompt, greedy_reference):
    # The target drafting for itself: every round accepted; the controller is told each round's
    # wall time, takes its one-off plain steps to time the target alone, and the output is exact.
    adaptive = AdaptiveGamma(2, 2, cost_ratio=0.1, timed=True, plain_samples=2)
    out, stats = speculative_generate(
        target, target, prompt, N_NEW, adaptive=adaptive, temperature=0
    )
    assert torch.equal(out, greedy_reference) and stats.acceptance_rate == 1.0
    assert adaptive.history[:5] == [2, 2, 2, 2, 0]  # the fourth drafted round asks for a sample
    assert adaptive._median(0) > 0 and adaptive._median(2) > adaptive._median(0)
    # untimed: the first round (the draft reads the prompt), each after a plain step (the draft
    # catches up), a last one cut short by the budget (not gamma 2)
    h = adaptive.history
    catch_up = sum(1 for before, g in zip([0, *h], h) if g and not before)
    cut = stats.gammas[-1] != 2
    assert len(adaptive._seconds[2]) == len(stats.gammas) - catch_up - cut > 0
    assert adaptive.overhead(2) > 0
