"""Adaptive draft length: stays in bounds and follows the measured acceptance."""

import random

import pytest

from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.metrics import theoretical_speedup


def test_gamma_stays_within_bounds_under_random_rounds():
    adaptive = AdaptiveGamma(gamma_min=2, gamma_max=5, window=8, cost_ratio=0.2)
    rng = random.Random(0)
    for _ in range(500):
        gamma = adaptive.gamma
        assert 2 <= gamma <= 5
        accepted = rng.randint(0, gamma)
        adaptive.update(accepted, min(accepted + 1, gamma))
    assert set(adaptive.history) <= {2, 3, 4, 5}


def test_gamma_follows_acceptance():
    adaptive = AdaptiveGamma(gamma_min=2, gamma_max=6, window=10, cost_ratio=0.2)
    for _ in range(10):
        adaptive.update(adaptive.gamma, adaptive.gamma)  # everything accepted
    assert adaptive.gamma == 6
    for _ in range(10):
        adaptive.update(0, 1)  # everything rejected at the first position
    assert adaptive.gamma == 0  # no block pays: plain decoding


def test_chosen_gamma_maximises_expected_speedup():
    adaptive = AdaptiveGamma(gamma_min=1, gamma_max=8, window=100, cost_ratio=0.3)
    for _ in range(40):
        adaptive.update(3, 4)  # alpha ~ 0.75
    best = max(range(1, 9), key=lambda g: theoretical_speedup(adaptive.alpha, g, 0.3))
    assert adaptive.gamma == best
    assert 1 < best < 8


def test_a_costly_verification_shortens_the_block():
    # All accepted: with v = 1 the longest block wins; when 5+ tokens cost twice what 4 do
    # (a CPU kernel working 4 rows at a time), gamma 3 (4 tokens verified) wins instead.
    steps = {2: 1.6, 3: 1.8, 4: 3.5, 5: 3.6}
    for verify_cost, want in (({}, 5), (steps, 3)):
        adaptive = AdaptiveGamma(2, 5, cost_ratio=0.1, verify_cost=verify_cost)
        for _ in range(10):
            adaptive.update(adaptive.gamma, adaptive.gamma)
        assert adaptive.gamma == want


def test_free_drafting_always_uses_the_longest_block():
    adaptive = AdaptiveGamma(gamma_min=2, gamma_max=5, cost_ratio=0.0)
    for _ in range(5):
        adaptive.update(0, 1)
    assert adaptive.gamma == 5


def test_window_forgets_old_rounds():
    adaptive = AdaptiveGamma(gamma_min=2, gamma_max=5, window=3, cost_ratio=0.2)
    for _ in range(20):
        adaptive.update(0, 1)
    for _ in range(3):
        adaptive.update(5, 5)
    assert adaptive.alpha == pytest.approx(16 / 17)


@pytest.mark.parametrize(
    "kwargs",
    [{"gamma_min": 0}, {"gamma_min": 4, "gamma_max": 3}, {"window": 0}, {"cost_ratio": -1}],
)
def test_invalid_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        AdaptiveGamma(**{"cost_ratio": 0.2} | kwargs)


def test_the_cost_ratio_is_required_and_the_window_defaults_to_64():
    with pytest.raises(TypeError, match="cost_ratio"):
        AdaptiveGamma(2, 5)  # a guessed c would pick the wrong gamma
    adaptive = AdaptiveGamma(cost_ratio=0.2)
    for _ in range(64):
        adaptive.update(4, 4)
    for _ in range(63):
        adaptive.update(0, 1)
    assert adaptive.alpha == pytest.approx(5 / 69)  # one accepted round still in the window
    adaptive.update(0, 1)
    assert adaptive.alpha == pytest.approx(1 / 66)


def test_gamma_shrinks_when_the_monitored_acceptance_drops():
    # A draft that was good (every token accepted) meets text it cannot predict: the windowed
    # alpha falls, and the draft length follows it down within the window.
    adaptive = AdaptiveGamma(2, 5, cost_ratio=0.2, allow_plain=False)
    for _ in range(64):
        adaptive.update(adaptive.gamma, adaptive.gamma)
    assert adaptive.gamma == 5
    for _ in range(64):
        adaptive.update(0, 1)
    assert adaptive.gamma == 2 and adaptive.alpha < 0.1
    assert adaptive.history[63] == 5 and adaptive.history[-1] == 2


def test_a_draft_that_never_agrees_switches_to_plain_decoding():
    # alpha ~ 0: even gamma 1 costs c + v for ~1 token, so plain decoding (speed-up 1) wins.
    adaptive = AdaptiveGamma(1, 5, cost_ratio=0.2)
    for _ in range(10):
        adaptive.update(0, 1)
    assert adaptive.gamma == 0 and adaptive.speedup(adaptive.best_gamma()) < 1
    fixed = AdaptiveGamma(1, 5, cost_ratio=0.2, allow_plain=False)
    for _ in range(10):
        fixed.update(0, 1)
    assert fixed.gamma == 1  # without allow_plain the shortest block is the floor


def test_a_draft_that_always_agrees_never_chooses_plain():
    adaptive = AdaptiveGamma(1, 5, window=8, cost_ratio=0.1)
    for _ in range(200):
        g = adaptive.gamma
        adaptive.update(g, g)
    assert 0 not in adaptive.history and adaptive.gamma == 5


def test_plain_decoding_probes_backs_off_and_switches_back():
    adaptive = AdaptiveGamma(1, 4, cost_ratio=0.2, probe_every=5)
    for _ in range(10):
        adaptive.update(0, 1)
    assert adaptive.gamma == 0

    def plain_until_probe() -> int:
        steps = 0
        while adaptive.gamma == 0:
            adaptive.update(0, 0)  # plain steps leave the window alone
            steps += 1
        return steps

    assert plain_until_probe() == 5 and adaptive.alpha == pytest.approx(1 / 12)
    gaps = []
    for _ in range(6):  # the draft still disagrees: back to plain, each gap twice the last
        adaptive.update(0, 1)
        gaps.append(plain_until_probe())
    assert gaps == [10, 20, 40, 80, 80, 80]  # up to MAX_BACKOFF (here 16) x probe_every
    probes = 0
    while True:  # the draft now agrees: each probe accepts its whole block
        adaptive.update(adaptive.gamma, adaptive.gamma)
        probes += 1
        if adaptive.gamma:
            break
        plain_until_probe()
    assert probes <= 5
    adaptive.update(0, 1)
    while adaptive.gamma:  # speculating reset the gap: plain again, the next probe comes soon
        adaptive.update(0, 1)
    assert plain_until_probe() == 5


def test_probe_every_must_be_positive():
    with pytest.raises(ValueError, match="probe_every"):
        AdaptiveGamma(cost_ratio=0.2, probe_every=0)


def test_a_timed_controller_prices_rounds_with_what_they_cost():
    # The model (c = 0.1, v = 1) promises alpha ~0.67 at gamma 3 a speed-up of 1.85; rounds that
    # take 4 plain steps' time (fixed per-round work the model leaves out) give 0.6: plain wins.
    adaptive = AdaptiveGamma(3, 3, cost_ratio=0.1, timed=True, plain_samples=2)
    plain, round_s, seen = 0.010, 0.040, []
    for _ in range(40):
        g = adaptive.gamma
        seen.append(g)
        if g == 0:
            adaptive.update(0, 0, plain)
        else:
            adaptive.update(2, 3, round_s)
    assert seen[:4] == [3] * 4 and seen[4] == 0  # a one-off plain step to time the target
    assert adaptive.overhead(3) == pytest.approx(round_s / (plain * 1.3))
    assert adaptive.speedup(3) < 1 and adaptive.gamma == 0 and seen[-5:].count(0) >= 4
    untimed = AdaptiveGamma(3, 3, cost_ratio=0.1)
    for _ in range(40):
        untimed.update(2, 3, round_s)  # seconds are ignored unless timed
    assert untimed.overhead(3) == 1.0 and 0 not in untimed.history


def test_a_timed_controller_keeps_drafting_when_rounds_pay():
    adaptive = AdaptiveGamma(1, 4, cost_ratio=0.1, timed=True, plain_samples=3)
    for _ in range(60):
        g = adaptive.gamma
        adaptive.update(0, 0, 0.010) if g == 0 else adaptive.update(g, g, 0.010 * (0.1 * g + 1.1))
    assert adaptive.history.count(0) == 3  # only the timing samples
    assert adaptive.gamma == 4 and adaptive.overhead(4) == pytest.approx(1.5 / 1.4)


def test_without_plain_steps_a_timed_controller_still_drafts():
    adaptive = AdaptiveGamma(1, 4, cost_ratio=0.1, timed=True, allow_plain=False)
    for _ in range(20):
        adaptive.update(0, 1, 0.05)
    assert 0 not in adaptive.history and adaptive.overhead(1) == 1.0  # no plain time to compare
