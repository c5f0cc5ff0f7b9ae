"""BitPlan: the file round-trips, formats come back parsed, unknown versions are refused."""

from __future__ import annotations

import json

import pytest

from pipeline.config import QuantConfig
from pipeline.errors import LowbitError
from pipeline.quant.allocate import make_plan
from pipeline.quant.formats import parse_format
from pipeline.quant.plan import BitPlan

SHAPES = {"a.q_proj": (8, 64), "a.k_proj": (8, 64), "a.o_proj": (8, 64), "lm_head": (16, 64)}


def plan() -> BitPlan:
    q = QuantConfig(candidates=["int2g32", "int4g32"], budget_bits=3.5, keep_float=["lm_head"])
    dloss = {"a.q_proj": 1.0, "a.k_proj": 2.0, "a.o_proj": 0.5, "lm_head": 9.0}
    scores = {n: _Score({"int2g32": d, "int4g32": d / 4}) for n, d in dloss.items()}
    return make_plan(SHAPES, scores, [["a.q_proj", "a.k_proj"]], q.recipe)


class _Score:
    def __init__(self, dloss):
        self.dloss, self.dloss_keep, self.outlier_columns = dloss, None, None


def test_round_trip_keeps_formats_parsed(tmp_path):
    p = plan().replace(score="fisher")
    path = p.save(tmp_path)
    assert path == tmp_path / "bitplan.json" and BitPlan.load(path) == p
    loaded = BitPlan.load(tmp_path)
    assert loaded == p and loaded.layers["lm_head"] == parse_format("float")
    assert set(loaded.quantized()) == {"a.q_proj", "a.k_proj", "a.o_proj"}
    raw = json.loads(path.read_text())
    assert raw["schema"] == BitPlan.SCHEMA and raw["schema_version"] == BitPlan.VERSION
    assert raw["layers"]["lm_head"] == "float" and "outlier_columns" not in raw


def test_a_file_without_a_version_is_version_1(tmp_path):
    raw = plan().to_dict()  # what allocate wrote before files carried a version
    (tmp_path / "bitplan.json").write_text(json.dumps(raw))
    assert BitPlan.load(tmp_path) == plan()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"schema_version": BitPlan.VERSION + 1}, r"version 2, newer than this lowbit reads \(1\)"),
        ({"schema": "lowbit.quant_report"}, r"is a lowbit\.quant_report file"),
    ],
)
def test_newer_or_foreign_files_are_refused_in_one_line(tmp_path, header, message):
    (tmp_path / "bitplan.json").write_text(json.dumps({**plan().to_dict(), **header}))
    with pytest.raises(LowbitError, match=message) as err:
        BitPlan.load(tmp_path)
    assert "\n" not in str(err.value) and "allocate" in str(err.value)


def test_missing_or_malformed_files_name_the_stage_to_rerun(tmp_path):
    with pytest.raises(LowbitError, match="rerun the allocate stage"):
        BitPlan.load(tmp_path)
    (tmp_path / "bitplan.json").write_text(json.dumps({"layers": {"x": "int4"}}))
    with pytest.raises(LowbitError, match="malformed.*rerun the allocate stage"):
        BitPlan.load(tmp_path)
