"""One device setting for every stage: `trainer.accelerator` / `trainer.devices` resolve to one
torch device per rank (`pipeline.lit.devices.stage_device`), the old per-stage keys are refused
naming it, and each stage puts its models there (device_cases.py, against a stand-in NPU in a
child process: torch's privateuse1 rename is once per process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipeline import workflow
from pipeline.config import parse, to_plain
from pipeline.errors import ConfigError
from pipeline.lit.devices import ASCEND_VISIBLE_DEVICES, stage_device
from pipeline.stages import load
from tests.conftest import REPO, cases_in_child, make_cfg


@pytest.fixture
def cuda_here(monkeypatch):
    """A CPU build told it has 4 CUDA devices: what resolution reads, nothing allocated."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def trainer(*overrides: str) -> dict:
    return to_plain(make_cfg(*overrides).trainer)


def test_the_default_trainer_keeps_every_stage_on_the_cpu(cuda_here):
    # conf's default is trainer=cpu: a CUDA machine is used only when the user says so
    assert stage_device(trainer()) == torch.device("cpu")
    assert stage_device(trainer("trainer=cpu"), local_rank=3) == torch.device("cpu")


@pytest.mark.parametrize(
    ("overrides", "local_rank", "expected"),
    [
        (("trainer=gpu",), 0, "cuda:0"),
        (("trainer=ddp", "trainer.accelerator=cuda", "trainer.devices=4"), 3, "cuda:3"),
        (("trainer=gpu", "trainer.devices=[2,3]"), 1, "cuda:3"),  # Lightning's indices
        (("trainer=gpu", "trainer.accelerator=auto"), 1, "cuda:1"),
        (("trainer=deepspeed_zero3", "trainer.accelerator=gpu"), 1, "cuda:1"),
    ],
)
def test_a_gpu_trainer_puts_each_rank_on_its_cuda_device(
    cuda_here, overrides, local_rank, expected
):
    assert stage_device(trainer(*overrides), local_rank) == torch.device(expected)


def test_auto_without_cuda_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert stage_device({"accelerator": "auto"}, 2) == torch.device("cpu")
    assert stage_device(None) == torch.device("cpu")


def test_a_device_the_machine_lacks_is_one_line_naming_trainer_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="`trainer.accelerator` is gpu, but torch sees no CUDA"):
        stage_device(trainer("trainer=gpu"))
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ModuleNotFoundError
    monkeypatch.delenv(ASCEND_VISIBLE_DEVICES, raising=False)
    with pytest.raises(ConfigError) as e:
        stage_device(trainer("trainer=npu"))
    assert "`trainer.accelerator` is npu" in str(e.value) and "torch_npu" in str(e.value)
    with pytest.raises(ConfigError, match="allowed: cpu, gpu"):
        stage_device({"accelerator": "mps"})


def test_the_workflow_refuses_an_unusable_accelerator_before_any_stage(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = make_cfg("trainer.accelerator=mps", f"run_dir={tmp_path}", "tracking=none")
    with pytest.raises(ConfigError, match="trainer.accelerator"):
        workflow.plan(cfg, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("stage", ["sensitivity", "quantize"])
def test_the_old_stage_device_keys_are_refused_naming_the_trainer(stage):
    cfg = make_cfg(f"stage.{stage}.device=cuda")
    with pytest.raises(ConfigError) as e:
        parse(cfg.stage[stage], load(stage).config, f"stage.{stage}")
    msg = str(e.value)
    assert f"`stage.{stage}.device` is 'cuda'" in msg and "trainer.accelerator" in msg
    assert "\n" not in msg
    # Left alone, the marker Hydra needs to accept the override is no setting at all.
    parsed = parse(make_cfg().stage[stage], load(stage).config, f"stage.{stage}")
    assert not hasattr(parsed, "device")


def test_no_stage_chooses_its_own_device():
    # Every stage reads `io.device`; none asks torch what the machine has.
    stages = Path(REPO, "pipeline", "stages")
    for path in sorted(stages.glob("*.py")):
        src = path.read_text()
        for needle in ("cuda", "is_available", "local_rank"):
            assert needle not in src, f"{path.name} mentions {needle!r}"


def test_every_stage_places_its_models_on_the_configured_stand_in_npu():
    cases_in_child(Path(__file__).with_name("device_cases.py"), timeout=1500)
