"""report.md: built from the stage folders alone; lm_eval scores become one table."""

from __future__ import annotations

import json

from pipeline.evaluation.result import FILENAME, EvalResult
from pipeline.report import write_report


def test_lm_eval_scores_render_as_task_by_model_table(tmp_path):
    ev = EvalResult(
        ppl={"target_fp": 12.0, "target_quantized": 13.5},
        lm_eval={
            "target_fp": {"arc_easy": {"acc": 0.5, "acc_stderr": 0.01, "acc_norm": 0.48}},
            "target_quantized": {"arc_easy": {"acc": 0.45, "acc_stderr": 0.012}},
        },
    )
    (tmp_path / "evaluate").mkdir()
    ev.save(tmp_path / "evaluate")
    lines = write_report(tmp_path).read_text().splitlines()

    i = lines.index("## Downstream tasks (lm-evaluation-harness)")
    assert lines[i + 2] == "| task | metric | target_fp | target_quantized |"
    assert lines[i + 4] == "| arc_easy | acc | 0.500 ± 0.010 | 0.450 ± 0.012 |"
    assert lines[i + 5] == "| arc_easy | acc_norm | 0.480 |  |"  # no stderr, model missing
    assert not any("stderr" in line for line in lines[i:])


def test_no_lm_eval_section_without_scores_and_the_error_flow_from_the_result(tmp_path):
    (tmp_path / "evaluate").mkdir()
    EvalResult(ppl={"target_fp": 12.0}, error_flow={"quantized": [0.01, 0.02]}).save(
        tmp_path / "evaluate"
    )
    text = write_report(tmp_path).read_text()
    assert "Downstream" not in text and "## Error flow" in text and "0.02" in text


def test_both_decoding_modes_render_per_pair_with_the_run_s_temperature(tmp_path):
    def cell(alpha, tau, match, alpha_greedy, tau_greedy):
        return dict(alpha=alpha, tau=tau, greedy_match=match, alpha_greedy=alpha_greedy,
                    tau_greedy=tau_greedy)  # fmt: skip

    ev = EvalResult(
        ppl={"target_fp": 12.0},
        acceptance={"d@t": {"mix": 0.7, "long": 0.5, "mean": 0.6}, "old@t": {"mix": 0.1}},
        speculative={
            "d@t": {"mix": cell(0.7, 3.0, 0.6, 0.55, 2.5), "long": cell(0.5, 2.0, 0.4, 0.45, 2.0)},
            "old@t": {"mix": {"alpha": 0.1, "tau": 1.1}},  # written before greedy was measured
        },
        temperature=0.7,
    )
    (tmp_path / "evaluate").mkdir()
    ev.save(tmp_path / "evaluate")
    lines = write_report(tmp_path).read_text().splitlines()
    i = lines.index("## Both decoding modes (mean over scenarios; τ: tokens per target call)")
    assert lines[i + 2] == (
        "| pair | α (T = 0.7) | τ (T = 0.7) | greedy match | greedy α | greedy τ |"
    )
    assert lines[i + 4] == "| d@t | 0.600 | 2.50 | 0.500 | 0.500 | 2.25 |"
    assert not any(line.startswith("| old@t | 0.100 | 1.10") for line in lines)


def test_an_unreadable_evaluation_leaves_one_line_and_the_rest_of_the_report(tmp_path):
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / FILENAME).write_text(json.dumps({"schema_version": 99, "ppl": {}}))
    lines = write_report(tmp_path).read_text().splitlines()
    assert "## Stages" in lines and "## Perplexity" not in "\n".join(lines)
    assert any(line.startswith("Evaluation not shown: ") and "99" in line for line in lines)


def test_the_report_says_which_machine_and_commit_the_timings_come_from(tmp_path):
    from pipeline.hardware import where

    machine = where()
    other = machine | {"cpu": "Some AVX2 CPU", "cpu_flags": ["avx2", "fma"], "commit": "abc"}
    for stage, m in (("sensitivity", machine), ("allocate", machine), ("quantize", other)):
        (tmp_path / stage).mkdir()
        done = {"metrics": {}, "timings": {"seconds": 1.0, "machine": m}}
        (tmp_path / stage / "_done.json").write_text(json.dumps(done))
    lines = write_report(tmp_path).read_text().splitlines()
    assert f"- sensitivity, allocate: {machine['cpu']} ({machine['cores']} cores; " in "\n".join(
        lines
    )
    assert "- quantize: Some AVX2 CPU (" in "\n".join(lines)
    assert any("avx2 fma), lowbit abc, torch" in line for line in lines)
    (tmp_path / "quantize" / "_done.json").unlink()
    text = write_report(tmp_path).read_text()
    assert f"Measured on {machine['cpu']} (" in text and "torch " + machine["torch"] in text


def test_the_speed_table_renders_with_the_overhead_note(tmp_path):
    timing = {"tokens_per_s_min": 90.0, "tokens_per_s_max": 110.0, "weight_bytes": 4_000_000,
              "kv_bytes": 500_000}  # fmt: skip
    rows = [
        {"row": "FP plain", "ms_per_token": 10.0, "tokens_per_s": 100.0, "x_fp_plain": 1.0,
         "alpha": None, "tau": 1.0, "gamma": 0.0, "plain_share": 1.0, **timing},
        {"row": "target_quantized + draft_fp", "ms_per_token": 5.0, "tokens_per_s": 200.0,
         "x_fp_plain": 2.0, "alpha": 0.7, "tau": 2.5, "gamma": 3.2, "plain_share": 0.25,
         **timing},
    ]  # fmt: skip
    (tmp_path / "evaluate").mkdir()
    EvalResult(ppl={"target_fp": 12.0}, speed_table={"rows": rows, "width": 96}).save(
        tmp_path / "evaluate"
    )
    lines = write_report(tmp_path).read_text().splitlines()
    i = lines.index("## Decode speed against FP plain (batch 1; ratios of side-by-side passes)")
    assert (
        lines[i + 4]
        == "| FP plain | 10.00 | 100.0 (90.0–110.0) | 1.00 | 4.00 | 0.50 | - | 1.00 | 0 |"
    )
    assert lines[i + 5].endswith("| 2.00 | 4.00 | 0.50 | 0.700 | 2.50 | 3.2 (25%) |")
    assert lines[i + 7].startswith("Models 96 wide are overhead-bound")


def test_the_keep_decisions_show_what_each_training_stage_handed_on(tmp_path):
    keep = {"keep_confidence": 0.95, "keep_windows": 128.0}
    margins = {  # kept_input, best_step, gain, low, high
        "distill": (1.0, 50.0, 0.004, -0.01, 0.02),
        "reinforce": (0.0, 20.0, 0.05, 0.03, 0.07),
    }
    names = ("kept_input", "best_step", "keep_gain", "keep_ci_low", "keep_ci_high")
    for stage, m in margins.items():
        (tmp_path / stage).mkdir()
        done = {"metrics": dict(zip(names, m, strict=True)) | keep, "timings": {"seconds": 1.0}}
        (tmp_path / stage / "_done.json").write_text(json.dumps(done))
    lines = write_report(tmp_path).read_text().splitlines()
    i = lines.index("## Keep decisions (best check vs input, paired bootstrap over windows)")
    assert lines[i + 4] == "| distill | its input | +0.004 | [-0.01, +0.02] (95% each) | 128 |"
    assert lines[i + 5] == "| reinforce | step 20 | +0.05 | [+0.03, +0.07] (95% each) | 128 |"
