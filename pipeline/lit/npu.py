"""Ascend NPUs as a Lightning accelerator, through torch_npu (imported on first use).

Lightning 2.6 has no NPU accelerator and falls back to CUDA or CPU in three places, each replaced
by `npu_trainer_kwargs`: the single-device strategy (cpu -> `npu:i`), DDP's CUDA side stream
(`NPUDDPStrategy` wraps without one) and mixed-precision autocast on "cuda" (silently fp32 on an
NPU machine: here autocast on "npu"). DDP uses the trainer's `dist_backend` (HCCL).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from pipeline.errors import ConfigError, LowbitError
from pipeline.lit.devices import (
    ASCEND_VISIBLE_DEVICES,
    ddp_with_backend,
    device_list,
    torch_npu_problem,
    visible_npus,
)

log = logging.getLogger(__name__)

# Lightning's legacy precision spellings, mapped to the autocast ones.
MIXED = {"16": "16-mixed", "16-mixed": "16-mixed", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}


def _npu():
    """`torch.npu`, after importing torch_npu; one clear line when it cannot be had."""
    problem = torch_npu_problem()
    if problem:
        raise LowbitError(f"accelerator npu: {problem}")
    return torch.npu


class NPUAccelerator(Accelerator):
    """Accelerator for Ascend NPUs; devices are the visible NPUs, numbered from 0."""

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "npu":
            raise MisconfigurationException(f"Device should be an NPU, got {device} instead")
        _npu().set_device(device.index)

    @override
    def setup(self, trainer) -> None:
        mask = os.environ.get(ASCEND_VISIBLE_DEVICES, "all")
        log.info("LOCAL_RANK: %d - %s: [%s]", trainer.local_rank, ASCEND_VISIBLE_DEVICES, mask)

    @override
    def get_device_stats(self, device: torch.device) -> dict[str, Any]:
        return dict(_npu().memory_stats(device))

    @override
    def teardown(self) -> None:
        if getattr(torch, "npu", None) is not None:
            torch.npu.empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        """-1 → every visible NPU, n → the first n, a list → those indices (of the visible ones)."""
        visible = visible_npus()
        ids = device_list(devices)
        if ids is None:
            text = str(devices).strip().lower()
            count = -1 if text == "auto" else int(text)
            ids = list(range(visible if count == -1 else count))
        if len(set(ids)) != len(ids) or not all(0 <= i < visible for i in ids):
            raise ConfigError(
                "trainer.devices",
                f"asks for NPUs {ids}, but {visible} are visible",
                f"indices 0..{visible - 1}, a count up to {visible}, or -1",
            )
        return ids

    @staticmethod
    @override
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("npu", i) for i in devices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return visible_npus()

    @staticmethod
    @override
    def is_available() -> bool:
        return visible_npus() > 0

    @staticmethod
    @override
    def name() -> str:
        return "npu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)


class NPUDDPStrategy(DDPStrategy):
    """DDPStrategy that wraps the model without Lightning's CUDA side stream."""

    strategy_name = "ddp_npu"

    @override
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)


def npu_trainer_kwargs(kw: dict[str, Any], backend: str) -> dict[str, Any]:
    """Trainer kwargs for `accelerator: npu` with Lightning's CUDA/CPU fallbacks replaced."""
    kw = dict(kw, accelerator=NPUAccelerator.name())
    strategy = kw.get("strategy", "auto")
    if strategy == "auto":
        devices = kw.get("devices", "auto")
        ids = NPUAccelerator.parse_devices(
            NPUAccelerator.auto_device_count() if devices == "auto" else devices
        )
        if not ids:
            raise LowbitError("accelerator npu: torch_npu sees no NPU; trainer=cpu runs here")
        if len(ids) * int(kw.get("num_nodes", 1)) > 1:
            strategy = "ddp"
        else:
            strategy = SingleDeviceStrategy(device=torch.device("npu", ids[0]))
    kw["strategy"] = ddp_with_backend(strategy, backend, NPUDDPStrategy)

    # DeepSpeed (and any strategy still named by string) chooses its own precision plugin.
    precision = MIXED.get(str(kw.get("precision", "")))
    if precision and not isinstance(kw["strategy"], DeepSpeedStrategy | str):
        plugins = kw.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        kw["plugins"] = [*plugins, MixedPrecision(precision, "npu")]
        del kw["precision"]
    return kw


if NPUAccelerator.name() not in AcceleratorRegistry:
    NPUAccelerator.register_accelerators(AcceleratorRegistry)
