"""Per-layer bit allocation as an exact multiple-choice knapsack (HAWQ-v2/v3 line).

Each item (a layer, or a fused group sharing one format) picks one format minimising Σ ΔL with
Σ bits ≤ C, by DP over the capacity. Exact: costs are integer bits, each item's cheapest is
subtracted and the rest divided by their gcd g (every reachable total is a multiple of g). Beyond
``max_units`` costs round *up* to a coarser unit u and C *down*: Σ c ≤ Σ u·ceil(c/u) ≤
u·floor(C/u) ≤ C, so the budget still holds (``Solution.exact`` says which case ran).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from fractions import Fraction
from typing import Protocol

import numpy as np

from pipeline.errors import ConfigError
from pipeline.quant.formats import Format, as_format, parse_format
from pipeline.quant.plan import BitPlan, Recipe

log = logging.getLogger(__name__)
Shape = tuple[int, int]
FLOAT = parse_format("float")


class InfeasibleBudgetError(ValueError):
    """Even the cheapest choice of every item exceeds the capacity."""

    def __init__(self, min_cost: int, capacity: int):
        super().__init__(f"the cheapest choices need {min_cost} bits, capacity is {capacity}")
        self.min_cost = min_cost
        self.capacity = capacity


@dataclass(frozen=True)
class Solution:
    """Choice per item, exact cost and value; ``exact``: solved at the gcd resolution (optimal)."""

    choice: list[int]
    cost: int
    value: float
    exact: bool
    unit: int


def layer_bits(fmt: Format | str, shape: Sequence[int]) -> int:
    """Exact storage of an (out, in) weight in ``fmt``, in bits (codes + scales + zeros)."""
    fmt = as_format(fmt)
    out_features, in_features = int(shape[0]), int(shape[1])
    # bits_per_weight is (integer bits per row) / in_features; undo the division exactly.
    per_row = round(fmt.bits_per_weight(in_features) * in_features)
    return out_features * per_row


def kept_bits(out_features: int, columns: int) -> int:
    """Bits of ``columns`` kept inputs: fp16 side matrix (out × k) and int32 indices."""
    return columns * (16 * int(out_features) + 32)


def solve_mckp(
    costs: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]],
    capacity: int,
    max_units: int = 1_000_000,
) -> Solution:
    """One option per item minimising Σ ``values[i][j]`` (finite) with Σ ``costs[i][j]``
    (non-negative ints) ≤ ``capacity``, over at most ``max_units`` DP cells; raises
    InfeasibleBudgetError when the cheapest options exceed the capacity."""
    if len(costs) != len(values):
        raise ValueError(f"{len(costs)} cost rows but {len(values)} value rows")
    c = [np.asarray(row, dtype=object) for row in costs]  # Python ints: no overflow
    v = [np.asarray(row, dtype=np.float64) for row in values]
    for i, (ci, vi) in enumerate(zip(c, v)):
        if len(ci) == 0 or len(ci) != len(vi):
            raise ValueError(f"item {i}: {len(ci)} costs and {len(vi)} values (need >= 1, equal)")
        if any(int(x) != x or x < 0 for x in ci):
            raise ValueError(f"item {i}: costs must be non-negative integers, got {list(ci)}")
        if not np.isfinite(vi).all():
            raise ValueError(f"item {i}: values must be finite, got {list(vi)}")
    base = [int(min(ci)) for ci in c]
    min_cost = sum(base)
    if min_cost > capacity:
        raise InfeasibleBudgetError(min_cost, capacity)
    reduced = [[int(x) - b for x in ci] for ci, b in zip(c, base)]
    # Beyond the cost of taking every item's most expensive option, capacity is worthless.
    spare = min(capacity - min_cost, sum(max(r) for r in reduced))
    g = math.gcd(*[x for r in reduced for x in r]) or 1
    exact = spare // g <= max_units
    unit = g if exact else g * math.ceil(spare / g / max_units)
    units = spare // unit
    w = [[-(-x // unit) for x in r] for r in reduced]  # ceil: exact when unit divides x
    choice = _dp(w, v, units)
    cost = sum(int(ci[j]) for ci, j in zip(c, choice))
    if cost > capacity:  # unreachable by the argument above; a guard against regressions
        raise AssertionError(f"allocation cost {cost} exceeds capacity {capacity}")
    value = float(sum(vi[j] for vi, j in zip(v, choice)))
    return Solution(choice, cost, value, exact, unit)


def _dp(w: list[list[int]], v: list[np.ndarray], units: int) -> list[int]:
    """Min-value DP; dp[u] = best value using at most u units. Returns one choice per item."""
    n_cells = units + 1
    dp = np.zeros(n_cells)  # no item yet: value 0 whatever the capacity
    back_dtype = np.uint8 if max(len(x) for x in w) < 256 else np.uint16
    back = np.zeros((len(w), n_cells), dtype=back_dtype)  # (items, units + 1)
    for i, (wi, vi) in enumerate(zip(w, v)):
        new = np.full(n_cells, np.inf)
        # Options by increasing cost, strict improvement only: ties go to the cheaper option.
        for j in sorted(range(len(wi)), key=lambda j: (wi[j], j)):
            if wi[j] > units:
                continue
            cand = dp[: n_cells - wi[j]] + vi[j]  # (n_cells - w,)
            better = cand < new[wi[j] :]
            new[wi[j] :][better] = cand[better]
            back[i, wi[j] :][better] = j
        dp = new
    choice = [0] * len(w)
    u = units
    for i in range(len(w) - 1, -1, -1):
        j = int(back[i, u])
        choice[i] = j
        u -= w[i][j]
    return choice


class Scored(Protocol):
    """A scored layer as make_plan reads it (``analysis.report.LayerScore``), by format name."""

    dloss: Mapping[str, float]
    dloss_keep: Mapping[str, float] | None
    outlier_columns: Sequence[int] | None


def keep_float(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``name`` matches a glob or a run of dotted components (``mlp.down_proj``)."""
    for pat in patterns:
        if any(ch in pat for ch in "*?[") and fnmatch(name, pat):
            return True
        if f".{pat.strip('.')}." in f".{name}.":
            return True
    return False


def items_of(names: list[str], fused: list[list[str]], floats: set[str]) -> list[list[str]]:
    """Fused groups and single layers in model order; a group with a float member turns float."""
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
    r: Recipe, shapes: Mapping[str, Shape], items: list[list[str]], exact: bool
) -> None:
    """Fail when no assignment meets the budget; ``exact=False`` checks a lower bound only."""
    if r.budget_bits is None or not items:
        return
    cheapest = [min(sum(layer_bits(f, shapes[n]) for n in it) for f in r.formats) for it in items]
    n_q = sum(math.prod(shapes[n]) for it in items for n in it)
    if exact:
        minimum = Fraction(sum(cheapest), n_q)
    else:  # any average is at least the smallest per-item average
        minimum = min(
            Fraction(c, sum(math.prod(shapes[n]) for n in it)) for c, it in zip(cheapest, items)
        )
    if Fraction(r.budget_bits) < minimum:
        raise infeasible(r.budget_bits, minimum, exact)
    if Fraction(r.plan_bits) < minimum:
        floor = math.ceil(minimum * 10_000) / 10_000
        raise ConfigError(
            "quant.feedback.slack_bits",
            f"is {r.slack_bits}: the plan is made at budget_bits - slack_bits = {r.plan_bits:.4f}"
            f" bits per weight, below the cheapest candidates' {floor:.4f}",
            f"0 <= slack_bits <= {r.budget_bits - floor:.4f}",
        )


class _Costs:
    """ΔL and exact bits of an item's options (format, keep columns)."""

    def __init__(self, shapes: Mapping[str, Shape], scores: Mapping[str, Scored], r: Recipe):
        self.shapes, self.scores, self.r = shapes, scores, r

    def dloss(self, it: list[str], f: Format, keep: bool = False) -> float:
        s = self.scores
        return sum((s[n].dloss_keep if keep else s[n].dloss)[f.name] for n in it)

    def side(self, n: str) -> int:
        return kept_bits(self.shapes[n][0], len(self.scores[n].outlier_columns or ()))

    def bits(self, it: list[str], f: Format, keep: bool = False) -> int:
        return sum(layer_bits(f, self.shapes[n]) + (self.side(n) if keep else 0) for n in it)

    def options(self, it: list[str]) -> list[tuple[Format, bool]]:
        """The candidates, plus each quantized one with kept columns where all layers have some."""
        plain = [(f, False) for f in self.r.formats]
        if not self.r.keep_columns or not all(self.scores[n].outlier_columns for n in it):
            return plain
        return plain + [(f, True) for f in self.r.formats if f.kind != "float"]


def _fallback(items: list[list[str]], c: _Costs, r: Recipe) -> list[str]:
    """The ``float_fallback`` most sensitive items' layers: largest ΔL at their cheapest format."""
    if not r.float_fallback:
        return []
    if not c.scores:
        raise ConfigError("quant.float_fallback", "needs the sensitivity stage's output")
    if r.float_fallback >= len(items):
        raise ConfigError(
            "quant.float_fallback",
            f"is {r.float_fallback}, which leaves nothing to quantize",
            f"0 <= float_fallback < {len(items)} (the quantizable items)",
        )
    ranked = sorted(items, key=lambda it: -c.dloss(it, min(r.formats, key=lambda f: c.bits(it, f))))
    return [n for it in ranked[: r.float_fallback] for n in it]


def make_plan(
    shapes: Mapping[str, Shape],
    scores: Mapping[str, Scored],
    fused: list[list[str]],
    r: Recipe,
    max_units: int = 1_000_000,
) -> BitPlan:
    """The bit plan of ``shapes`` ({name: (out, in)}) minimising Σ ΔL of ``scores`` (by name)."""
    names = list(shapes)
    floats = {n for n in names if keep_float(n, r.keep_float)}
    items = items_of(names, fused, floats)
    kept = set(floats)  # keep_float matches, widened to whole fused groups
    if r.keep_columns and not scores:
        raise ConfigError(
            "quant.outliers",
            "is keep_fp16, which needs the sensitivity stage's outlier columns",
            "run sensitivity before allocate, or quant.outliers=none",
        )
    if not items:
        raise ConfigError("quant.keep_float", "keeps every layer float: nothing to quantize")
    c = _Costs(shapes, scores, r)
    fallback = _fallback(items, c, r)
    items = [it for it in items if it[0] not in fallback]
    check_budget(r, shapes, items, exact=True)
    n_q = sum(math.prod(shapes[n]) for it in items for n in it)
    opts = [c.options(it) for it in items]
    if all(len(o) == 1 for o in opts):
        choice, exact = [0] * len(items), True
    else:
        capacity = math.floor(Fraction(r.plan_bits) * n_q)  # exact: floats are dyadic
        sol = solve_mckp(
            [[c.bits(it, *o) for o in opt] for it, opt in zip(items, opts)],
            [[c.dloss(it, *o) for o in opt] for it, opt in zip(items, opts)],
            capacity,
            max_units,
        )
        choice, exact = sol.choice, sol.exact
    chosen = [opt[j] for opt, j in zip(opts, choice)]  # (format, keep) per item
    layers = dict.fromkeys(names, FLOAT)
    for it, (f, _) in zip(items, chosen):
        layers.update(dict.fromkeys(it, f))
    q_bits = sum(c.bits(it, *o) for it, o in zip(items, chosen))
    all_bits = q_bits + sum(layer_bits(FLOAT, shapes[n]) for n in floats | set(fallback))
    keepers = [n for it, (_, keep) in zip(items, chosen) if keep for n in it]
    return BitPlan(
        layers=layers,
        budget_bits=r.budget_bits,
        avg_bits=q_bits / n_q,
        total_bytes=math.ceil(all_bits / 8),
        predicted_dloss=sum(c.dloss(it, *o) for it, o in zip(items, chosen)) if scores else None,
        fused_groups=[g for g in fused if all(n in layers for n in g)],
        candidates=tuple(r.formats),
        quantized_params=n_q,
        quantized_bytes=math.ceil(q_bits / 8),
        keep_float=sorted(kept & set(names)),
        fallback=fallback,
        exact=exact,
        outlier_columns={n: list(scores[n].outlier_columns) for n in keepers}
        if r.keep_columns
        else None,
        kept_bytes=math.ceil(sum(c.side(n) for n in keepers) / 8) if r.keep_columns else None,
        feedback_bits=math.floor(Fraction(r.budget_bits) * n_q) - q_bits if r.slack_bits else None,
    )
