"""What sensitivity records for the runtime's int8 activations, and the plan an export takes."""

from __future__ import annotations

import pytest
import torch

from pipeline.analysis.capture import ACT_COLUMNS_CAP, InputStats
from pipeline.analysis.report import LayerScore, SensitivityReport
from pipeline.quant import act8


def test_input_stats_record_act8_error_and_ranked_outlier_channels():
    torch.manual_seed(0)
    x = torch.randn(3, 40, 128)
    x[..., [9, 77, 100]] *= torch.tensor([20.0, 60.0, 40.0])
    st = InputStats(128)
    for chunk in x:  # in pieces, as batches arrive
        st.add(chunk)
    s = st.summary()
    assert s["columns"][:3] == [77, 100, 9]  # largest first
    err, ref = act8.error_sums(x).tolist()
    assert s["act8_error"] == pytest.approx((err / ref) ** 0.5, rel=1e-9)
    assert s["act8_error"] > 0.01  # the outliers coarsen their blocks: > 2x the Gaussian's


def test_columns_are_capped_and_unblocked_inputs_have_no_act8_error():
    torch.manual_seed(1)
    x = torch.randn(50, 64)
    x[:, :10] *= 100.0  # ten flagged channels, more than the cap of 64 / 16 = 4
    st = InputStats(64)
    st.add(x)
    assert len(st.summary()["columns"]) == int(64 * ACT_COLUMNS_CAP)
    odd = InputStats(24)  # not in blocks of 32: no kernel quantizes it so
    odd.add(torch.randn(5, 24))
    assert odd.summary()["act8_error"] is None


def _layer(name: str, k: int, err: float | None, cols: list[int]) -> LayerScore:
    outliers = {"share": 0.0, "act8_error": err, "columns": cols}
    return LayerScore(name, (16, k), 16 * k, 3.0, {"int4g128": 1.0}, outliers)


def _report(*layers: LayerScore) -> SensitivityReport:
    return SensitivityReport("fisher", None, "data", ["int4g128"], 4, 32, False, [], layers)


def test_activation_plan_takes_the_cap_and_the_threshold():
    report = _report(
        _layer("a", 128, 0.004, [90, 3, 50, 7, 11]),
        _layer("b", 64, 0.03, [1, 2]),
        _layer("c", 64, 0.005, []),
        _layer("old", 64, None, []),  # a report that predates activation statistics
    )
    assert report.measured_activations()
    plan = report.activation_plan(1 / 32, None)  # 4 of a's 128 inputs, 2 of b's 64
    assert plan == {"a": {"act_columns": (3, 7, 50, 90), "a16": False},
                    "b": {"act_columns": (1, 2), "a16": False}}  # fmt: skip
    plan = report.activation_plan(0.0, 0.01)  # b's error is above: its input stays float
    assert plan == {"b": {"act_columns": (), "a16": True}}
    assert report.activation_plan(0.0, None) == {}
    assert not _report(_layer("old", 64, None, [])).measured_activations()
