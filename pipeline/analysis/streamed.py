"""The GPTQ-proxy sensitivity of a checkpoint bigger than memory, block by block.

The proxy needs only forward passes: while each FP block computes its outputs, hooks gather its
linears' Hessians and input statistics, then the block is scored and freed (the final norm's
output feeds lm_head's statistics without the logits). Equal to ``analyze(method="gptq_proxy")``
on the loaded model up to summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.analysis.capture import Capture, outlier_columns
from pipeline.analysis.scores import embedding_weigh, hessian_weigh, layer_dloss
from pipeline.analysis.sensitivity import (
    NO_STATS,
    layer_dloss_keep,
    layer_entry,
    report,
    with_columns,
)
from pipeline.dist import Dist
from pipeline.models.adapters import Adapter
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.streaming.engine import Batches, BlockSource, BlockWalk, StreamOptions
from pipeline.streaming.workdir import Scratch


def block_capture(
    adapter: Adapter, i: int, block: nn.Module, hessians: bool
) -> tuple[dict[str, nn.Module], Capture]:
    """Block ``i``'s linears by full name and hooks on them (fused groups share one input)."""
    prefix = adapter.block_prefix(i)
    linears = {prefix + n: block.get_submodule(n) for n in adapter.linears}
    shared = {prefix + n: prefix + g[0] for g in adapter.fused for n in g[1:]}
    return linears, Capture(linears, hessians=hessians, shared=shared)


class _ScoreStep:
    """Scores the embeddings, each block's linears from hooks on its output pass, and lm_head."""

    def __init__(
        self, ckpt, candidates, dist, weighting, include_lm_head, include_embeddings, keep_cap
    ):
        self.a, self.config, self.dist, self.keep_cap = ckpt.adapter, ckpt.config, dist, keep_cap
        self.ckpt, self.candidates, self.weighting = ckpt, candidates, weighting
        self.include_lm_head, self.include_embeddings = include_lm_head, include_embeddings
        self.layers: list[dict] = []
        self.linears: dict[str, nn.Module] = {}
        self.capture: Capture | None = None

    def _score(self, name: str, weight: Tensor, weigh, stats: dict, cols=None) -> None:
        if self.keep_cap is None:
            dloss = layer_dloss(weight, self.candidates, weigh)
            self.layers.append(layer_entry(name, weight, dloss, stats))
            return
        dloss, dkeep = layer_dloss_keep(weight, self.candidates, weigh, cols)
        entry = layer_entry(name, weight, dloss, stats)
        self.layers.append(with_columns(entry, cols or [], dkeep or None))

    def _score_captured(self, capture: Capture, linears: dict[str, nn.Module]) -> None:
        capture.reduce_(self.dist)
        for name, mod in linears.items():
            weigh = hessian_weigh(capture.hessian(name), self.weighting)
            stats = capture.stats[name]
            cols = None if self.keep_cap is None else outlier_columns(stats.absmax, self.keep_cap)
            self._score(name, mod.weight, weigh, stats.summary(), cols)

    def embed(self, ids: Tensor) -> Tensor:
        table = self.ckpt.tensor(self.a.embed + ".weight")  # (vocab, C)
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        if self.include_embeddings and not tied:
            counts = torch.bincount(ids.reshape(-1), minlength=table.shape[0]).double()
            weigh = embedding_weigh(self.dist.all_reduce_(counts))
            self._score(self.a.embed, table, weigh, dict(NO_STATS))
        return table

    def before(self, i: int, block: nn.Module, batches: Batches, kwargs: dict) -> None:
        self.linears, self.capture = block_capture(self.a, i, block, hessians=True)

    def after(self, i: int, block: nn.Module) -> None:
        self.capture.remove()
        self._score_captured(self.capture, self.linears)
        self.linears, self.capture = {}, None  # the block is freed next

    def end_segment(self, k: int) -> dict:
        return {}

    def head(self, source: BlockSource, batches: Batches) -> None:
        if not self.include_lm_head:
            return
        name = self.a.lm_head
        norm, head = source.norm(), source.lm_head()
        capture = Capture({name: head}, hessians=True)
        capture.remove()  # fed directly: the logits themselves are never needed
        for x in batches():
            capture.observe(name, norm(x))
        self._score_captured(capture, {name: head})


@torch.no_grad()
def analyze_streamed(
    ckpt: StreamingCheckpoint,
    windows: Tensor,
    candidates: Sequence[str],
    walk: StreamOptions,
    *,
    spill_dir: str | Path,
    weighting: str,
    include_lm_head: bool,
    include_embeddings: bool,
    dist: Dist | None = None,
    keep_cap: float | None = None,
) -> dict:
    """Sensitivity report (``SensitivityReport``'s fields) of the checkpoint on ``windows``
    (S, T), the same on every rank; ``walk.segment_size`` only sets blocks per spill file."""
    dist = dist or Dist()
    engine = BlockWalk("sensitivity", ckpt, windows, walk, dist, Scratch(spill_dir, "sensitivity"))
    step = _ScoreStep(
        ckpt, candidates, dist, weighting, include_lm_head, include_embeddings, keep_cap
    )
    engine.run(step)
    scored = report(
        ckpt.config,
        step.layers,
        method="gptq_proxy",
        weighting=weighting,
        fisher_labels=None,
        candidates=candidates,
        windows=windows,
    )
    return {**scored, "streamed": True}
