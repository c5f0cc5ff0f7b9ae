"""evaluate: its config checks, and one run recording costs and the draft length."""

import pytest

from pipeline import workflow
from pipeline.errors import ConfigError
from pipeline.evaluation.result import EvalResult
from pipeline.stages import evaluate
from tests.conftest import smoke_cfg

STAGES = "stages=[bootstrap,evaluate]"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("stage.evaluate.window=16", "window"),
        ("stage.evaluate.window=200", "window"),
        ("stage.evaluate.gamma_min=0", "gamma_min"),
        ("stage.evaluate.gamma_max=1", "gamma_max"),
    ],
)
def test_check_names_the_bad_key(tmp_path, override, key):
    cfg = smoke_cfg(tmp_path, "tracking=none", STAGES, override)
    with pytest.raises(ConfigError, match=f"stage.evaluate.{key}"):
        workflow.check_stage(cfg, "evaluate")


def test_defaults_adapt_gamma_2_to_5_over_64_verifications():
    cfg = evaluate.EvaluateConfig()
    assert cfg.adaptive and (cfg.gamma_min, cfg.gamma_max, cfg.window) == (2, 5, 64)
    assert not cfg.temperature_schedule


@pytest.mark.parametrize("adaptive", [True, False])
def test_end_to_end_records_costs_and_the_draft_length(boot, tmp_path, adaptive):
    from tests.stages.conftest import boot_cfg

    tiny = ("stage.evaluate.timing=false", "stage.evaluate.scenarios=[mix]")
    cfg = boot_cfg(boot, tmp_path, STAGES, *tiny, f"stage.evaluate.adaptive={adaptive}")
    metrics = workflow.run(cfg)["evaluate"]["metrics"]
    ev = EvalResult.load(tmp_path / "run" / "evaluate")
    row = ev.speculative["draft_fp@target_fp"]["mix"]
    assert metrics["tau_draft_fp-vs-target_fp_mean"] == pytest.approx(row["tau"])
    if not adaptive:
        assert ev.costs is None and row["gamma"] <= 4  # fixed gamma 4 (shorter at the end)
        return
    cost = ev.costs["draft_fp@target_fp"]
    assert cost["cost_ratio"] > 0 and set(cost["verify_cost"]) == {2, 3, 4, 5}
    assert 1 <= row["gamma"] <= 5
