"""allocate: one format per layer, minimising the predicted loss under the bit budget.

Items are layers, except that a fused group (q/k/v, gate/up: one input, one kernel) is one item
whose members share a format. Layers matching ``quant.keep_float`` are never quantized (a group
with such a member stays float as a whole); ``quant.float_fallback: k`` keeps the k most
sensitive remaining items float as well (msModelSlim's fallback: ranked by ΔL at their cheapest
candidate). Float layers are excluded from the average. The rest solve

    min Σ_i ΔL_i(f_i)   s.t.   Σ_i bits_i(f_i) ≤ quant.budget_bits · Σ_i n_i

exactly (``pipeline.quant.allocate.solve_mckp``), with ``bits_i`` the exact storage of the
layer's codes, scales and zeros (``Format.bits_per_weight``). A single candidate gives a uniform
plan without sensitivity.

Kept columns (``quant.outliers=keep_fp16``): every item whose layers have outlier columns in
sensitivity.json gets, per format f, a second option "f + kept columns" worth ``dloss_keep[f]``
and costing f's bits plus the side matrix's exact storage (``kept_bits``: fp16 out × k values
and int32 indices per layer; a fused group reads one input, so its members keep the same
columns). The budget covers those bits too (equal total bytes), and so do ``avg_bits`` and
``total_bytes``; ``outlier_columns`` lists the columns of every layer that keeps some.

Output: ``bitplan.json`` (every scored layer, ``float`` for the unquantized ones) and
``bits_per_layer.png``. ΔL is sensitivity.json's ``dloss``: one estimator's,
or with ``stage.sensitivity.importance=combined`` the fitted combination of all three (the plan
records which under ``score``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from fnmatch import fnmatch
from fractions import Fraction
from pathlib import Path

from pipeline import plots, runmodels
from pipeline.analysis.shapes import LayerShapes, shapes_from_dir, shapes_from_spec
from pipeline.config import ModelConfig, QuantConfig, RunConfig, positive
from pipeline.errors import ConfigError
from pipeline.quant.allocate import kept_bits, layer_bits, solve_mckp
from pipeline.quant.formats import parse_format
from pipeline.stages import StageIO

NEEDS: tuple[str, ...] = ("sensitivity",)
USES: tuple[str, ...] = ("bootstrap",)
SECTIONS = ("model", "quant")
DISTRIBUTED = False

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AllocateConfig:
    """Multiple-choice knapsack: one format per layer (fused groups share one) under
    quant.budget_bits."""

    # The DP runs in exact bit units (costs divided by their gcd) up to max_units cells; above
    # that it rounds costs up to a coarser unit, which still respects the budget exactly.
    max_units: int = 1_000_000

    def check(self, prefix: str) -> None:
        positive(prefix, max_units=self.max_units)


CONFIG = AllocateConfig


def keep_float(name: str, patterns: list[str]) -> bool:
    """Whether ``name`` matches a keep_float entry: a glob, or a run of dotted components
    (``lm_head``, ``embed_tokens``, ``mlp.down_proj``, ``model.layers.0``)."""
    for pat in patterns:
        if any(ch in pat for ch in "*?[") and fnmatch(name, pat):
            return True
        if f".{pat.strip('.')}." in f".{name}.":
            return True
    return False


def items_of(names: list[str], fused: list[list[str]], floats: set[str]) -> list[list[str]]:
    """Allocation items in model order: fused groups (when all present) and single layers.

    A group with a float member turns float as a whole (``floats`` is updated)."""
    group_of = {n: tuple(g) for g in fused if all(m in names for m in g) for n in g}
    items, seen = [], set()
    for n in names:
        g = group_of.get(n, (n,))
        if g in seen:
            continue
        seen.add(g)
        if floats & set(g):
            if not set(g) <= floats:
                log.warning(
                    "allocate: %s kept float because %s is", list(g), sorted(floats & set(g))
                )
            floats.update(g)
            continue
        items.append(list(g))
    return items


def infeasible(budget: float, minimum: Fraction, exact: bool) -> ConfigError:
    floor = math.ceil(minimum * 10_000) / 10_000  # rounded up: setting it is feasible
    what = "the minimum achievable" if exact else "a lower bound of what is achievable"
    return ConfigError(
        "quant.budget_bits",
        f"is {budget}, below {what}: {floor:.4f} bits per weight (every quantized layer in "
        "its cheapest candidate, scales and zeros included)",
        f"quant.budget_bits >= {floor:.4f}, or a cheaper format in quant.candidates",
    )


def check_budget(
    q: QuantConfig, shapes: dict[str, tuple[int, int]], items: list[list[str]], exact: bool
) -> None:
    """Fail when no assignment meets the budget; ``exact=False`` checks a lower bound only."""
    if q.budget_bits is None or not items:
        return
    cheapest = [
        min(sum(layer_bits(f, shapes[n]) for n in it) for f in q.candidates) for it in items
    ]
    n_q = sum(math.prod(shapes[n]) for it in items for n in it)
    if exact:
        minimum = Fraction(sum(cheapest), n_q)
    else:  # any average is at least the smallest per-item average
        minimum = min(
            Fraction(c, sum(math.prod(shapes[n]) for n in it)) for c, it in zip(cheapest, items)
        )
    if Fraction(q.budget_bits) < minimum:
        raise infeasible(q.budget_bits, minimum, exact)


def _config_shapes(m: ModelConfig) -> LayerShapes | None:
    if m.target.path is None:
        return shapes_from_spec(m.target, m.tokenizer.vocab_size)
    try:
        return shapes_from_dir(Path(m.target.path))
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
    # A uniform plan holds every layer. A mixed one holds the layers sensitivity scored, and
    # whether the vocabulary layers are among them is its config's to say (seen in its output),
    # so with any in play the check is a lower bound only.
    uniform = len(q.candidates) == 1 and q.float_fallback == 0
    vocab_free = all(not n.endswith(("lm_head", "embed_tokens")) for it in items for n in it)
    exact = vocab_free or (uniform and ls.exact_vocab)
    check_budget(q, ls.shapes, items, exact=q.float_fallback == 0 and exact)


def run(cfg: AllocateConfig, run: RunConfig, io: StageIO) -> dict:
    q = run.quant
    if "sensitivity" in io.inputs:
        report = json.loads((io.inputs["sensitivity"] / "sensitivity.json").read_text())
        layers = {layer["name"]: layer for layer in report["layers"]}
        shapes = {n: tuple(layer["shape"]) for n, layer in layers.items()}
        fused = report["fused_groups"]
    else:  # uniform plan: no sensitivity needed, only the shapes
        ls = shapes_from_dir(runmodels.fp_target(run.model, io.inputs))
        layers, shapes, fused = {}, ls.shapes, ls.fused
    plan = make_plan(shapes, layers, fused, q, cfg.max_units)
    if "sensitivity" in io.inputs:  # which score the plan minimised (combined: and its weights)
        plan["score"] = report["method"]
        if "importance" in report:
            plan["importance_weights"] = report["importance"]["weights"]
    (io.out_dir / "bitplan.json").write_text(json.dumps(plan, indent=1))
    names = list(plan["layers"])
    kept = plan.get("outlier_columns", {})
    plots.bars(
        [
            parse_format(plan["layers"][n]).bits_per_weight(shapes[n][1])
            + kept_bits(shapes[n][0], len(kept.get(n, []))) / math.prod(shapes[n])
            for n in names
        ],
        names,
        io.out_dir / "bits_per_layer.png",
        "bits per weight (scales and zeros included)",
        "bits",
        hline=q.budget_bits,
        hline_label="budget",
        colors=["tab:gray" if plan["layers"][n] == "float" else "tab:blue" for n in names],
    )
    metrics = {k: plan[k] for k in ("avg_bits", "total_bytes") if plan[k] is not None}
    if plan["predicted_dloss"] is not None:
        metrics["predicted_dloss"] = plan["predicted_dloss"]
    metrics["float_layers"] = sum(f == "float" for f in plan["layers"].values())
    if "outlier_columns" in plan:
        metrics["kept_layers"] = len(plan["outlier_columns"])
        metrics["kept_columns"] = sum(len(c) for c in plan["outlier_columns"].values())
        metrics["kept_bytes"] = plan["kept_bytes"]
    for f in q.candidates:
        metrics[f"layers_{f}"] = sum(v == f for v in plan["layers"].values())
    log.info(
        "allocate: avg %.4f bits (budget %s), predicted ΔL %s",
        plan["avg_bits"],
        q.budget_bits,
        plan["predicted_dloss"],
    )
    exp = [n for n, f in plan["layers"].items() if f != "float" and parse_format(f).kind == "exp"]
    if exp and layers:  # where the exponential grid won a mixed plan: by the weights' tails
        log.info(
            "allocate: exponential codes for %s",
            ", ".join(f"{n} (weight kurtosis {layers[n].get('weight_kurtosis')})" for n in exp),
        )
    return metrics


def make_plan(
    shapes: dict[str, tuple[int, int]],
    layers: dict[str, dict],
    fused: list[list[str]],
    q: QuantConfig,
    max_units: int = 1_000_000,
) -> dict:
    """The bitplan.json content (budget_bits, avg_bits, total_bytes, predicted_dloss, layers,
    fused_groups, and details) for the layers {name: (out, in)}.

    Args:
        shapes: Every planned layer's weight shape, in model order.
        layers: sensitivity.json entries by name (``dloss`` per candidate); may be empty for a
            single candidate without fallback.
        fused: Groups that share a format.
        q: The quant section (candidates, budget_bits, float_fallback, keep_float).
        max_units: DP resolution cap.
    """
    names = list(shapes)
    cands = [parse_format(c).name for c in q.candidates]
    floats = {n for n in names if keep_float(n, q.keep_float)}
    items = items_of(names, fused, floats)
    kept = set(floats)  # keep_float matches, widened to whole fused groups

    keeping = q.outliers == "keep_fp16"
    if keeping and not layers:
        raise ConfigError(
            "quant.outliers",
            "is keep_fp16, which needs the sensitivity stage's outlier columns",
            "run sensitivity before allocate, or quant.outliers=none",
        )

    def dloss(it: list[str], f: str, keep: bool = False) -> float:
        return sum(layers[n]["dloss_keep" if keep else "dloss"][f] for n in it)

    def cost(it: list[str], f: str, keep: bool = False) -> int:
        return sum(layer_bits(f, shapes[n]) + (side(n) if keep else 0) for n in it)

    def side(n: str) -> int:
        return kept_bits(shapes[n][0], len(layers[n]["outlier_columns"]))

    def options(it: list[str]) -> list[tuple[str, bool]]:
        """(format, keep columns) choices of an item: the candidates, and with keep_fp16 each
        quantized one plus kept columns where every layer of the item has some."""
        plain = [(f, False) for f in cands]
        if not keeping or not all(layers[n].get("outlier_columns") for n in it):
            return plain
        return plain + [(f, True) for f in cands if parse_format(f).kind != "float"]

    if not items:
        raise ConfigError("quant.keep_float", "keeps every layer float: nothing to quantize")
    fallback: list[str] = []
    if q.float_fallback:
        if not layers:
            raise ConfigError("quant.float_fallback", "needs the sensitivity stage's output")
        if q.float_fallback >= len(items):
            raise ConfigError(
                "quant.float_fallback",
                f"is {q.float_fallback}, which leaves nothing to quantize",
                f"0 <= float_fallback < {len(items)} (the quantizable items)",
            )
        # The most sensitive item: the largest ΔL at its cheapest candidate.
        ranked = sorted(items, key=lambda it: -dloss(it, min(cands, key=lambda f: cost(it, f))))
        for it in ranked[: q.float_fallback]:
            fallback += it
        items = [it for it in items if it[0] not in fallback]
    check_budget(q, shapes, items, exact=True)
    n_q = sum(math.prod(shapes[n]) for it in items for n in it)
    opts = [options(it) for it in items]
    if all(len(o) == 1 for o in opts):
        choice, exact = [0] * len(items), True
    else:
        capacity = math.floor(Fraction(q.budget_bits) * n_q)  # exact: floats are dyadic
        sol = solve_mckp(
            [[cost(it, *o) for o in opt] for it, opt in zip(items, opts)],
            [[dloss(it, *o) for o in opt] for it, opt in zip(items, opts)],
            capacity,
            max_units,
        )
        choice, exact = sol.choice, sol.exact
    chosen = [opt[j] for opt, j in zip(opts, choice)]  # (format, keep) per item
    plan = dict.fromkeys(names, "float")
    for it, (f, _) in zip(items, chosen):
        plan.update(dict.fromkeys(it, f))
    q_bits = sum(cost(it, *o) for it, o in zip(items, chosen))
    all_bits = q_bits + sum(layer_bits("float", shapes[n]) for n in floats | set(fallback))
    extra = {}
    if keeping:
        keepers = [n for it, (_, keep) in zip(items, chosen) if keep for n in it]
        extra = {
            "outlier_columns": {n: layers[n]["outlier_columns"] for n in keepers},
            "kept_bytes": math.ceil(sum(side(n) for n in keepers) / 8),
        }
    return {
        "budget_bits": q.budget_bits,
        "avg_bits": q_bits / n_q,
        "total_bytes": math.ceil(all_bits / 8),
        "predicted_dloss": sum(dloss(it, *o) for it, o in zip(items, chosen)) if layers else None,
        "layers": plan,
        "fused_groups": [g for g in fused if all(n in plan for n in g)],
        "candidates": cands,
        "quantized_params": n_q,
        "quantized_bytes": math.ceil(q_bits / 8),
        "keep_float": sorted(kept & set(names)),
        "fallback": fallback,
        "exact": exact,
        **extra,
    }
