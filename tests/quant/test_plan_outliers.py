"""allocate with quant.outliers=keep_fp16: kept columns traded against bits at equal bytes."""

from __future__ import annotations

import itertools
import math

import pytest

from pipeline.config import QuantConfig
from pipeline.errors import ConfigError
from pipeline.quant.allocate import kept_bits, layer_bits
from tests.quant.test_plan import CANDS, instance, plan_of


def with_outliers(seed: int, gain: float = 0.2):
    """``instance(seed)`` whose layers have outlier columns (a fused group shares its set) and
    dloss_keep = gain · dloss."""
    shapes, layers, fused = instance(seed)
    for n, layer in layers.items():
        group = next((g for g in fused if n in g), [n])
        layer["outlier_columns"] = [1, 2 + len(group[0]) % 3]  # same within a group
        layer["dloss_keep"] = {f: gain * v for f, v in layer["dloss"].items()}
    return shapes, layers, fused


def plan_bits(plan, shapes) -> int:
    """The plan's exact storage of its quantized layers, side matrices included."""
    kept = plan["outlier_columns"]
    return sum(
        layer_bits(f, shapes[n]) + kept_bits(shapes[n][0], len(kept.get(n, [])))
        for n, f in plan["layers"].items()
        if f != "float"
    )


def brute_force(shapes, layers, items, budget):
    """Best value over every (format, keep) choice per item, costs with the side matrices."""
    n_q = sum(math.prod(shapes[n]) for it in items for n in it)
    options = [(f, k) for f in CANDS for k in (False, True)]
    best = None
    for choice in itertools.product(options, repeat=len(items)):
        bits = value = 0
        for it, (f, keep) in zip(items, choice):
            for n in it:
                side = kept_bits(shapes[n][0], len(layers[n]["outlier_columns"]))
                bits += layer_bits(f, shapes[n]) + keep * side
                value += layers[n]["dloss_keep" if keep else "dloss"][f]
        if bits <= budget * n_q:
            best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(3))
def test_plan_is_optimal_over_formats_and_kept_columns(seed):
    shapes, layers, fused = with_outliers(seed)
    q = QuantConfig(candidates=CANDS, budget_bits=3.5, keep_float=["lm_head"], outliers="keep_fp16")
    plan = plan_of(shapes, layers, fused, q)
    items = [*fused, ["model.layers.0.self_attn.o_proj"], ["model.layers.1.self_attn.o_proj"]]
    assert plan["predicted_dloss"] == pytest.approx(brute_force(shapes, layers, items, 3.5))
    kept = plan["outlier_columns"]
    assert kept, "the side matrices are worth their bytes here"
    for group in fused:  # one input, one column set: all members keep or none does
        assert len({n in kept for n in group}) == 1
    bits = plan_bits(plan, shapes)
    assert bits <= 3.5 * plan["quantized_params"]  # the budget pays for the side matrices
    assert plan["avg_bits"] == pytest.approx(bits / plan["quantized_params"])
    side = sum(kept_bits(shapes[n][0], len(c)) for n, c in kept.items())
    assert plan["kept_bytes"] == math.ceil(side / 8)
    floats = sum(layer_bits("float", shapes[n]) for n, f in plan["layers"].items() if f == "float")
    assert plan["total_bytes"] == math.ceil((bits + floats) / 8)


def test_columns_are_kept_only_where_worth_their_bytes():
    shapes, layers, fused = with_outliers(0, gain=1.0)  # keeping gains nothing
    q = QuantConfig(candidates=CANDS, budget_bits=3.5, keep_float=["lm_head"], outliers="keep_fp16")
    assert plan_of(shapes, layers, fused, q)["outlier_columns"] == {}


def test_none_plans_as_before_and_records_no_columns():
    shapes, layers, fused = with_outliers(1)
    q = QuantConfig(candidates=CANDS, budget_bits=3.5, keep_float=["lm_head"])
    plan = plan_of(shapes, layers, fused, q)
    assert "outlier_columns" not in plan and "kept_bytes" not in plan
    bare = {n: {"dloss": layer["dloss"]} for n, layer in layers.items()}
    assert plan == plan_of(shapes, bare, fused, q)


def test_keep_fp16_with_a_single_candidate_still_chooses_columns():
    shapes, layers, fused = with_outliers(2)
    budget = 4.9  # int4g32 and room for some side matrices
    q = QuantConfig(candidates=["int4g32"], budget_bits=budget, keep_float=["lm_head"],
                    outliers="keep_fp16")  # fmt: skip
    plan = plan_of(shapes, layers, fused, q)
    assert plan["outlier_columns"] and plan["avg_bits"] <= budget


def test_keep_fp16_needs_sensitivity_and_a_budget():
    shapes, _, fused = instance(0)
    q = QuantConfig(candidates=["int4g32"], budget_bits=5.0, keep_float=[], outliers="keep_fp16")
    with pytest.raises(ConfigError, match=r"quant\.outliers.*sensitivity"):
        plan_of(shapes, {}, fused, q)
    with pytest.raises(ConfigError, match=r"quant\.budget_bits.*keep_fp16"):
        QuantConfig(candidates=["int4g32"], outliers="keep_fp16").check("quant")
    for cap in (0.0, 0.3):
        with pytest.raises(ConfigError, match=r"quant\.outlier_cap"):
            QuantConfig(outlier_cap=cap).check("quant")
