"""Sensitivity with kept outlier columns: which columns, and dloss_keep on every path."""

from __future__ import annotations

import pytest
import torch

from pipeline.analysis.estimators import fisher_diagonal
from pipeline.analysis.scores import quant_error
from pipeline.analysis.sensitivity import analyze, scored_modules
from pipeline.analysis.streamed import analyze_streamed
from pipeline.analysis.streamed_fisher import analyze_fisher_streamed
from pipeline.dist import Dist
from pipeline.models import StreamingCheckpoint
from pipeline.models.synthetic import synthetic_config
from pipeline.streaming import StreamOptions
from tests.analysis.conftest import scaled_, tiny_llama, windows

FORMATS = ["int2g32", "int4"]
OUTLIER = 3  # the planted outlier channel of every block's q/k/v and gate/up input

pytestmark = pytest.mark.usefixtures("one_thread")


def planted(model):
    """Scale one channel of each norm feeding q/k/v and gate/up: an emergent outlier feature."""
    with torch.no_grad():
        for block in model.model.layers:
            block.input_layernorm.weight[OUTLIER] = 25.0
            block.post_attention_layernorm.weight[OUTLIER] = 25.0
    return model


@pytest.mark.parametrize("method", ["fisher", "hutchinson", "gptq_proxy"])
def test_kept_columns_lower_the_predicted_loss(method):
    model, x = planted(tiny_llama()), windows()
    report = analyze(model, x, FORMATS, method, keep_cap=0.25, probes=2)
    plain = analyze(model, x, FORMATS, method, probes=2)
    by_name = {la["name"]: la for la in report["layers"]}
    q = by_name["model.layers.0.self_attn.q_proj"]
    assert OUTLIER in q["outlier_columns"] and len(q["outlier_columns"]) <= 2  # floor(0.25·8)
    assert by_name["model.layers.0.self_attn.k_proj"]["outlier_columns"] == q["outlier_columns"]
    assert by_name["model.embed_tokens"]["outlier_columns"] == []
    assert "dloss_keep" not in by_name["model.embed_tokens"]
    lower = 0
    for a, b in zip(report["layers"], plain["layers"]):
        assert a["dloss"] == b["dloss"] and "outlier_columns" not in b  # none: as before
        for f in a.get("dloss_keep", {}):
            assert a["dloss_keep"][f] <= a["dloss"][f], (a["name"], f)
            lower += a["dloss_keep"][f] < a["dloss"][f]
    assert lower >= 10  # (hutchinson predicts 0 where its trace estimate is negative)


def test_fisher_dloss_keep_drops_the_kept_columns_exactly():
    model, x = planted(tiny_llama()), windows()
    report = analyze(model, x, FORMATS, "fisher", keep_cap=0.25)
    params = {n: m.weight for n, m in scored_modules(model).items()}
    fisher = fisher_diagonal(model, x, params, Dist())
    for layer in report["layers"]:
        cols = layer["outlier_columns"]
        if not cols:
            continue
        w = params[layer["name"]].detach()
        for f in FORMATS:
            d = quant_error(w, f)
            d[:, cols] = w[:, cols].half().float() - w[:, cols]
            want = float(0.5 * (fisher[layer["name"]] * d * d).sum())
            assert layer["dloss_keep"][f] == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> StreamingCheckpoint:
    from transformers import AutoModelForCausalLM

    config = synthetic_config(hidden=64, layers=2, intermediate=96, heads=4, kv_heads=2,
                              vocab=61, arch="llama", dtype=torch.float32)  # fmt: skip
    torch.manual_seed(0)
    model = scaled_(AutoModelForCausalLM.from_config(config))
    path = tmp_path_factory.mktemp("ckpt")
    planted(model).save_pretrained(path)
    return StreamingCheckpoint(path)


@pytest.mark.parametrize("method", ["gptq_proxy", "fisher"])
def test_streamed_paths_keep_the_loaded_columns_and_dloss_keep(ckpt, tmp_path, method):
    x = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(0))
    loaded = analyze(ckpt.full_model(), x, FORMATS, method, keep_cap=0.05, batch_size=2)
    walk = StreamOptions(segment_size=1, batch_size=2, act_budget_gb=1.0, progress=False)
    scope = dict(spill_dir=tmp_path, include_lm_head=True, include_embeddings=True, keep_cap=0.05)
    if method == "fisher":
        streamed = analyze_fisher_streamed(ckpt, x, FORMATS, walk, labels="data", seed=0, **scope)
    else:
        streamed = analyze_streamed(ckpt, x, FORMATS, walk, weighting="full", **scope)
    assert any(la["outlier_columns"] for la in loaded["layers"])
    for a, b in zip(streamed["layers"], loaded["layers"]):
        assert list(a) == list(b), a["name"]  # same keys, same order
        assert a["outlier_columns"] == b["outlier_columns"], a["name"]
        for f in b.get("dloss_keep", {}):
            assert a["dloss_keep"][f] == pytest.approx(b["dloss_keep"][f], rel=1e-3, abs=1e-9)
