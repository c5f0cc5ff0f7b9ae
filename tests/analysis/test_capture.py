"""Input statistics and Hessians gathered by forward hooks, against direct computation."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torch import nn

from pipeline.analysis.capture import Capture, InputStats, outlier_summary


def test_kurtosis_and_absmax_match_direct_computation():
    torch.manual_seed(0)
    x = torch.distributions.StudentT(5.0).sample((3, 50, 24))  # heavy tails: kurtosis > 3
    st = InputStats(24)
    for chunk in x:  # streaming in pieces must equal the whole
        st.add(chunk)
    summary = st.summary()
    flat = x.reshape(-1).double().numpy()
    assert summary["kurtosis"] == pytest.approx(stats.kurtosis(flat, fisher=False), rel=1e-9)
    assert summary["kurtosis"] > 3
    assert torch.equal(st.absmax, x.abs().reshape(-1, 24).amax(0))


def test_mad_rule_flags_exactly_the_outlier_channels():
    torch.manual_seed(0)
    absmax = 1.0 + 0.05 * torch.rand(100)
    absmax[[7, 42, 93]] = torch.tensor([20.0, 35.0, 50.0])
    s = outlier_summary(absmax)
    assert s["share"] == pytest.approx(0.03)
    assert s["max_over_median"] == pytest.approx(50.0 / float(absmax.median()), rel=1e-6)
    assert outlier_summary(torch.ones(10))["share"] == 0.0


def test_capture_hessian_and_shared_inputs():
    torch.manual_seed(0)
    q, k, o = nn.Linear(8, 4), nn.Linear(8, 6), nn.Linear(4, 8)
    cap = Capture({"q": q, "k": k, "o": o}, hessians=True, shared={"k": "q"})
    xs = [torch.randn(2, 5, 8) for _ in range(3)]
    for x in xs:
        o(q(x))
        k(x)
    cap.remove()
    flat = torch.cat([x.reshape(-1, 8) for x in xs])  # (30, 8)
    torch.testing.assert_close(cap.hessian("q"), 2 * flat.T @ flat / 30, rtol=1e-5, atol=1e-6)
    assert cap.hessian("k") is cap.hessian("q")  # one accumulator for a shared input
    assert cap.stats["k"] is cap.stats["q"]
    assert cap.hessian("o").shape == (4, 4)
    assert int(cap.stats["q"].moments[0]) == flat.numel()  # k's calls were not counted twice
    o(torch.randn(1, 4))  # hooks removed: nothing changes
    assert int(cap.stats["o"].moments[0]) == 30 * 4
