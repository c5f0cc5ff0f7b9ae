"""SensitivityReport: exactly the estimators' report, through the file and back."""

from __future__ import annotations

import json

import pytest

from pipeline.analysis.report import SensitivityReport
from pipeline.analysis.sensitivity import analyze
from pipeline.errors import LowbitError
from tests.analysis.conftest import tiny_llama, windows

FORMATS = ["int4g32", "int2g32"]


@pytest.mark.parametrize("keep_cap", [None, 0.25])
def test_report_round_trips_the_estimators_dict(tmp_path, keep_cap):
    raw = analyze(tiny_llama(), windows(n=2), FORMATS, "gptq_proxy", keep_cap=keep_cap)
    report = SensitivityReport.from_dict(raw)
    assert report.to_dict() == raw
    report.save(tmp_path)
    loaded = SensitivityReport.load(tmp_path / "sensitivity.json")
    assert loaded.to_dict() == json.loads(json.dumps(raw))  # shapes as JSON lists
    layer = loaded.by_name()["lm_head"]
    assert layer.shape == tuple(raw["layers"][-1]["shape"]) and set(layer.dloss) == set(FORMATS)
    assert (layer.outlier_columns is not None) == (keep_cap is not None)


def test_a_newer_version_is_refused(tmp_path):
    raw = analyze(tiny_llama(), windows(n=2), FORMATS, "gptq_proxy")
    (tmp_path / "sensitivity.json").write_text(json.dumps({**raw, "schema_version": 7}))
    with pytest.raises(LowbitError, match="version 7, newer.*rerun the sensitivity stage"):
        SensitivityReport.load(tmp_path)
    (tmp_path / "sensitivity.json").write_text(json.dumps(raw))  # before versions: version 1
    assert SensitivityReport.load(tmp_path).to_dict() == json.loads(json.dumps(raw))
