"""The diagonal empirical Fisher of a checkpoint bigger than memory, segment by segment.

Activation checkpointing (Chen et al. 2016) applied to ``estimators.fisher_diagonal``: a forward
walk keeps every segment's input; per sequence the head's loss gradient is cached; a reverse
walk, last segment first, recomputes each sequence's forward from the kept input, back-propagates
the cached gradient, accumulates squared weight gradients and passes the input gradient down;
the embeddings get the bottom gradient by token. Same operations on the same inputs, so the
estimate equals the loaded one up to rounding. Memory: one segment and the boundary caches
(spilled to disk beyond ``act_budget_gb``): depth costs disk, not RAM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.analysis.capture import InputStats, outlier_columns
from pipeline.analysis.estimators import label_generator, logits_loss
from pipeline.analysis.scores import fisher_weigh
from pipeline.analysis.sensitivity import (
    NO_STATS,
    layer_dloss_keep,
    layer_entry,
    report,
    with_columns,
)
from pipeline.analysis.streamed import block_capture
from pipeline.dist import Dist
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.streaming.actcache import ActivationCache
from pipeline.streaming.engine import Batches, BlockSource, BlockWalk, StreamOptions
from pipeline.streaming.workdir import Scratch

Sink = Callable[[str, Tensor, Tensor], None]  # (name, weight, Fisher) of one finished tensor


class _Kept:
    """Activations for the reverse walk: in memory up to ``budget`` bytes, then files."""

    def __init__(self, folder: Path, rank: int, shape: tuple, dtype: torch.dtype, budget: float):
        self.folder, self.rank, self.shape, self.dtype = folder, rank, shape, dtype
        self.budget = budget
        self.paths: dict[int, Path] = {}

    def new(self, tag: str) -> ActivationCache:
        path = self.folder / f"fisher-{tag}-rank{self.rank}.npy"
        cache = ActivationCache.create(self.shape, self.dtype, self.budget, path)
        if cache.in_memory:
            self.budget -= cache.nbytes
        else:
            self.paths[id(cache)] = path
        return cache

    def copy(self, batches: Batches, tag: str) -> ActivationCache:
        cache, row = self.new(tag), 0
        for x in batches():  # (B, T, C), in row order
            cache[row : row + len(x)] = x
            row += len(x)
        return cache

    def drop(self, cache: ActivationCache) -> None:
        path = self.paths.pop(id(cache), None)
        if path is not None:
            path.unlink(missing_ok=True)  # a mapping still open keeps its pages until freed


class _KeepInputs:
    """Forward-walk step: keeps segment inputs and the last output, gathers input statistics."""

    def __init__(
        self,
        ckpt: StreamingCheckpoint,
        starts: set[int],
        kept: _Kept,
        dist: Dist,
        columns: dict[str, list[int]] | None,
        keep_cap: float,
    ):
        self.ckpt, self.a, self.starts, self.kept, self.dist = (
            ckpt,
            ckpt.adapter,
            starts,
            kept,
            dist,
        )
        self.inputs: list[ActivationCache] = []  # segment inputs, in order
        self.final: ActivationCache | None = None
        self.stats: dict[str, dict] = {}
        self.columns, self.keep_cap = columns, keep_cap

    def _keep(self, name: str, st: InputStats) -> None:
        self.stats[name] = st.summary()
        if self.columns is not None:
            self.columns[name] = outlier_columns(st.absmax, self.keep_cap)

    def embed(self, ids: Tensor) -> Tensor:
        return self.ckpt.tensor(self.a.embed + ".weight")

    def before(self, i: int, block: nn.Module, batches: Batches, kwargs: dict) -> None:
        if i in self.starts:
            self.inputs.append(self.kept.copy(batches, f"in{i:05d}"))
        self.linears, self.capture = block_capture(self.a, i, block, hessians=False)

    def after(self, i: int, block: nn.Module) -> None:
        self.capture.remove()
        self.capture.reduce_(self.dist)
        for n in self.linears:
            self._keep(n, self.capture.stats[n])
        self.linears, self.capture = {}, None  # else the last block stays loaded all reverse walk

    def end_segment(self, k: int) -> dict:
        return {}

    def head(self, source: BlockSource, batches: Batches) -> None:
        self.final = self.kept.copy(batches, "out")
        norm, st = source.norm(), InputStats(self.ckpt.config.hidden_size, self.ckpt.device)
        for x in batches():  # lm_head's input, without the (tokens x vocab) logits
            st.add(norm(x))
        st.reduce_(self.dist)
        self._keep(self.a.lm_head, st)


def _accumulate(fisher: list[Tensor], grads: Sequence[Tensor], tokens: int) -> None:
    # T·g² of the per-token mean loss's gradient: the per-token Fisher, as fisher_diagonal.
    for f, g in zip(fisher, grads):
        g = g.float()
        f.addcmul_(g, g, value=tokens)


def _weights(named: dict[str, nn.Module]) -> list[Tensor]:
    return [m.weight.requires_grad_(True) for m in named.values()]


class _Reverse:
    """The head, the reverse walk and the embeddings, on this rank's windows."""

    def __init__(self, ckpt, source, ids, mine, total, labels, seed, dist, sink):
        self.ckpt, self.source, self.ids, self.mine = ckpt, source, ids, mine
        self.total, self.labels, self.seed, self.dist, self.sink = total, labels, seed, dist, sink
        self.tokens = ids.shape[1] - 1
        self.dev = ckpt.device

    def _finish(self, named: dict[str, Tensor], fisher: list[Tensor]) -> None:
        for (name, weight), f in zip(named.items(), fisher):
            self.sink(name, weight.detach(), self.dist.all_reduce_(f).div_(self.total))

    def _head_loss(self, norm, lm_head, h: Tensor, j: int) -> Tensor:
        gen = label_generator(self.labels, self.seed, self.mine[j])
        return logits_loss(lm_head(norm(h)), self.ids[j : j + 1].to(self.dev), gen)

    def head(self, final: ActivationCache, grads: ActivationCache, score: bool) -> None:
        """Loss gradient at the last output into ``grads``; lm_head's Fisher if ``score``."""
        norm, lm_head = self.source.norm(), self.source.lm_head()
        wants = _weights({"h": lm_head}) if score else []
        fisher = [torch.zeros_like(w, dtype=torch.float32) for w in wants]
        for j in range(len(self.ids)):
            h = final[j : j + 1].to(self.dev).requires_grad_(True)  # (1, T, C)
            g = torch.autograd.grad(self._head_loss(norm, lm_head, h, j), [h, *wants])
            grads[j : j + 1] = g[0]
            _accumulate(fisher, g[1:], self.tokens)
            del g  # before the next window's backward: else two sets of gradients at its peak
        if score:
            self._finish({self.ckpt.adapter.lm_head: lm_head.weight}, fisher)

    def segment(self, first: int, stop: int, inputs: ActivationCache, grads: ActivationCache):
        """Blocks [first, stop): their linears' Fisher, and ``grads`` moved to their input."""
        a, seq_len = self.ckpt.adapter, self.ids.shape[1]
        blocks = [self.source.block(i) for i in range(first, stop)]
        kwargs = [self.ckpt.block_forward_inputs(seq_len, layer_idx=i) for i in range(first, stop)]
        named = {
            a.block_prefix(i) + n: block.get_submodule(n)
            for i, block in zip(range(first, stop), blocks)
            for n in a.linears
        }
        weights = _weights(named)
        fisher = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
        for j in range(len(self.ids)):
            x = inputs[j : j + 1].to(self.dev).requires_grad_(True)  # (1, T, C)
            h = x
            for block, kw in zip(blocks, kwargs):
                h = block(h, **kw)
            g = torch.autograd.grad(h, [x, *weights], grad_outputs=grads[j : j + 1].to(self.dev))
            grads[j : j + 1] = g[0]
            _accumulate(fisher, g[1:], self.tokens)
            del g, h
        self._finish({n: m.weight for n, m in named.items()}, fisher)

    def embeddings(self, grads: ActivationCache, final: ActivationCache | None) -> None:
        """The table's Fisher from the bottom gradients (plus the head's when tied: ``final``)."""
        a, pad = self.ckpt.adapter, getattr(self.ckpt.config, "pad_token_id", None)
        if final is None:
            name, table, norm, lm_head = a.embed, self.ckpt.tensor(a.embed + ".weight"), None, None
        else:
            name, norm, lm_head = a.lm_head, self.source.norm(), self.source.lm_head()
            table = lm_head.weight.requires_grad_(True)
        fisher = torch.zeros_like(table, dtype=torch.float32)  # (vocab, C)
        for j in range(len(self.ids)):
            ids = self.ids[j].to(self.dev)  # (T,)
            tok, where = ids.unique(return_inverse=True)
            g0 = grads[j : j + 1][0].to(self.dev)  # (T, C)
            rows = torch.zeros(len(tok), g0.shape[1], dtype=g0.dtype, device=self.dev)
            rows.index_add_(0, where, g0)  # (U, C): the lookup's gradient, row by token
            if pad is not None:
                rows[tok == pad] = 0  # nn.Embedding(padding_idx=pad) passes no gradient there
            if final is None:
                fisher[tok] += rows.float().square() * self.tokens
                continue
            h = final[j : j + 1].to(self.dev).requires_grad_(True)
            (g,) = torch.autograd.grad(self._head_loss(norm, lm_head, h, j), [table])
            g = g.clone()
            g[tok] += rows
            _accumulate([fisher], [g], self.tokens)
            del g
        self._finish({name: table}, [fisher])


@torch.no_grad()
def fisher_streamed(
    ckpt: StreamingCheckpoint,
    windows: Tensor,
    walk: StreamOptions,
    sink: Sink,
    *,
    spill_dir: str | Path,
    labels: str = "data",
    seed: int = 0,
    include_lm_head: bool = True,
    include_embeddings: bool = True,
    dist: Dist | None = None,
    columns: dict[str, list[int]] | None = None,
    keep_cap: float = 0.0,
) -> dict[str, dict]:
    """Streamed diagonal Fisher: each finished tensor goes to ``sink(name, weight, fisher)``
    (lm_head, blocks top down, embeddings) and is dropped; ``columns`` is filled with the
    outlier columns before the first. Returns {name: input outlier statistics}."""
    dist = dist or Dist()
    scratch = Scratch(spill_dir, "fisher")
    engine = BlockWalk("fisher forward", ckpt, windows, walk, dist, scratch)
    kept = _Kept(scratch.folder, dist.rank, engine.shape, ckpt.dtype, walk.act_budget_gb * 2**30)
    step = _KeepInputs(ckpt, {first for first, _ in engine.segments}, kept, dist, columns, keep_cap)
    engine.run(step)
    tied = bool(getattr(ckpt.config, "tie_word_embeddings", False))
    mine = list(dist.shard(windows.shape[0]))
    source = BlockSource(ckpt, walk.stream)
    back = _Reverse(ckpt, source, engine.ids, mine, windows.shape[0], labels, seed, dist, sink)
    grads = kept.new("grad")
    with torch.enable_grad():
        back.head(step.final, grads, score=include_lm_head and not tied)
        if not tied:
            kept.drop(step.final)
        for first, stop in reversed(engine.segments):
            inputs = step.inputs.pop()  # the last reference: freed (or its file deleted) next
            back.segment(first, stop, inputs, grads)
            kept.drop(inputs)
            del inputs
        if tied and include_lm_head:
            back.embeddings(grads, step.final)
        elif include_embeddings and not tied:
            back.embeddings(grads, None)
    kept.drop(step.final)
    kept.drop(grads)
    return step.stats


def analyze_fisher_streamed(
    ckpt: StreamingCheckpoint,
    windows: Tensor,
    candidates: Sequence[str],
    walk: StreamOptions,
    *,
    spill_dir: str | Path,
    labels: str,
    seed: int,
    include_lm_head: bool,
    include_embeddings: bool,
    dist: Dist | None = None,
    keep_cap: float | None = None,
) -> dict:
    """``analyze(method="fisher")``'s report, streamed: each tensor scored once complete."""
    dist = dist or Dist()
    scored: dict[str, dict] = {}
    columns: dict[str, list[int]] | None = None if keep_cap is None else {}

    def score(name: str, weight: Tensor, fisher: Tensor) -> None:
        cols = None if columns is None else columns.get(name, [])
        dloss, dkeep = layer_dloss_keep(weight, candidates, fisher_weigh(fisher), cols)
        scored[name] = layer_entry(name, weight, dloss, {})
        if columns is not None:
            scored[name] = with_columns(scored[name], cols, dkeep or None)

    stats = fisher_streamed(
        ckpt, windows, walk, score, spill_dir=spill_dir, labels=labels, seed=seed,
        include_lm_head=include_lm_head, include_embeddings=include_embeddings, dist=dist,
        columns=columns, keep_cap=keep_cap or 0.0,
    )  # fmt: skip
    a = ckpt.adapter
    order = [a.embed] + [a.block_prefix(i) + n for i in range(ckpt.num_layers) for n in a.linears]
    layers = []
    for name in [*order, a.lm_head]:
        if name in scored:
            layers.append({**scored[name], "outliers": stats.get(name, dict(NO_STATS))})
    out = report(
        ckpt.config,
        layers,
        method="fisher",
        weighting=None,
        fisher_labels=labels,
        candidates=candidates,
        windows=windows,
    )
    return {**out, "streamed": True}
