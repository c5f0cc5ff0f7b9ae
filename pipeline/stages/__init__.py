"""The stages, one module each. A stage module exposes:

NEEDS: tuple[str, ...]     earlier stages whose outputs it requires
USES: tuple[str, ...]      earlier stages whose outputs it uses when they exist
KEYS: tuple[str, ...]      config sections (besides `stage.<name>` and `seed`) its result depends on
DISTRIBUTED: bool          run on every rank (True) or on rank 0 while the others wait
validate(cfg) -> None      raise ConfigError before any compute
run(ctx) -> dict           do the work into ctx.out_dir, return metrics
skip_reason(cfg) -> str | None   (optional) why the stage is not needed with this config
"""

import importlib
from types import ModuleType

from pipeline.errors import ConfigError

ORDER = (
    "bootstrap",
    "sensitivity",
    "allocate",
    "quantize",
    "distill",
    "reinforce",
    "evaluate",
    "export",
)


def load(name: str) -> ModuleType:
    if name not in ORDER:
        raise ConfigError("stages", f"contains unknown stage {name!r}", ", ".join(ORDER))
    return importlib.import_module(f"pipeline.stages.{name}")
