"""The stages, one module each, run in ORDER; each declares itself as `STAGE = Stage(...)`.

`run(cfg, run, io) -> dict` does the work into io.out_dir and returns metrics: `cfg` is the
parsed stage.<name>, `run` a RunConfig with only `sections` set, `io` a StageIO. `check` (checks
across sections, before any compute) and `skip_reason` (why the stage is not needed) are optional.
A config's optional `scaled(run)` returns it with its nulls chosen for the model's size
(pipeline.modelshape), before any fingerprint hashes it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    # Where the stage computes: trainer.accelerator's device for this rank (the workflow resolves
    # it with pipeline.lit.devices.stage_device); not hashed: it changes how, not what.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def describe(self, path: Path | str) -> str:
        """`path` as stage outputs record it: relative to the run dir when inside it, so an
        output never depends on where the run dir lives (a copied run keeps its digests)."""
        path = Path(path).resolve()
        try:
            return str(path.relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path)


@dataclass(frozen=True)
class Stage:
    """A stage's declaration: its config schema, its work and what it reads."""

    config: type  # the frozen dataclass of `stage.<name>`: its keys and defaults
    run: Callable[[Any, Any, StageIO], dict]
    sections: tuple[str, ...]  # run-wide sections it reads (pipeline.config.RUN_SECTIONS)
    needs: tuple[str, ...] = ()  # earlier stages whose outputs it requires
    uses: tuple[str, ...] = ()  # earlier stages whose outputs it reads when they exist
    distributed: bool = False  # run on every rank, or on rank 0 while the others wait
    check: Callable[[Any, Any], None] | None = None
    skip_reason: Callable[[Any, Any], str | None] | None = None

    def problems(self, name: str) -> list[str]:
        """What is wrong with this declaration as stage `name` (empty when nothing)."""
        from pipeline.config import RUN_SECTIONS

        earlier = ORDER[: ORDER.index(name)] if name in ORDER else ()
        out = [] if dataclasses.is_dataclass(self.config) else ["config is not a dataclass"]
        out += [f"{n} is not callable" for n in ("run", "check", "skip_reason")
                if getattr(self, n) is not None and not callable(getattr(self, n))]  # fmt: skip
        out += [f"reads {s!r}, not an earlier stage" for s in self.needs + self.uses
                if s not in earlier]  # fmt: skip
        out += [f"section {s!r} is not one of {RUN_SECTIONS}" for s in self.sections
                if s.split(".")[0] not in RUN_SECTIONS]  # fmt: skip
        return out


def load(name: str) -> Stage:
    """Stage `name`'s declaration, checked; a broken one fails here, before any stage runs."""
    if name not in ORDER:
        raise ConfigError("stages", f"contains unknown stage {name!r}", ", ".join(ORDER))
    return _declared(name)


def _declared(name: str) -> Stage:
    stage = getattr(importlib.import_module(f"pipeline.stages.{name}"), "STAGE", None)
    if not isinstance(stage, Stage):
        raise TypeError(f"pipeline.stages.{name} must define STAGE = Stage(...)")
    if problems := stage.problems(name):
        raise TypeError(f"pipeline.stages.{name}.STAGE: {'; '.join(problems)}")
    return stage


def register_configs() -> None:
    """Give Hydra every default from the dataclasses, before it composes conf/config.yaml.

    Imports every stage module (their schemas live beside their code).
    """
    from hydra.core.config_store import ConfigStore

    from pipeline.config import defaults_node

    # Not `load`, which tests replace with stand-ins.
    schemas = {name: _declared(name).config for name in ORDER}
    node = defaults_node(schemas)
    ConfigStore.instance().store(name=DEFAULTS_NODE, node=node)
