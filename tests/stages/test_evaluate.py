"""evaluate's speculative settings: the adaptive draft length's window and measured costs."""

import pytest

from pipeline import workflow
from pipeline.errors import ConfigError
from pipeline.stages import evaluate
from tests.conftest import smoke_cfg
from tests.speculative.conftest import perturbed, tiny_llama

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


def test_the_adaptive_draft_length_is_priced_with_the_measured_costs(monkeypatch):
    # Stand-in timings (cost.py's own tests time real models): c by draft, v by gamma.
    timed = []

    def cost_ratio(target, draft, input_ids):
        timed.append(("c", draft.tag))
        return {"near": 0.5, "small": 0.05}[draft.tag]

    def verify_cost(target, gammas, input_ids):
        timed.append(("v", target.tag))
        return {g: 1.0 + g / 10 for g in gammas}

    monkeypatch.setattr(evaluate, "measure_cost_ratio", cost_ratio)
    monkeypatch.setattr(evaluate, "measure_verify_cost", verify_cost)
    target = tiny_llama(0)
    models = {"t": target, "near": perturbed(target, 0.004, seed=1), "small": tiny_llama(2)}
    for name, m in models.items():
        m.tag = name
    pairs = [("near", "t"), ("small", "t")]
    costs = evaluate._costs(evaluate.EvaluateConfig(), models, pairs, list(range(16)))
    assert sorted(timed) == [("c", "near"), ("c", "small"), ("v", "t")]  # v once per target
    assert costs["small@t"]["cost_ratio"] == 0.05 and costs["near@t"]["cost_ratio"] == 0.5
    assert costs["near@t"]["verify_cost"] == {2: 1.2, 3: 1.3, 4: 1.4, 5: 1.5}
    make = evaluate._adaptive(evaluate.EvaluateConfig(), costs)
    window = make("small", "t")
    assert window.cost_ratio == 0.05 and window.verify_cost == costs["small@t"]["verify_cost"]
    assert (window.gamma_min, window.gamma_max, window._rounds.maxlen) == (2, 5, 64)
    assert make("small", "t") is not window  # a fresh window per scenario


@pytest.mark.parametrize("adaptive", [True, False])
def test_end_to_end_records_costs_and_the_draft_length(boot, tmp_path, adaptive):
    import json

    from tests.stages.conftest import boot_cfg

    tiny = ("stage.evaluate.timing=false", "stage.evaluate.scenarios=[mix]")
    cfg = boot_cfg(boot, tmp_path, STAGES, *tiny, f"stage.evaluate.adaptive={adaptive}")
    metrics = workflow.run(cfg)["evaluate"]["metrics"]
    ev = json.loads((tmp_path / "run" / "evaluate" / "eval.json").read_text())
    row = ev["speculative"]["draft_fp@target_fp"]["mix"]
    assert metrics["tau_draft_fp-vs-target_fp_mean"] == pytest.approx(row["tau"])
    if not adaptive:
        assert "costs" not in ev and row["gamma"] <= 4  # fixed gamma 4 (shorter at the end)
        return
    cost = ev["costs"]["draft_fp@target_fp"]
    assert cost["cost_ratio"] > 0 and set(cost["verify_cost"]) == {"2", "3", "4", "5"}
    assert 1 <= row["gamma"] <= 5
