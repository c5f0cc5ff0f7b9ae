"""The quantize stage: the bit plan it quantizes with, and the stage through the workflow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import QuantConfig
from pipeline.models import StreamingCheckpoint
from pipeline.models.synthetic import write_synthetic_checkpoint
from pipeline.quant.allocate import make_plan
from pipeline.quant.formats import parse_format
from pipeline.quant.plan import BitPlan
from pipeline.stages.quantize import load_plan
from pipeline.streaming.quant_report import QuantReport

TINY = dict(hidden=32, layers=3, intermediate=48, heads=4, kv_heads=2, vocab=61)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src")
    return write_synthetic_checkpoint(path, **TINY, shard_bytes=20_000, dtype=torch.float32)


def test_plan_from_bitplan_or_uniform_recipe(src, tmp_path):
    config = StreamingCheckpoint(src).config
    uniform = load_plan({}, config, QuantConfig(candidates=["int4g128"]))
    assert len(uniform) == 3 * 7 and "lm_head" not in uniform
    assert uniform["model.layers.0.mlp.up_proj"] == parse_format("int4g128")
    assert (
        load_plan({}, config, QuantConfig(candidates=["int8"], keep_float=[]))["lm_head"].bits == 8
    )
    shapes = {"lm_head": (61, 32), "model.layers.0.mlp.up_proj": (48, 32)}
    q = QuantConfig(candidates=["int8"], keep_float=["up_proj"])
    make_plan(shapes, {}, [], q.recipe).save(tmp_path)
    assert load_plan({"allocate": tmp_path}, config, q) == {"lm_head": parse_format("int8")}


def test_stage_end_to_end_on_the_smoke_models(boot, tmp_path):
    from pipeline import workflow
    from pipeline.config import data_cfg
    from pipeline.data.heldout import corpus_heldout
    from pipeline.data.text import Corpus
    from pipeline.models.hf import load_causal_lm, load_tokenizer, perplexity
    from pipeline.models.quantized import load_quantized, read_quant_meta
    from tests.stages.conftest import boot_cfg

    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,quantize]", "quant=w4g128")
    done = workflow.run(cfg)["quantize"]
    stage = tmp_path / "run" / "quantize"
    meta = read_quant_meta(stage / "model")
    n_lin = 7 * cfg.model.target.layers
    assert meta["method"] == "gptq" and set(meta["layers"].values()) == {"int4g128"}
    assert len(meta["layers"]) == n_lin  # lm_head is in quant.keep_float
    report = QuantReport.load(stage).to_dict()
    assert len(report["layers"]) == n_lin
    assert all(0 < r["rel_output_error"] < 0.5 for r in report["layers"].values())
    assert 4 < done["metrics"]["avg_bits"] < 4.5
    assert (stage / "model" / "tokenizer.json").is_file()
    assert not list((tmp_path / "run" / ".work").glob("quantize-*"))  # work dir cleaned

    target = boot["target"]
    win = corpus_heldout(Corpus(data_cfg(cfg), load_tokenizer(target))).windows
    ppl_fp = perplexity(load_causal_lm(target), win)
    ppl_q = perplexity(load_quantized(stage / "model"), win)
    # 4-bit GPTQ keeps the small model's quality (it may even land slightly below FP).
    assert ppl_q != ppl_fp and abs(ppl_q / ppl_fp - 1) < 0.25


def test_error_feedback_through_the_workflow_stays_within_the_budget(boot, tmp_path):
    from pipeline import workflow
    from pipeline.models.quantized import read_quant_meta
    from tests.stages.conftest import boot_cfg

    cfg = boot_cfg(
        boot, tmp_path, "stages=[bootstrap,sensitivity,allocate,quantize]",
        "quant.budget_bits=3.0", "quant.feedback.slack_bits=0.25", "quant.feedback.threshold=0.01",
    )  # fmt: skip
    workflow.run(cfg)
    run = tmp_path / "run"
    plan = BitPlan.load(run / "allocate")
    report = QuantReport.load(run / "quantize")
    assert plan.avg_bits <= 2.75 and plan.feedback_bits > 0
    assert report.moved and 0 < report.feedback_bits <= plan.feedback_bits
    assert plan.avg_bits < report.avg_bits <= 3.0
    assert all(report.layers[n].format_before == plan.layers[n].name for n in report.layers)
    meta = read_quant_meta(run / "quantize" / "model")
    assert {n: meta["layers"][n] for n in report.moved} == {
        n: after for n, (_, after) in report.moved.items()
    }
    assert (run / "quantize" / "feedback_error.png").stat().st_size > 0
