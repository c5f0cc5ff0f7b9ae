"""EvalResult: what the evaluate stage measured, the one reader and writer of its ``eval.json``."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from pipeline import handoff
from pipeline.evaluation.acceptance import column
from pipeline.evaluation.harness import lm_eval_metrics

SCHEMA_VERSION = 2  # 2 adds speed_table; files without a version are version 1
FILENAME = "eval.json"
SCHEMA = "lowbit.eval"
# The greedy mode's metrics per pair and scenario (acceptance_table's `greedy`).
GREEDY = ("greedy_match", "alpha_greedy", "tau_greedy")


@dataclass(frozen=True)
class EvalResult(handoff.HandOff):
    """Every measurement of one run; pairs are keyed "draft@target", unmeasured fields empty."""

    FILENAME: ClassVar[str] = FILENAME
    SCHEMA: ClassVar[str] = SCHEMA
    VERSION: ClassVar[int] = SCHEMA_VERSION
    WRITER: ClassVar[str] = "evaluate"

    ppl: dict[str, float]
    ppl_protocol: dict[str, int | str] | None = None  # split, window, windows, tokens scored
    acceptance: dict[str, dict[str, float]] = field(default_factory=dict)  # on-line alpha
    # pair -> scenario -> metric: at `temperature`, and greedy (GREEDY) beside it
    speculative: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    temperature: float | None = None  # of acceptance and speed (0: greedy); None: not recorded
    costs: dict[str, dict] | None = None  # {"cost_ratio": c, "verify_cost": {gamma: v}}
    error_flow: dict[str, list[float]] = field(default_factory=dict)  # error after each layer
    lm_eval: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    speed: dict | None = None  # pipeline.runtime.speed.decode_speed's result
    speed_table: dict | None = None  # pipeline.evaluation.speed.speed_table's: the design's rows

    def has_greedy(self, pair: str) -> bool:
        """Whether every scenario of `pair` has the greedy mode's metrics (older files: none)."""
        cells = self.speculative.get(pair, {}).values()
        return bool(cells) and all(set(GREEDY) <= set(c) for c in cells)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> EvalResult:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        kwargs["ppl"] = raw["ppl"]
        for cost in (kwargs.get("costs") or {}).values():  # JSON keys are strings; gamma is int
            cost["verify_cost"] = {int(g): v for g, v in cost["verify_cost"].items()}
        return cls(**kwargs)

    def metrics(self) -> dict[str, float]:
        """Flat scalars for the tracker: ppl, last-layer drift, lm-eval, alpha, tau, speed."""
        out = {f"ppl_{k}": v for k, v in self.ppl.items()}
        out.update({f"error_flow_last_{k}": v[-1] for k, v in self.error_flow.items()})
        out.update(lm_eval_metrics(self.lm_eval))
        for pair, per in self.acceptance.items():
            key = pair.replace("@", "-vs-")
            out.update({f"alpha_{key}_{s}": v for s, v in per.items()})
            out[f"tau_{key}_mean"] = column(self.speculative, pair, "tau")["mean"]
            for metric in GREEDY if self.has_greedy(pair) else ():
                values = column(self.speculative, pair, metric)
                shown = values if metric == "greedy_match" else {"mean": values["mean"]}
                out.update({f"{metric}_{key}_{s}": v for s, v in shown.items()})
        speed = self.speed or {"plain": {}, "speculative": {}}
        out.update({f"tok_s_{k}": v["tokens_per_s"] for k, v in speed["plain"].items()})
        for pair, v in speed["speculative"].items():
            out[f"speedup_{pair.replace('@', '-vs-')}"] = v["speedup"]
        for row in (self.speed_table or {}).get("rows", []):
            key = re.sub(r"[^0-9A-Za-z_-]+", "_", row["row"]).strip("_")
            out[f"ms_per_token_{key}"] = row["ms_per_token"]
            out[f"x_fp_plain_{key}"] = row["x_fp_plain"]
        return out
