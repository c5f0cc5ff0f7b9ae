"""The streamed Fisher equals the loaded model's, tensor by tensor, and the stage wires it."""

from __future__ import annotations

import pytest
import torch

from pipeline.analysis.estimators import fisher_diagonal
from pipeline.analysis.sensitivity import analyze, scored_modules
from pipeline.analysis.streamed_fisher import analyze_fisher_streamed, fisher_streamed
from pipeline.config import parse
from pipeline.dist import Dist
from pipeline.errors import ConfigError
from pipeline.models import StreamingCheckpoint
from pipeline.models.synthetic import synthetic_config
from pipeline.stages.sensitivity import SensitivityConfig
from pipeline.streaming import StreamOptions
from tests.analysis.conftest import scaled_

FORMATS = ["int2g32", "int4", "int8"]
TINY = dict(hidden=64, layers=3, intermediate=96, heads=4, kv_heads=2, vocab=61)
PAD = 3  # a token the windows contain: its embedding row gets no gradient
X = torch.randint(0, TINY["vocab"], (5, 12), generator=torch.Generator().manual_seed(0))

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-tied"])
def ckpt(request, tmp_path_factory) -> StreamingCheckpoint:
    """A 3-layer fp32 checkpoint with O(1) weights, so every gradient is far from zero
    (Qwen2: biased q/k/v; llama-tied: lm_head shares the embedding table)."""
    from transformers import AutoModelForCausalLM

    arch, _, tied = request.param.partition("-")
    config = synthetic_config(**TINY, arch=arch, dtype=torch.float32,
                              tie_word_embeddings=bool(tied), pad_token_id=PAD)  # fmt: skip
    torch.manual_seed(0)
    model = scaled_(AutoModelForCausalLM.from_config(config))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return StreamingCheckpoint(path)


def walk(budget_gb: float) -> StreamOptions:
    return StreamOptions(segment_size=2, batch_size=2, act_budget_gb=budget_gb, progress=False)


@pytest.mark.parametrize("labels", ["data", "model"])
@pytest.mark.parametrize("budget_gb", [2.0, 0.0], ids=["in-memory", "spilled"])
def test_streamed_fisher_equals_the_loaded_one(ckpt, tmp_path, budget_gb, labels):
    model = ckpt.full_model()
    params = {n: m.weight for n, m in scored_modules(model).items()}
    ref = fisher_diagonal(model, X, params, Dist(), labels=labels, seed=3)
    got: dict[str, torch.Tensor] = {}
    fisher_streamed(ckpt, X, walk(budget_gb), lambda n, w, f: got.setdefault(n, f),
                    spill_dir=tmp_path, labels=labels, seed=3)  # fmt: skip
    assert set(got) == set(ref)
    for name, f in ref.items():
        assert f.abs().max() > 1e-3, name  # a real signal, not float noise
        torch.testing.assert_close(got[name], f, rtol=1e-5, atol=1e-5 * float(f.abs().max()))
    if "embed_tokens" in str(list(ref)):
        assert got["model.embed_tokens"][PAD].abs().max() == 0
        assert (X == PAD).any()
    # Every kept activation file is gone; only the forward walk's own scratch stays.
    assert not list(tmp_path.glob("fisher-in*")) and not list(tmp_path.glob("fisher-grad*"))
    if budget_gb == 0.0:
        assert list(tmp_path.glob("fisher-rank0*.npy"))  # it did spill


def test_streamed_report_equals_the_loaded_one(ckpt, tmp_path):
    loaded = analyze(ckpt.full_model(), X, FORMATS, "fisher", Dist())
    streamed = analyze_fisher_streamed(
        ckpt, X, FORMATS, walk(0.0), spill_dir=tmp_path, labels="data", seed=0,
        include_lm_head=True, include_embeddings=True,
    )  # fmt: skip
    assert streamed["streamed"] and streamed["method"] == "fisher"
    assert [la["name"] for la in streamed["layers"]] == [la["name"] for la in loaded["layers"]]
    assert streamed["fused_groups"] == loaded["fused_groups"]
    for a, b in zip(streamed["layers"], loaded["layers"]):
        for f in FORMATS:
            assert a["dloss"][f] == pytest.approx(b["dloss"][f], rel=1e-5), (a["name"], f)
        for key, value in b["outliers"].items():
            expect = None if value is None else pytest.approx(value, rel=1e-4)
            assert a["outliers"][key] == expect, (a["name"], key)


def test_stream_takes_fisher_but_not_hutchinson():
    parse({"method": "fisher", "stream": True}, SensitivityConfig, "stage.sensitivity")
    for method in ("hutchinson", "gradient"):
        with pytest.raises(ConfigError, match="method=fisher or"):
            parse({"method": method, "stream": True}, SensitivityConfig, "stage.sensitivity")


def test_one_block_is_loaded_at_a_time(ckpt, tmp_path, monkeypatch):
    """With one block a segment, no block outlives its turn: the reverse walk holds none of
    the forward walk's (else a block's weights more at its peak: 3 GiB on a 70B)."""
    import gc
    import weakref

    from pipeline.streaming.engine import BlockSource

    alive: list[weakref.ref] = []
    load = BlockSource.block

    def tracked(self, i):
        gc.collect()
        assert all(r() is None for r in alive), "a weight of a block loaded earlier is held"
        block = load(self, i)
        alive.extend(weakref.ref(p) for p in block.parameters())
        return block

    monkeypatch.setattr(BlockSource, "block", tracked)
    one = StreamOptions(segment_size=1, batch_size=2, act_budget_gb=2.0, progress=False)
    fisher_streamed(ckpt, X, one, lambda n, w, f: None, spill_dir=tmp_path)
    assert len(alive) == 2 * TINY["layers"] * len(list(load(BlockSource(ckpt), 0).parameters()))
