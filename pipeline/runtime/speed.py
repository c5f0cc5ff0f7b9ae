"""Decode speed of runtime models (packed kernels), next to what theory promises.

Per model: plain batch-1 tokens/s and the kernels run. Per (draft, target) pair: speculative
tokens/s, the speed-up, and theory tau / (gamma * c + 1) at the measured alpha and c
(``of_theory``), plus ``theory_at_v`` with the measured verification cost v.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pipeline.runtime.backends import kernel_summary
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio, measure_verify_cost
from pipeline.speculative.decoding import plain_generate, speculative_decoder
from pipeline.speculative.metrics import theoretical_speedup
from pipeline.speculative.stats import SpecStats, decode_prompts, pair_name

__all__ = ["decode_speed", "format_speed", "slow_lowbit"]


def _decode(fn, prompts: Sequence[torch.Tensor], seed: int) -> SpecStats:
    warm = torch.Generator(device=prompts[0].device).manual_seed(seed)
    fn(prompts[0][:, :8], warm)  # warm-up, untimed
    return decode_prompts(fn, list(prompts), seed)


@torch.no_grad()
def decode_speed(
    models: Mapping[str, nn.Module],
    pairs: Sequence[tuple[str, str]],
    prompts: Sequence[torch.Tensor],
    *,
    new_tokens: int = 32,
    gamma: int = 4,
    adaptive: tuple[int, int, int] | None = None,
    temperature: float = 0.0,
    temperature_schedule: bool = False,
    seed: int = 0,
) -> dict:
    """Plain and speculative decode speed of runtime models, batch 1, same prompts and seeds.

    ``models``: {name: causal LM} (targets and drafts); ``pairs``: (draft, target) names;
    ``adaptive``: (gamma_min, gamma_max, window), None = fixed ``gamma``; prompt i uses seed + i.
    Returns ``{"plain": {name: row}, "speculative": {"draft@target": row}}``.
    """
    plain = {}
    for name in dict.fromkeys([t for _, t in pairs] + list(models)):
        stats = _decode(
            lambda x, g, m=models[name]: plain_generate(m, x, new_tokens, temperature, g),
            prompts,
            seed,
        )
        plain[name] = {
            "tokens_per_s": stats.tokens_per_s,
            "kernels": kernel_summary(models[name]) or "float (F.linear)",
        }
    gammas = [gamma] if adaptive is None else list(range(adaptive[0], adaptive[1] + 1))
    spec, verify = {}, {}
    for draft, target in pairs:
        cost = measure_cost_ratio(models[target], models[draft], input_ids=prompts[0])
        if target not in verify:
            verify[target] = measure_verify_cost(models[target], gammas, input_ids=prompts[0])
        stats = _speculative_stats(
            models[target],
            models[draft],
            prompts,
            cost,
            verify[target],
            new_tokens=new_tokens,
            gamma=gamma,
            adaptive=adaptive,
            temperature=temperature,
            temperature_schedule=temperature_schedule,
            seed=seed,
        )
        spec[pair_name(draft, target)] = _pair_row(
            stats, gammas, cost, verify[target], plain[target]["tokens_per_s"]
        )
    return {"plain": plain, "speculative": spec}


def _speculative_stats(
    target: nn.Module,
    draft: nn.Module,
    prompts: Sequence[torch.Tensor],
    cost: float,
    verify: dict[int, float],
    *,
    new_tokens: int,
    gamma: int,
    adaptive: tuple[int, int, int] | None,
    temperature: float,
    temperature_schedule: bool,
    seed: int,
) -> SpecStats:
    """Speculative decoding of ``prompts``, adaptive when asked (one window for all prompts)."""
    window = None
    if adaptive is not None:
        lo, hi, size = adaptive
        window = AdaptiveGamma(lo, hi, size, cost_ratio=cost, verify_cost=verify)
    spec = speculative_decoder(
        target, draft, new_tokens, gamma=gamma, adaptive=window, temperature=temperature,
        temperature_schedule=temperature_schedule,
    )  # fmt: skip
    return _decode(spec, prompts, seed)


def _pair_row(
    stats: SpecStats, gammas: list[int], cost: float, verify: dict[int, float], plain_tps: float
) -> dict:
    """A pair's measured speed next to the theory at the draft length it used."""
    used = sum(stats.gammas) / max(len(stats.gammas), 1)
    g_theory = min(gammas, key=lambda g: abs(g - used))  # the nearest measured one if adaptive
    v = verify[g_theory]
    theory = float(theoretical_speedup(stats.alpha_hat, g_theory, cost))
    speedup = stats.tokens_per_s / max(plain_tps, 1e-9)
    return {
        "tokens_per_s": stats.tokens_per_s,
        "speedup": speedup,
        "alpha": stats.alpha_hat,
        "tau": stats.tau,
        "gamma": used,
        "cost_ratio": cost,
        "theoretical_speedup": theory,
        "of_theory": speedup / max(theory, 1e-9),
        "verify_cost": v,
        "theory_at_v": float(theoretical_speedup(stats.alpha_hat, g_theory, cost, v)),
    }


def slow_lowbit(speed: dict, fp: str = "target_fp") -> list[str]:
    """The quantized models that decode slower than ``fp`` (per-call overhead beats bytes)."""
    plain = speed["plain"]
    if fp not in plain:
        return []
    base = plain[fp]["tokens_per_s"]
    return [
        n
        for n, row in plain.items()
        if n != fp and "pack" in row["kernels"] and row["tokens_per_s"] < base
    ]


def format_speed(speed: dict, fp: str = "target_fp") -> list[str]:
    """Markdown tables of :func:`decode_speed`'s result, with the overhead caveat when due."""
    out = ["| model | plain tok/s | kernels |", "|---|---|---|"]
    out += [
        f"| {n} | {r['tokens_per_s']:.1f} | {r['kernels']} |" for n, r in speed["plain"].items()
    ]

    def gamma(r: dict) -> str:  # rows recorded before the draft length was: "-"
        return f"{r['gamma']:.1f}" if "gamma" in r else "-"

    if speed["speculative"]:
        out += [
            "",
            "| pair | spec tok/s | speed-up | theory | of theory | α | τ | γ | c | v "
            "| theory at v |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {p} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
            f"{r['theoretical_speedup']:.2f} | {r['of_theory']:.2f} | {r['alpha']:.3f} | "
            f"{r['tau']:.2f} | {gamma(r)} | {r['cost_ratio']:.2f} | {r['verify_cost']:.2f} | "
            f"{r['theory_at_v']:.2f} |"
            for p, r in speed["speculative"].items()
        ]
    slow = slow_lowbit(speed, fp)
    if slow:
        out += [
            "",
            f"{', '.join(slow)} decode slower than {fp} here: on a model this small each "
            "linear's matmul costs less than the per-call overhead of the packed kernel (casting "
            "or quantizing its activations, dispatch), so the bytes the low-bit weights save do "
            "not show. `bench/decode_speed.py` shows where the crossover lies.",
        ]
    return out
