"""Decode speed of runtime models (packed kernels), next to what theory promises.

Per model: plain batch-1 tokens/s (the median of ``repeats`` passes over the prompts, with their
min and max), ms/token, the kernels run and the bytes resident for weights and a KV cache. Per
(draft, target) pair: the same, the speed-up, and theory tau / (gamma * c + 1) at the measured
alpha and c (``of_theory``), plus ``theory_at_v`` with the measured verification cost v.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pipeline.runtime.backends import kernel_summary
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio, measure_verify_cost
from pipeline.speculative.decoding import plain_generate, speculative_decoder
from pipeline.speculative.metrics import theoretical_speedup
from pipeline.speculative.stats import SpecStats, decode_prompts, pair_name

__all__ = [
    "decode_speed",
    "format_speed",
    "kv_cache_bytes",
    "slow_lowbit",
    "weight_bytes",
]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (packed codes, scales, tables), shared ones once."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for t in tensors.values())


def kv_cache_bytes(model: nn.Module, context: float) -> int:
    """Bytes of the keys and values of ``context`` positions, in the embedding's dtype."""
    cfg = model.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    size = model.get_input_embeddings().weight.element_size()
    return int(2 * cfg.num_hidden_layers * kv_heads * head * context * size)


def decode_passes(fn, prompts: Sequence[torch.Tensor], seed: int, repeats: int):
    """(counters merged over every pass, the tokens/s of each pass) after an untimed warm-up."""
    total, rates, _ = paired_passes(fn, None, prompts, seed, repeats)
    return total, rates


def paired_passes(fn, base, prompts: Sequence[torch.Tensor], seed: int, repeats: int):
    """:func:`decode_passes` of ``fn``, each pass next to one of ``base`` (None: none), in an
    order that swaps every repeat: (fn's merged counters, fn's tokens/s per pass, base's). A
    VM's memory bandwidth drifts by tens of percent between runs seconds apart: per-pass ratios
    of alternating passes see the machine alike on both sides, two separate series do not."""
    fns = [fn] if base is None else [base, fn]
    for f in fns:  # untimed: the allocator and the kernels' first calls
        f(prompts[0][:, :8], torch.Generator(device=prompts[0].device).manual_seed(seed))
    runs = []
    for i in range(repeats):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        timed = {k: decode_prompts(fns[k], list(prompts), seed) for k in order}
        runs.append([timed[k] for k in range(len(fns))])
    total = runs[0][-1]
    for run in runs[1:]:
        total = total.merge(run[-1])
    base_rates = [r[0].tokens_per_s for r in runs] if base is not None else []
    return total, [r[-1].tokens_per_s for r in runs], base_rates


def _plain(model: nn.Module, new_tokens: int, temperature: float):
    return lambda x, g: plain_generate(model, x, new_tokens, temperature, g)


def median_ratio(rates: Sequence[float], base: Sequence[float]) -> float:
    """The median of per-pass ratios of ``rates`` to the ``base`` passes run beside them."""
    return statistics.median(r / max(b, 1e-9) for r, b in zip(rates, base, strict=True))


def _plain_rates(models, name, reference, new_tokens, temperature, prompts, seed, repeats):
    """``name``'s plain tokens/s per pass, and its median ratio to ``reference``'s passes."""
    fn = _plain(models[name], new_tokens, temperature)
    if reference is None or name == reference:
        rates = paired_passes(fn, None, prompts, seed, repeats)[1]
        return rates, None if reference is None else 1.0
    base = _plain(models[reference], new_tokens, temperature)
    _, rates, ref_rates = paired_passes(fn, base, prompts, seed, repeats)
    return rates, median_ratio(rates, ref_rates)


def _timing(rates: list[float]) -> dict:
    """Median tokens/s of the passes, its min-max spread and ms/token."""
    mid = statistics.median(rates)
    return {
        "tokens_per_s": mid,
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "ms_per_token": 1000.0 / max(mid, 1e-9),
    }


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
    repeats: int = 3,
    allow_plain: bool = True,
    timed: bool = True,
    reference: str | None = None,
) -> dict:
    """Plain and speculative decode speed of runtime models, batch 1, same prompts and seeds.

    ``models``: {name: causal LM} (targets and drafts); ``pairs``: (draft, target) names;
    ``adaptive``: (gamma_min, gamma_max, window), None = fixed ``gamma``, one window over every
    pass, with plain steps if ``allow_plain``, priced by each round's wall time if ``timed``
    (``AdaptiveGamma``); prompt i uses seed + i in each of ``repeats``; plain rows are timed
    beside ``reference``'s (``x_reference``).
    Returns ``{"plain": {name: row}, "speculative": {"draft@target": row}}``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    context = max(p.shape[-1] for p in prompts) + new_tokens
    memory = {n: (weight_bytes(m), kv_cache_bytes(m, context)) for n, m in models.items()}
    plain = {}
    for name in dict.fromkeys([t for _, t in pairs] + list(models)):
        rates, x_ref = _plain_rates(models, name, reference, new_tokens, temperature, prompts,
                                    seed, repeats)  # fmt: skip
        plain[name] = {
            **_timing(rates),
            "kernels": kernel_summary(models[name]) or "float (F.linear)",
            "weight_bytes": memory[name][0],
            "kv_bytes": memory[name][1],
        }
        if x_ref is not None:
            plain[name]["x_reference"] = x_ref
    gammas = [gamma] if adaptive is None else list(range(adaptive[0], adaptive[1] + 1))
    spec, verify = {}, {}
    for draft, target in pairs:
        cost = measure_cost_ratio(models[target], models[draft], input_ids=prompts[0])
        if target not in verify:
            verify[target] = measure_verify_cost(models[target], gammas, input_ids=prompts[0])
        window = None
        if adaptive is not None:
            lo, hi, size = adaptive
            window = AdaptiveGamma(
                lo, hi, size, cost_ratio=cost, verify_cost=verify[target], allow_plain=allow_plain,
                timed=timed,
            )  # fmt: skip
        fn = speculative_decoder(
            models[target], models[draft], new_tokens, gamma=gamma, adaptive=window,
            temperature=temperature, temperature_schedule=temperature_schedule,
        )  # fmt: skip
        stats, rates, plain_rates = paired_passes(
            fn, _plain(models[target], new_tokens, temperature), prompts, seed, repeats
        )
        speedup = median_ratio(rates, plain_rates)
        row = _pair_row(stats, gammas, cost, verify[target], _timing(rates), speedup)
        row["weight_bytes"] = memory[target][0] + memory[draft][0]
        row["kv_bytes"] = memory[target][1] + memory[draft][1]
        spec[pair_name(draft, target)] = row
        del fn  # holds the pair: a ModelShelf frees it when the next pair loads
    return {"plain": plain, "speculative": spec}


def _pair_row(
    stats: SpecStats,
    gammas: list[int],
    cost: float,
    verify: dict[int, float],
    timing: dict,
    speedup: float,
) -> dict:
    """A pair's measured speed next to the theory at the draft length it used; ``speedup``: the
    median over passes of its tokens/s over plain decoding's in the pass before.

    ``gamma`` averages the rounds that drafted; ``plain_share`` is the share of target calls
    that drafted nothing (adaptive plain steps, and a last round with no budget left).
    """
    used = sum(stats.gammas) / max(len(stats.gammas), 1)
    g_theory = min(gammas, key=lambda g: abs(g - used))  # the nearest measured one if adaptive
    v = verify[g_theory]
    theory = float(theoretical_speedup(stats.alpha_hat, g_theory, cost))
    return {
        **timing,
        "speedup": speedup,
        "alpha": stats.alpha_hat,
        "tau": stats.tau,
        "gamma": used,
        "plain_share": 1.0 - len(stats.gammas) / max(stats.target_calls, 1),
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
