"""runtime_speed: every model timed plain and every pair speculatively, on runtime modules;
speed_report: the design's table of the run's own models, against FP plain."""

import pytest

from pipeline.evaluation.speed import format_speed_table, runtime_speed, speed_report, speed_table
from pipeline.runtime.speed import weight_bytes
from tests.speculative.conftest import tiny_llama

SETTINGS = dict(new_tokens=4, gamma=2, temperature=1.0, temperature_schedule=False, seed=0)


def test_every_model_and_pair_gets_a_row():
    models = {"t": tiny_llama(0), "d": tiny_llama(1)}
    speed = runtime_speed(models, [("d", "t")], [list(range(1, 13))], adaptive=None, **SETTINGS)
    assert set(speed["plain"]) == {"t", "d"} and set(speed["speculative"]) == {"d@t"}
    row = speed["speculative"]["d@t"]
    assert row["tokens_per_s"] > 0 and 0 <= row["alpha"] <= 1 and row["gamma"] <= 2
    for r in (*speed["plain"].values(), row):  # a median of three passes, with its spread
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["ms_per_token"] == pytest.approx(1000 / r["tokens_per_s"])
    assert row["weight_bytes"] == weight_bytes(models["t"]) + weight_bytes(models["d"])
    # Keys and values of 2 layers x 4 heads x 8 dims for 12 + 4 positions, float32, per model.
    assert speed["plain"]["t"]["kv_bytes"] == 2 * 2 * 32 * 16 * 4
    assert row["kv_bytes"] == 2 * speed["plain"]["t"]["kv_bytes"]


def test_the_report_has_the_design_rows_against_fp_plain(tmp_path):
    # Float stand-ins under the run's names: the table's wiring, not low-bit speed.
    models = {
        "target_fp": tiny_llama(0),
        "draft_fp": tiny_llama(1, layers=1),
        "target_quantized": tiny_llama(0),
        "draft_reinforced": tiny_llama(0, layers=1),
    }
    pairs = [("draft_fp", "target_fp"), ("draft_reinforced", "target_quantized")]
    out = speed_report(
        models, pairs, [list(range(1, 13))], tmp_path, adaptive=(1, 3, 64), **SETTINGS
    )
    rows = out["speed_table"]["rows"]
    assert [r["row"] for r in rows] == [
        "FP plain",
        "FP + FP draft",
        "target_quantized plain",
        "target_quantized + draft_reinforced",
    ]
    # Each ratio from passes timed side by side: a pair's speed-up over its target's plain
    # passes, times the target's over FP plain's.
    plain, specs = out["speed"]["plain"], out["speed"]["speculative"]
    x_low = plain["target_quantized"]["x_reference"]
    assert plain["target_fp"]["x_reference"] == 1.0 and x_low > 0
    assert [r["x_fp_plain"] for r in rows] == pytest.approx([
        1.0,
        specs["draft_fp@target_fp"]["speedup"],
        x_low,
        x_low * specs["draft_reinforced@target_quantized"]["speedup"],
    ])  # fmt: skip
    assert rows[0]["alpha"] is None and rows[0]["gamma"] == 0
    spec = out["speed"]["speculative"]["draft_reinforced@target_quantized"]
    assert rows[3]["alpha"] == spec["alpha"] and rows[3]["tau"] == spec["tau"]
    assert (tmp_path / "speed.png").stat().st_size > 0
    text = "\n".join(format_speed_table(out["speed_table"]))
    assert "| FP plain | " in text and "32 wide are overhead-bound" in text
    assert "bench.decode_speed" in text


def test_a_plain_row_against_the_reference_is_the_median_of_side_by_side_passes():
    models = {"t": tiny_llama(0), "deep": tiny_llama(0, layers=12)}
    speed = runtime_speed(
        models, [], [list(range(1, 13))], adaptive=None, reference="t", **SETTINGS
    )
    plain = speed["plain"]
    assert plain["t"]["x_reference"] == 1.0
    assert plain["deep"]["x_reference"] < 0.8  # six times the layers: every pass sees it slower


def test_the_table_keeps_only_the_rows_the_run_has():
    row = {"tokens_per_s": 10.0, "tokens_per_s_min": 9.0, "tokens_per_s_max": 11.0,
           "ms_per_token": 100.0, "weight_bytes": 1, "kv_bytes": 1}  # fmt: skip
    speed = {"plain": {"target_fp": row, "target_quantized": {**row, "tokens_per_s": 25.0}},
             "speculative": {}}  # fmt: skip
    table = speed_table(speed, "target_quantized", None, 64)
    assert [r["row"] for r in table["rows"]] == ["FP plain", "target_quantized plain"]
    assert table["rows"][1]["x_fp_plain"] == 2.5  # a result saved before paired ratios
