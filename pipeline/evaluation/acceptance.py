"""Acceptance of draft/target pairs per scenario: the tables evaluate, reinforce and bench report.

Per (draft, target, scenario), on the scenario's held-out prompts (definitions in
:mod:`pipeline.speculative.metrics`): ``alpha_tf`` teacher-forced on the prompts; ``alpha`` the
on-line alpha of real speculative decoding (Rao-Blackwellised, so a few prompts suffice);
``acceptance_rate``, ``tau`` and the mean draft length ``gamma``; with ``greedy``, the same pair
decoded greedily too (``greedy_match``, ``alpha_greedy``, ``tau_greedy``), since greedy serving
gains from argmax agreement alone, which alpha at T > 0 does not track. With ``adaptive`` each
pair, scenario and mode gets one AdaptiveGamma whose window runs on across prompts, as across a
server's requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from pipeline.progress import progress
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio, measure_verify_cost
from pipeline.speculative.decoding import speculative_decoder
from pipeline.speculative.metrics import teacher_forced_acceptance
from pipeline.speculative.stats import decode_prompts, pair_name

TOKENIZE_BATCH = 256

__all__ = [
    "acceptance_table",
    "adaptive_gamma",
    "column",
    "final_target",
    "heldout_scenarios",
    "measure_costs",
    "plot_acceptance",
    "report_acceptance",
    "run_pairs",
]

log = logging.getLogger(__name__)

Table = dict[str, dict[str, dict[str, float]]]  # "draft@target" -> scenario -> metric -> value
Adaptive = Callable[[str, str], AdaptiveGamma]


def run_pairs(targets: Iterable[str], drafts: Iterable[str]) -> list[tuple[str, str]]:
    """The (draft, target) pairs a run evaluates among the models it has.

    FP draft vs FP target; FP and reinforced drafts vs the final low-bit target; and
    self-speculation, the low-bit target drafting for its FP self.
    """
    targets, drafts = set(targets), set(drafts)
    final = final_target(targets)
    pairs = [("draft_fp", "target_fp")] if "draft_fp" in drafts else []
    if final:
        pairs += [(d, final) for d in ("draft_fp", "draft_reinforced") if d in drafts]
        pairs.append((final, "target_fp"))
    return pairs


def final_target(names: Iterable[str]) -> str | None:
    """The run's last low-bit target among ``names`` (distilled over quantized), or None."""
    names = set(names)
    return next((t for t in ("target_distilled", "target_quantized") if t in names), None)


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

    # A batch at a time, kept as arrays: a split in one call peaks at its encodings' size.
    ids = [
        np.asarray(doc, dtype=np.int64)
        for i in range(0, len(documents), TOKENIZE_BATCH)
        for doc in tokenizer(
            documents[i : i + TOKENIZE_BATCH], add_special_tokens=False, return_attention_mask=False
        )["input_ids"]
    ]
    return build_scenarios(
        ids,
        n_prompts=n_prompts,
        prompt_len=prompt_len,
        long_len=long_len,
        seed=seed,
        cache_path=cache_path,
    )


def measure_costs(
    models: Mapping[str, torch.nn.Module],
    pairs: Iterable[tuple[str, str]],
    prompt: list[int],
    gammas: Iterable[int],
) -> dict[str, dict]:
    """``{pair: {"cost_ratio": c, "verify_cost": {gamma: v}}}``, v timed once per target."""
    ids = torch.as_tensor([prompt], dtype=torch.long)
    pairs, gammas = list(pairs), list(gammas)
    verify = {
        t: measure_verify_cost(models[t], gammas, input_ids=ids)
        for t in dict.fromkeys(t for _, t in pairs)
    }
    return {
        pair_name(d, t): {
            "cost_ratio": measure_cost_ratio(models[t], models[d], input_ids=ids),
            "verify_cost": verify[t],
        }
        for d, t in pairs
    }


def adaptive_gamma(costs: Mapping[str, dict], gamma_min: int, gamma_max: int, window: int):
    """``make(draft, target)``: a fresh AdaptiveGamma priced with that pair's measured costs.

    It never falls back to plain steps: they test no draft token, and alpha is what is measured.
    """

    def make(draft: str, target: str) -> AdaptiveGamma:
        cost = costs[pair_name(draft, target)]
        return AdaptiveGamma(
            gamma_min,
            gamma_max,
            window,
            cost_ratio=cost["cost_ratio"],
            verify_cost=cost["verify_cost"],
            allow_plain=False,
        )

    return make


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
    adaptive: Adaptive | None = None,
    temperature: float = 1.0,
    temperature_schedule: bool = False,
    new_tokens: int | Mapping[str, int] = 32,
    max_prompts: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
    greedy: bool = False,
) -> Table:
    """{"draft@target": {scenario: {"alpha_tf", "alpha", "acceptance_rate", "tau", "gamma"}}}.

    ``pairs`` default to every combination; ``adaptive(draft, target)`` gives a fresh window per
    scenario and mode (None: fixed ``gamma``); ``max_prompts`` per scenario are decoded, prompt i
    with seed + i, while alpha_tf uses all of them; ``new_tokens`` per prompt, or per scenario
    ({scenario: n}); temperature 0 is greedy. ``greedy`` adds the
    greedy mode beside it: ``greedy_match`` (teacher-forced argmax agreement), ``alpha_greedy``
    (on-line) and ``tau_greedy`` (tokens per target call), decoded again unless temperature is 0.
    """
    pairs = list(pairs) if pairs is not None else [(d, t) for t in targets for d in drafts]
    modes = [temperature] + ([0.0] if greedy and temperature > 0 else [])
    table: Table = {}
    cells = [(d, t, scen) for d, t in pairs for scen in scenarios]
    # `zip` asks `decoded` for the next count as each prompt starts, counting the last one done.
    n_decode = len(modes) * sum(len(scenarios[scen][:max_prompts]) for _, _, scen in cells)
    decoded = iter(progress(range(n_decode), "acceptance: prompts decoded", unit="prompt"))
    for draft_name, target_name, scen in cells:
        target, draft = targets[target_name], drafts[draft_name]
        ids = torch.as_tensor(scenarios[scen], dtype=torch.long)  # (N, L)
        batches = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
        decode = [p[None].to(_device(target)) for p in ids[:max_prompts]]
        n_new = new_tokens[scen] if isinstance(new_tokens, Mapping) else new_tokens
        m: dict[str, float] = {}
        for t in modes:
            spec = speculative_decoder(
                target, draft, n_new, gamma=gamma, temperature=t,
                adaptive=adaptive(draft_name, target_name) if adaptive is not None else None,
                temperature_schedule=temperature_schedule,
            )  # fmt: skip
            got = _measure(target, draft, batches, spec, zip(decode, decoded), t, seed)
            if t == temperature:
                m |= got
            if greedy and t == 0:
                m |= {"greedy_match": got["alpha_tf"], "alpha_greedy": got["alpha"]}
                m["tau_greedy"] = got["tau"]
        table.setdefault(pair_name(draft_name, target_name), {})[scen] = m
        del target, draft, spec  # a ModelShelf frees them when the next pair loads
    for _ in decoded:  # the last prompt is done: progress' closing line
        pass
    return table


def _measure(target, draft, batches, spec, prompts, temperature: float, seed: int) -> dict:
    """One pair's metrics on one scenario in one decoding mode (``prompts``: (prompt, count))."""
    stats = decode_prompts(spec, (p for p, _ in prompts), seed)
    return {
        "alpha_tf": teacher_forced_acceptance(target, draft, batches, temperature),
        "alpha": stats.alpha_hat,
        "acceptance_rate": stats.acceptance_rate,
        "tau": stats.tau,
        "gamma": sum(stats.gammas) / max(len(stats.gammas), 1),
    }


def column(table: Table, pair: str, metric: str = "alpha") -> dict[str, float]:
    """{scenario: value} of one pair and metric, with "mean" over the scenarios appended."""
    values = {scen: m[metric] for scen, m in table[pair].items()}
    values["mean"] = sum(values.values()) / len(values)
    return values


def report_acceptance(table: Table, out_dir: Path) -> dict[str, dict[str, float]]:
    """``{pair: {scenario: alpha, "mean": ...}}``; logs alpha and tau, plots acceptance.png."""
    import matplotlib.pyplot as plt

    alpha = {pair: column(table, pair, "alpha") for pair in table}
    for pair, per in alpha.items():
        log.info("evaluate: α %-36s %s", pair, "  ".join(f"{s} {v:.3f}" for s, v in per.items()))
        tau = column(table, pair, "tau")["mean"]
        log.info("evaluate: τ %-36s %.2f tokens per target call", pair, tau)
        if all("greedy_match" in m for m in table[pair].values()):
            match, tau = (column(table, pair, k)["mean"] for k in ("greedy_match", "tau_greedy"))
            log.info("evaluate: greedy %-31s match %.3f, τ %.2f", pair, match, tau)
    fig = plot_acceptance(alpha, ylabel="on-line acceptance α", title="acceptance per scenario")
    fig.savefig(out_dir / "acceptance.png", dpi=120)
    plt.close(fig)  # pyplot keeps every open figure alive
    return alpha


def plot_acceptance(
    series: Mapping[str, Mapping[str, float]], *, ylabel: str = "acceptance", title: str = ""
):
    """Grouped bars, one group per scenario and one bar per series; returns the Figure."""
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
