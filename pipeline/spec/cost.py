"""Measured cost ratio c = draft forward time / target forward time.

c enters the speed-up tau / (gamma * c + 1), the adaptive draft length and the throughput
reward. It is measured, not derived from parameter counts: a 2-bit self-draft has the target's
FLOPs but a quarter of its weight bytes, and whether that matters depends on the hardware
(memory-bound decoding on GPUs/NPUs, compute- or overhead-bound on small CPU models).

What is timed is one cached single-token decode step after a prompt of ``context_len`` tokens,
the step the draft repeats gamma times per round; the median over ``n_iters`` steps resists
scheduler noise. The cache is cropped back after every step so each step sees the same context.
"""

from __future__ import annotations

import statistics
import time

import torch

from pipeline.spec.decoding import CachedLM, vocab_size

__all__ = ["measure_cost_ratio"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu" and hasattr(torch, "npu"):
        torch.npu.synchronize(device)


@torch.no_grad()
def _step_seconds(
    model: torch.nn.Module, prompt: torch.Tensor, n_warmup: int, n_iters: int
) -> float:
    lm = CachedLM(model)
    lm.forward(prompt, keep=1)
    length = lm.length
    token = prompt[:, -1:]
    times = []
    for i in range(n_warmup + n_iters):
        _synchronize(lm.device)
        start = time.perf_counter()
        lm.forward(token, keep=1)
        _synchronize(lm.device)
        if i >= n_warmup:
            times.append(time.perf_counter() - start)
        lm.rollback(length)
    return statistics.median(times)


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
    """Time one cached decode step of each model and return draft time / target time.

    Args:
        target: the verifying model.
        draft: the proposing model.
        input_ids: (1, T) context to decode after; random tokens of ``context_len`` if None.
        context_len: length of the random context.
        n_warmup: untimed steps (allocator and kernel warm-up).
        n_iters: timed steps; the median is used.
        seed: seed of the random context.

    Returns:
        c > 0.
    """
    if n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    if input_ids is None:
        vocab = min(vocab_size(target), vocab_size(draft))
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab, (1, context_len), generator=gen)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    t_target = _step_seconds(target, input_ids, n_warmup, n_iters)
    t_draft = _step_seconds(draft, input_ids, n_warmup, n_iters)
    return t_draft / max(t_target, 1e-9)
