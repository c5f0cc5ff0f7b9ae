"""The streamed GPTQ-proxy sensitivity equals the in-memory one, and the stage wires it."""

from __future__ import annotations

import pytest
import torch

from pipeline.analysis.sensitivity import analyze
from pipeline.analysis.streamed import analyze_streamed
from pipeline.dist import Dist
from pipeline.models import StreamingCheckpoint
from pipeline.models.synthetic import write_synthetic_checkpoint
from pipeline.streaming import StreamOptions

FORMATS = ["int2g32", "int4", "int8"]
TINY = dict(hidden=64, layers=3, intermediate=96, heads=4, kv_heads=2, vocab=61)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def ckpt(request, tmp_path_factory) -> StreamingCheckpoint:
    """A 3-layer fp32 checkpoint in small shards (Qwen2: biased q/k/v; Llama: none)."""
    path = tmp_path_factory.mktemp(request.param)
    write_synthetic_checkpoint(path, **TINY, arch=request.param, shard_bytes=20_000,
                               dtype=torch.float32)  # fmt: skip
    return StreamingCheckpoint(path)


@pytest.mark.parametrize("budget_gb", [2.0, 0.0])  # activations in memory / spilled to a file
def test_streamed_equals_loaded_model(ckpt, tmp_path, budget_gb):
    x = torch.randint(0, TINY["vocab"], (5, 12), generator=torch.Generator().manual_seed(0))
    loaded = analyze(ckpt.full_model(), x, FORMATS, "gptq_proxy", Dist(), batch_size=2)
    walk = StreamOptions(segment_size=1, batch_size=2, act_budget_gb=budget_gb, progress=False)
    streamed = analyze_streamed(ckpt, x, FORMATS, walk, spill_dir=tmp_path, weighting="full",
                                include_lm_head=True, include_embeddings=True)  # fmt: skip
    assert [la["name"] for la in streamed["layers"]] == [la["name"] for la in loaded["layers"]]
    assert streamed["fused_groups"] == loaded["fused_groups"]
    for a, b in zip(streamed["layers"], loaded["layers"]):
        assert a["shape"] == b["shape"]
        for f in FORMATS:
            assert a["dloss"][f] == pytest.approx(b["dloss"][f], rel=1e-4, abs=1e-9), (a["name"], f)
        for key, value in b["outliers"].items():
            expect = None if value is None else pytest.approx(value, rel=1e-4)
            assert a["outliers"][key] == expect, (a["name"], key)
    if budget_gb == 0.0:
        assert list(tmp_path.glob("sensitivity-rank0*.npy"))  # it did spill
