"""BlockWalk: the streamed walk computes the loaded model's logits; a work dir resumes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.dist import Dist
from pipeline.models import StreamingCheckpoint
from pipeline.models.synthetic import write_synthetic_checkpoint
from pipeline.streaming import BlockWalk, Scratch, StreamOptions, WorkDir

TINY = dict(hidden=32, layers=3, intermediate=48, heads=4, kv_heads=2, vocab=61)
IDS = torch.randint(0, 61, (5, 10), generator=torch.Generator().manual_seed(0))

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> StreamingCheckpoint:
    path = tmp_path_factory.mktemp("src")
    write_synthetic_checkpoint(path, **TINY, shard_bytes=20_000, dtype=torch.float32)
    return StreamingCheckpoint(path)


@pytest.fixture(scope="module")
def ref_logits(ckpt) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.full_model(torch.float32)(IDS).logits  # (N, T, V)


class Logits:
    """A step that changes nothing: records the blocks it sees, returns the head's logits."""

    def __init__(self, ckpt: StreamingCheckpoint) -> None:
        self.ckpt, self.seen = ckpt, []

    def embed(self, ids):
        return self.ckpt.tensor(self.ckpt.adapter.embed + ".weight")

    def before(self, i, block, batches, kwargs):
        self.seen.append(i)

    def after(self, i, block):
        pass

    def end_segment(self, k):
        return {"blocks": self.seen[-1]}

    def head(self, source, batches):
        norm, lm_head = source.norm(), source.lm_head()
        return torch.cat([lm_head(norm(x)) for x in batches()])


def walk(**kw) -> StreamOptions:
    return StreamOptions(**{"segment_size": 2, "batch_size": 2, "act_budget_gb": 1.0,
                            "progress": False, **kw})  # fmt: skip


@pytest.mark.parametrize("budget_gb", [1.0, 0.0], ids=["in-memory", "spilled"])
def test_walk_computes_the_loaded_models_logits(ckpt, ref_logits, tmp_path, budget_gb):
    step = Logits(ckpt)
    engine = BlockWalk("test", ckpt, IDS, walk(act_budget_gb=budget_gb), Dist(),
                       Scratch(tmp_path, "acts"))  # fmt: skip
    result = engine.run(step)
    assert engine.segments == [(0, 2), (2, 3)] and step.seen == [0, 1, 2]
    assert result.resumed == 0 and result.reports == [{"blocks": 1}, {"blocks": 2}]
    torch.testing.assert_close(result.head, ref_logits, atol=1e-5, rtol=1e-5)
    assert bool(list(tmp_path.glob("acts-rank0*.npy"))) == (budget_gb == 0.0)


class Crash(RuntimeError):
    pass


def _crash_after_first(k: int) -> None:
    if k == 0:
        raise Crash("killed")


@pytest.mark.parametrize("budget_gb", [1.0, 0.0], ids=["in-memory", "spilled"])
def test_work_dir_resumes_after_the_last_finished_segment(ckpt, ref_logits, tmp_path, budget_gb):
    def run(key: str, **kw):
        step = Logits(ckpt)
        opts = walk(segment_size=1, act_budget_gb=budget_gb, **kw)
        engine = BlockWalk("test", ckpt, IDS, opts, Dist(), WorkDir(tmp_path / "w", key))
        return step, engine.run(step)

    with pytest.raises(Crash):
        run("a", on_segment=_crash_after_first)
    assert (tmp_path / "w" / "segments" / "00000.json").is_file()
    step, result = run("a")
    assert result.resumed == 1 and step.seen == [1, 2]  # block 0 is not visited again
    assert result.reports == [{"blocks": 0}, {"blocks": 1}, {"blocks": 2}]
    torch.testing.assert_close(result.head, ref_logits, atol=1e-5, rtol=1e-5)
    acts = sorted(p.name for p in Path(tmp_path / "w" / "acts").iterdir())
    assert acts == ["00002-rank0.npy"]  # only the newest committed state is kept

    step, result = run("b")  # other inputs: the finished segments are not reused
    assert result.resumed == 0 and step.seen == [0, 1, 2]
