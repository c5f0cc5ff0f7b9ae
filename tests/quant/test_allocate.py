"""The multiple-choice knapsack against brute force; exact costs; budget safety."""

from __future__ import annotations

import itertools
import random

import pytest

from pipeline.quant.allocate import InfeasibleBudgetError, layer_bits, solve_mckp
from pipeline.quant.formats import parse_format


def brute_force(costs, values, capacity):
    best = None
    for choice in itertools.product(*(range(len(c)) for c in costs)):
        cost = sum(c[j] for c, j in zip(costs, choice))
        value = sum(v[j] for v, j in zip(values, choice))
        if cost <= capacity and (best is None or value < best):
            best = value
    return best


def random_instance(rng: random.Random):
    n = rng.randint(1, 5)
    scale = rng.choice([1, 8, 96])  # shared factors exercise the gcd reduction
    costs = [[scale * rng.randint(0, 30) for _ in range(rng.randint(1, 4))] for _ in range(n)]
    values = [[rng.uniform(0, 1) for _ in c] for c in costs]
    low, high = sum(min(c) for c in costs), sum(max(c) for c in costs)
    return costs, values, rng.randint(low, high + scale)


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    costs, values, capacity = random_instance(random.Random(seed))
    sol = solve_mckp(costs, values, capacity)
    assert sol.exact
    assert sol.value == pytest.approx(brute_force(costs, values, capacity), abs=1e-12)
    assert sol.cost == sum(c[j] for c, j in zip(costs, sol.choice)) <= capacity


@pytest.mark.parametrize("seed", range(20))
def test_coarse_resolution_still_respects_the_budget(seed):
    costs, values, capacity = random_instance(random.Random(100 + seed))
    sol = solve_mckp(costs, values, capacity, max_units=3)
    assert sol.cost <= capacity
    assert sol.value >= brute_force(costs, values, capacity) - 1e-12


def test_ties_prefer_the_cheaper_option():
    sol = solve_mckp([[10, 20]], [[1.0, 1.0]], capacity=30)
    assert sol.choice == [0]


def test_infeasible_capacity_names_the_minimum():
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_mckp([[5, 9], [7]], [[0.0, 0.0], [0.0]], capacity=11)
    assert e.value.min_cost == 12 and "12" in str(e.value)


@pytest.mark.parametrize("bad", [[[1.5]], [[-1]], [[]]])
def test_malformed_costs_are_rejected(bad):
    with pytest.raises(ValueError):
        solve_mckp(bad, [[0.0] * len(bad[0])], capacity=10)


@pytest.mark.parametrize("fmt", ["int2g64", "int3g128", "int4g128-sym", "int8", "exp4g32", "float"])
@pytest.mark.parametrize("shape", [(32, 64), (7, 200), (5, 128)])
def test_layer_bits_is_bits_per_weight_times_size(fmt, shape):
    bits = layer_bits(fmt, shape)
    assert isinstance(bits, int)
    assert bits == pytest.approx(parse_format(fmt).bits_per_weight(shape[1]) * shape[0] * shape[1])
