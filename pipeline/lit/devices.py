"""The accelerator devices this machine has, the one device every stage computes on, and the DDP
strategy on a chosen backend.

Shared by the trainer's checks (`pipeline.lit.trainer`), the NPU accelerator (`pipeline.lit.npu`)
and the workflow, which hands `stage_device` to every stage: `trainer.accelerator` and
`trainer.devices` are the only device settings, so the plain loops (sensitivity, quantize,
evaluate, export) run where Lightning trains (distill, reinforce).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from pipeline.errors import ConfigError, first_line
from pipeline.hardware import device_type

ASCEND_VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"
DEVICES_ALLOWED = "a positive count, a list of device indices, auto or -1 (all visible)"
ACCELERATORS = "cpu, gpu (or cuda), npu, or auto (CUDA when torch sees it, else cpu)"


def torch_npu_problem() -> str | None:
    """None once torch_npu is imported (it adds `torch.npu` and the `npu` device), else why not."""
    try:
        importlib.import_module("torch_npu")
    except ModuleNotFoundError as e:
        if e.name == "torch_npu":
            return "torch_npu (Ascend's PyTorch plug-in, on the CANN toolkit) is not installed"
        why = first_line(e) or type(e).__name__
        return f"torch_npu does not load ({why}); is the CANN toolkit installed?"
    except (ImportError, OSError, RuntimeError) as e:
        # Typically libascendcl/libhccl not found: CANN missing or its set_env.sh not sourced.
        why = first_line(e) or type(e).__name__
        return f"torch_npu does not load ({why}); source CANN's set_env.sh"
    if getattr(torch, "npu", None) is None:
        return "torch_npu imported but did not add torch.npu"
    return None


def visible_npus(env: str = ASCEND_VISIBLE_DEVICES) -> int:
    """NPUs this process may use: torch.npu's count, capped by the entries of `env` when set."""
    if torch_npu_problem():
        return 0
    try:
        count = int(torch.npu.device_count())
    except RuntimeError:  # driver not loaded or no device node: nothing usable
        return 0
    mask = entries(os.environ.get(env, ""))
    return min(count, len(mask)) if mask else count


def entries(text: str) -> list[str]:
    """The devices a visible-devices variable lists ("4, 5" -> ["4", "5"])."""
    return [x.strip() for x in text.split(",") if x.strip()]


def device_list(devices: Any) -> list[int] | None:
    """The device indices when `devices` names them (a list, or "0,1,2"), else None."""
    try:
        if isinstance(devices, list | tuple):
            return [int(d) for d in devices]
        if isinstance(devices, str) and "," in devices:
            return [int(x) for x in entries(devices)]
    except (TypeError, ValueError):
        raise ConfigError("trainer.devices", f"is {devices}", DEVICES_ALLOWED) from None
    return None


def ddp_with_backend(strategy: Any, backend: str, ddp_cls: type | None = None) -> Any:
    """A DDP-family strategy name ("ddp", "ddp_spawn", ...) as a `ddp_cls` object on `backend`."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    if isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        if entry["strategy"] is DDPStrategy:
            cls = ddp_cls or DDPStrategy
            return cls(**entry["init_params"], process_group_backend=backend)
    return strategy


def stage_device(trainer: dict | None, local_rank: int = 0) -> torch.device:
    """The device this rank's stages compute on: `trainer.accelerator`'s, the `local_rank`-th of
    `trainer.devices` (`cuda:{local_rank}`, `npu:{local_rank}`, or the listed index).

    `auto` is CUDA when torch sees it, else the CPU, as Lightning's own `auto` picks for the
    training stages; NPUs are used when asked for (`trainer=npu`). One clear line when the
    device is missing, whichever stage asks first.
    """
    trainer = trainer or {}
    accelerator = str(trainer.get("accelerator") or "auto").lower()
    kind = device_type(accelerator)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.accelerator",
            f"is {accelerator}, but torch sees no CUDA device; trainer=cpu runs on this machine",
        )
    if kind == "npu" and (problem := torch_npu_problem()):
        raise ConfigError("trainer.accelerator", f"is npu, but {problem}; trainer=cpu runs here")
    if kind not in ("cuda", "npu"):
        raise ConfigError("trainer.accelerator", f"is {accelerator!r}", ACCELERATORS)
    ids = device_list(trainer.get("devices"))
    # Under a visible-devices mask (pin_visible_devices exported the list) devices count from 0.
    if ids is None or trainer.get("visible_devices_env"):
        return torch.device(kind, local_rank)
    if local_rank >= len(ids):
        raise ConfigError(
            "trainer.devices", f"lists {ids}, too few for local rank {local_rank}", DEVICES_ALLOWED
        )
    return torch.device(kind, ids[local_rank])
