"""Decode speed of a run's models as the runtime runs them (low-bit targets on packed kernels).

Beside every model's and pair's row, the design's table for the run's own models: FP plain,
FP target + FP draft, the final low-bit target plain, and the final target with its final
(reinforced if trained) draft at adaptive gamma, each against FP plain.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from pipeline import plots
from pipeline.evaluation.acceptance import final_target
from pipeline.evaluation.shelf import ModelShelf
from pipeline.runtime.inmemory import to_runtime
from pipeline.runtime.speed import decode_speed, format_speed
from pipeline.speculative.stats import pair_name

log = logging.getLogger(__name__)

FP_TARGET, FP_DRAFT = "target_fp", "draft_fp"


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
    repeats: int = 3,
    allow_plain: bool = True,
    reference: str | None = None,
) -> dict:
    """Plain tok/s of every model and speculative tok/s of every pair, beside the theory.

    Converts ``models`` in place (a copy would double their memory): call it last.
    ``adaptive`` is (gamma_min, gamma_max, window), or None for the fixed ``gamma``.
    """
    if isinstance(models, ModelShelf):  # converted as each loads, not all at once
        runtime = models.mapped(lambda m: to_runtime(m, copy_model=False))
    else:
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
        repeats=repeats,
        allow_plain=allow_plain,
        reference=reference,
    )
    for line in format_speed(speed):
        log.info("evaluate: %s", line)
    return speed


def speed_report(
    models: Mapping[str, nn.Module],
    pairs: Sequence[tuple[str, str]],
    prompts: Sequence[list[int]],
    out_dir: Path,
    **settings,
) -> dict:
    """``runtime_speed``'s result and the design's table (logged, plotted as speed.png): the
    ``speed`` and ``speed_table`` fields of EvalResult. ``settings``: runtime_speed's keywords."""
    width = models[FP_TARGET].config.hidden_size
    final = final_target(models)
    final_draft = next((d for d in ("draft_reinforced", FP_DRAFT) if d in models), None)
    speed = runtime_speed(models, pairs, prompts, reference=FP_TARGET, **settings)
    table = speed_table(speed, final, final_draft, width)
    for line in format_speed_table(table):
        log.info("evaluate: %s", line)
    plot_speed_table(table, out_dir)
    return {"speed": speed, "speed_table": table}


def speed_table(speed: dict, final: str | None, final_draft: str | None, width: int) -> dict:
    """The design's rows present in ``speed`` (``decode_speed``'s result), each against FP plain
    from side-by-side passes: a pair's speed-up times its target's ``x_reference``.

    ``final``/``final_draft``: the run's last low-bit target and its draft; ``width``: the
    FP target's hidden size, for the overhead note.
    """
    plain, spec = speed["plain"], speed["speculative"]
    wanted = [("FP plain", FP_TARGET, None), ("FP + FP draft", FP_TARGET, FP_DRAFT)]
    if final:
        wanted += [(f"{final} plain", final, None)]
        wanted += [(f"{final} + {final_draft}", final, final_draft)] if final_draft else []
    base = plain[FP_TARGET]["tokens_per_s"]
    rows = []
    for label, target, draft in wanted:
        row = plain.get(target) if draft is None else spec.get(pair_name(draft, target))
        if row is None or target not in plain:
            continue
        x = plain[target].get("x_reference", plain[target]["tokens_per_s"] / max(base, 1e-9))
        rows.append({
            "row": label,
            **{k: row[k] for k in ("ms_per_token", "tokens_per_s", "tokens_per_s_min",
                                   "tokens_per_s_max", "weight_bytes", "kv_bytes")},
            "x_fp_plain": x if draft is None else x * row["speedup"],
            "alpha": None if draft is None else row["alpha"],
            "tau": 1.0 if draft is None else row["tau"],
            "gamma": 0.0 if draft is None else row["gamma"],
            "plain_share": 1.0 if draft is None else row["plain_share"],
        })  # fmt: skip
    return {"rows": rows, "width": width}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def format_speed_table(table: dict) -> list[str]:
    """Markdown lines of :func:`speed_table`'s result, closed by the overhead note."""
    out = [
        "| row | ms/token | tok/s (min–max) | × FP plain | weights MB | + KV MB | α | τ "
        "| γ (plain share) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["rows"]:
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:.3f}"
        gamma = "0" if r["plain_share"] == 1.0 else f"{r['gamma']:.1f} ({r['plain_share']:.0%})"
        out.append(
            f"| {r['row']} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} "
            f"({r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f}) | "
            f"{r['x_fp_plain']:.2f} | {_mb(r['weight_bytes'])} | {_mb(r['kv_bytes'])} | {alpha} "
            f"| {r['tau']:.2f} | {gamma} |"
        )
    out += [
        "",
        f"Models {table['width']} wide are overhead-bound: per-call kernel costs, not the bytes "
        "low-bit weights save, set their speed; `python -m bench.decode_speed` measures the "
        "crossover width from which W4g128 beats FP32.",
    ]
    return out


def plot_speed_table(table: dict, out_dir: Path) -> Path:
    """speed.png: each row's tokens/s as a multiple of FP plain's."""
    rows = table["rows"]
    return plots.bars(
        [r["x_fp_plain"] for r in rows],
        [r["row"] for r in rows],
        out_dir / "speed.png",
        "decode speed (batch 1, median of passes)",
        "× FP plain tokens/s",
        hline=1.0,
        hline_label="FP plain",
    )
