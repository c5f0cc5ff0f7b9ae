"""Measured costs of speculative decoding: the cost ratio c and the verification cost v(gamma).

Both enter the speed-up tau / (gamma * c + v) and are measured (medians of cached forwards on
the same context), not derived: v = 1 holds only where decoding is memory-bound.
"""

from __future__ import annotations

import statistics
import time

import torch

from pipeline.speculative.decoding import CachedLM, vocab_size

__all__ = ["forward_seconds", "measure_cost_ratio", "measure_verify_cost"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu" and hasattr(torch, "npu"):
        torch.npu.synchronize(device)


@torch.no_grad()
def forward_seconds(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    tokens: int = 1,
    n_warmup: int = 2,
    n_iters: int = 10,
) -> float:
    """Median seconds of one cached forward of ``tokens`` tokens after ``prompt`` (1, T)."""
    lm = CachedLM(model)
    lm.forward(prompt, keep=1)
    length = lm.length
    feed = prompt[:, -1:].repeat(1, tokens)
    times = []
    for i in range(n_warmup + n_iters):
        _synchronize(lm.device)
        start = time.perf_counter()
        lm.forward(feed, keep=tokens)
        _synchronize(lm.device)
        if i >= n_warmup:
            times.append(time.perf_counter() - start)
        lm.rollback(length)
    return statistics.median(times)


def _context(model: torch.nn.Module, input_ids, context_len: int, seed: int) -> torch.Tensor:
    if input_ids is None:
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab_size(model), (1, context_len), generator=gen)
    return torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)


def measure_cost_ratio(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    *,
    input_ids: torch.Tensor | None = None,
    context_len: int = 128,
    n_warmup: int = 2,
    n_iters: int = 10,
    seed: int = 0,
) -> float:
    """c = draft time / target time of one cached decode step (medians of ``n_iters``).

    ``input_ids``: (1, T) context to decode after; random tokens of ``context_len`` if None.
    """
    if n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    # The smaller vocabulary's ids are valid for both models.
    smaller = target if vocab_size(target) <= vocab_size(draft) else draft
    input_ids = _context(smaller, input_ids, context_len, seed)
    t_target = forward_seconds(target, input_ids, 1, n_warmup, n_iters)
    t_draft = forward_seconds(draft, input_ids, 1, n_warmup, n_iters)
    return t_draft / max(t_target, 1e-9)


def measure_verify_cost(
    target: torch.nn.Module,
    gammas,
    *,
    input_ids: torch.Tensor | None = None,
    context_len: int = 128,
    n_warmup: int = 2,
    n_iters: int = 10,
    seed: int = 0,
) -> dict[int, float]:
    """{gamma: v}, v(gamma) = time of a (gamma + 1)-token target forward / a single-token one."""
    input_ids = _context(target, input_ids, context_len, seed)
    step = forward_seconds(target, input_ids, 1, n_warmup, n_iters)
    return {
        g: forward_seconds(target, input_ids, g + 1, n_warmup, n_iters) / max(step, 1e-9)
        for g in gammas
    }
