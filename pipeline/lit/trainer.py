"""Build a Lightning Trainer from the `trainer` config group, and check it fits the machine.

The group holds Trainer keyword arguments plus a few lowbit keys that select a strategy object
(`strategy: deepspeed` + `deepspeed_config`); the rest passes through. A `trainer.*` key wins over
a stage's default, but one the stage must set itself is refused naming the stage key instead
(`Owned`, `refuse_owned`). `callbacks` and `loggers` are lists of `{_target_: ...}` entries that
Hydra builds and adds beside the stage's own (`EXTRAS`). `check_trainer` runs before any rank
starts, so a misfit is one line, not N ranks failing in torch.distributed. A `devices` list is
exported to `visible_devices_env` before torch_npu initialises, so every later rank inherits the
mask.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from pipeline import conf_dir
from pipeline.config import to_plain
from pipeline.errors import ConfigError, first_line
from pipeline.hardware import resolve_precision
from pipeline.lit.devices import (
    ASCEND_VISIBLE_DEVICES,
    DEVICES_ALLOWED,
    ddp_with_backend,
    device_list,
    entries,
    torch_npu_problem,
    visible_npus,
)

LOWBIT_KEYS = {"deepspeed_config", "dist_backend", "visible_devices_env", "loggers"}
# `trainer.<key>`: `{_target_: ...}` entries added to a stage's own callbacks and MLflow logger
# (never in their place), and the class each entry must build.
EXTRAS = {
    "callbacks": "lightning.pytorch.callbacks.Callback",
    "loggers": "lightning.pytorch.loggers.Logger",
}
_EXAMPLE = "[{_target_: lightning.pytorch.loggers.CSVLogger, save_dir: logs}]"


def trainer_kwargs(cfg: DictConfig | dict) -> dict[str, Any]:
    """Validated Trainer kwargs; unknown keys fail with the list of allowed ones."""
    import lightning as L

    plain = dict(to_plain(cfg) or {})
    allowed = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    for key in plain:
        if key not in allowed and key not in LOWBIT_KEYS:
            raise ConfigError(
                f"trainer.{key}", "is not a lightning.Trainer argument", ", ".join(sorted(allowed))
            )
    for key in EXTRAS:
        _extra_entries(key, plain.get(key))
    return plain


def _extra_entries(key: str, entries: Any) -> list[dict]:
    """`trainer.<key>` checked before any compute: a list of entries whose `_target_` imports."""
    from hydra.utils import get_object

    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ConfigError(
            f"trainer.{key}", f"is {entries!r}", f"a list of entries, e.g. {_EXAMPLE}"
        )
    for i, entry in enumerate(entries):
        target = entry.get("_target_") if isinstance(entry, dict) else None
        if not isinstance(target, str):
            raise ConfigError(
                f"trainer.{key}[{i}]", f"is {entry!r}", "a mapping with a `_target_` class path"
            )
        try:
            get_object(target)
        except Exception as e:
            raise ConfigError(
                f"trainer.{key}[{i}]._target_",
                f"is {target!r}, which does not import ({first_line(e)})",
                f"an importable class, e.g. {_EXAMPLE}",
            ) from None
    return entries


def _built_extras(key: str, entries: Any) -> list:
    """The objects `trainer.<key>` describes, each checked to be what the Trainer takes there."""
    from hydra.utils import get_class, instantiate

    out = []
    base = get_class(EXTRAS[key])
    for i, entry in enumerate(_extra_entries(key, entries)):
        name = f"trainer.{key}[{i}]"
        try:
            obj = instantiate(entry)
        except Exception as e:
            raise ConfigError(
                name, f"({entry['_target_']}) could not be built: {first_line(e)}"
            ) from None
        if not isinstance(obj, base):
            raise ConfigError(
                name, f"builds a {type(obj).__name__}", f"a subclass of {base.__name__}"
            )
        out.append(obj)
    return out


@dataclass(frozen=True)
class Owned:
    """A Trainer argument a stage sets itself, and what a user sets instead of `trainer.<key>`."""

    value: Any
    instead: str  # "set stage.distill.train.steps instead", or why there is nothing to set


def training_owned(stage: str) -> dict[str, str]:
    """What every training stage sets itself: where it writes, logs and checkpoints. Values
    are what a user sets instead of `trainer.<key>` (`Owned.instead`)."""
    return {
        "default_root_dir": "it writes into its work dir under run_dir",
        "logger": "it logs to the run's MLflow tracking; trainer.loggers adds loggers beside it",
        "callbacks": "its checkpoints and monitors are its own; trainer.callbacks adds to them",
        "enable_checkpointing": f"it needs its checkpoints; see stage.{stage}",
    }


def refuse_owned(cfg: DictConfig | dict | None, stage: str, instead: Mapping[str, str]) -> None:
    """Refuse a `trainer.<key>` that the stage sets itself (a key of `instead`); extra
    callbacks are added to the stage's, not refused."""
    given = to_plain(cfg) or {}
    for key, fix in instead.items():
        if given.get(key) is not None and key not in EXTRAS:
            raise ConfigError(
                f"trainer.{key}", f"is set by the {stage} stage: {fix}; remove trainer.{key}"
            )


def deepspeed_config_path(name: str) -> Path:
    path = Path(name)
    if not path.is_absolute():
        path = conf_dir() / "deepspeed" / name
    if not path.exists():
        raise ConfigError("trainer.deepspeed_config", f"file {path} does not exist")
    return path


def pin_visible_devices(trainer_cfg: DictConfig | dict) -> Any:
    """Export `visible_devices_env` for a list of device indices; returns the devices to use."""
    plain = dict(to_plain(trainer_cfg) or {})
    devices = plain.get("devices", "auto")
    env = plain.get("visible_devices_env")
    ids = device_list(devices)
    if not env or ids is None:
        return devices
    have = entries(os.environ.get(env, ""))
    if not have:
        os.environ[env] = ",".join(map(str, ids))
    elif have != [str(i) for i in ids]:
        raise ConfigError(
            "trainer.devices",
            f"lists devices {ids}, but {env}={','.join(have)} is already set",
            f"unset {env}, or a count such as trainer.devices={len(have)}",
        )
    return len(ids)


def check_trainer(trainer_cfg: DictConfig | dict | None) -> None:
    """Refuse, in one line, a trainer group this machine cannot run. Call before starting ranks."""
    plain = dict(to_plain(trainer_cfg) or {})
    if not plain:
        return
    accelerator = str(plain.get("accelerator", "auto")).lower()
    backend = str(plain.get("dist_backend") or "").lower()
    env = plain.get("visible_devices_env") or ASCEND_VISIBLE_DEVICES
    requested = _requested(plain.get("devices", "auto"), accelerator)
    pin_visible_devices(plain)

    if plain.get("strategy") == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(  # an optional extra: the core install runs without it
            "trainer.strategy",
            "is deepspeed, which is not installed",
            "pip install 'lowbit[deepspeed]', or trainer=ddp",
        )
    if accelerator == "npu" or backend == "hccl":
        key, value = ("accelerator", "npu") if accelerator == "npu" else ("dist_backend", "hccl")
        problem = torch_npu_problem()
        if problem:
            _refuse(key, f"is {value}, but {problem}")
    if backend == "nccl" and not torch.cuda.is_available():
        _refuse("dist_backend", f"is nccl, but {_no_cuda()}")
    if accelerator == "npu":
        have, what = visible_npus(env), "visible NPUs"
        if have == 0:
            mask = os.environ.get(env)
            _refuse(
                "accelerator",
                "is npu, but torch_npu sees no NPU" + (f" ({env}={mask})" if mask else ""),
            )
    elif accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            _refuse("accelerator", f"is {accelerator}, but {_no_cuda()}")
        have, what = torch.cuda.device_count(), "CUDA devices"
    elif accelerator == "cpu":
        have, what = os.cpu_count() or 1, "CPU cores (on cpu each device is one process)"
    else:
        return  # `auto` and other accelerators: Lightning picks and checks them
    if requested is None:
        return
    need = requested if isinstance(requested, int) else _list_need(requested, plain)
    if need > have:
        raise ConfigError(
            "trainer.devices",
            f"asks for {need} devices, but this machine has {have} {what}",
            f"1..{have} or auto" + ("" if accelerator == "cpu" else " or -1"),
        )


# Lightning records that say nothing about the run: an advertisement, and absent hardware.
_NOISE = ("💡 Tip:", "TPU available: False", "GPU available: False")


# Lightning warnings about what lowbit does on purpose (regexes matched at the message start).
_EXPECTED_WARNINGS = (
    "The `srun` command is available",  # lowbit starts its ranks itself, or under srun
    "You defined a `validation_step` but have no `val_dataloader`",  # bootstrap validates later
    "Found .* module\\(s\\) in eval mode",  # frozen teachers and targets stay in eval mode
    "`isinstance\\(treespec, LeafSpec\\)` is deprecated",  # inside Lightning, not fixable here
)


def _drop_noise(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_NOISE)


def _route_lightning_logs() -> None:
    """Lightning's records once, in the run's format: `lightning` adds a console handler of its
    own at import although its records also reach the root handlers (the CLI's console and log
    file, the stage log), so each line was printed twice. Idempotent."""
    if not logging.getLogger().hasHandlers():
        return  # no root handlers (a bare script): Lightning's own handler is the only output
    lightning_log = logging.getLogger("lightning")
    for handler in list(lightning_log.handlers):
        lightning_log.removeHandler(handler)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if _drop_noise not in rank_zero.filters:
        rank_zero.addFilter(_drop_noise)
    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def build_trainer(
    cfg: DictConfig | dict,
    *,
    stage: str = "training",
    name: str | None = None,
    owned: Mapping[str, Owned] | None = None,
    exclude_frozen_parameters: bool = False,
    **defaults,
):
    """A Trainer for `cfg` (the trainer group), the stage's own arguments and its defaults."""
    import lightning as L

    from pipeline.lit.progress import TrainingProgress

    _route_lightning_logs()
    owned = owned or {}
    refuse_owned(cfg, stage, {key: o.instead for key, o in owned.items()})
    kw = trainer_kwargs(cfg)
    added = {key: _built_extras(key, kw.pop(key, None)) for key in EXTRAS}
    for key, value in defaults.items():
        if kw.get(key) is None:
            kw[key] = value
    kw.update({key: o.value for key, o in owned.items()})
    kw["callbacks"] = [*_as_list(kw.get("callbacks")), *added["callbacks"]]
    if added["loggers"]:  # beside the stage's MLflow logger (False: tracking is off)
        own = kw.get("logger")
        kw["logger"] = [*([] if own in (None, False) else _as_list(own)), *added["loggers"]]
    kw["devices"] = pin_visible_devices(kw)
    # "auto": bf16 where the device computes it natively, else fp32 (pipeline.hardware)
    if kw.get("precision") is not None:
        kw["precision"] = resolve_precision(
            kw["precision"], kw.get("accelerator"), f"{stage}: trainer.precision"
        )
    if kw.get("enable_progress_bar") is None:  # a bar in a log file is one ever-growing line
        kw["enable_progress_bar"] = sys.stderr.isatty()
    ds_config = kw.pop("deepspeed_config", None)
    backend = kw.pop("dist_backend", None)
    for key in LOWBIT_KEYS:
        kw.pop(key, None)
    if kw.get("strategy") == "deepspeed":
        from pipeline.lit.deepspeed_cpu import make_deepspeed_strategy

        extra = {"process_group_backend": backend} if backend else {}
        path = deepspeed_config_path(ds_config or "zero2.json")
        kw["strategy"] = make_deepspeed_strategy(
            path, exclude_frozen_parameters=exclude_frozen_parameters, **extra
        )
    if kw.get("logger") not in (None, False):
        kw["callbacks"] = [*_as_list(kw.get("callbacks")), _lr_monitor()]
    kw["plugins"] = _with_sibling_checkpoints(_without_auto_requeue(kw.get("plugins")))
    lines = not kw["enable_progress_bar"]  # off a terminal the log is the only progress
    kw["callbacks"] = [*_as_list(kw.get("callbacks")), TrainingProgress(name or stage, lines=lines)]
    if str(kw.get("accelerator", "")).lower() == "npu":
        from pipeline.lit.npu import npu_trainer_kwargs

        kw = npu_trainer_kwargs(kw, backend or "hccl")
    elif backend:
        kw["strategy"] = ddp_with_backend(kw.get("strategy", "auto"), backend)
    return L.Trainer(**kw)


def _lr_monitor():
    from lightning.pytorch.callbacks import LearningRateMonitor

    # Every step: the stages' schedules change the rate every step.
    return LearningRateMonitor(logging_interval="step")


def _without_auto_requeue(plugins: Any) -> list | None:
    """Under Slurm, Lightning's SLURMEnvironment with its auto-requeue off: lowbit answers the
    time-limit signal itself at a step boundary (`pipeline.preempt`)."""
    from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment

    given = _as_list(plugins)
    if not SLURMEnvironment.detect() or any(isinstance(p, ClusterEnvironment) for p in given):
        return plugins
    return [*given, SLURMEnvironment(auto_requeue=False)]


def _with_sibling_checkpoints(plugins: Any) -> list:
    """Checkpoint files through `SiblingCheckpointIO` unless the config names a CheckpointIO."""
    from lightning.fabric.plugins.io import CheckpointIO

    from pipeline.lit.resume import SiblingCheckpointIO

    given = _as_list(plugins)
    if any(isinstance(p, CheckpointIO) for p in given):
        return given
    return [*given, SiblingCheckpointIO()]


def _as_list(callbacks: Any) -> list:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]


def _no_cuda() -> str:
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"torch sees no CUDA device (torch {torch.__version__}, {build})"


def _refuse(key: str, problem: str) -> None:
    here = "trainer=gpu or trainer=cpu run" if torch.cuda.is_available() else "trainer=cpu runs"
    raise ConfigError(f"trainer.{key}", f"{problem}; {here} on this machine")


def _requested(devices: Any, accelerator: str) -> int | list[int] | None:
    """A count, a list of indices, or None for all visible (`auto`, -1)."""
    ids = device_list(devices)
    if ids is not None:
        if accelerator == "cpu" or not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ConfigError("trainer.devices", f"is {devices}", _allowed(accelerator))
        return ids
    text = str(devices).strip().lower()
    if text == "auto" or (text == "-1" and accelerator != "cpu"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError("trainer.devices", f"is {devices}", _allowed(accelerator))
    return int(text)


def _allowed(accelerator: str) -> str:
    if accelerator == "cpu":
        return f"1..{os.cpu_count() or 1} (processes, at most one per core) or auto"
    return DEVICES_ALLOWED


def _list_need(ids: list[int], plain: dict) -> int:
    """Devices a list needs: n under the mask lowbit set, else its highest index + 1."""
    return len(ids) if plain.get("visible_devices_env") else max(ids) + 1
