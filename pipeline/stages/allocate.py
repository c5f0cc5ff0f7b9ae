"""allocate: one format per layer (fused groups share one) minimising the predicted loss,

    min Σ_i ΔL_i(f_i)   s.t.   Σ_i bits_i(f_i) ≤ quant.budget_bits · Σ_i n_i

exactly (``pipeline.quant.allocate``), bits including scales, zeros and kept fp16 columns;
``quant.keep_float`` and ``quant.float_fallback`` layers stay float, outside the average.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from pipeline import plots, runmodels
from pipeline.analysis.report import SensitivityReport
from pipeline.analysis.shapes import LayerShapes, shapes_from_dir, shapes_from_spec
from pipeline.config import ModelConfig, RunConfig, positive
from pipeline.errors import ConfigError
from pipeline.quant.allocate import check_budget, items_of, keep_float, kept_bits, make_plan
from pipeline.quant.plan import BitPlan
from pipeline.stages import Stage, StageIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AllocateConfig:
    """Multiple-choice knapsack: one format per layer under quant.budget_bits."""

    max_units: int = 1_000_000  # DP cells; above, a coarser unit still within the budget

    def check(self, prefix: str) -> None:
        positive(prefix, max_units=self.max_units)


def _config_shapes(m: ModelConfig) -> LayerShapes | None:
    if m.target.path is None:
        return shapes_from_spec(m.target, m.tokenizer.vocab_size)
    try:
        return shapes_from_dir(m.target.local_dir("model.target"))
    except (OSError, KeyError, ValueError):
        return None  # not a checkpoint yet: checked at the start of run()


def check(cfg: AllocateConfig, run: RunConfig) -> None:
    """Refuse a budget no plan can meet, from the config alone (the target's shapes)."""
    q = run.quant
    if q.float_fallback < 0:
        raise ConfigError("quant.float_fallback", f"is {q.float_fallback}", "an integer >= 0")
    ls = _config_shapes(run.model)
    if ls is None:
        return
    floats = {n for n in ls.shapes if keep_float(n, q.keep_float)}
    items = items_of(list(ls.shapes), ls.fused, floats)
    # vocabulary layers are planned only if sensitivity scores them: then a lower bound only
    uniform = len(q.candidates) == 1 and q.float_fallback == 0
    vocab_free = all(not n.endswith(("lm_head", "embed_tokens")) for it in items for n in it)
    exact = vocab_free or (uniform and ls.exact_vocab)
    check_budget(q.recipe, ls.shapes, items, exact=q.float_fallback == 0 and exact)


def run(cfg: AllocateConfig, run: RunConfig, io: StageIO) -> dict:
    q = run.quant
    report = None
    if "sensitivity" in io.inputs:
        report = SensitivityReport.load(io.inputs["sensitivity"])
        scores = report.by_name()
        shapes = {n: layer.shape for n, layer in scores.items()}
        fused = report.fused_groups
    else:  # uniform plan: no sensitivity needed, only the shapes
        ls = shapes_from_dir(runmodels.fp_target(run.model, io.inputs))
        scores, shapes, fused = {}, ls.shapes, ls.fused
    plan = make_plan(shapes, scores, fused, q.recipe, cfg.max_units)
    if report is not None:  # which score the plan minimised (combined: and its weights)
        plan = plan.replace(score=report.method, importance_weights=report.importance_weights)
    plan.save(io.out_dir)
    _plot(plan, shapes, q.budget_bits, io.out_dir)
    log.info(
        "allocate: avg %.4f bits (budget %s), predicted ΔL %s",
        plan.avg_bits,
        q.budget_bits,
        plan.predicted_dloss,
    )
    exp = [n for n, f in plan.layers.items() if f.kind == "exp"]
    if exp and scores:  # where the exponential grid won a mixed plan: by the weights' tails
        tails = (f"{n} (weight kurtosis {scores[n].weight_kurtosis})" for n in exp)
        log.info("allocate: exponential codes for %s", ", ".join(tails))
    return _metrics(plan, q.candidates)


def _metrics(plan: BitPlan, candidates: list[str]) -> dict:
    metrics = {"avg_bits": plan.avg_bits, "total_bytes": plan.total_bytes}
    if plan.predicted_dloss is not None:
        metrics["predicted_dloss"] = plan.predicted_dloss
    names = [f.name for f in plan.layers.values()]
    metrics["float_layers"] = names.count("float")
    if plan.outlier_columns is not None:
        metrics["kept_layers"] = len(plan.outlier_columns)
        metrics["kept_columns"] = sum(len(c) for c in plan.outlier_columns.values())
        metrics["kept_bytes"] = plan.kept_bytes
    for f in candidates:
        metrics[f"layers_{f}"] = names.count(f)
    return metrics


def _plot(plan: BitPlan, shapes: dict, budget: float | None, out_dir: Path) -> None:
    names, kept = list(plan.layers), plan.kept()
    bits = [
        plan.layers[n].bits_per_weight(shapes[n][1])
        + kept_bits(shapes[n][0], len(kept.get(n, []))) / math.prod(shapes[n])
        for n in names
    ]
    colors = ["tab:gray" if plan.layers[n].kind == "float" else "tab:blue" for n in names]
    plots.bars(
        bits,
        names,
        out_dir / "bits_per_layer.png",
        "bits per weight (scales and zeros included)",
        "bits",
        hline=budget,
        hline_label="budget",
        colors=colors,
    )


STAGE = Stage(
    config=AllocateConfig,
    run=run,
    needs=("sensitivity",),
    uses=("bootstrap",),
    sections=("model", "quant"),
    check=check,
)
