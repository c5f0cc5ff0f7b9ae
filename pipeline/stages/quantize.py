"""quantize: segment-wise streaming quantization (GPTQ or RTN) into the quantized model format.

Wires the config to :func:`pipeline.streaming.quantize_checkpoint` (see there for the
algorithm, memory and resume behaviour): the calibration windows come from the train split,
the per-layer formats from the allocate stage's ``bitplan.json`` when it ran, else the uniform
recipe ``quant.candidates[0]``; with ``quant.outliers=keep_fp16`` the bit plan's
``outlier_columns`` are stored exactly in fp16 beside the codes. Writes ``model/``
(pipeline.models.quantized format) and ``quant_report.json``; finished segments wait in
``io.work_dir`` so a killed run resumes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pipeline.config import RunConfig, positive
from pipeline.errors import LowbitError
from pipeline.hardware import warn_if_emulated
from pipeline.models.adapters import linear_names
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.quant.formats import parse_format
from pipeline.runmodels import fp_target
from pipeline.stages import StageIO
from pipeline.streaming import StreamOptions, quant_options, quantize_checkpoint

NEEDS: tuple[str, ...] = ("bootstrap",)  # the FP target (skipped when model.target.path is set)
USES: tuple[str, ...] = ("allocate",)  # bitplan.json when allocate ran, else the uniform recipe
SECTIONS: tuple[str, ...] = ("model", "data", "quant")
DISTRIBUTED = True  # calibration windows split over ranks, Hessians all-reduced

log = logging.getLogger(__name__)
_RUN_FACTS = ("seconds", "resumed_segments")  # vary from run to run with the same result
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class QuantizeConfig:
    """Segment-wise streaming quantization; the method, formats, segment size, activation budget
    and calibration set are in the shared `quant` section (pipeline.config.QuantConfig)."""

    # Compute dtype of the calibration forward passes.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    batch_size: int = 8  # calibration windows per forward pass through a block

    def check(self, prefix: str) -> None:
        positive(prefix, batch_size=self.batch_size)


CONFIG = QuantizeConfig


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


def load_kept(inputs: dict[str, Path], outliers: str) -> dict[str, list[int]]:
    """``{linear: kept input columns}`` of the bit plan (empty with ``quant.outliers=none``)."""
    if outliers == "none":
        return {}
    if "allocate" not in inputs:
        raise LowbitError(
            f"quant.outliers={outliers} keeps the columns the allocate stage chose, but this run "
            "has no allocate stage: add sensitivity and allocate to stages, or set "
            "quant.outliers=none"
        )
    plan = json.loads((inputs["allocate"] / "bitplan.json").read_text())
    if "outlier_columns" not in plan:
        raise LowbitError(
            f"{inputs['allocate'] / 'bitplan.json'} has no outlier_columns: rerun allocate "
            f"with quant.outliers={outliers}"
        )
    return plan["outlier_columns"]


def _device(choice: str, local_rank: int) -> str:
    if choice == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    return choice


def run(cfg: QuantizeConfig, run: RunConfig, io: StageIO) -> dict:
    """Quantize the FP target into ``io.out_dir/model``; returns the stage metrics."""
    from transformers import AutoConfig

    from pipeline.data.text import Corpus
    from pipeline.models.hf import load_tokenizer

    q = run.quant
    target = fp_target(run.model, io.inputs)
    corpus = Corpus(run.data, load_tokenizer(target))
    calib = corpus.calibration(q.calib.samples, q.calib.seq_len, run.seed)  # (N, T)
    plan = load_plan(
        io.inputs,
        AutoConfig.from_pretrained(target, local_files_only=True),
        q.candidates,
        q.keep_float,
    )
    device = _device(cfg.device, io.dist.local_rank)
    warn_if_emulated(_DTYPES[cfg.dtype], torch.device(device).type, "stage.quantize.dtype")
    ckpt = StreamingCheckpoint(target, dtype=_DTYPES[cfg.dtype], device=device)
    walk = StreamOptions(q.segment_size, cfg.batch_size, q.activation_budget_gb)
    report = quantize_checkpoint(
        ckpt, io.out_dir / "model", plan, calib, quant_options(q), walk,
        work_dir=io.work_dir, dist=io.dist, keep=load_kept(io.inputs, q.outliers),
    )  # fmt: skip
    if io.dist.is_main:
        # The file holds only what the weights determine, so a resumed or forced rerun leaves its
        # digest, and every reader's fingerprint, unchanged; times go to metrics and MLflow.
        stored = {k: v for k, v in report.items() if k not in _RUN_FACTS}
        stored["layers"] = {
            n: {k: v for k, v in r.items() if k != "seconds"} for n, r in report["layers"].items()
        }
        (io.out_dir / "quant_report.json").write_text(json.dumps(stored, indent=1))
        seconds = {n: r["seconds"] for n, r in report["layers"].items()}
        io.log.log_dict(seconds, "layer_seconds.json")
    return {k: v for k, v in report.items() if isinstance(v, int | float)}
