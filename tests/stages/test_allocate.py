"""allocate: plans against brute force, constraints, budget errors, and the stage in a workflow."""

from __future__ import annotations

import itertools
import json
import math
import random
from types import SimpleNamespace

import pytest

from pipeline import workflow
from pipeline.config import QuantConfig
from pipeline.errors import ConfigError
from pipeline.quant.allocate import layer_bits, make_plan
from pipeline.quant.plan import BitPlan
from tests.conftest import make_cfg
from tests.stages.conftest import boot_cfg

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


@pytest.mark.parametrize(("budget", "fails"), [("2.1", True), ("2.2", False)])
def test_check_refuses_the_budget_from_config_alone(budget, fails):
    # the default candidates' cheapest, int2g128, costs 2 + 18/128 = 2.140625 bits per weight,
    # printed rounded up
    cfg = make_cfg(f"quant.budget_bits={budget}")
    if fails:
        with pytest.raises(ConfigError, match=r"quant\.budget_bits.*2\.1407"):
            workflow.check_stage(cfg, "allocate")
    else:
        workflow.check_stage(cfg, "allocate")


def test_check_reads_shapes_of_a_user_checkpoint(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 50,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = make_cfg(
        "model=hf",
        f"model.target.path={tmp_path}",
        "quant.candidates=[int4g64]",
        "quant.budget_bits=4.2",
    )
    # in=96: two groups of 64 -> (4*96 + 20*2)/96 bits on q,k,v,o,gate,up (67584 weights);
    # in=160: (4*160 + 20*3)/160 on down (15360); lm_head and embeddings stay float
    minimum = (67584 * (4 * 96 + 40) / 96 + 15360 * (4 * 160 + 60) / 160) / (67584 + 15360)
    with pytest.raises(ConfigError, match=f"minimum achievable: {math.ceil(minimum * 1e4) / 1e4}"):
        workflow.check_stage(cfg, "allocate")


def test_uniform_workflow_skips_sensitivity(boot, tmp_path):
    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,sensitivity,allocate]", "quant=w4g128")
    done = workflow.run(cfg)
    assert "sensitivity" not in done
    plan = BitPlan.load(tmp_path / "run" / "allocate")
    formats = {
        f.name for n, f in plan.layers.items() if not n.endswith(("lm_head", "embed_tokens"))
    }
    assert formats == {"int4g128"}
    assert (tmp_path / "run" / "allocate" / "bits_per_layer.png").stat().st_size > 0
