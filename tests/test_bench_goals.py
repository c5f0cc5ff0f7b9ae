"""Each benchmark's goal function on synthetic rows: goals met, goals missed, and goals whose rows
are missing, which must be missed as "(not measured: ...)" rather than vanish; and the one way
to narrow the goal set, ``--skip-goal``. Pure function calls: nothing is built or measured."""

from __future__ import annotations

import argparse
import ast
import importlib
import math
import sys
import time
from pathlib import Path

import pytest

from bench import (
    acceptance,
    decode_speed,
    default_model,
    distill_effect,
    exp_codes,
    exp_design,
    fisher_memory,
    float_rows,
    headline,
    importance_fit,
    log_gaps,
    outliers,
    pipelined,
    quality,
    rehearsal,
)
from bench._common import add_goal_args, goal, report_goals, unmeasured
from tests.conftest import REPO

MODULES_WITH_GOALS = sorted(
    p.stem
    for p in (REPO / "bench").glob("*.py")
    if not p.stem.startswith("_") and "report_goals(" in p.read_text()
)


def verdicts(goals: list[dict]) -> list[str]:
    return [g["verdict"] for g in goals]


def not_measured(goals: list[dict]) -> list[dict]:
    """The goals that could not be checked: missed, no value, their name says why."""
    found = [g for g in goals if "(not measured: " in g["goal"]]
    assert all(g["verdict"] == "MISSED" and g["value"] is None for g in found)
    return found


# --- the shared mechanism -----------------------------------------------------------------------


def test_a_goal_that_could_not_be_checked_fails_the_run(tmp_path, capsys):
    goals = [goal("a", 1.0, ">= 1", True), unmeasured("b", ">= 1", "add its rows")]
    assert report_goals(goals, tmp_path) == 1
    out = capsys.readouterr().out
    assert "b (not measured: add its rows)" in out and "goals missed: b (not measured" in out
    assert "MISSED" in (tmp_path / "goals.md").read_text()


def test_skip_goal_leaves_out_the_goals_it_names_and_only_those(capsys):
    goals = [goal("W4g128 x FP32", 2.0, ">= 1.8", True), unmeasured("W8 x FP32", ">= 1.5", "rows")]
    assert report_goals(goals, skip=["W8"]) == 0
    out = capsys.readouterr().out
    assert "skipped (MISSED)" in out and "every goal checked met (1 skipped)" in out
    assert report_goals(goals, skip=["W4"]) == 1  # the unmeasured one still counts
    assert report_goals([goal("x", 0.0, ">= 1", False)], skip=["y"]) == 1
    assert "--skip-goal 'y' matches no goal" in capsys.readouterr().out


def test_met_goals_pass_and_an_empty_goal_list_does_not(capsys):
    assert report_goals([goal("a", 1.0, ">= 1", True)]) == 0
    assert "every goal met" in capsys.readouterr().out
    assert report_goals([]) == 1


def test_skip_goal_is_repeatable_and_empty_by_default():
    p = argparse.ArgumentParser()
    add_goal_args(p)
    assert p.parse_args([]).skip_goal == []
    assert p.parse_args(["--skip-goal", "a", "--skip-goal", "b c"]).skip_goal == ["a", "b c"]


@pytest.mark.parametrize("name", MODULES_WITH_GOALS)
def test_every_bench_with_goals_offers_skip_goal(name, monkeypatch, capsys):
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"bench.{name}", "--help"])
    with pytest.raises(SystemExit):
        module.main()
    assert "--skip-goal" in capsys.readouterr().out


@pytest.mark.parametrize("name", MODULES_WITH_GOALS)
def test_every_report_goals_call_passes_the_skip_list(name):
    calls = [
        node
        for node in ast.walk(ast.parse((REPO / "bench" / f"{name}.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "report_goals"
    ]
    assert calls
    for call in calls:
        assert len(call.args) == 3 or any(k.arg == "skip" for k in call.keywords), (
            f"bench/{name}.py line {call.lineno}: report_goals without --skip-goal's list"
        )


# --- acceptance ---------------------------------------------------------------------------------


def alpha_table(**alpha: float) -> dict:
    """``pair=alpha`` (``@`` spelled ``_at_``) as acceptance_table's rows with their mean."""
    return {k.replace("_at_", "@"): {"mean": {"alpha_tf": a}} for k, a in alpha.items()}


def test_acceptance_alpha_goals_met_and_missed():
    table = alpha_table(
        draft_reinforced_at_target_quantized=0.70,
        draft_fp_at_target_fp=0.60,
        draft_fp_at_target_quantized=0.62,
    )
    assert verdicts(acceptance.acceptance_goals(table, "target_quantized")) == ["met", "met"]
    table["draft_reinforced@target_quantized"]["mean"]["alpha_tf"] = 0.65  # < 0.62 + 0.05
    assert verdicts(acceptance.acceptance_goals(table, "target_quantized")) == ["met", "MISSED"]


def test_acceptance_without_a_reinforce_stage_misses_both_alpha_goals(capsys):
    table = alpha_table(draft_fp_at_target_fp=0.6, draft_fp_at_target_quantized=0.5)
    goals = acceptance.acceptance_goals(table, None)
    assert len(not_measured(goals)) == 2
    assert all("the run has no reinforce stage" in g["goal"] for g in goals)
    assert report_goals(goals) == 1
    assert report_goals(goals, skip=["draft_reinforced"]) == 0


def test_acceptance_a_missing_pair_row_is_missed():
    table = alpha_table(draft_reinforced_at_target_quantized=0.7, draft_fp_at_target_fp=0.6)
    goals = acceptance.acceptance_goals(table, "target_quantized")
    assert verdicts(goals) == ["met", "MISSED"]
    assert "no draft_fp@target_quantized row" in not_measured(goals)[0]["goal"]
    goals = acceptance.acceptance_goals(alpha_table(draft_fp_at_target_fp=0.6), "target_quantized")
    assert all("no draft_reinforced@target_quantized" in g["goal"] for g in not_measured(goals))


def test_acceptance_speed_goal_per_low_bit_pair_and_missing_rows_missed():
    pairs = [
        ("draft_fp", "target_fp"),
        ("draft_fp", "target_quantized"),
        ("self_int2", "target_int8"),
    ]
    speed = {"speculative": {"draft_fp@target_fp": {"of_theory": 0.1},
                             "draft_fp@target_quantized": {"of_theory": 0.9}}}  # fmt: skip
    goals = acceptance.speed_goals(speed, pairs)
    assert [g["goal"].split(" ")[0] for g in goals] == [
        "draft_fp@target_quantized",
        "self_int2@target_int8",
    ]  # an FP target is not a goal
    assert verdicts(goals) == ["met", "MISSED"] and len(not_measured(goals)) == 1
    speed["speculative"]["self_int2@target_int8"] = {"of_theory": 0.5}
    assert verdicts(acceptance.speed_goals(speed, pairs)) == ["met", "MISSED"]
    assert not not_measured(acceptance.speed_goals(speed, pairs))


# --- decode_speed -------------------------------------------------------------------------------


def speed_rows(sub4: dict[str, float] | None = None, **x_fp32: float) -> list[dict]:
    """FP32 and ``row=x FP32`` rows, plus the sub-4-bit rows ``sub4`` as multiples of W4g128."""
    rows = [{"row": "FP32", "x FP32": 1.0}]
    rows += [{"row": row, "x FP32": x} for row, x in x_fp32.items()]
    sub4 = {"W2": 1.6, "W3": 1.3, "exp4": 0.9} if sub4 is None else sub4
    return rows + [{"row": row, "x W4g128": x} for row, x in sub4.items()]


SPEC = [
    {"gamma": 2, "measured": 1.4, "measured / theoretical": 0.82, "v": 1.1},
    {"gamma": 4, "measured": 1.6, "measured / theoretical": 0.85, "v": 1.2},
]


@pytest.mark.parametrize("isa", ["avx512", None])
def test_decode_speed_goals_met_and_missed(isa):
    goals = decode_speed.check_goals(speed_rows(W4g128=2.0, W8=1.6), SPEC, isa)
    assert verdicts(goals) == ["met"] * 7
    assert ["(gamma 2)" in goals[-2]["goal"], "(gamma 4)" in goals[-1]["goal"]] == [True, True]
    slow = speed_rows({"W2": 1.4, "W3": 1.3, "exp4": 0.7}, W4g128=1.2, W8=1.6)
    goals = decode_speed.check_goals(slow, SPEC, isa)
    assert verdicts(goals) == ["MISSED", "met", "MISSED", "met", "MISSED", "met", "met"]
    assert not not_measured(goals)


def test_decode_speed_speculative_goal_holds_at_every_gamma_not_the_best():
    spec = [{**SPEC[0], "measured / theoretical": 0.7}, SPEC[1]]  # gamma 4 fastest and met
    goals = decode_speed.check_goals(speed_rows(W4g128=2.0, W8=1.6), spec, "avx512")
    assert verdicts(goals)[-2:] == ["MISSED", "met"] and "(gamma 2)" in goals[-2]["goal"]


def test_decode_speed_a_row_not_selected_is_missed_not_dropped():
    rows = speed_rows({}, W4g128=2.0)  # --rows FP32,W4g128
    goals = decode_speed.check_goals(rows, SPEC, "avx512")
    assert len(goals) == 7
    w8, *sub4 = not_measured(goals)
    assert w8["goal"].startswith("W8 tok/s / FP32 tok/s") and "add W8 to --rows" in w8["goal"]
    assert [g["goal"].split(" ")[0] for g in sub4] == ["W2", "W3", "exp4"]
    assert all(f"add {g['goal'].split(' ')[0]} to --rows" in g["goal"] for g in sub4)
    rows = [{"row": "W4g128", "x FP32": None}, {"row": "W8", "x FP32": None}]  # no FP32 row
    assert all("add FP32 to --rows" in g["goal"] for g in not_measured(
        decode_speed.check_goals(rows, SPEC, "avx512"))[:2])  # fmt: skip
    assert report_goals(goals, skip=["W8", "W2", "W3", "exp4"]) == 0


def test_decode_speed_no_speculative_rows_is_missed():
    goals = decode_speed.check_goals(speed_rows(W4g128=2.0, W8=1.6), [], "avx512")  # --gammas ''
    (spec,) = not_measured(goals)
    assert spec["goal"].startswith("speculative measured / theoretical speed-up")


def avx2_rows(**rows: tuple[float, float | None]) -> list[dict]:
    """``row=(of limit, x torch)``, and every ``@torch`` row the ratios need."""
    out = [{"row": r, "of limit": lim, "x torch": xt} for r, (lim, xt) in rows.items()]
    out += [{"row": f"{r}@torch", "of limit": 0.3, "x torch": None} for r in rows]
    return out + speed_rows()[1:]  # the sub-4-bit rows, met


def test_decode_speed_avx2_goals_met_missed_and_missing():
    rows = avx2_rows(FP32=(0.5, 1.1), W8=(0.7, 1.4), W4g128=(0.7, 1.8))
    assert verdicts(decode_speed.check_goals(rows, SPEC, "avx2")) == ["met"] * 11
    spec = [{**SPEC[0], "v": 1.5, "measured / theoretical": 0.7}]
    goals = decode_speed.check_goals(rows, spec, "avx2")
    assert verdicts(goals)[5] == "MISSED" and goals[5]["goal"].startswith("v:")
    assert verdicts(goals)[-1] == "MISSED"
    # --rows without W8@torch: W8 has no "x torch" (measure_rows divides by that row's rate)
    rows = avx2_rows(FP32=(0.5, 1.1), W8=(0.7, None), W4g128=(0.7, 1.8))
    rows = [r for r in rows if r["row"] != "W8@torch"]
    (w8,) = not_measured(decode_speed.check_goals(rows, SPEC, "avx2"))
    assert "add W8@torch to --rows" in w8["goal"]
    goals = decode_speed.check_goals(rows, [], "avx2")
    assert len(goals) == 10 and len(not_measured(goals)) == 3  # W8 x torch, v, speculative


# --- headline -----------------------------------------------------------------------------------


def headline_run(spec: float = 110.0, plain: float = 100.0, final: float = 0.6) -> dict:
    rows = [{"level": "trained wf", "row": "lowbit plain", "tok/s": plain},
            {"level": "trained wf", "row": "lowbit", "tok/s": spec, "alpha": 0.2}]  # fmt: skip
    return {"rows": rows, "alphas": {"lowbit": final}, "fp_draft_on_lowbit": 0.55,
            "paired": {"spec / plain": spec / plain}}  # fmt: skip


def headline_scale(lowbit: float = 40.0, calibrated: float = 0.5, of_theory=(0.9, 0.85)) -> dict:
    rows = [{"row": "FP plain", "tok/s": 10.0}, {"row": "int4 + FP draft", "tok/s": 25.0},
            {"row": "lowbit", "tok/s": lowbit, "alpha": 0.1}]  # fmt: skip
    sweep = [{"gamma": g, "of theory": x} for g, x in zip((2, 3), of_theory)]
    keys = headline.PAIRS.values()
    return {"rows": rows, "sweep": sweep, "alphas": dict.fromkeys(keys, 0.49),
            "calibrated": dict.fromkeys(keys, calibrated)}  # fmt: skip


def test_headline_goals_met_and_missed():
    goals = headline.check_goals([headline_run()], headline_scale(), 0.03)
    assert verdicts(goals) == ["met"] * 9 and not not_measured(goals)
    slow = headline.check_goals(
        [headline_run(spec=95.0, final=0.5)], headline_scale(30.0, 0.45, (0.9, 0.7)), 0.03
    )
    assert verdicts(slow) == ["MISSED", "MISSED", "met", "MISSED", *["MISSED"] * 3, "met", "MISSED"]


def test_headline_alphas_are_the_fixed_gamma_ones_not_the_adaptive_rows():
    # The rows' on-line alphas (0.2, 0.1) are an adaptive run's: far off, yet not what counts.
    goals = headline.check_goals([headline_run()], headline_scale(calibrated=0.47), 0.03)
    assert goals[1]["value"] == pytest.approx(0.05)  # 0.6 - 0.55, the runs at gamma 3
    assert [g["value"] for g in goals[4:7]] == pytest.approx([-0.02] * 3)


def test_headline_without_scale_or_gammas_is_missed():
    (scale,) = not_measured(headline.check_goals([headline_run()], None, 0.03))
    assert "run with --scale" in scale["goal"]
    no_sweep = headline.check_goals([], headline_scale(of_theory=()), 0.03)
    assert "no --gammas" in not_measured(no_sweep)[0]["goal"]


# --- default_model ------------------------------------------------------------------------------

DEFAULT_VALUES = {
    "fp ppl": 38.0,
    "rtn int2g64 cost %": 26.0,
    "rtn int3g128 cost %": 5.0,
    "gptq int2g64 cost %": 4.8,
    "alpha draft@target": 0.55,
    "draft ppl": 80.0,
    "bootstrap seconds": 300.0,
}


def test_default_model_goals_met_missed_and_missing():
    goals = default_model.default_model_goals(DEFAULT_VALUES)
    assert verdicts(goals) == ["met"] * len(default_model.GOALS)
    low_alpha = {**DEFAULT_VALUES, "alpha draft@target": 0.8, "bootstrap seconds": float("nan")}
    missed = [
        g["goal"] for g in default_model.default_model_goals(low_alpha) if g["verdict"] != "met"
    ]
    assert missed == ["alpha draft@target", "bootstrap seconds"]  # a NaN is not within bounds
    values = {k: v for k, v in DEFAULT_VALUES.items() if k != "gptq int2g64 cost %"}
    goals = default_model.default_model_goals(values)
    assert len(goals) == len(default_model.GOALS)
    assert not_measured(goals)[0]["goal"].startswith("gptq int2g64 cost %")


# --- distill_effect -----------------------------------------------------------------------------


def test_distill_effect_goals_met_missed_and_missing():
    rows = [  # (recipe, variant, ppl quantized, ppl distilled, gap, kept input, seconds)
        ("w2g64", "default", 60.0, 45.0, 0.75, False, 1.0),
        ("w2g64", "scales", 60.0, 55.0, 0.25, False, 1.0),
        ("mixed@2.5", "default", 50.0, 48.0, 0.3, False, 1.0),
        ("mixed@3", "default", 42.0, 42.0, 0.0, True, 1.0),  # kept its input: not worse
    ]
    quantized = {"w2g64": 60.0, "mixed@2.5": 50.0, "mixed@3": 42.0, "w3g128": 49.0}
    recipes = list(distill_effect.RECIPES)
    goals = distill_effect.distill_goals(rows, quantized, recipes)
    assert verdicts(goals) == ["met"] * 5
    assert [g["goal"].split(":")[0] for g in goals[:3]] == ["w2g64", "mixed@2.5", "mixed@3"]
    # one variant worse than its input fails its recipe, whichever variant it is
    worse = [*rows, ("mixed@2.5", "beta=0", 50.0, 50.5, -0.05, False, 1.0)]
    goals = distill_effect.distill_goals(worse, quantized, recipes)
    assert verdicts(goals)[1] == "MISSED" and goals[1]["value"] == 0.5
    # 2.5 bits distilled above the 3.25-bit reference; 60% of w2g64's gap is below 70%
    low = [(*rows[0][:4], 0.6, *rows[0][5:]), *rows[1:]]
    goals = distill_effect.distill_goals(low, {**quantized, "w3g128": 47.0}, recipes)
    assert verdicts(goals)[3:] == ["MISSED", "MISSED"]
    # --variants scales, without the reference: every goal that needs a missing row is missed
    goals = distill_effect.distill_goals(rows[1:2], {"w2g64": 60.0}, ["w2g64", "mixed@2.5"])
    assert verdicts(goals) == ["met", "MISSED", "MISSED", "MISSED"]
    assert len(not_measured(goals)) == 3
    nan = [("w2g64", "default", 38.0, 38.0, float("nan"), True, 1.0)]  # quantizing cost nothing
    assert verdicts(distill_effect.distill_goals(nan, {}, ["w2g64"]))[-1] == "MISSED"


# --- exp_codes ----------------------------------------------------------------------------------


def test_exp_codes_goal_per_budget_met_missed_and_missing():
    ppl = {"3.0": {"with exp4": 40.0, "without": 40.5}, "2.5": {"with exp4": 45.1, "without": 45.0}}
    assert verdicts(exp_codes.exp_goals(ppl, ["3.0", "2.5"])) == ["met", "MISSED"]
    goals = exp_codes.exp_goals({"3.0": {"with exp4": 40.0}}, ["3.0", "2.5"])
    assert len(not_measured(goals)) == 2
    assert len(not_measured(exp_codes.exp_goals({}, ["3.0"]))) == 1  # no exp format to compare


# --- exp_design ---------------------------------------------------------------------------------


def test_exp_design_goal_met_missed_and_missing():
    got = {"exp4g128": 40.0, "exp4g128-design": 41.0}
    assert verdicts(exp_design.design_goals(got)) == ["met"]
    got = {"exp4g128": 42.0, "exp4g128-design": 41.0}
    assert verdicts(exp_design.design_goals(got)) == ["MISSED"]
    assert len(not_measured(exp_design.design_goals({"exp4g128": 40.0}))) == 1


# --- fisher_memory ------------------------------------------------------------------------------


def test_fisher_memory_flat_streamed_peak_met_missed_and_missing():
    (g,) = fisher_memory.flat_goals({64: 108.0, 4: 100.0, 16: 104.0})  # depth order, not --layers'
    assert g["verdict"] == "met" and math.isclose(g["value"], 1.08)
    assert verdicts(fisher_memory.flat_goals({4: 100.0, 64: 150.0})) == ["MISSED"]
    assert len(not_measured(fisher_memory.flat_goals({4: 100.0}))) == 1  # one depth
    assert len(not_measured(fisher_memory.flat_goals({}))) == 1  # --modes loaded


# --- float_rows ---------------------------------------------------------------------------------


def test_float_rows_worst_routed_count_met_missed_and_missing():
    rows = [{"rows": m, "F.linear / f32rows": r} for m, r in ((1, 1.3), (5, 1.1), (32, 0.4))]
    (g,) = float_rows.routed_goals(rows)  # 32 rows is not routed to f32rows
    assert g["verdict"] == "met" and "(worst: 5 rows)" in g["goal"]
    rows[1]["F.linear / f32rows"] = 0.9
    assert verdicts(float_rows.routed_goals(rows)) == ["MISSED"]
    assert len(not_measured(float_rows.routed_goals(rows[2:]))) == 1


# --- importance_fit -----------------------------------------------------------------------------


def test_importance_fit_combined_against_best_single_met_missed_and_missing():
    formats = ["int4g128", "int2g64"]
    held = {m: {f: 0.5 for f in formats} for m in importance_fit.METHODS}
    held[importance_fit.METHODS[0]] = {"int4g128": 0.7, "int2g64": 0.5}
    held["combined"] = {"int4g128": 0.7, "int2g64": 0.6}
    (g,) = importance_fit.fit_goals(held, formats)
    assert g["verdict"] == "met" and f"({importance_fit.METHODS[0]})" in g["goal"]
    held["combined"] = {"int4g128": 0.5, "int2g64": 0.6}
    assert verdicts(importance_fit.fit_goals(held, formats)) == ["MISSED"]
    del held["combined"]["int2g64"]
    assert len(not_measured(importance_fit.fit_goals(held, formats))) == 1


# --- log_gaps -----------------------------------------------------------------------------------


def test_log_gaps_longest_gap_met_missed_and_missing():
    found = [log_gaps.Gap(70.0, 1, 2), log_gaps.Gap(30.0, 0, 1)]
    assert verdicts(log_gaps.gap_goals(found, 60.0)) == ["MISSED"]
    assert verdicts(log_gaps.gap_goals(found, 75.0)) == ["met"]
    assert len(not_measured(log_gaps.gap_goals([], 60.0))) == 1
    goals = log_gaps.gap_goals(found, 75.0, 610.0, 600.0)  # the workflow took too long
    assert verdicts(goals) == ["met", "MISSED"] and goals[1]["value"] == 610.0
    assert verdicts(log_gaps.gap_goals(found, 75.0, 590.0, 600.0)) == ["met", "met"]
    assert len(not_measured(log_gaps.gap_goals([], 60.0, None, 600.0))) == 2


# --- outliers -----------------------------------------------------------------------------------


def plan(outliers_: str, cap: float | None, ppl: float, bits: float) -> dict:
    return {"outliers": outliers_, "cap": cap, "test_ppl": ppl, "avg_bits": bits}


def test_outliers_goals_met_missed_and_missing():
    rows = [plan("none", None, 40.0, 2.5), plan("keep_fp16", 0.01, 39.0, 2.49),
            plan("keep_fp16", 0.05, 41.0, 2.6)]  # fmt: skip
    goals = outliers.outlier_goals(rows, 2.5, [0.01, 0.05])
    assert verdicts(goals) == ["met", "met", "MISSED"] and "(best: cap 0.01)" in goals[0]["goal"]
    goals = outliers.outlier_goals(rows[:2], 2.5, [0.01, 0.05])
    assert "keep_fp16 (cap 0.05)" in not_measured(goals)[0]["goal"]
    goals = outliers.outlier_goals(rows[:1], 2.5, [0.01])
    assert len(goals) == 2 and len(not_measured(goals)) == 2


# --- pipelined ----------------------------------------------------------------------------------


def test_pipelined_goal_per_shape_met_missed_and_missing():
    rows = [
        {"shape": "wide", "method": "pipelined-thread", "vs_speculative": 1.1},
        {"shape": "wide", "method": "speculative", "vs_speculative": 1.0},
        {"shape": "deep", "method": "pipelined-thread", "vs_speculative": 1.0},
    ]
    goals = pipelined.overlap_goals(rows, ["wide", "deep", "small"])
    assert verdicts(goals) == ["met", "MISSED", "MISSED"]
    assert not_measured(goals)[0]["goal"].startswith("small:")


# --- rehearsal ----------------------------------------------------------------------------------


def _rows(shape: str, ratios: dict[str, float | None], peak: float = 10.0) -> list[dict]:
    return [
        {"shape": shape, "stage": s, "status": "done", "measured GiB": peak,
         "planned/measured": r}
        for s, r in ratios.items()
    ]  # fmt: skip


def test_rehearsal_goals_met_missed_and_missing():
    rows = [
        *_rows("default", {"bootstrap": 1.1, "quantize": 0.85}),
        *_rows("8b", {"sensitivity": 1.0, "distill": 1.25}, peak=12.0),
        *_rows("70b", {"sensitivity": 1.0, "quantize": 1.0}, peak=1.0),
        *_rows("70b-2", {"sensitivity": 1.0, "quantize": 1.0}, peak=1.0),
    ]
    sizes = {"8b": 3.0, "70b": 5.0, "70b-2": 6.0}  # 80 layers: 6 + 78 x 1 = 84 GiB
    goals = rehearsal.rehearsal_goals(rows, sizes)
    assert verdicts(goals) == ["met", "MISSED", "met", "met", "met"]
    assert "(distill)" in goals[1]["goal"] and math.isclose(goals[1]["value"], 1.25)
    assert math.isclose(goals[3]["value"], 12.0) and math.isclose(goals[4]["value"], 1 / 84)
    # a 70B-shaped peak that grows with depth: 0.3 GiB a layer is 24.4 GiB at 80 layers
    grows = [{**r, "measured GiB": 1.3} if r["shape"] == "70b-2" else r for r in rows]
    deep = rehearsal.rehearsal_goals(grows, sizes)[4]
    assert deep["verdict"] == "MISSED" and math.isclose(deep["value"], (1.3 + 78 * 0.3) / 84)
    # a 70B-shaped plan off at the second depth misses the planner goal
    off = [{**r, "planned/measured": 1.3} if r["shape"] == "70b-2" else r for r in rows]
    assert verdicts(rehearsal.rehearsal_goals(off, sizes))[2] == "MISSED"
    huge = [{**r, "measured GiB": 30.0} if r["shape"] == "8b" else r for r in rows]
    assert verdicts(rehearsal.rehearsal_goals(huge, sizes))[3] == "MISSED"


def test_rehearsal_a_stopped_stage_or_a_missing_plan_is_not_measured():
    rows = [
        *_rows("default", {"bootstrap": None}),  # no planner: no ratio
        *[{**r, "status": "stopped at 14.1 GiB"} for r in _rows("8b", {"evaluate": 1.0})],
        *_rows("70b", {"sensitivity": 1.0, "quantize": 1.0}),
        *_rows("70b-2", {"sensitivity": 1.0}),  # quantize never ran
    ]
    goals = rehearsal.rehearsal_goals(rows, {"70b": 5.0, "70b-2": 6.0})
    missing = not_measured(goals)
    assert [g["goal"].split(":")[0] for g in missing] == ["default", "8b", "70b"]
    assert "evaluate did not finish" in missing[1]["goal"]
    assert "70b-2 quantize" in missing[2]["goal"]
    assert len(not_measured(rehearsal.rehearsal_goals([], {}))) == 5


# --- quality ------------------------------------------------------------------------------------


def test_quality_goals_met_and_missed():
    rows = [
        {"row": "lowbit gptq int4g128", "ppl": 40.0},
        {"row": "llmcompressor gptq int4g128", "ppl": 40.5},
        {"row": "lowbit gptq int3g128", "ppl": 44.0},
        {"row": "lowbit mixed@2.5", "ppl": 45.0},
        {"row": "lowbit mixed@2.5+distill", "ppl": 43.0},
    ]
    goals = quality.quality_goals(rows, ["int4g128"])
    assert verdicts(goals) == ["met", "met"]
    assert goals[1]["goal"] == "lowbit mixed@2.5+distill <= lowbit gptq int3g128"
    goals = quality.quality_goals(rows[:4], ["int4g128"])  # without --distill: the stretch
    assert verdicts(goals) == ["met", "MISSED"]


def test_quality_without_llmcompressor_the_peer_goals_are_missed():
    rows = [
        {"row": "lowbit gptq int4g128", "ppl": 40.0},
        {"row": "lowbit gptq int3g128", "ppl": 44.0},
        {"row": "lowbit mixed@2.5", "ppl": 43.0},
    ]
    goals = quality.quality_goals(rows, ["int4g128", "int3g128"])
    peers = not_measured(goals)
    assert [g["goal"].split(" (")[0] for g in peers] == [
        "lowbit gptq int4g128 <= llmcompressor gptq int4g128",
        "lowbit gptq int3g128 <= llmcompressor gptq int3g128",
    ]
    assert all("no llmcompressor gptq" in g["goal"] for g in peers)
    assert report_goals(goals) == 1
    assert report_goals(goals, skip=["llmcompressor"]) == 0


def test_quality_without_the_2_5_bit_plan_its_goal_is_missed():
    rows = [{"row": "lowbit gptq int3g128", "ppl": 44.0}]  # --budgets 4.0
    (plan_goal,) = not_measured(quality.quality_goals(rows, []))
    assert "no lowbit mixed@2.5 row" in plan_goal["goal"]


def test_the_rehearsal_counts_a_child_that_shares_its_parents_pages_once():
    import os
    import signal
    import subprocess

    from bench.rehearsal import _tree_rss_kib

    code = (
        "import os, time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
        "os.fork() or time.sleep(60); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        for _ in range(200):  # until the forked child is up and the buffer resident
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            if kids and _tree_rss_kib(proc.pid) > 250 * 2**10:
                break
            time.sleep(0.05)
        assert kids, "the child did not fork"
        own = _tree_rss_kib(proc.pid)
        assert 250 * 2**10 < own < 450 * 2**10  # once, not twice (about 620 MiB)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
