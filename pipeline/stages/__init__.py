"""The stages, one module each, run in ORDER. A stage module exposes:

NEEDS: tuple[str, ...]      earlier stages whose outputs it requires
USES: tuple[str, ...]       earlier stages whose outputs it uses when they exist
SECTIONS: tuple[str, ...]   run-wide sections it reads, from pipeline.config.RUN_SECTIONS
DISTRIBUTED: bool           run on every rank (True) or on rank 0 while the others wait
CONFIG: type                the frozen dataclass of `stage.<name>`: its keys and defaults

run(cfg, run, io) -> dict            do the work into io.out_dir, return metrics; `cfg` is the
                                     parsed stage.<name>, `run` a pipeline.config.RunConfig with
                                     only SECTIONS set, `io` a StageIO
check(cfg, run) -> None              (optional) checks across sections, before any compute
skip_reason(cfg, run) -> str | None  (optional) why the stage is not needed with this config
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from pipeline.dist import Dist
from pipeline.errors import ConfigError
from pipeline.tracking import StageRun

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
# The ConfigStore name conf/config.yaml's defaults list starts with.
DEFAULTS_NODE = "lowbit_defaults"


@dataclass
class StageIO:
    """Where a stage writes and what earlier stages produced (its `run`'s third argument).

    Defined here, beside the contract, so stage modules need not import the workflow that calls
    them; `pipeline.workflow.StageIO` is the same class.
    """

    name: str
    out_dir: Path
    work_dir: Path
    run_dir: Path
    inputs: dict[str, Path] = field(default_factory=dict)  # stage name -> its finished folder
    dist: Dist = field(default_factory=Dist)
    log: StageRun = field(default_factory=StageRun)

    def describe(self, path: Path | str) -> str:
        """`path` as stage outputs record it: relative to the run dir when inside it, so an
        output never depends on where the run dir lives (a copied run keeps its digests)."""
        path = Path(path).resolve()
        try:
            return str(path.relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path)


def load(name: str) -> ModuleType:
    if name not in ORDER:
        raise ConfigError("stages", f"contains unknown stage {name!r}", ", ".join(ORDER))
    return importlib.import_module(f"pipeline.stages.{name}")


def register_configs() -> None:
    """Give Hydra every default from the dataclasses, before it composes conf/config.yaml.

    Imports every stage module (their schemas live beside their code).
    """
    from hydra.core.config_store import ConfigStore

    from pipeline.config import defaults_node

    # Not `load`, which tests replace with stand-ins.
    schemas = {name: importlib.import_module(f"pipeline.stages.{name}").CONFIG for name in ORDER}
    node = defaults_node(schemas)
    ConfigStore.instance().store(name=DEFAULTS_NODE, node=node)
