"""Every stage against a stand-in NPU, run by test_devices_every_stage.py in a child pytest.

The `npu` device is torch's privateuse1 backend renamed, as torch_npu does (once per process,
hence the child), with no kernels behind it: the first tensor a stage sends there fails. Until
then a dispatch mode records every device a tensor is sent to or made on, and any model
computation (matmul, embedding) on the host. A stage obeys the setting when its models go to
npu:0 and to no other accelerator, before any of them computed on the host.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline import workflow
from pipeline.config import run_config
from pipeline.lit.devices import stage_device
from pipeline.stages import StageIO
from tests.conftest import smoke_cfg
from tests.lit.conftest import no_mask  # noqa: F401  (fake_npu's fixture)
from tests.lit.npu_cases import fake_npu  # noqa: F401  (the stand-in NPU)

MODEL_OPS = {"mm", "addmm", "bmm", "baddbmm", "embedding"}  # what a forward pass is made of
ON_NPU = ("trainer=npu", "trainer.devices=1", "trainer.strategy=auto", "trainer.precision=32-true")


class Placements(TorchDispatchMode):
    """Devices tensors are sent to or made on, and the model ops that ran on the host first."""

    def __init__(self):
        super().__init__()
        self.targets: list[torch.device] = []
        self.host_compute: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is not None:
            self.targets.append(torch.device(kwargs["device"]))
        name = func.overloadpacket.__name__
        if name in MODEL_OPS and not self.accelerated():
            self.host_compute.append(name)
        return func(*args, **kwargs)

    def accelerated(self) -> list[torch.device]:
        return [d for d in self.targets if d.type not in ("cpu", "meta")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A smoke run with bootstrap and quantize done, on the CPU before the rename."""
    tmp = tmp_path_factory.mktemp("run")
    workflow.run(smoke_cfg(tmp, "stages=[bootstrap,quantize]", "tracking=none", "quant=w4g128"))
    return tmp


@pytest.fixture
def npu(finished, request, monkeypatch):
    fake = request.getfixturevalue("fake_npu")
    monkeypatch.setitem(sys.modules, "torch.npu", fake)  # torch_npu registers it as a module
    return finished


def run_stage(tmp: Path, name: str, out: Path) -> Placements:
    cfg = smoke_cfg(tmp, "tracking=none", "quant=w4g128", *ON_NPU)
    run = run_config(cfg)
    stage = workflow.make_stage(cfg, name, run)
    run_dir = Path(cfg.run_dir)
    inputs = {
        n: run_dir / n for n in sorted(stage.reads()) if (run_dir / n / "_done.json").exists()
    }
    device = stage_device(run.trainer)
    assert device == torch.device("npu", 0)
    io = StageIO(name, out / "out", out / "work", run_dir, inputs, device=device)
    io.out_dir.mkdir(parents=True)
    io.work_dir.mkdir(parents=True)
    seen = Placements()
    with pytest.raises(Exception) as failed, seen:  # noqa: PT011  (the stand-in's own error)
        stage.decl.run(stage.cfg, stage.run, io)
    seen.error = failed.value
    return seen


@pytest.mark.parametrize(
    "name", ["sensitivity", "quantize", "distill", "reinforce", "evaluate", "export"]
)
def test_the_stage_puts_its_models_on_npu_0_first(npu, name, tmp_path):
    seen = run_stage(npu, name, tmp_path)
    where = seen.accelerated()
    stand_in_failed = "'npu' backend" in str(seen.error) or "privateuse" in str(seen.error).lower()
    # The dispatch mode is thread-local and blind to tensors C++ loaders make on a device
    # (quantize's prefetch thread, safetensors): then the stand-in's own error is the evidence.
    assert where or stand_in_failed, f"{name} never used the configured device: {seen.error!r}"
    assert set(where) <= {torch.device("npu", 0), torch.device("npu")}, where
    assert not seen.host_compute, f"{name} computed on the host first: {seen.host_compute[:5]}"
    assert stand_in_failed or "npu" in str(seen.error).lower(), seen.error


def test_the_workflow_hands_every_stage_the_trainer_device(npu, monkeypatch, tmp_path):
    from pipeline import stages

    names = ("bootstrap", "sensitivity", "quantize", "evaluate", "export")
    real = {n: stages.load(n) for n in names}
    got = {}

    def toy(name: str) -> stages.Stage:
        def run(cfg, run, io):
            got[name] = io.device
            (io.out_dir / "out.txt").write_text(name)
            return {}

        return stages.Stage(config=real[name].config, run=run, sections=())

    toys = {n: toy(n) for n in names}
    monkeypatch.setattr(stages, "load", lambda n: toys[n])
    chosen = f"stages=[{','.join(names)}]"
    workflow.run(smoke_cfg(tmp_path, chosen, "tracking=none", "quant=w4g128", *ON_NPU))
    assert got == dict.fromkeys(names, torch.device("npu", 0))
