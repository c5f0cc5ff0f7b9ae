"""What a distill run reports: validation numbers of the input, the best check and the result."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from pathlib import Path

from pipeline.data.heldout import Heldout, heldout
from pipeline.data.text import Corpus
from pipeline.lit.fit import Fit

log = logging.getLogger(__name__)


def validation_windows(corpus: Corpus, seq_len: int, n_windows: int) -> Heldout:
    """`n_windows` fixed windows spread evenly over the validation split (never test)."""
    val = heldout(corpus.stream("validation"), "validation", seq_len, limit=n_windows)
    if val.windows.shape[0] < n_windows:
        log.warning(
            "distill: the validation split holds only %d windows of %d tokens (val_windows=%d)",
            val.windows.shape[0],
            seq_len,
            n_windows,
        )
    return val


def ppl(nll: float) -> float:
    return math.exp(min(nll, 50.0))


def metrics(fit: Fit, val: Heldout) -> dict[str, float]:
    """Validation-split numbers of the input, the best check and what was written, then the
    last training losses and the guard's count."""
    before, best, kept = fit.before, fit.chosen, fit.kept
    out = before if kept else best
    m: dict[str, float] = {}
    if before is not None:
        m.update(val_ppl_fp=ppl(before["nll_teacher"]), val_ppl_quantized=ppl(before["nll"]))
    m.update(val_ppl_distilled=ppl(out["nll"]), kept_input=float(kept))
    m.update(fit.margin.metrics() if fit.margin else {})  # the keep decision's NLL gain
    if before is not None and m["val_ppl_quantized"] > m["val_ppl_fp"]:
        gap = m["val_ppl_quantized"] - m["val_ppl_fp"]
        m["gap_recovered"] = (m["val_ppl_quantized"] - m["val_ppl_distilled"]) / gap
    if before is not None:
        m["val_kl_quantized"] = before["kl"]
    m.update(
        val_kl_distilled=out["kl"],
        val_ppl_best=ppl(best["nll"]),
        best_step=best["step"],
        val_window=val.window,
        val_windows=int(val.windows.shape[0]),
        val_tokens=val.tokens,
    )
    logged = {k: float(v) for k, v in fit.trainer.callback_metrics.items() if k.startswith("loss/")}
    m.update({f"final_{k.replace('/', '_')}": v for k, v in logged.items() if math.isfinite(v)})
    m.update(
        steps=fit.trainer.global_step,
        nan_skipped=float(fit.nan_skipped),
        lr_scale=fit.guard_lr_scale,
    )
    return m


def report(cfg, fit: Fit, val: Heldout, m: dict, weights, world_size: int) -> dict:
    """distill_report.json: nothing in it differs between a resumed and an uninterrupted run."""
    return {
        "config": asdict(cfg),
        "metrics": m,
        "kept_input": fit.kept,
        "validation": {
            **val.describe(),
            "metric": "student mean next-token NLL (val/nll; ppl = exp), lower is better",
            **fit.validation(),
        },
        "layer_weights": weights.tolist(),
        "strategy": type(fit.trainer.strategy).__name__,
        "world_size": world_size,
    }


def plot_layer_weights(history: list[dict], path: Path) -> None:
    """Layers × reweighting steps (at most ~12 columns, the last one always)."""
    from pipeline import plots

    shown = history[:: math.ceil(len(history) / 12)]
    shown += history[-1:] if shown[-1] is not history[-1] else []
    plots.heatmap(
        [list(ws) for ws in zip(*(h["weights"] for h in shown))],
        [f"layer {i}" for i in range(len(history[0]["weights"]))],
        [f"step {h['step']}" for h in shown],
        path,
        "distill: layer weights of the matching term",
        "w_l",
        log10=False,
    )
