"""sensitivity (+ allocate) through the workflow on the smoke bootstrap models."""

from __future__ import annotations

import pytest

from pipeline import workflow
from pipeline.analysis.report import SensitivityReport
from pipeline.analysis.sensitivity import METHODS
from pipeline.errors import ConfigError
from pipeline.quant.allocate import layer_bits
from pipeline.quant.plan import BitPlan
from tests.conftest import make_cfg
from tests.stages.conftest import boot_cfg

# Formats in order of falling error: the candidates ΔL must follow, in every layer for more bits,
# in the sum over layers for finer groups. In one layer min-max RTN in finer groups can land
# farther (int3g64 7% above int3g128 in one layer of a bf16-trained smoke bootstrap).
BIT_CHAIN = ["int2g64", "int3g128", "int4g128", "int8"]
GROUP_CHAINS = [["int2g128", "int2g64", "int2g32"], ["int3g128", "int3g64"]]


def test_workflow_writes_sensitivity_and_bitplan(boot, tmp_path):
    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,sensitivity,allocate]")
    done = workflow.run(cfg)
    run = tmp_path / "run"
    report = SensitivityReport.load(run / "sensitivity").to_dict()
    cands = list(cfg.quant.candidates)
    assert report["candidates"] == cands
    names = [layer["name"] for layer in report["layers"]]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert len(names) == 2 + 7 * cfg.model.target.layers
    for layer in report["layers"]:
        assert layer["params"] == layer["shape"][0] * layer["shape"][1]
        assert layer["weight_kurtosis"] > 1  # Pearson: 3 for a Gaussian, >= 1 always
        # more bits cost less (exponential codes sit apart)
        assert all(v >= 0 for v in layer["dloss"].values()), layer["name"]
        dl = [layer["dloss"][f] for f in BIT_CHAIN if f in cands]
        assert dl == sorted(dl, reverse=True), layer["name"]
        keys = {"share", "kurtosis", "max_over_median", "act8_error", "columns"}
        assert set(layer["outliers"]) == keys
        if layer["name"] != "model.embed_tokens":
            assert 0 <= layer["outliers"]["share"] < 0.5 and layer["outliers"]["kurtosis"] > 1
            # inputs in blocks of 32: what int8 activations cost them, measured
            assert 0 < layer["outliers"]["act8_error"] < 0.1
    for chain in GROUP_CHAINS:  # the same bits in finer groups cost less over the model
        total = [sum(x["dloss"][f] for x in report["layers"]) for f in chain if f in cands]
        assert total == sorted(total, reverse=True), chain
    for png in ("sensitivity_heatmap.png", "sensitivity_bars.png", "outliers.png"):
        assert (run / "sensitivity" / png).stat().st_size > 1000

    plan = BitPlan.load(run / "allocate").to_dict()
    assert set(plan["layers"]) == set(names)
    shapes = {layer["name"]: layer["shape"] for layer in report["layers"]}
    quantized = {n: f for n, f in plan["layers"].items() if f != "float"}
    bits = sum(layer_bits(f, shapes[n]) for n, f in quantized.items())
    assert bits <= cfg.quant.budget_bits * plan["quantized_params"]
    assert plan["avg_bits"] == pytest.approx(bits / plan["quantized_params"])
    for group in plan["fused_groups"]:
        assert len({plan["layers"][n] for n in group}) == 1
    assert plan["predicted_dloss"] == pytest.approx(
        sum(
            next(x for x in report["layers"] if x["name"] == n)["dloss"][f]
            for n, f in quantized.items()
        )
    )
    assert (run / "allocate" / "bits_per_layer.png").exists()
    assert done["allocate"]["metrics"]["avg_bits"] <= cfg.quant.budget_bits


def test_invalid_method_is_rejected_before_compute():
    with pytest.raises(ConfigError, match="stage.sensitivity.method"):
        workflow.check_stage(make_cfg("stage.sensitivity.method=obd"), "sensitivity")


@pytest.mark.parametrize("method", ["gptq_proxy", "fisher"])
def test_streamed_stage_matches_the_loaded_one(boot, tmp_path, method):
    """stream=true (what the 70B experiment runs) writes the same ΔL as the loaded model (of
    RTN's δ: the streamed walk scores no other)."""
    reports = {}
    for stream in ("false", "true"):
        overrides = (f"stage.sensitivity.method={method}", f"stage.sensitivity.stream={stream}",
                     "quant.segment_size=2", "stage.sensitivity.delta=rtn")  # fmt: skip
        cfg = boot_cfg(boot, tmp_path / stream, "stages=[bootstrap,sensitivity]", *overrides)
        workflow.run(cfg)
        path = tmp_path / stream / "run" / "sensitivity"
        reports[stream] = SensitivityReport.load(path).to_dict()["layers"]
    assert [la["name"] for la in reports["true"]] == [la["name"] for la in reports["false"]]
    for a, b in zip(reports["true"], reports["false"]):
        assert a["dloss"] == pytest.approx(b["dloss"], rel=1e-3), a["name"]


def test_combined_importance_feeds_the_allocator(boot, tmp_path):
    """importance=combined: sensitivity.json holds the fitted weights and every estimator's ΔL,
    and the plan minimises the combined score."""
    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,sensitivity,allocate]",
                   "stage.sensitivity.importance=combined", "stage.sensitivity.fit_layers=6",
                   "stage.sensitivity.hutchinson_probes=1")  # fmt: skip
    done = workflow.run(cfg)
    run = tmp_path / "run"
    report = SensitivityReport.load(run / "sensitivity").to_dict()
    weights = report["importance"]["weights"]
    assert report["method"] == "combined" and len(report["importance"]["fit_layers"]) == 6
    assert set(weights) == set(METHODS) and any(weights.values())
    assert done["sensitivity"]["metrics"]["importance_fisher"] == weights["fisher"]
    layers = {la["name"]: la for la in report["layers"]}
    for la in layers.values():
        for f, v in la["dloss"].items():
            assert v == pytest.approx(sum(w * la["estimators"][m][f] for m, w in weights.items()))
    plan = BitPlan.load(run / "allocate").to_dict()
    assert plan["score"] == "combined" and plan["importance_weights"] == weights
    quantized = {n: f for n, f in plan["layers"].items() if f != "float"}
    assert plan["predicted_dloss"] == pytest.approx(
        sum(layers[n]["dloss"][f] for n, f in quantized.items())
    )


def test_combined_importance_cannot_stream():
    with pytest.raises(ConfigError, match="stage.sensitivity.importance"):
        workflow.check_stage(
            make_cfg("stage.sensitivity.importance=combined", "stage.sensitivity.stream=true"),
            "sensitivity",
        )


@pytest.mark.parametrize(
    ("overrides", "delta"),
    [
        ((), "gptq"),  # the default recipe quantizes with GPTQ, loaded
        (("quant.method=rtn",), "rtn"),
        (("stage.sensitivity.stream=true",), "rtn"),
        (("stage.sensitivity.importance=combined",), "rtn"),  # fitted to RTN's measured KL
        (("quant.method=rtn", "stage.sensitivity.delta=rtn"), "rtn"),
    ],
)
def test_a_null_delta_follows_the_quantizer_where_the_loaded_estimate_runs(overrides, delta):
    cfg, _ = workflow.stage_config(make_cfg(*overrides), "sensitivity")
    assert cfg.delta == delta


@pytest.mark.parametrize(
    "overrides",
    [
        ("stage.sensitivity.delta=gptq", "stage.sensitivity.stream=true"),
        ("stage.sensitivity.delta=gptq", "stage.sensitivity.importance=combined"),
        ("stage.sensitivity.delta=gptq", "quant.method=rtn"),
    ],
)
def test_a_gptq_delta_the_run_cannot_compute_is_refused(overrides):
    with pytest.raises(ConfigError, match="stage.sensitivity.delta"):
        workflow.check_stage(make_cfg(*overrides), "sensitivity")


def test_the_gptq_delta_reaches_the_report(boot, tmp_path):
    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,sensitivity]", "quant.method=gptq",
                   "stage.sensitivity.delta=gptq")  # fmt: skip
    workflow.run(cfg)
    assert SensitivityReport.load(tmp_path / "run" / "sensitivity").delta == "gptq"
