"""Decode speed of a run's models as the runtime runs them (low-bit targets on packed kernels)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pipeline.runtime.inmemory import to_runtime
from pipeline.runtime.speed import decode_speed, format_speed

log = logging.getLogger(__name__)


def runtime_speed(
    models: Mapping[str, nn.Module],
    pairs: Sequence[tuple[str, str]],
    prompts: Sequence[list[int]],
    *,
    new_tokens: int,
    gamma: int,
    adaptive: tuple[int, int, int] | None,
    temperature: float,
    temperature_schedule: bool,
    seed: int,
) -> dict:
    """Plain tok/s of every model and speculative tok/s of every pair, beside the theory.

    Converts ``models`` in place (a copy would double their memory): call it last.
    ``adaptive`` is (gamma_min, gamma_max, window), or None for the fixed ``gamma``.
    """
    runtime = {n: to_runtime(m, copy_model=False) for n, m in models.items()}
    ids = [torch.as_tensor([x], dtype=torch.long) for x in prompts]
    speed = decode_speed(
        runtime,
        pairs,
        ids,
        new_tokens=new_tokens,
        gamma=gamma,
        adaptive=adaptive,
        temperature=temperature,
        temperature_schedule=temperature_schedule,
        seed=seed,
    )
    for line in format_speed(speed):
        log.info("evaluate: %s", line)
    return speed
