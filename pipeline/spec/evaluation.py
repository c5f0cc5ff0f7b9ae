"""Acceptance of draft/target pairs per scenario: the numbers evaluate, reinforce and bench report.

For every (draft, target, scenario) three views of acceptance are measured on the scenario's
held-out prompts (see :mod:`pipeline.spec.metrics` for the definitions):

- ``alpha_tf``: teacher-forced alpha, mean sum_x min(p, q) over every position of the prompts
  (one forward per model, deterministic, the corpus text as context);
- ``alpha``: the on-line alpha of real speculative decoding, mean beta over the positions whose
  acceptance test ran while generating ``new_tokens`` after each prompt (the draft's own
  continuations as context, Rao-Blackwellised so a few prompts suffice);
- ``acceptance_rate`` (accepted / drafted) and ``tau`` (tokens per target call, bonus included).

With ``timing=True`` the same prompts are also decoded plainly by the target, so tokens/s of
both and the measured speed-up sit beside the theoretical one, tau(alpha) / (gamma * c + 1) with
c measured once per pair. Timings are wall-clock on whatever device the models are on; they are
indicative only on a loaded machine, while the acceptance numbers do not depend on speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from pipeline.spec.cost import measure_cost_ratio
from pipeline.spec.decoding import plain_generate, speculative_generate
from pipeline.spec.metrics import teacher_forced_acceptance, theoretical_speedup
from pipeline.spec.stats import SpecStats

__all__ = ["acceptance_table", "column", "heldout_scenarios", "pair_name", "plot_acceptance"]

Table = dict[str, dict[str, dict[str, float]]]  # "draft@target" -> scenario -> metric -> value


def pair_name(draft: str, target: str) -> str:
    """The key of a pair in eval.json and reinforce.json: ``<draft>@<target>``."""
    return f"{draft}@{target}"


def heldout_scenarios(
    tokenizer,
    documents: list[str],
    *,
    n_prompts: int,
    prompt_len: int,
    long_len: int,
    seed: int = 0,
    cache_path=None,
) -> dict[str, list[list[int]]]:
    """Scenario prompt sets (long, repetition, rare, mix) cut from tokenised documents."""
    from pipeline.data.scenarios import build_scenarios

    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return build_scenarios(
        ids,
        n_prompts=n_prompts,
        prompt_len=prompt_len,
        long_len=long_len,
        seed=seed,
        cache_path=cache_path,
    )


def _decode_all(fn, prompts: list[torch.Tensor], seed: int) -> SpecStats:
    total = SpecStats()
    for i, prompt in enumerate(prompts):
        # The same seed per prompt for every model, so plain and speculative runs draw alike.
        _, stats = fn(prompt, torch.Generator(device=prompt.device).manual_seed(seed + i))
        total = total.merge(stats)
    return total


def _device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def acceptance_table(
    targets: Mapping[str, torch.nn.Module],
    drafts: Mapping[str, torch.nn.Module],
    scenarios: Mapping[str, list[list[int]]],
    *,
    pairs: Iterable[tuple[str, str]] | None = None,
    gamma: int = 4,
    temperature: float = 1.0,
    new_tokens: int = 32,
    max_prompts: int | None = None,
    batch_size: int = 8,
    timing: bool = True,
    seed: int = 0,
) -> Table:
    """Acceptance (and optionally speed) of every (draft, target) pair on every scenario.

    Args:
        targets: {name: causal LM} verifying models (eval mode).
        drafts: {name: causal LM} proposing models with the targets' tokenizer.
        scenarios: {scenario: prompts}, prompts of one scenario sharing one length.
        pairs: (draft, target) names to measure; default every combination.
        gamma: draft length per round.
        temperature: decoding temperature of both models (0 = greedy).
        new_tokens: tokens generated after each prompt.
        max_prompts: prompts per scenario used for decoding (all of them for alpha_tf).
        batch_size: prompts per teacher-forced forward.
        timing: also decode plainly with the target and report tokens/s and speed-ups.
        seed: sampling seed (prompt i uses seed + i).

    Returns:
        {"draft@target": {scenario: {"alpha_tf", "alpha", "acceptance_rate", "tau", ...}}}; with
        timing also "tokens_per_s", "plain_tokens_per_s", "speedup", "cost_ratio",
        "theoretical_speedup".
    """
    pairs = list(pairs) if pairs is not None else [(d, t) for t in targets for d in drafts]
    plain: dict[tuple[str, str], SpecStats] = {}
    table: Table = {}
    for draft_name, target_name in pairs:
        target, draft = targets[target_name], drafts[draft_name]
        dev = _device(target)
        cost = None
        row: dict[str, dict[str, float]] = {}
        for scen, prompts in scenarios.items():
            ids = torch.as_tensor(prompts, dtype=torch.long)  # (N, L)
            batches = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
            m = {"alpha_tf": teacher_forced_acceptance(target, draft, batches, temperature)}
            decode = [p[None].to(dev) for p in ids[:max_prompts]]

            def spec(x, g, target=target, draft=draft):
                return speculative_generate(
                    target, draft, x, new_tokens, gamma=gamma, temperature=temperature, generator=g
                )

            stats = _decode_all(spec, decode, seed)
            m.update(alpha=stats.alpha_hat, acceptance_rate=stats.acceptance_rate, tau=stats.tau)
            if timing:
                if (target_name, scen) not in plain:
                    plain[target_name, scen] = _decode_all(
                        lambda x, g, target=target: plain_generate(
                            target, x, new_tokens, temperature, g
                        ),
                        decode,
                        seed,
                    )
                base = plain[target_name, scen]
                if cost is None:  # c depends on the models, not the scenario: measure once
                    cost = measure_cost_ratio(target, draft, input_ids=decode[0][:, :128])
                m.update(
                    tokens_per_s=stats.tokens_per_s,
                    plain_tokens_per_s=base.tokens_per_s,
                    speedup=stats.tokens_per_s / max(base.tokens_per_s, 1e-9),
                    cost_ratio=cost,
                    theoretical_speedup=float(theoretical_speedup(stats.alpha_hat, gamma, cost)),
                )
            row[scen] = m
        table[pair_name(draft_name, target_name)] = row
    return table


def column(table: Table, pair: str, metric: str = "alpha") -> dict[str, float]:
    """{scenario: value} of one pair and metric, with "mean" over the scenarios appended."""
    values = {scen: m[metric] for scen, m in table[pair].items()}
    values["mean"] = sum(values.values()) / len(values)
    return values


def plot_acceptance(
    series: Mapping[str, Mapping[str, float]], *, ylabel: str = "acceptance", title: str = ""
):
    """Grouped bars: one group per scenario, one bar per series (e.g. before / after).

    Args:
        series: {label: {scenario: value}}, e.g. from :func:`column`.

    Returns:
        The matplotlib Figure (the caller saves or logs it).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    labels = list(series)
    scens = list(next(iter(series.values())))
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(1.6 * len(scens) + 2, 3.5))
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(scens))]
        bars = ax.bar(xs, [series[label].get(s, 0.0) for s in scens], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(scens)), scens)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
