"""The DeepSpeed strategy wrapper: config loading, errors, clipping precedence, trainer wiring.

Real ZeRO-2/3 training on CPU runs in tests/stages/test_distill.py (2 ranks)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy

from pipeline.errors import ConfigError
from pipeline.lit.deepspeed_cpu import AnyDeviceDeepSpeedStrategy, make_deepspeed_strategy
from pipeline.lit.trainer import build_trainer
from tests._require import needs

pytestmark = needs("deepspeed")


def test_loads_the_shipped_configs():
    for stage in (2, 3):
        strategy = make_deepspeed_strategy(
            __import__("pipeline").conf_dir() / "deepspeed" / f"zero{stage}.json"
        )
        assert isinstance(strategy, DeepSpeedStrategy)
        assert strategy.config["zero_optimization"]["stage"] == stage
        assert strategy.zero_stage_3 == (stage == 3)


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ('{"bf16": {}}', "zero_optimization"),
    ],
)
def test_bad_config_files_name_the_key(tmp_path, content, match):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as err:
        make_deepspeed_strategy(path)
    assert "trainer.deepspeed_config" in str(err.value)


def test_trainer_clip_value_overrides_the_json(tmp_path):
    path = tmp_path / "ds.json"
    cfg = {
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 2,
    }
    path.write_text(json.dumps(cfg))
    strategy = make_deepspeed_strategy(path)
    trainer = SimpleNamespace(gradient_clip_val=2.5, accumulate_grad_batches=1)
    strategy._lightning_module = SimpleNamespace(trainer=trainer)
    strategy._format_batch_size_and_grad_accum_config()
    assert strategy.config["gradient_clipping"] == 2.5
    assert strategy.config["gradient_accumulation_steps"] == 1


def test_build_trainer_uses_the_any_device_strategy_on_cpu():
    trainer = build_trainer(
        {
            "accelerator": "cpu",
            "devices": 1,
            "strategy": "deepspeed",
            "deepspeed_config": "zero3.json",
        },
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
    )
    assert isinstance(trainer.strategy, AnyDeviceDeepSpeedStrategy)
    assert trainer.strategy._device_rank() == 0  # CPU has no index: the local rank


@pytest.mark.parametrize("exclude", [True, False])
def test_build_trainer_passes_the_frozen_parameter_exclusion_to_the_constructor(exclude):
    """Decided when the strategy is built, not patched onto it once training started."""
    trainer = build_trainer(
        {"accelerator": "cpu", "devices": 1, "strategy": "deepspeed"},
        logger=False,
        enable_progress_bar=False,
        exclude_frozen_parameters=exclude,
    )
    assert trainer.strategy.exclude_frozen_parameters is exclude
