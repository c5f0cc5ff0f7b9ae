"""The block-walking engine: embed -> segments of decoder blocks -> head, one segment in memory.

As in GPTQ's sequential walk, each segment of ``segment_size`` blocks is read from the shards,
handed block by block to a :class:`BlockStep` (which may change it in place, so later blocks see
the changed model's activations), run forward once for the next block's inputs, and freed: peak
memory is one segment, the activation cache and one block's step state, whatever the depth."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from pipeline.dist import Dist
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.peakmem import release_free_heap
from pipeline.progress import progress
from pipeline.streaming.actcache import ActivationCache
from pipeline.streaming.workdir import Scratch, WorkDir

log = logging.getLogger(__name__)

Batches = Callable[[], Iterator[Tensor]]  # each call: this rank's (B, T, C) batches, on device


@dataclass(frozen=True)
class StreamOptions:
    """How the engine walks a checkpoint (the values come from the run's config)."""

    segment_size: int  # decoder blocks per segment: the unit of loading and of resume
    batch_size: int
    act_budget_gb: float  # activation cache size above which it spills to a file
    stream: bool = True  # False: load the whole model first (the tests' and benchmarks' reference)
    progress: bool = True
    on_segment: Callable[[int], None] | None = None  # after each finished segment (tests crash)


class BlockStep(Protocol):
    """What a walk does with the model's pieces; the engine calls these in order."""

    def embed(self, ids: Tensor) -> Tensor:
        """The (vocab, C) table this rank's windows ``ids`` (n, T) are looked up in."""

    def before(self, i: int, block: nn.Module, batches: Batches, kwargs: dict) -> None:
        """Block ``i`` on its inputs (``kwargs``: its forward's masks), before its outputs."""

    def after(self, i: int, block: nn.Module) -> None:
        """Block ``i``'s outputs are computed (forward hooks set in ``before`` saw them)."""

    def end_segment(self, k: int) -> dict:
        """Persist segment ``k``'s results; returns its JSON-able report."""

    def head(self, source: BlockSource, batches: Batches) -> Any:
        """Final norm and lm_head (loaded from ``source`` if needed) on the last outputs."""


class BlockSource:
    """Pieces of the model, streamed from the shards or (``stream=False``, the reference) loaded."""

    def __init__(self, ckpt: StreamingCheckpoint, stream: bool = True) -> None:
        self.ckpt, self.adapter = ckpt, ckpt.adapter
        self.full = None if stream else ckpt.full_model().to(ckpt.device)

    def _get(self, name: str) -> nn.Module:
        return self.full.get_submodule(name)

    def block(self, i: int) -> nn.Module:
        if self.full is None:
            return self.ckpt.load_block(i)
        return self._get(self.adapter.block_prefix(i)[:-1])

    def norm(self) -> nn.Module:
        return self.ckpt.load_norm() if self.full is None else self._get(self.adapter.final_norm)

    def lm_head(self) -> nn.Module:
        return self.ckpt.load_lm_head() if self.full is None else self._get(self.adapter.lm_head)


@dataclass
class StreamResult:
    resumed: int  # segments found finished in the work dir
    reports: list[dict]  # every segment's report (end_segment's), resumed ones included
    head: Any


def _segment_bounds(n_layers: int, segment_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + segment_size, n_layers)) for s in range(0, n_layers, segment_size)]


class BlockWalk:
    """A walk over ``ckpt`` with the (N, T) windows ``calib``; opening it is a collective."""

    def __init__(
        self,
        name: str,
        ckpt: StreamingCheckpoint,
        calib: Tensor,
        opts: StreamOptions,
        dist: Dist,
        store: Scratch | WorkDir,
    ) -> None:
        self.name, self.ckpt, self.opts, self.dist, self.store = name, ckpt, opts, dist, store
        self.segments = _segment_bounds(ckpt.num_layers, opts.segment_size)
        self.ids = calib[list(dist.shard(calib.shape[0]))]  # (n, T) this rank's windows
        n, self.seq_len = self.ids.shape
        self.shape = (n, self.seq_len, ckpt.config.hidden_size)
        self.slices = [slice(i, i + opts.batch_size) for i in range(0, n, opts.batch_size)]
        self.start = store.open(calib, self.segments, dist, ckpt.device)

    def _batches(self, cache: ActivationCache) -> Batches:
        return lambda: (cache[s].to(self.ckpt.device) for s in self.slices)

    @torch.no_grad()
    def run(self, step: BlockStep) -> StreamResult:
        ckpt, dist, store = self.ckpt, self.dist, self.store
        source = BlockSource(ckpt, self.opts.stream)
        budget = self.opts.act_budget_gb * 2**30
        if self.start == 0:
            table = step.embed(self.ids)  # (vocab, C)
            cache = ActivationCache.create(
                self.shape, ckpt.dtype, budget, store.embed_file(dist.rank)
            )
            for s in self.slices:  # nn.Embedding is a row lookup
                cache[s] = table[self.ids[s]]
            del table
        else:
            cache = store.resume(self.start - 1, dist.rank, ckpt.dtype, budget)
            log.info("%s: resuming after %d finished segment(s)", self.name, self.start)

        n_seg = len(self.segments)
        bar = progress(
            range(self.start, n_seg),
            f"{self.name} segments",
            unit="seg",
            initial=self.start,
            enabled=self.opts.progress,
            is_main=dist.is_main,
        )
        for k in bar:
            out = cache.for_outputs(store.outputs_file(k, dist.rank))
            for i in range(*self.segments[k]):
                block = source.block(i)
                kwargs = ckpt.block_forward_inputs(self.seq_len, layer_idx=i)
                step.before(i, block, self._batches(cache), kwargs)
                for s in self.slices:  # the block's outputs: the next block's inputs
                    out[s] = block(cache[s].to(ckpt.device), **kwargs)
                cache = out
                step.after(i, block)
                del block
            store.save_acts(k, cache, dist.rank)
            report = step.end_segment(k)
            release_free_heap()
            store.mark(k, report, dist)
            if self.opts.on_segment is not None:
                self.opts.on_segment(k)
        head = step.head(source, self._batches(cache))
        return StreamResult(self.start, store.reports(n_seg), head)
