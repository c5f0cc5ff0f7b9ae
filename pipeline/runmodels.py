"""Which models a run has, from the `model` section and the finished stage folders (`inputs`):
the one answer for every stage and benchmark.

Target: `model.target.path` (a folder, or a hub id's cached snapshot) or `bootstrap/target`, then
`quantize/model`, `distill/model`. Draft: `model.draft.path` or bootstrap's (none for a user
target without one: it drafts for itself), then `reinforce/draft`. The last of each that a run has
is its final model.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import ModelConfig
from pipeline.errors import LowbitError
from pipeline.rundir import read_done


def finished_stages(run_dir: Path) -> dict[str, Path]:
    """{stage: its folder} for every stage of `run_dir` with a `_done.json`."""
    run_dir = Path(run_dir)
    found = (p.parent for p in sorted(run_dir.glob("*/_done.json")))
    return {d.name: d for d in found if read_done(d) is not None}


def fp_target(model: ModelConfig, inputs: dict[str, Path]) -> Path:
    """The FP target checkpoint: the user's, or the one bootstrap trained."""
    if model.target.path:
        return model.target.local_dir("model.target")
    if "bootstrap" not in inputs:
        raise LowbitError("no target model: set model.target.path or run the bootstrap stage")
    return inputs["bootstrap"] / "target"


def fp_draft(model: ModelConfig, inputs: dict[str, Path]) -> Path | None:
    """The FP draft checkpoint, or None (then the target drafts for itself)."""
    if model.draft.path:
        return model.draft.local_dir("model.draft")
    if not model.target.path and "bootstrap" in inputs:
        return inputs["bootstrap"] / "draft"
    return None


def quantized_targets(inputs: dict[str, Path]) -> dict[str, Path]:
    """{"target_quantized": ..., "target_distilled": ...}, those the run has, in order."""
    found = {}
    for stage, name in (("quantize", "target_quantized"), ("distill", "target_distilled")):
        if stage in inputs and (inputs[stage] / "model").is_dir():
            found[name] = inputs[stage] / "model"
    return found


def targets(model: ModelConfig, inputs: dict[str, Path]) -> dict[str, Path]:
    """{"target_fp": ..., "target_quantized": ..., "target_distilled": ...}, those it has."""
    return {"target_fp": fp_target(model, inputs), **quantized_targets(inputs)}


def drafts(model: ModelConfig, inputs: dict[str, Path]) -> dict[str, Path]:
    """{"draft_fp": ..., "draft_reinforced": ...}, the ones the run has (the last is final)."""
    found = {}
    draft = fp_draft(model, inputs)
    if draft is not None:
        found["draft_fp"] = draft
    if "reinforce" in inputs and (inputs["reinforce"] / "draft").is_dir():
        found["draft_reinforced"] = inputs["reinforce"] / "draft"
    return found


def final_target(model: ModelConfig, inputs: dict[str, Path]) -> Path:
    """distill's model when distill ran, else quantize's, else the FP target."""
    low_bit = quantized_targets(inputs)
    return list(low_bit.values())[-1] if low_bit else fp_target(model, inputs)


def final_draft(model: ModelConfig, inputs: dict[str, Path]) -> Path | None:
    """reinforce's draft when reinforce ran, else the FP draft (None when there is none)."""
    found = drafts(model, inputs)
    return list(found.values())[-1] if found else None
