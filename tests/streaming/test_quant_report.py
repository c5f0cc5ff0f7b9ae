"""QuantReport: the summary without its run facts, through the file and back."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import LowbitError
from pipeline.streaming.quant_report import QuantReport

LAYER = {"format": "int4g32", "shape": [8, 64], "gptq_loss": 0.5, "rel_output_error": 0.1}
SUMMARY = {
    "method": "gptq", "segments": 2, "resumed_segments": 1, "world_size": 1,
    "calib_samples": 4, "calib_seq_len": 16, "quantized_layers": 2, "avg_bits": 4.5,
    "mean_rel_output_error": 0.15, "max_rel_output_error": 0.2, "seconds": 3.0,
    "layers": {"a": {**LAYER, "seconds": 1.0},
               "b": {**LAYER, "rel_output_error": 0.2, "kept_columns": 2, "seconds": 1.0}},
}  # fmt: skip


def test_run_facts_stay_out_of_the_file(tmp_path):
    report = QuantReport.from_dict(SUMMARY)
    path = report.save(tmp_path)
    raw = json.loads(path.read_text())
    assert "seconds" not in raw and "resumed_segments" not in raw
    assert all("seconds" not in r for r in raw["layers"].values())
    assert "kept_columns" not in raw["layers"]["a"] and raw["layers"]["b"]["kept_columns"] == 2
    loaded = QuantReport.load(tmp_path)
    assert loaded == report and loaded.rel_output_error == {"a": 0.1, "b": 0.2}


def test_old_files_load_and_newer_ones_are_refused(tmp_path):
    old = QuantReport.from_dict(SUMMARY).to_dict()  # before files carried a version
    (tmp_path / "quant_report.json").write_text(json.dumps(old))
    assert QuantReport.load(tmp_path).layers["b"].kept_columns == 2
    (tmp_path / "quant_report.json").write_text(json.dumps({**old, "schema_version": 2}))
    with pytest.raises(LowbitError, match="newer than this lowbit.*rerun the quantize stage"):
        QuantReport.load(tmp_path)
