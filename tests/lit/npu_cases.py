"""Cases for the Ascend accelerator against a stand-in torch.npu, run by test_npu.py in a child.

torch_npu is replaced by a module in sys.modules and `torch.npu` by a small object that counts
devices and records set_device. The `npu` device type itself is what torch_npu gets by renaming
torch's privateuse1 backend. That rename is process-wide and final, and torch then takes `npu`
for the machine's accelerator (an optimizer step asks `torch.npu` about it), so these cases run
in a pytest process of their own.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import pytest
import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from pipeline.errors import ConfigError
from pipeline.lit import npu as npu_mod
from pipeline.lit.devices import ASCEND_VISIBLE_DEVICES
from pipeline.lit.npu import NPUAccelerator, NPUDDPStrategy
from pipeline.lit.trainer import build_trainer, check_trainer
from tests.conftest import make_cfg


class FakeNpu:
    """The part of torch.npu the accelerator uses."""

    def __init__(self, count: int = 8):
        self.count = count
        self.set_to: list[int] = []

    def device_count(self) -> int:
        return self.count

    def is_available(self) -> bool:
        return self.count > 0

    def set_device(self, index: int) -> None:
        self.set_to.append(index)

    def memory_stats(self, device=None) -> dict:
        return {"allocated_bytes.all.current": 4096}

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self, device=None) -> tuple[int, int]:  # (free, total), as torch_npu's
        return 60 * 2**30, 64 * 2**30

    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # what torch.autocast asks of it
        return [torch.float16, torch.bfloat16]


@pytest.fixture
def fake_npu(monkeypatch, no_mask):
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")
    elif name != "npu":
        pytest.skip(f"torch's privateuse1 device is already named {name!r}")
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    fake = FakeNpu()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return fake


def refusal(trainer_cfg) -> str:
    with pytest.raises(ConfigError) as e:
        check_trainer(trainer_cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_registered_as_npu(fake_npu):
    assert "npu" in AcceleratorRegistry.available_accelerators()
    assert isinstance(AcceleratorRegistry.get("npu"), NPUAccelerator)
    assert NPUAccelerator.is_available()
    fake_npu.count = 0
    assert not NPUAccelerator.is_available()


def test_device_parsing_honours_the_visible_devices_variable(fake_npu, monkeypatch):
    assert NPUAccelerator.auto_device_count() == 8
    assert NPUAccelerator.parse_devices(-1) == list(range(8))
    assert NPUAccelerator.parse_devices("2,5") == [2, 5]
    # The runtime still reports 8 (it initialised first); the mask leaves two.
    monkeypatch.setenv(ASCEND_VISIBLE_DEVICES, "4,5")
    assert NPUAccelerator.auto_device_count() == 2
    assert NPUAccelerator.parse_devices(-1) == [0, 1]
    assert NPUAccelerator.parse_devices(2) == [0, 1]
    with pytest.raises(ConfigError, match="trainer.devices"):
        NPUAccelerator.parse_devices(3)
    with pytest.raises(ConfigError, match="trainer.devices"):
        NPUAccelerator.parse_devices([1, 1])
    devices = NPUAccelerator.get_parallel_devices([0, 1])
    assert devices == [torch.device("npu", 0), torch.device("npu", 1)]


def test_setup_device_selects_the_npu_index(fake_npu):
    acc = NPUAccelerator()
    acc.setup_device(torch.device("npu", 3))
    assert fake_npu.set_to == [3]
    with pytest.raises(Exception, match="NPU"):
        acc.setup_device(torch.device("cpu"))
    assert fake_npu.set_to == [3]
    assert acc.get_device_stats(torch.device("npu", 3))["allocated_bytes.all.current"] == 4096


def _trainer(*overrides: str):
    cfg = make_cfg("trainer=npu", *overrides).trainer
    return build_trainer(cfg, max_steps=1, logger=False, enable_checkpointing=False)


def test_build_trainer_npu_uses_hccl_ddp_and_npu_autocast(fake_npu):
    trainer = _trainer()
    assert isinstance(trainer.accelerator, NPUAccelerator)
    assert isinstance(trainer.strategy, NPUDDPStrategy)
    assert trainer.strategy.process_group_backend == "hccl"
    assert trainer.strategy.parallel_devices == [torch.device("npu", i) for i in range(8)]
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.device == "npu"
    assert plugin.autocast_context_manager().fast_dtype == torch.bfloat16


def test_one_npu_is_a_single_device_strategy_on_that_npu(fake_npu):
    trainer = _trainer("trainer.devices=1", "trainer.strategy=auto")
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert trainer.strategy.root_device == torch.device("npu", 0)


def test_a_device_list_becomes_the_visible_devices_variable(fake_npu):
    trainer = _trainer("trainer.devices=[4,5]")
    assert os.environ[ASCEND_VISIBLE_DEVICES] == "4,5"
    assert trainer.strategy.parallel_devices == [torch.device("npu", 0), torch.device("npu", 1)]
    check_trainer(make_cfg("trainer=npu", "trainer.devices=[4,5]").trainer)  # idempotent
    msg = refusal(make_cfg("trainer=npu", "trainer.devices=[6,7]").trainer)
    assert "trainer.devices" in msg and f"{ASCEND_VISIBLE_DEVICES}=4,5" in msg


def test_ddp_wraps_the_model_without_a_cuda_stream(fake_npu, monkeypatch):
    seen = {}

    def ddp(module, device_ids, **kwargs):
        seen["device_ids"] = device_ids
        return module

    def no_cuda(*args, **kwargs):
        raise AssertionError("the NPU strategy touched torch.cuda")

    monkeypatch.setattr(npu_mod, "DistributedDataParallel", ddp)
    monkeypatch.setattr(torch.cuda, "Stream", no_cuda)
    strategy = NPUDDPStrategy(parallel_devices=[torch.device("npu", 0), torch.device("npu", 1)])
    model = nn.Linear(4, 2)
    assert strategy._setup_model(model) is model
    assert seen["device_ids"] == [0]


def test_check_refuses_npu_when_none_is_visible(fake_npu):
    fake_npu.count = 0
    msg = refusal(make_cfg("trainer=npu").trainer)
    assert "sees no NPU" in msg


def test_check_refuses_more_devices_than_the_machine_has(fake_npu, monkeypatch):
    cores = os.cpu_count() or 1
    msg = refusal(make_cfg("trainer=cpu", f"trainer.devices={cores + 1}").trainer)
    assert "`trainer.devices`" in msg and f"{cores + 1} devices" in msg and f"has {cores}" in msg
    assert "allowed: 1.." in refusal(make_cfg("trainer=cpu", "trainer.devices=-1").trainer)

    check_trainer(make_cfg("trainer=npu").trainer)  # 8 asked, 8 visible
    fake_npu.count = 4
    assert "has 4 visible NPUs" in refusal(make_cfg("trainer=npu").trainer)
    check_trainer(make_cfg("trainer=npu", "trainer.devices=-1").trainer)
    monkeypatch.setenv(ASCEND_VISIBLE_DEVICES, "0,1")
    assert "has 2 visible NPUs" in refusal(make_cfg("trainer=npu", "trainer.devices=3").trainer)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "has 1 CUDA devices" in refusal(make_cfg("trainer=gpu", "trainer.devices=2").trainer)
