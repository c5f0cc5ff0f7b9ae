"""quantize: segment-wise streaming quantization (GPTQ or RTN) into the quantized model format.

Wires the config to :func:`pipeline.quant.streaming.quantize_checkpoint` (see there for the
algorithm, memory and resume behaviour): the calibration windows come from the train split,
the per-layer formats from the allocate stage's ``bitplan.json`` when it ran, else the uniform
recipe ``quant.candidates[0]``. Writes ``model/`` (pipeline.models.quantized format) and
``quant_report.json``; finished segments wait in ``ctx.work_dir`` so a killed run resumes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pipeline.config import data_cfg, model_cfg, parse, positive, quant_cfg
from pipeline.errors import LowbitError
from pipeline.models.adapters import linear_names
from pipeline.quant.formats import parse_format
from pipeline.quant.sequential import QuantOptions
from pipeline.quant.streaming import quantize_checkpoint

NEEDS: tuple[str, ...] = ("bootstrap",)  # the FP target (skipped when model.target.path is set)
USES: tuple[str, ...] = ("allocate",)  # bitplan.json when allocate ran, else the uniform recipe
KEYS = ("model", "data", "quant")
DISTRIBUTED = True  # calibration windows split over ranks, Hessians all-reduced

log = logging.getLogger("lowbit")
_RUN_FACTS = ("seconds", "resumed_segments")  # vary from run to run with the same result
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class QuantizeConfig:
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    batch_size: int = 8

    def check(self, prefix: str) -> None:
        positive(prefix, batch_size=self.batch_size)


def validate(cfg) -> None:
    parse(cfg.stage.quantize, QuantizeConfig, "stage.quantize")
    model_cfg(cfg)
    data_cfg(cfg)
    quant_cfg(cfg)


def load_plan(
    inputs: dict[str, Path], config: Any, candidates: list[str], keep_float: list[str]
) -> dict[str, str]:
    """``{linear: format}``: the allocate stage's bitplan, else candidates[0] everywhere.

    In the uniform recipe, linears matching ``keep_float`` (a full name or a final name part,
    e.g. ``lm_head``) stay float. ``float`` entries are dropped (float means not quantized).
    """
    if "allocate" in inputs:
        path = inputs["allocate"] / "bitplan.json"
        try:
            layers = json.loads(path.read_text())["layers"]
        except (OSError, ValueError, KeyError) as err:
            raise LowbitError(f"cannot read the bit plan {path} ({err!r}); rerun allocate") from err
    else:
        if len(candidates) > 1:
            log.warning(
                "quantize: no allocate stage in this run; every linear gets %s "
                "(quant.candidates[0])",
                candidates[0],
            )
        kept = tuple(keep_float)
        layers = {
            n: candidates[0]
            for n in linear_names(config)
            if not any(n == k or n.endswith("." + k) for k in kept)
        }
    return {n: f for n, f in layers.items() if parse_format(f).kind != "float"}


def run(ctx) -> dict:
    p = parse(ctx.params, QuantizeConfig, "stage.quantize")
    q = quant_cfg(ctx.cfg)
    from pipeline.data.text import Corpus
    from pipeline.models.hf import load_tokenizer

    target = ctx.target_dir()
    corpus = Corpus(data_cfg(ctx.cfg), load_tokenizer(target))
    calib = corpus.calibration(q.calib.samples, q.calib.seq_len, ctx.cfg.seed)  # (N, T)
    from transformers import AutoConfig

    plan = load_plan(ctx.inputs, AutoConfig.from_pretrained(target), q.candidates, q.keep_float)
    device = p.device
    if device == "auto":
        device = f"cuda:{ctx.dist.local_rank}" if torch.cuda.is_available() else "cpu"
    report = quantize_checkpoint(
        target, ctx.out_dir / "model", plan, calib, method=q.method,
        segment_size=q.segment_size, work_dir=ctx.work_dir, dist=ctx.dist,
        act_budget_gb=q.activation_budget_gb, batch_size=p.batch_size, dtype=_DTYPES[p.dtype],
        device=device, opts=QuantOptions(q.method, q.block_size, q.damp, q.act_order),
    )  # fmt: skip
    if ctx.dist.is_main:
        # The file holds only what the weights determine, so a resumed or forced rerun leaves its
        # digest, and every reader's fingerprint, unchanged; times go to metrics and MLflow.
        stored = {k: v for k, v in report.items() if k not in _RUN_FACTS}
        stored["layers"] = {
            n: {k: v for k, v in r.items() if k != "seconds"} for n, r in report["layers"].items()
        }
        (ctx.out_dir / "quant_report.json").write_text(json.dumps(stored, indent=1))
        ctx.log.log_dict(
            {n: r["seconds"] for n, r in report["layers"].items()}, "layer_seconds.json"
        )
    return {k: v for k, v in report.items() if isinstance(v, int | float)}


__all__ = ["QuantizeConfig", "load_plan", "quantize_checkpoint", "run", "validate"]
