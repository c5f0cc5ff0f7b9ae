"""make_plan against brute force and its constraints; BitPlan's file round-trips, formats come
back parsed, unknown versions are refused."""

from __future__ import annotations

import itertools
import json
import math
import random
from types import SimpleNamespace

import pytest

from pipeline.config import FeedbackConfig, QuantConfig
from pipeline.errors import ConfigError, LowbitError
from pipeline.quant.allocate import layer_bits, make_plan
from pipeline.quant.formats import parse_format
from pipeline.quant.plan import BitPlan

CANDS = ["int2g32", "int3g64", "int4g32", "int8"]


def instance(seed: int):
    """Two blocks of q/k/v + o + lm_head with random shapes and decreasing ΔL per format."""
    rng = random.Random(seed)
    names, fused = [], []
    for b in range(2):
        qkv = [f"model.layers.{b}.self_attn.{p}_proj" for p in "qkv"]
        names += [*qkv, f"model.layers.{b}.self_attn.o_proj"]
        fused.append(qkv)
    names.append("lm_head")
    shapes = {n: (rng.choice([4, 8]), rng.choice([32, 64, 96])) for n in names}
    layers = {}
    for n in names:
        scale = rng.uniform(0.01, 1.0)
        layers[n] = {
            "dloss": {f: scale * 4.0**-i * rng.uniform(0.5, 1.5) for i, f in enumerate(CANDS)}
        }
    return shapes, layers, fused


def plan_of(shapes, layers, fused, q: QuantConfig) -> dict:
    """make_plan on test layers ({name: {"dloss", ...}}) and a quant section, as a file dict."""
    keys = ("dloss", "dloss_keep", "outlier_columns")
    scores = {n: SimpleNamespace(**{k: la.get(k) for k in keys}) for n, la in layers.items()}
    return make_plan(shapes, scores, fused, q.recipe).to_dict()


def brute_force(shapes, layers, items, budget):
    n_q = sum(math.prod(shapes[n]) for it in items for n in it)
    best = None
    for choice in itertools.product(CANDS, repeat=len(items)):
        bits = sum(layer_bits(f, shapes[n]) for it, f in zip(items, choice) for n in it)
        if bits <= budget * n_q:
            value = sum(layers[n]["dloss"][f] for it, f in zip(items, choice) for n in it)
            best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_optimal_with_fused_groups(seed):
    shapes, layers, fused = instance(seed)
    q = QuantConfig(candidates=CANDS, budget_bits=3.5, keep_float=["lm_head"])
    plan = plan_of(shapes, layers, fused, q)
    items = [*fused, ["model.layers.0.self_attn.o_proj"], ["model.layers.1.self_attn.o_proj"]]
    assert plan["predicted_dloss"] == pytest.approx(brute_force(shapes, layers, items, 3.5))
    for group in fused:  # one format per fused group
        assert len({plan["layers"][n] for n in group}) == 1
    # the budget holds exactly, recomputed from the plan in integer bits
    quantized = [n for n, f in plan["layers"].items() if f != "float"]
    bits = sum(layer_bits(plan["layers"][n], shapes[n]) for n in quantized)
    assert bits <= 3.5 * plan["quantized_params"] and plan["avg_bits"] <= 3.5
    assert plan["layers"]["lm_head"] == "float" and plan["keep_float"] == ["lm_head"]


def test_keep_float_widens_to_the_group_and_fallback_takes_the_most_sensitive():
    shapes, layers, fused = instance(0)
    layers["model.layers.1.self_attn.o_proj"]["dloss"] = {f: 100.0 for f in CANDS}
    q = QuantConfig(
        candidates=CANDS,
        budget_bits=8.5,
        float_fallback=1,
        keep_float=["lm_head", "layers.0.self_attn.k_proj"],
    )
    plan = plan_of(shapes, layers, fused, q)
    assert all(plan["layers"][n] == "float" for n in fused[0])  # k kept float -> q, v too
    assert plan["fallback"] == ["model.layers.1.self_attn.o_proj"]
    assert plan["layers"]["model.layers.1.self_attn.o_proj"] == "float"
    # excluded from the average: what is left fits int8 (8.5 bits with its scales)
    assert plan["quantized_params"] == sum(math.prod(shapes[n]) for n in fused[1]) + math.prod(
        shapes["model.layers.0.self_attn.o_proj"]
    )


def test_fallback_that_leaves_nothing_is_rejected():
    shapes, layers, fused = instance(0)
    q = QuantConfig(candidates=CANDS, budget_bits=4.0, float_fallback=4, keep_float=["lm_head"])
    with pytest.raises(ConfigError, match=r"quant\.float_fallback.*< 4"):
        plan_of(shapes, layers, fused, q)


def test_single_candidate_gives_a_uniform_plan_without_sensitivity():
    shapes, _, fused = instance(1)
    plan = plan_of(shapes, {}, fused, QuantConfig(candidates=["int4g32"], keep_float=[]))
    assert set(plan["layers"].values()) == {"int4g32"} and plan["predicted_dloss"] is None


def test_infeasible_budget_names_the_key_and_minimum():
    shapes, layers, fused = instance(2)
    q = QuantConfig(candidates=["int3g64", "int4g32"], budget_bits=2.0, keep_float=[])
    with pytest.raises(ConfigError, match=r"quant\.budget_bits.*minimum achievable: 3\.\d{4}"):
        plan_of(shapes, layers, fused, q)


SHAPES = {"a.q_proj": (8, 64), "a.k_proj": (8, 64), "a.o_proj": (8, 64), "lm_head": (16, 64)}


def plan() -> BitPlan:
    q = QuantConfig(candidates=["int2g32", "int4g32"], budget_bits=3.5, keep_float=["lm_head"])
    dloss = {"a.q_proj": 1.0, "a.k_proj": 2.0, "a.o_proj": 0.5, "lm_head": 9.0}
    scores = {n: _Score({"int2g32": d, "int4g32": d / 4}) for n, d in dloss.items()}
    return make_plan(SHAPES, scores, [["a.q_proj", "a.k_proj"]], q.recipe)


class _Score:
    def __init__(self, dloss):
        self.dloss, self.dloss_keep, self.outlier_columns = dloss, None, None


def test_round_trip_keeps_formats_parsed(tmp_path):
    p = plan().replace(score="fisher")
    path = p.save(tmp_path)
    assert path == tmp_path / "bitplan.json" and BitPlan.load(path) == p
    loaded = BitPlan.load(tmp_path)
    assert loaded == p and loaded.layers["lm_head"] == parse_format("float")
    assert set(loaded.quantized()) == {"a.q_proj", "a.k_proj", "a.o_proj"}
    raw = json.loads(path.read_text())
    assert raw["schema"] == BitPlan.SCHEMA and raw["schema_version"] == BitPlan.VERSION
    assert raw["layers"]["lm_head"] == "float" and "outlier_columns" not in raw


def test_a_file_without_a_version_is_version_1(tmp_path):
    raw = plan().to_dict()  # what allocate wrote before files carried a version
    (tmp_path / "bitplan.json").write_text(json.dumps(raw))
    assert BitPlan.load(tmp_path) == plan()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"schema_version": BitPlan.VERSION + 1}, r"version 2, newer than this lowbit reads \(1\)"),
        ({"schema": "lowbit.quant_report"}, r"is a lowbit\.quant_report file"),
    ],
)
def test_newer_or_foreign_files_are_refused_in_one_line(tmp_path, header, message):
    (tmp_path / "bitplan.json").write_text(json.dumps({**plan().to_dict(), **header}))
    with pytest.raises(LowbitError, match=message) as err:
        BitPlan.load(tmp_path)
    assert "\n" not in str(err.value) and "allocate" in str(err.value)


def test_missing_or_malformed_files_name_the_stage_to_rerun(tmp_path):
    with pytest.raises(LowbitError, match="rerun the allocate stage"):
        BitPlan.load(tmp_path)
    (tmp_path / "bitplan.json").write_text(json.dumps({"layers": {"x": "int4"}}))
    with pytest.raises(LowbitError, match="malformed.*rerun the allocate stage"):
        BitPlan.load(tmp_path)


def test_feedback_slack_is_held_back_from_the_plan():
    shapes, layers, fused = instance(0)
    full = plan_of(shapes, layers, fused, QuantConfig(candidates=CANDS, budget_bits=4.0))
    q = QuantConfig(candidates=CANDS, budget_bits=4.0, feedback=FeedbackConfig(slack_bits=0.5))
    held = plan_of(shapes, layers, fused, q)
    assert "feedback_bits" not in full and held["avg_bits"] <= 3.5 < full["avg_bits"]
    # what feedback may spend: exactly the bits between the plan and the budget
    n_q = held["quantized_params"]
    assert held["feedback_bits"] == 4 * n_q - round(held["avg_bits"] * n_q) >= 0.5 * n_q
