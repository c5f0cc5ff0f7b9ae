"""The keep decision's paired bootstrap on synthetic paired scores: a clear gain keeps the trained
model, a gain inside the noise, or a loss, keeps the input; deterministic for a seed."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import ConfigError, LowbitError
from pipeline.lit.fit import Selection, pick_best
from pipeline.lit.keep import KeepConfig, Margin, paired_bootstrap

KEEP = KeepConfig(confidence=0.95, min_gain=0.0, resamples=2000)
# Per-window NLLs that vary a lot from window to window (as real windows do), lower is better.
BEFORE = np.random.default_rng(0).normal(4.0, 1.0, 128)
NOISE = np.random.default_rng(1).normal(0.0, 0.05, 128)  # what training changes per window


def nll_margin(shift: float, noise=NOISE, seed: int = 0, keep=KEEP) -> Margin:
    after = BEFORE - shift + noise
    return paired_bootstrap(BEFORE, after, larger_is_better=False, keep=keep, seed=seed)


def test_a_clear_gain_hands_on_the_trained_model():
    m = nll_margin(0.05)  # every window ~0.05 nats better, noise sd 0.05 over 128 windows
    assert m.gain == pytest.approx(0.05 - NOISE.mean())
    assert 0 < m.low < m.gain < m.high
    assert m.trained and not m.unresolved
    assert m.windows == 128 and m.resamples == 2000


def test_a_gain_inside_the_noise_keeps_the_input():
    # A mean gain of +0.003 nats, but the windows disagree by 0.05: the lower bound is below 0.
    m = nll_margin(0.003 + NOISE.mean())
    assert m.gain == pytest.approx(0.003)
    assert m.low < 0 < m.gain and not m.trained
    assert m.unresolved  # the half-width exceeds the gain: more windows would tell


def test_a_loss_keeps_the_input():
    m = nll_margin(-0.05)
    assert m.gain < 0 and m.high < 0 and not m.trained


def test_min_gain_raises_the_bar():
    assert nll_margin(0.05).trained
    assert not nll_margin(0.05, keep=KeepConfig(min_gain=0.1)).trained


def test_the_same_seed_gives_the_same_bounds_and_another_seed_other_ones():
    a, b, c = nll_margin(0.01), nll_margin(0.01), nll_margin(0.01, seed=1)
    assert (a.low, a.high) == (b.low, b.high)
    assert (a.low, a.high) != (c.low, c.high)
    assert a.gain == c.gain  # the point estimate does not depend on the resamples


def test_bounds_match_the_normal_approximation():
    m = nll_margin(0.05)
    diff = -NOISE  # before - after, minus the shift
    se = diff.std(ddof=1) / np.sqrt(diff.size)
    assert m.half_width == pytest.approx(1.645 * se, rel=0.15)


def test_groups_weigh_alike_and_resample_within_themselves():
    # Group 0 (4 windows) gains 1.0 on each, group 1 (100 windows) loses 0.1 on each: the mean
    # of group means is +0.45; pooling the windows would say -0.058.
    before = np.zeros(104)
    after = np.r_[np.full(4, 1.0), np.full(100, -0.1)]
    groups = [0] * 4 + [1] * 100
    m = paired_bootstrap(before, after, larger_is_better=True, keep=KEEP, seed=0, groups=groups)
    assert m.gain == pytest.approx(0.45)
    assert m.low == pytest.approx(0.45) and m.high == pytest.approx(0.45)  # no spread within


def test_a_nan_score_never_hands_on_the_trained_model():
    after = BEFORE - 1.0
    after[3] = np.nan
    m = paired_bootstrap(BEFORE, after, larger_is_better=False, keep=KEEP, seed=0)
    assert not m.trained


def test_margin_round_trips_through_its_report_form():
    m = nll_margin(0.05)
    assert Margin.load(m.describe()) == m
    assert m.metrics()["keep_ci_low"] == m.low


def test_pick_best_keeps_the_input_when_the_best_mean_is_noise(caplog):
    before = {"step": 0.0, "nll": float(BEFORE.mean()), "windows": BEFORE.tolist()}
    after = BEFORE - (0.003 + NOISE.mean()) + NOISE
    check = {"step": 5.0, "nll": float(after.mean()), "windows": after.tolist()}
    select = Selection("val/nll", "nll", larger_is_better=False, keep=KEEP, seed=0)
    with caplog.at_level("WARNING", logger="pipeline"):
        chosen, kept, margin = pick_best("distill", before, [check], select)
    assert chosen is check and check["nll"] < before["nll"]  # better on the mean, and yet
    assert kept and margin.gain == pytest.approx(0.003)
    assert "raise stage.distill.val_windows" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline"):
        assert pick_best("distill", before, [check], select, warn=False)[1]  # the other ranks
    assert not caplog.text


@pytest.mark.parametrize(
    "override, key",
    [
        ({"confidence": 1.0}, "confidence"),
        ({"confidence": 0.3}, "confidence"),
        ({"min_gain": -0.1}, "min_gain"),
        ({"resamples": 10}, "resamples"),
    ],
)
def test_check_names_the_bad_key(override, key):
    with pytest.raises(ConfigError, match=rf"stage\.distill\.keep\.{key}"):
        KeepConfig(**override).check("stage.distill.keep")


def test_records_without_window_scores_name_the_work_dir_to_remove():
    old = {"step": 0.0, "nll": 4.0}  # a record from a checkpoint that kept means only
    select = Selection("val/nll", "nll", larger_is_better=False)
    with pytest.raises(LowbitError, match=r"remove <run_dir>/\.work/distill-\*"):
        pick_best("distill", old, [{"step": 5.0, "nll": 3.9}], select)
