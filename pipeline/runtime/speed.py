"""Decode speed of a run's models as the runtime runs them, next to what theory promises.

For every model: plain batch-1 decode tokens/s and the kernels its quantized linears ran
(:func:`pipeline.runtime.backends.kernel_summary`). For every (draft, target) pair:
speculative tokens/s, the measured speed-up over the target's plain decoding, and the
theoretical one ``tau(alpha, gamma) / (gamma * c + 1)`` at the alpha measured in that same
decode and the cost ratio c measured on these very models; ``of_theory`` is their ratio.
Beside it, the verification cost v (the target's gamma + 1 token forward in single-token
steps, ``pipeline.speculative.cost``) and ``theory_at_v`` = tau / (gamma * c + v): the theory
assumes v = 1 (memory-bound decoding), and where v > 1 that is what bounds the speed-up.
With ``adaptive`` the draft length follows the windowed acceptance
(:class:`~pipeline.speculative.adaptive.AdaptiveGamma`, priced with the c and v measured here,
one window per pair across its prompts), and the theory is taken at the mean gamma it chose.

The caller passes runtime models (:func:`pipeline.runtime.inmemory.to_runtime` for a run's
fake-quant targets), so a quantized target is timed on its packed kernels, never through
fake-quant modules that rebuild a float weight on every call. Every model decodes a short
warm-up first (allocator, kernel dispatch), then the same prompts with the same seeds.
Timings are wall-clock and share the machine with whatever else runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pipeline.runtime.backends import kernel_summary
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio, measure_verify_cost
from pipeline.speculative.decoding import plain_generate, speculative_generate
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
    """Plain and speculative decode speed of runtime models.

    Args:
        models: {name: causal LM} as the runtime runs them (targets and drafts alike).
        pairs: (draft, target) names to decode speculatively.
        prompts: (1, T) prompts, decoded one at a time (batch 1, the latency setting).
        new_tokens: Tokens generated after each prompt.
        gamma: Draft length per round (without ``adaptive``).
        adaptive: (gamma_min, gamma_max, window) of an adaptive draft length; None = ``gamma``.
        temperature: 0 = greedy.
        temperature_schedule: The draft samples on the decoding-step temperature schedule.
        seed: Prompt i samples with seed + i, the same for every model.

    Returns:
        ``{"plain": {name: {"tokens_per_s", "kernels"}}, "speculative": {"draft@target":
        {"tokens_per_s", "speedup", "alpha", "tau", "gamma", "cost_ratio",
        "theoretical_speedup", "of_theory", "verify_cost", "theory_at_v"}}}``.
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
        window = None
        if adaptive is not None:
            lo, hi, size = adaptive
            window = AdaptiveGamma(lo, hi, size, cost_ratio=cost, verify_cost=verify[target])
        stats = _decode(
            lambda x, g, t=models[target], d=models[draft], w=window: speculative_generate(
                t,
                d,
                x,
                new_tokens,
                gamma=gamma,
                adaptive=w,
                temperature=temperature,
                temperature_schedule=temperature_schedule,
                generator=g,
            ),
            prompts,
            seed,
        )
        # The theory at the draft length used (the nearest measured one when adaptive).
        used = sum(stats.gammas) / max(len(stats.gammas), 1)
        g_theory = min(gammas, key=lambda g: abs(g - used))
        v = verify[target][g_theory]
        theory = float(theoretical_speedup(stats.alpha_hat, g_theory, cost))
        speedup = stats.tokens_per_s / max(plain[target]["tokens_per_s"], 1e-9)
        spec[pair_name(draft, target)] = {
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
    return {"plain": plain, "speculative": spec}


def slow_lowbit(speed: dict, fp: str = "target_fp") -> list[str]:
    """The quantized models that decode slower than ``fp``, e.g. where per-call overhead of a
    small model outweighs the bytes its packed weights save."""
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
