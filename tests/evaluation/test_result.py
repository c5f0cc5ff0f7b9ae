"""EvalResult: save/load round-trips, reads files written before the schema version, refuses
a version it does not know, and flattens to the tracker's metrics."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipeline.errors import LowbitError
from pipeline.evaluation.result import FILENAME, SCHEMA_VERSION, EvalResult

FULL = EvalResult(
    ppl={"target_fp": 12.0, "target_quantized": 13.5, "draft_fp": 30.0},
    ppl_protocol={"split": "test", "window": 64, "windows": 10, "tokens": 630},
    acceptance={"draft_fp@target_fp": {"mix": 0.6, "long": 0.4, "mean": 0.5}},
    speculative={
        "draft_fp@target_fp": {
            "mix": {"alpha_tf": 0.6, "alpha": 0.6, "acceptance_rate": 0.5, "tau": 2.0, "gamma": 3},
            "long": {"alpha_tf": 0.4, "alpha": 0.4, "acceptance_rate": 0.3, "tau": 1.0, "gamma": 2},
        }
    },
    costs={"draft_fp@target_fp": {"cost_ratio": 0.2, "verify_cost": {2: 1.1, 3: 1.2}}},
    error_flow={"quantized": [0.01, 0.03]},
    lm_eval={"target_fp": {"arc_easy": {"acc": 0.5, "acc_stderr": 0.01}}},
    speed={
        "plain": {"target_fp": {"tokens_per_s": 100.0, "kernels": "float (F.linear)"}},
        "speculative": {"draft_fp@target_fp": {"speedup": 1.5}},
    },
    speed_table={
        "width": 64,
        "rows": [
            {"row": "FP plain", "ms_per_token": 10.0, "x_fp_plain": 1.0},
            {"row": "target_quantized + draft_reinforced", "ms_per_token": 4.0, "x_fp_plain": 2.5},
        ],
    },
)


def test_save_then_load_gives_the_same_result(tmp_path):
    path = FULL.save(tmp_path)
    assert path == tmp_path / FILENAME
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION
    assert EvalResult.load(tmp_path) == FULL  # gamma keys come back as ints
    EvalResult(ppl={"m": 1.0}).save(tmp_path)
    assert EvalResult.load(tmp_path) == EvalResult(ppl={"m": 1.0})


def test_a_file_without_a_version_reads_as_version_1(tmp_path):
    # As the evaluate stage wrote it before the version was recorded: no "version", no "costs".
    old = {"ppl": {"target_fp": 12.0}, "ppl_protocol": None, "acceptance": {}, "speculative": {}}
    (tmp_path / FILENAME).write_text(json.dumps(old))
    ev = EvalResult.load(tmp_path)
    assert ev.ppl == {"target_fp": 12.0} and ev.costs is None and ev.speed is None


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, "2", 0])
def test_an_unknown_version_is_refused_in_one_line_naming_the_fix(tmp_path, version):
    (tmp_path / FILENAME).write_text(
        json.dumps({"schema": "lowbit.eval", "schema_version": version})
    )
    with pytest.raises(LowbitError, match="rerun the evaluate stage") as err:
        EvalResult.load(tmp_path)
    assert "\n" not in str(err.value) and repr(version) in str(err.value)


@pytest.mark.parametrize("text", [None, "{trunc", "[1, 2]", "{}"])
def test_a_missing_or_corrupt_file_names_the_stage_to_rerun(tmp_path, text):
    if text is not None:
        (tmp_path / FILENAME).write_text(text)
    with pytest.raises(LowbitError, match="rerun the evaluate stage"):
        EvalResult.load(tmp_path)


def test_greedy_metrics_reach_the_tracker_where_measured():
    greedy = {"greedy_match": 0.5, "alpha_greedy": 0.45, "tau_greedy": 2.0}
    cells = {s: m | greedy for s, m in FULL.speculative["draft_fp@target_fp"].items()}
    cells["long"] = cells["long"] | {"greedy_match": 0.3}
    ev = replace(FULL, speculative={"draft_fp@target_fp": cells}, temperature=0.0)
    assert ev.has_greedy("draft_fp@target_fp") and not FULL.has_greedy("draft_fp@target_fp")
    m = ev.metrics()
    assert m["greedy_match_draft_fp-vs-target_fp_long"] == 0.3
    assert m["greedy_match_draft_fp-vs-target_fp_mean"] == pytest.approx(0.4)
    assert m["tau_greedy_draft_fp-vs-target_fp_mean"] == 2.0
    assert m["alpha_greedy_draft_fp-vs-target_fp_mean"] == pytest.approx(0.45)
    assert not any(k.startswith(("greedy", "tau_greedy")) for k in FULL.metrics())
    assert EvalResult.from_dict(ev.to_dict()) == ev  # the temperature round-trips


def test_metrics_flatten_every_measurement():
    m = FULL.metrics()
    assert m["ppl_target_quantized"] == 13.5 and m["error_flow_last_quantized"] == 0.03
    assert m["alpha_draft_fp-vs-target_fp_mix"] == 0.6
    assert m["tau_draft_fp-vs-target_fp_mean"] == pytest.approx(1.5)
    assert m["lm_eval_target_fp_arc_easy_acc"] == 0.5
    assert m["tok_s_target_fp"] == 100.0 and m["speedup_draft_fp-vs-target_fp"] == 1.5
    assert m["ms_per_token_FP_plain"] == 10.0  # MLflow keys: no "+" or spaces
    assert m["x_fp_plain_target_quantized_draft_reinforced"] == 2.5
    assert EvalResult(ppl={"m": 2.0}).metrics() == {"ppl_m": 2.0}
