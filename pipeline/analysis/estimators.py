"""Curvature estimates that turn a weight perturbation into a predicted loss increase.

Around trained weights (gradient ≈ 0) ΔL ≈ ½ δᵀHδ for δ = Q(w) − w, with H approximated by
the diagonal empirical Fisher E[g_i²] (EWC; SqueezeLLM; ``labels="model"``: the true Fisher),
Hutchinson's Tr(H_l)/n from Hessian-vector products (HAWQ-v2), or GPTQ's input Hessian
H = 2/N Σ xxᵀ (gradient-free: the layer's output error, not the loss). The first-order term
|ḡ·δ| (``mean_gradient``), which the trained-weights assumption drops, is one more estimator.
Ranks split the sequences and sums are all-reduced; accumulation is float32/float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.dist import Dist
from pipeline.progress import progress


def logits_loss(logits: Tensor, x: Tensor, gen: torch.Generator | None = None) -> Tensor:
    """Mean next-token cross-entropy of logits (B, T, V); with ``gen`` on sampled labels."""
    logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])  # (B·(T-1), V)
    if gen is None:
        labels = x[:, 1:].reshape(-1)
    else:
        probs = logits.detach().softmax(-1).cpu()
        labels = torch.multinomial(probs, 1, generator=gen).squeeze(1).to(logits.device)
    return F.cross_entropy(logits, labels)


def label_generator(labels: str, seed: int, s: int) -> torch.Generator | None:
    """Label sampler of sequence ``s`` seeded by (seed, s), rank-independent; None: data labels."""
    if labels not in ("data", "model"):
        raise ValueError(f"labels must be 'data' or 'model', got {labels!r}")
    return torch.Generator().manual_seed(seed * 1_000_003 + s) if labels == "model" else None


def sequence_loss(model: nn.Module, x: Tensor) -> Tensor:
    """Mean next-token cross-entropy of the windows x (B, T)."""
    return logits_loss(model(input_ids=x).logits, x)


def _bar(dist: Dist, items, desc: str, enabled: bool):
    return progress(items, f"sensitivity {desc}", enabled=enabled, is_main=dist.is_main)


def _sequence_grads(model, windows, tensors, dist: Dist, progress, desc, labels="data", seed=0):
    """Each of this rank's windows' gradients of its mean loss: one backward per sequence."""
    device = tensors[0].device
    for s in _bar(dist, dist.shard(len(windows)), desc, progress):
        x = windows[s : s + 1].to(device)  # (1, T)
        loss = logits_loss(model(input_ids=x).logits, x, label_generator(labels, seed, s))
        yield torch.autograd.grad(loss, tensors)


def fisher_diagonal(
    model: nn.Module,
    windows: Tensor,
    params: dict[str, nn.Parameter],
    dist: Dist,
    progress: bool = False,
    labels: str = "data",
    seed: int = 0,
) -> dict[str, Tensor]:
    """{name: F} (float32, shaped like the parameter, mean over the S windows (S, T))."""
    names, tensors = list(params), list(params.values())
    fisher = [torch.zeros_like(p, dtype=torch.float32) for p in tensors]
    tokens = windows.shape[1] - 1
    walk = _sequence_grads(model, windows, tensors, dist, progress, "fisher", labels, seed)
    for grads in walk:
        for f, g in zip(fisher, grads):
            g = g.float()
            f.addcmul_(g, g, value=tokens)
    for f in fisher:
        dist.all_reduce_(f).div_(len(windows))
    return dict(zip(names, fisher))


def mean_gradient(
    model: nn.Module,
    windows: Tensor,
    params: dict[str, nn.Parameter],
    dist: Dist,
    progress: bool = False,
) -> dict[str, Tensor]:
    """{name: ḡ} (float32): the mean-loss gradient over the windows, on the data's labels
    (with labels sampled from the model its expectation is zero)."""
    names, tensors = list(params), list(params.values())
    total = [torch.zeros_like(p, dtype=torch.float32) for p in tensors]
    for grads in _sequence_grads(model, windows, tensors, dist, progress, "gradient"):
        for t, g in zip(total, grads):
            t.add_(g.float())
    for t in total:
        dist.all_reduce_(t).div_(len(windows))
    return dict(zip(names, total))


def _rademacher(shape: torch.Size, gen: torch.Generator, device: torch.device) -> Tensor:
    return (torch.randint(0, 2, shape, generator=gen) * 2 - 1).float().to(device)


def hutchinson_trace(
    model: nn.Module,
    windows: Tensor,
    params: dict[str, nn.Parameter],
    dist: Dist,
    probes: int = 4,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, float]:
    """{name: Tr(H)} of the mean loss; probes seeded by (seed, s), so rank-independent."""
    names, tensors = list(params), list(params.values())
    trace = torch.zeros(len(tensors), dtype=torch.float64, device=tensors[0].device)
    for s in _bar(dist, dist.shard(len(windows)), "hutchinson", progress):
        x = windows[s : s + 1]  # (1, T)
        trace += _probe_sequence(model, x, tensors, probes, seed * 1_000_003 + s)
    dist.all_reduce_(trace).div_(len(windows) * probes)
    return dict(zip(names, trace.tolist()))


def _probe_sequence(
    model: nn.Module, x: Tensor, tensors: list[nn.Parameter], probes: int, seed: int
) -> Tensor:
    """Σ over probes of vᵀ H v per tensor for one sequence x (1, T). # (n_tensors,)"""
    trace = torch.zeros(len(tensors), dtype=torch.float64, device=tensors[0].device)
    x = x.to(tensors[0].device)
    # The fused attention kernels have no double backward; the math one is plain autograd.
    with sdpa_kernel(SDPBackend.MATH):
        grads = torch.autograd.grad(sequence_loss(model, x), tensors, create_graph=True)
    gen = torch.Generator().manual_seed(seed)
    for k in range(probes):
        vs = [_rademacher(p.shape, gen, p.device) for p in tensors]
        gv = sum((g * v).sum() for g, v in zip(grads, vs))
        hvs = torch.autograd.grad(gv, tensors, retain_graph=k < probes - 1)  # H v
        trace += torch.stack([(h.double() * v).sum() for h, v in zip(hvs, vs)])
    return trace


@torch.no_grad()
def forward_pass(
    model: nn.Module,
    windows: Tensor,
    dist: Dist,
    batch_size: int,
    vocab_size: int,
    progress: bool = False,
) -> Tensor:
    """This rank's windows forward (for the hooks); returns all-reduced token counts (vocab,)."""
    device = next(model.parameters()).device
    counts = torch.zeros(vocab_size, dtype=torch.float64, device=device)
    mine = list(dist.shard(len(windows)))
    for i in _bar(dist, range(0, len(mine), batch_size), "forward", progress):
        x = windows[mine[i : i + batch_size]].to(device)  # (B, T)
        model(input_ids=x)
        counts += torch.bincount(x.reshape(-1), minlength=vocab_size).double()
    return dist.all_reduce_(counts)
