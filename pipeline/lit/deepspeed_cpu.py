"""Lightning's DeepSpeedStrategy on any accelerator DeepSpeed supports (CPU too).

Lightning refuses DeepSpeed off CUDA although DeepSpeed runs ZeRO 1-3 on CPU over gloo; the three
CUDA-only steps are undone here (on CUDA the behaviour is Lightning's own), so CI tests ZeRO
sharding, checkpoints and consolidation without a GPU. The trainer's `gradient_clip_val` wins
over the JSON's `gradient_clipping`: one setting controls clipping everywhere.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators.cuda import CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy

from pipeline.errors import ConfigError


class AnyDeviceDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy without the CUDA-only assumptions (see the module docstring)."""

    strategy_name = "deepspeed_any_device"

    def _on_cuda(self) -> bool:
        return isinstance(self.accelerator, CUDAAccelerator)

    def setup_environment(self) -> None:
        if self._on_cuda():
            super().setup_environment()
            return
        # DeepSpeedStrategy.setup_environment only adds the CUDA check to DDPStrategy's.
        super(DeepSpeedStrategy, self).setup_environment()

    def setup_distributed(self) -> None:
        if self._on_cuda():
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _device_rank(self) -> int:
        index = self.root_device.index
        return self.local_rank if index is None else index

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _format_batch_size_and_grad_accum_config(self) -> None:
        super()._format_batch_size_and_grad_accum_config()
        module = self.lightning_module
        clip = module.trainer.gradient_clip_val if module is not None else None
        if clip is not None:
            self.config["gradient_clipping"] = float(clip)


def load_config(config_path: Path | str) -> dict:
    path = Path(config_path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("trainer.deepspeed_config", f"file {path} does not exist") from None
    except ValueError as e:
        raise ConfigError("trainer.deepspeed_config", f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or "zero_optimization" not in config:
        raise ConfigError(
            "trainer.deepspeed_config",
            f"{path} has no `zero_optimization` section",
            'a DeepSpeed JSON config, e.g. {"zero_optimization": {"stage": 2}}',
        )
    return config


def make_deepspeed_strategy(config_path: Path | str, **kwargs) -> AnyDeviceDeepSpeedStrategy:
    """The DeepSpeed strategy for `trainer.strategy=deepspeed` with the JSON at `config_path`."""
    return AnyDeviceDeepSpeedStrategy(config=load_config(config_path), **kwargs)
