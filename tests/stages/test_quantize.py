"""The quantize stage: the bit plan it quantizes with, and the stage through the workflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.models import StreamingCheckpoint
from pipeline.models.synthetic import write_synthetic_checkpoint
from pipeline.stages.quantize import load_plan

TINY = dict(hidden=32, layers=3, intermediate=48, heads=4, kv_heads=2, vocab=61)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src")
    return write_synthetic_checkpoint(path, **TINY, shard_bytes=20_000, dtype=torch.float32)


def test_plan_from_bitplan_or_uniform_recipe(src, tmp_path):
    config = StreamingCheckpoint(src).config
    uniform = load_plan({}, config, ["int4g128"], ["lm_head", "embed_tokens"])
    assert len(uniform) == 3 * 7 and "lm_head" not in uniform
    assert load_plan({}, config, ["int8"], [])["lm_head"] == "int8"
    (tmp_path / "alloc").mkdir()
    bitplan = {"layers": {"lm_head": "int8", "model.layers.0.mlp.up_proj": "float"}}
    (tmp_path / "alloc" / "bitplan.json").write_text(json.dumps(bitplan))
    assert load_plan({"allocate": tmp_path / "alloc"}, config, ["int4"], []) == {"lm_head": "int8"}


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
    report = json.loads((stage / "quant_report.json").read_text())
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
