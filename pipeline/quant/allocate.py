"""Per-layer bit allocation as an exact multiple-choice knapsack.

Mixed-precision allocation in the HAWQ-v2/v3 line (Dong et al., NeurIPS 2020; Yao et al., ICML
2021): every item (a layer, or a fused group of layers that must share one format) picks one
format; the predicted loss increases add up, and so do the storage costs. Minimising
Σ_i v_i(j_i) subject to Σ_i c_i(j_i) ≤ C is a multiple-choice knapsack, solved here by dynamic
programming over the capacity.

Exactness. Costs are exact integers (storage bits, scales and zeros included). Each item's
cheapest cost is subtracted first (every item then has a zero-cost choice and the capacity
shrinks by their sum), and the reduced costs and capacity are divided by the gcd ``g`` of the
reduced costs: every reachable total is a multiple of ``g``, so ``total ≤ C'`` iff
``total / g ≤ floor(C' / g)`` and the DP over ``floor(C'/g)`` units is exact. When that is more
than ``max_units`` units (very large models with coprime shapes), costs are rounded *up* to a
coarser unit ``u`` and the capacity *down*; a DP solution then satisfies
``Σ c ≤ Σ u·ceil(c/u) ≤ u·floor(C'/u) ≤ C'``, so the budget still holds exactly (the optimum may
be missed by at most the rounding slack; ``Solution.exact`` says which case ran). The exact cost
of the returned choice is checked against ``C`` in every case.

Memory: one byte (or two, above 255 choices) per item and unit for the back-pointers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.quant.formats import Format, parse_format


class InfeasibleBudgetError(ValueError):
    """Even the cheapest choice of every item exceeds the capacity."""

    def __init__(self, min_cost: int, capacity: int):
        super().__init__(f"the cheapest choices need {min_cost} bits, capacity is {capacity}")
        self.min_cost = min_cost
        self.capacity = capacity


@dataclass(frozen=True)
class Solution:
    """Result of :func:`solve_mckp`.

    Attributes:
        choice: Index of the chosen option per item.
        cost: Exact total cost (same units as the input costs).
        value: Total value of the choice.
        exact: True when the DP ran at the exact (gcd) resolution, so the value is optimal.
        unit: Cost units per DP cell.
    """

    choice: list[int]
    cost: int
    value: float
    exact: bool
    unit: int


def layer_bits(fmt: Format | str, shape: Sequence[int]) -> int:
    """Exact storage of an (out, in) weight in ``fmt``, in bits (codes + scales + zeros)."""
    fmt = parse_format(fmt)
    out_features, in_features = int(shape[0]), int(shape[1])
    # bits_per_weight is (integer bits per row) / in_features; undo the division exactly.
    per_row = round(fmt.bits_per_weight(in_features) * in_features)
    return out_features * per_row


def kept_bits(out_features: int, columns: int) -> int:
    """Exact storage of ``columns`` kept input columns of an (out, in) weight, in bits: the fp16
    side matrix (out × k) and the int32 column indices (``QTensor.keep_idx``/``keep_vals``)."""
    return columns * (16 * int(out_features) + 32)


def solve_mckp(
    costs: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]],
    capacity: int,
    max_units: int = 1_000_000,
) -> Solution:
    """Choose one option per item minimising the total value with total cost ≤ capacity.

    Args:
        costs: ``costs[i][j]`` non-negative integer cost of option j of item i.
        values: ``values[i][j]`` finite value (e.g. predicted loss increase) of that option.
        capacity: Integer capacity.
        max_units: Largest number of DP cells; above it the DP runs at a coarser, still
            budget-safe resolution (see the module docstring).

    Returns:
        The :class:`Solution`.

    Raises:
        InfeasibleBudgetError: The cheapest options together exceed the capacity.
        ValueError: Malformed input (empty item, negative cost, non-finite value).
    """
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
