"""The GPTQ-proxy sensitivity of a checkpoint that does not fit in memory, block by block.

The proxy needs only each linear's input Hessian H = 2/N Σ x xᵀ, i.e. forward passes, so it
can walk the checkpoint like the quantize stage does (:class:`StreamingCheckpoint`): the
calibration windows are embedded, then each decoder block is loaded, run on the cached
activations while hooks accumulate its linears' Hessians and input statistics, scored, and
freed; its outputs (FP, nothing is quantized here) become the next block's inputs. The final
norm's output feeds lm_head's statistics without computing the (tokens x vocab) logits. Peak
memory: one block, the activation cache (spilled to ``spill_dir`` beyond ``act_budget_gb``)
and one block's Hessians.

The report equals :func:`pipeline.analysis.sensitivity.analyze` with ``method="gptq_proxy"`` on
the loaded model (up to float summation order): same layers, ΔL and outlier statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipeline.analysis.capture import Capture
from pipeline.analysis.scores import embedding_weigh, hessian_weigh, layer_dloss
from pipeline.analysis.sensitivity import NO_STATS, layer_entry, report
from pipeline.dist import Dist
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.quant.actcache import ActivationCache


@torch.no_grad()
def analyze_streamed(
    ckpt: StreamingCheckpoint,
    windows: torch.Tensor,
    candidates: Sequence[str],
    dist: Dist | None = None,
    *,
    spill_dir: str | Path,
    weighting: str = "full",
    batch_size: int = 8,
    include_lm_head: bool = True,
    include_embeddings: bool = True,
    act_budget_gb: float = 2.0,
    progress: bool = False,
) -> dict:
    """Sensitivity report (the sensitivity.json contract) of the checkpoint on ``windows`` (S, T).

    Every rank passes the same windows and takes ``dist.shard`` of them; Hessians, statistics
    and token counts are all-reduced, so every rank returns the single-process report.
    """
    dist = dist or Dist()
    a, config = ckpt.adapter, ckpt.config
    ids = windows[list(dist.shard(len(windows)))]  # (S_rank, T)
    table = ckpt.tensor(a.embed + ".weight")  # (vocab, C)
    shape = (*ids.shape, table.shape[1])
    spill = Path(spill_dir) / f"sensitivity-rank{dist.rank}.npy"
    cache = ActivationCache.create(shape, ckpt.dtype, act_budget_gb * 2**30, spill)
    slices = [slice(i, i + batch_size) for i in range(0, len(ids), batch_size)]
    for s in slices:  # nn.Embedding is a row lookup
        cache[s] = table[ids[s]]

    layers: list[dict] = []

    def score(name: str, weight: torch.Tensor, weigh, stats: dict) -> None:
        layers.append(layer_entry(name, weight, layer_dloss(weight, candidates, weigh), stats))

    tied = bool(getattr(config, "tie_word_embeddings", False))
    if include_embeddings and not tied:
        counts = torch.bincount(ids.reshape(-1), minlength=table.shape[0]).double()
        score(a.embed, table, embedding_weigh(dist.all_reduce_(counts)), dict(NO_STATS))
    del table

    bar = tqdm(range(ckpt.num_layers), desc="sensitivity blocks", unit="block",
               disable=dist.bar_disable(progress))  # fmt: skip
    for i in bar:
        block, prefix = ckpt.load_block(i), a.block_prefix(i)
        linears = {prefix + n: block.get_submodule(n) for n in a.linears}
        shared = {prefix + n: prefix + g[0] for g in a.fused for n in g[1:]}
        capture = Capture(linears, hessians=True, shared=shared)
        kwargs = ckpt.block_forward_inputs(ids.shape[1], layer_idx=i)
        out = cache.for_outputs(spill.with_name(f"{spill.stem}-{i % 2}.npy"))
        for s in slices:  # the outputs of FP block i are the inputs of block i + 1
            out[s] = block(cache[s].to(ckpt.device), **kwargs)
        capture.remove()
        capture.reduce_(dist)
        for name, mod in linears.items():
            weigh = hessian_weigh(capture.hessian(name), weighting)
            score(name, mod.weight, weigh, capture.stats[name].summary())
        cache = out
        del block, capture

    if include_lm_head:
        norm, head = ckpt.load_norm(), ckpt.load_lm_head()
        capture = Capture({a.lm_head: head}, hessians=True)
        capture.remove()  # fed directly: the logits themselves are never needed
        for s in slices:
            capture.observe(a.lm_head, norm(cache[s].to(ckpt.device)))
        capture.reduce_(dist)
        weigh = hessian_weigh(capture.hessian(a.lm_head), weighting)
        score(a.lm_head, head.weight, weigh, capture.stats[a.lm_head].summary())
    scored = report(
        config,
        layers,
        method="gptq_proxy",
        weighting=weighting,
        fisher_labels=None,
        candidates=candidates,
        windows=windows,
    )
    return {**scored, "streamed": True}
