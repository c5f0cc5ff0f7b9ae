"""Build a Lightning Trainer from the `trainer` config group.

The group holds Trainer keyword arguments plus a few lowbit keys that select a strategy object
(e.g. `strategy: deepspeed` + `deepspeed_config`). Everything else passes through unchanged, so
any Trainer argument can be overridden on the command line (`trainer.precision=bf16-mixed`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline import conf_dir
from pipeline.config import to_plain
from pipeline.errors import ConfigError

LOWBIT_KEYS = {"deepspeed_config", "dist_backend", "visible_devices_env"}


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
    return plain


def deepspeed_config_path(name: str) -> Path:
    path = Path(name)
    if not path.is_absolute():
        path = conf_dir() / "deepspeed" / name
    if not path.exists():
        raise ConfigError("trainer.deepspeed_config", f"file {path} does not exist")
    return path


def build_trainer(cfg: DictConfig | dict, **overrides):
    """A Trainer for `cfg` (the trainer group) with stage-specific overrides (max_steps, ...)."""
    import lightning as L

    kw = trainer_kwargs(cfg)
    ds_config = kw.pop("deepspeed_config", None)
    for key in LOWBIT_KEYS:
        kw.pop(key, None)
    if kw.get("strategy") == "deepspeed":
        from pipeline.lit.deepspeed_cpu import make_deepspeed_strategy

        kw["strategy"] = make_deepspeed_strategy(deepspeed_config_path(ds_config or "zero2.json"))
    kw.update(overrides)
    return L.Trainer(**kw)
