"""quant.outliers=keep_fp16 through sensitivity, allocate and quantize on the smoke models."""

from __future__ import annotations

import pytest
import torch

from pipeline import workflow
from pipeline.analysis.report import SensitivityReport
from pipeline.errors import ConfigError, LowbitError
from pipeline.quant.allocate import kept_bits, layer_bits
from pipeline.quant.plan import BitPlan
from pipeline.streaming.quant_report import QuantReport
from tests.conftest import make_cfg
from tests.stages.conftest import boot_cfg

# One format and a budget above it: the only way to spend the rest is on kept columns.
KEEP = [
    "quant.candidates=[int2g64]",
    "quant.budget_bits=2.6",
    "quant.outliers=keep_fp16",
    "quant.outlier_cap=0.05",
]


def test_kept_columns_reach_the_quantized_model_exactly(boot, tmp_path):
    from pipeline.models.hf import load_causal_lm
    from pipeline.models.quantized import load_quantized

    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,sensitivity,allocate,quantize]", *KEEP)
    done = workflow.run(cfg)
    run = tmp_path / "run"
    report = SensitivityReport.load(run / "sensitivity").to_dict()
    assert report["outliers"] == "keep_fp16" and report["outlier_cap"] == 0.05
    for layer in report["layers"]:
        assert len(layer["outlier_columns"]) <= int(0.05 * layer["shape"][1])
        assert ("dloss_keep" in layer) == bool(layer["outlier_columns"])
    plan = BitPlan.load(run / "allocate").to_dict()
    kept = plan["outlier_columns"]
    assert kept, "the spare bits buy side matrices"
    shapes = {la["name"]: la["shape"] for la in report["layers"]}
    bits = sum(
        layer_bits(f, shapes[n]) + kept_bits(shapes[n][0], len(kept.get(n, [])))
        for n, f in plan["layers"].items()
        if f != "float"
    )
    assert bits <= 2.6 * plan["quantized_params"]  # the budget pays for the side matrices
    assert plan["avg_bits"] == pytest.approx(bits / plan["quantized_params"])
    assert done["allocate"]["metrics"]["kept_columns"] == sum(map(len, kept.values()))

    model = load_quantized(run / "quantize" / "model")
    fp = load_causal_lm(boot["target"])
    for name, cols in kept.items():
        layer = model.get_submodule(name)
        assert layer.keep_idx.tolist() == cols
        w = layer.quantized_weight().detach()
        # GPTQ compensates onto the kept columns; what it stores is what the model computes.
        assert torch.equal(w[:, cols], layer.keep_vals.float())
        assert not torch.equal(w[:, cols], fp.get_submodule(name).weight[:, cols])
    unkept = [n for n, f in plan["layers"].items() if f != "float" and n not in kept]
    assert all(model.get_submodule(n).keep_idx is None for n in unkept)
    quant = QuantReport.load(run / "quantize").to_dict()
    assert {n for n, r in quant["layers"].items() if "kept_columns" in r} == set(kept)
    assert quant["avg_bits"] == pytest.approx(plan["avg_bits"])


def test_keep_fp16_without_allocate_is_refused(boot, tmp_path):
    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,quantize]", *KEEP)
    with pytest.raises(LowbitError, match=r"quant\.outliers=keep_fp16.*allocate"):
        workflow.run(cfg)


def test_config_checks_name_the_keys():
    with pytest.raises(ConfigError, match=r"stage\.sensitivity\.importance"):
        workflow.check_stage(
            make_cfg(*KEEP, "stage.sensitivity.importance=combined"), "sensitivity"
        )
    int4 = ["quant.candidates=[int4g128]", "quant.budget_bits=4.5", "quant.outliers=keep_fp16"]
    with pytest.raises(ConfigError, match=r"stage\.export\.format.*quant\.outliers=none"):
        workflow.check_stage(make_cfg(*int4, "stage.export.format=ascend"), "export")
    workflow.check_stage(make_cfg(*int4[:2], "stage.export.format=ascend"), "export")
    workflow.check_stage(make_cfg(*KEEP), "export")  # lowbit holds them
