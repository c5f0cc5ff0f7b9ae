"""Acceptance of draft/target pairs per scenario: the numbers evaluate, reinforce and bench report.

For every (draft, target, scenario) three views of acceptance are measured on the scenario's
held-out prompts (see :mod:`pipeline.speculative.metrics` for the definitions):

- ``alpha_tf``: teacher-forced alpha, mean sum_x min(p, q) over every position of the prompts
  (one forward per model, deterministic, the corpus text as context);
- ``alpha``: the on-line alpha of real speculative decoding, mean beta over the positions whose
  acceptance test ran while generating ``new_tokens`` after each prompt (the draft's own
  continuations as context, Rao-Blackwellised so a few prompts suffice);
- ``acceptance_rate`` (accepted / drafted) and ``tau`` (tokens per target call, bonus included).

Decoding runs with a fixed gamma, or adaptively (``adaptive``): one
:class:`~pipeline.speculative.adaptive.AdaptiveGamma` per pair and scenario, its window running
on across the scenario's prompts as it would across a server's requests; ``gamma`` in the table
is then the mean draft length it chose. ``temperature_schedule`` makes the draft sample on the
schedule of :mod:`pipeline.speculative.schedule` over each generation's decoding steps.

Speed is measured apart, on the models as the runtime runs them (``pipeline.runtime.speed``):
acceptance is a property of the distributions, speed of the kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from pipeline.progress import progress
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.decoding import speculative_generate
from pipeline.speculative.metrics import teacher_forced_acceptance
from pipeline.speculative.stats import SpecStats

__all__ = [
    "acceptance_table",
    "column",
    "decode_prompts",
    "heldout_scenarios",
    "pair_name",
    "plot_acceptance",
]

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


def decode_prompts(fn, prompts: Iterable[torch.Tensor], seed: int) -> SpecStats:
    """Merged stats of ``fn(prompt, generator)`` over the prompts, prompt i seeded seed + i."""
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
    adaptive: Callable[[str, str], AdaptiveGamma] | None = None,
    temperature: float = 1.0,
    temperature_schedule: bool = False,
    new_tokens: int = 32,
    max_prompts: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
) -> Table:
    """Acceptance (and optionally speed) of every (draft, target) pair on every scenario.

    Args:
        targets: {name: causal LM} verifying models (eval mode).
        drafts: {name: causal LM} proposing models with the targets' tokenizer.
        scenarios: {scenario: prompts}, prompts of one scenario sharing one length.
        pairs: (draft, target) names to measure; default every combination.
        gamma: draft length per round (without ``adaptive``).
        adaptive: ``adaptive(draft, target)`` gives a fresh adaptive draft length for a pair,
            one per scenario (its cost ratio measured on that pair); None = fixed ``gamma``.
        temperature: decoding temperature of both models (0 = greedy).
        temperature_schedule: the draft samples on the decoding-step temperature schedule.
        new_tokens: tokens generated after each prompt.
        max_prompts: prompts per scenario used for decoding (all of them for alpha_tf).
        batch_size: prompts per teacher-forced forward.
        seed: sampling seed (prompt i uses seed + i).

    Returns:
        {"draft@target": {scenario: {"alpha_tf", "alpha", "acceptance_rate", "tau", "gamma"}}}.
    """
    pairs = list(pairs) if pairs is not None else [(d, t) for t in targets for d in drafts]
    table: Table = {}
    cells = [(d, t, scen) for d, t in pairs for scen in scenarios]
    # Decoding is the long part (a prompt takes seconds on a large model): off a terminal a log
    # line at most every 30 s, counting prompts over every cell. `zip` asks `decoded` for the
    # next count as each prompt starts, which counts the one before it as done.
    n_decode = sum(len(scenarios[scen][:max_prompts]) for _, _, scen in cells)
    decoded = iter(progress(range(n_decode), "acceptance: prompts decoded", unit="prompt"))
    for draft_name, target_name, scen in cells:
        target, draft = targets[target_name], drafts[draft_name]
        dev = _device(target)
        ids = torch.as_tensor(scenarios[scen], dtype=torch.long)  # (N, L)
        batches = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
        m = {"alpha_tf": teacher_forced_acceptance(target, draft, batches, temperature)}
        decode = [p[None].to(dev) for p in ids[:max_prompts]]
        window = adaptive(draft_name, target_name) if adaptive is not None else None

        def spec(x, g, target=target, draft=draft, window=window):
            return speculative_generate(
                target,
                draft,
                x,
                new_tokens,
                gamma=gamma,
                adaptive=window,
                temperature=temperature,
                temperature_schedule=temperature_schedule,
                generator=g,
            )

        stats = decode_prompts(spec, (p for p, _ in zip(decode, decoded)), seed)
        m.update(
            alpha=stats.alpha_hat,
            acceptance_rate=stats.acceptance_rate,
            tau=stats.tau,
            gamma=sum(stats.gammas) / max(len(stats.gammas), 1),
        )
        table.setdefault(pair_name(draft_name, target_name), {})[scen] = m
    for _ in decoded:  # the last prompt is done: progress' closing line
        pass
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
