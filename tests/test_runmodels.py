"""The one answer to "which target and draft does this run have", from config and stage folders."""

from __future__ import annotations

import json

import pytest

from pipeline import runmodels
from pipeline.config import ModelConfig, ModelSpec
from pipeline.errors import LowbitError


def run_dir(tmp_path, *stages: str):
    """A run dir whose `stages` finished, each with the folder it hands on."""
    made = {"bootstrap": ["target", "draft"], "quantize": ["model"], "distill": ["model"]}
    made["reinforce"] = ["draft"]
    for stage in stages:
        for sub in made[stage]:
            (tmp_path / stage / sub).mkdir(parents=True)
        (tmp_path / stage / "_done.json").write_text(json.dumps({"fingerprint": stage}))
    return runmodels.finished_stages(tmp_path)


BOOT = ModelConfig()


def user(tmp_path, draft: bool = False) -> ModelConfig:
    return ModelConfig(
        target=ModelSpec(path=str(tmp_path / "mine")),
        draft=ModelSpec(path=str(tmp_path / "my-draft") if draft else None),
    )


def test_finished_stages_are_those_with_a_done_file(tmp_path):
    inputs = run_dir(tmp_path, "bootstrap", "quantize")
    (tmp_path / "distill").mkdir()  # a folder without _done.json is not a finished stage
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "_done.json").write_text("{trunc")
    assert runmodels.finished_stages(tmp_path) == inputs
    assert inputs == {"bootstrap": tmp_path / "bootstrap", "quantize": tmp_path / "quantize"}


def test_the_bootstrap_run(tmp_path):
    inputs = run_dir(tmp_path, "bootstrap")
    assert runmodels.fp_target(BOOT, inputs) == tmp_path / "bootstrap" / "target"
    assert runmodels.fp_draft(BOOT, inputs) == tmp_path / "bootstrap" / "draft"
    assert runmodels.final_target(BOOT, inputs) == tmp_path / "bootstrap" / "target"
    assert runmodels.final_draft(BOOT, inputs) == tmp_path / "bootstrap" / "draft"
    inputs = run_dir(tmp_path, "quantize", "distill", "reinforce")
    assert runmodels.final_target(BOOT, inputs) == tmp_path / "distill" / "model"
    assert runmodels.final_draft(BOOT, inputs) == tmp_path / "reinforce" / "draft"
    assert list(runmodels.targets(BOOT, inputs)) == [
        "target_fp",
        "target_quantized",
        "target_distilled",
    ]
    assert list(runmodels.drafts(BOOT, inputs)) == ["draft_fp", "draft_reinforced"]


def test_quantize_is_final_without_distill(tmp_path):
    inputs = run_dir(tmp_path, "bootstrap", "quantize")
    assert runmodels.final_target(BOOT, inputs) == tmp_path / "quantize" / "model"
    assert runmodels.quantized_targets(inputs) == {"target_quantized": tmp_path / "quantize/model"}
    # Without bootstrap's folder the FP target is unknown, but the final one is not.
    del inputs["bootstrap"]
    assert runmodels.final_target(BOOT, inputs) == tmp_path / "quantize" / "model"
    with pytest.raises(LowbitError, match="set model.target.path or run the bootstrap stage"):
        runmodels.fp_target(BOOT, inputs)


def test_user_models_win_over_bootstrap(tmp_path):
    inputs = run_dir(tmp_path, "bootstrap")
    assert runmodels.fp_target(user(tmp_path), inputs) == tmp_path / "mine"
    # A user target without a draft drafts for itself: bootstrap's draft does not go with it.
    assert runmodels.fp_draft(user(tmp_path), inputs) is None
    assert runmodels.final_draft(user(tmp_path), inputs) is None
    assert runmodels.fp_draft(user(tmp_path, draft=True), {}) == tmp_path / "my-draft"
    # A user draft beside the bootstrap target.
    with_draft = ModelConfig(draft=ModelSpec(path=str(tmp_path / "my-draft")))
    assert runmodels.fp_draft(with_draft, inputs) == tmp_path / "my-draft"
