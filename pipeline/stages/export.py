"""export: pack the quantized model for its runtime, with a manifest, into MLflow.

The model is distill's when distill ran, else quantize's; the draft (reinforce's, else the FP one)
goes into ``artifact/draft`` for speculative decoding. Formats a target cannot run are refused at
config time and again per layer; the artifact is registered as an MLflow pyfunc that generates.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Literal

from pipeline import runmodels
from pipeline.analysis.capture import ACT_COLUMNS_CAP
from pipeline.analysis.report import SensitivityReport
from pipeline.config import RunConfig, positive
from pipeline.errors import ConfigError, LowbitError
from pipeline.export import ExportError, ExportOptions, export_artifact
from pipeline.quant.formats import Format
from pipeline.stages import Stage, StageIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportConfig:
    """Pack the quantized model into <run_dir>/export/artifact/. Formats:
    lowbit: ascendv1 + 2/3-bit and exp4 tensors, for `lowbit-run` (any recipe)
    ascend: msModelSlim ascendv1 for MindIE (W4A16 g64/g128 or per channel, W8A16, W8A8_DYNAMIC,
      FLOAT; others refused, see widen)
    compressed-tensors: pack-quantized for vLLM on GPUs (int4 / int8 only)
    """

    format: Literal["ascend", "lowbit", "compressed-tensors"] = "lowbit"
    # ascend only: store 2/3-bit codes as int4 (exactly the same weights) instead of refusing them.
    widen: bool = False
    # Largest weight shard in bytes; above it, *-0000i-of-0000N.safetensors + index.json.
    shard_bytes: int = 2_000_000_000
    # Unquantized tensors (embeddings, norms, lm_head, float layers).
    float_dtype: Literal["float16", "bfloat16", "float32", "keep"] = "float16"
    # Tag symmetric per-channel int8 layers W8A8_DYNAMIC (activations quantized per token).
    w8a8_dynamic: bool = False
    include_draft: bool = True
    # Each stores the weights in MLflow's artifact store: the run's artifact/ and the model's own.
    log_artifact: bool = True
    register_model: bool = True
    # An artifact larger than this (bytes) is stored once: the model then reads the run's logged
    # artifact/ when it loads instead of holding a second copy (needs log_artifact).
    single_copy_bytes: int = 1_000_000_000
    model_name: str | None = None  # registered model name; null = "<name>-<format>" (smoke-lowbit)
    # Int8-activation runtimes (docs/kernels.md), from sensitivity's report: each layer's outlier
    # input channels, up to this share, stay float; a layer whose ||x̂ - x|| / ||x|| exceeds
    # act_threshold runs float activations (null: none). Measured: docs/results/act_quant.
    act_columns: float = 0.0
    act_threshold: float | None = None

    def check(self, prefix: str) -> None:
        positive(prefix, shard_bytes=self.shard_bytes, single_copy_bytes=self.single_copy_bytes)
        if not 0 <= self.act_columns <= ACT_COLUMNS_CAP:
            raise ConfigError(
                f"{prefix}.act_columns",
                f"is {self.act_columns}",
                f"a share of the inputs in [0, {ACT_COLUMNS_CAP}]",
            )
        if self.act_threshold is not None and not self.act_threshold > 0:
            raise ConfigError(
                f"{prefix}.act_threshold",
                f"is {self.act_threshold}",
                "a relative error > 0, or null (no layer falls back)",
            )

    def options(self, act: dict | None = None) -> ExportOptions:
        return ExportOptions(
            self.format, self.widen, self.shard_bytes, self.float_dtype, self.w8a8_dynamic, act
        )


def activation_plan(cfg: ExportConfig, inputs: dict) -> dict | None:
    """{layer: activation fields} from the sensitivity report, when there is one."""
    if "sensitivity" not in inputs or (not cfg.act_columns and cfg.act_threshold is None):
        return None
    report = SensitivityReport.load(inputs["sensitivity"])
    if not report.measured_activations():
        log.warning(
            "export: the sensitivity report predates activation statistics; "
            "rerun sensitivity for act_columns / act_threshold"
        )
    return report.activation_plan(cfg.act_columns, cfg.act_threshold) or None


def check_candidates(p: ExportConfig, formats: tuple[Format, ...]) -> None:
    """Refuse, at config time, quant.candidates the export format cannot hold."""
    from pipeline.artifact.lowbit_format import plan_layer
    from pipeline.export import compressed_tensors

    if p.format == "lowbit":
        return
    if p.format == "compressed-tensors":  # the library writes this format: fail before any stage
        try:
            compressed_tensors.library()
        except ExportError as e:
            raise ConfigError("stage.export.format", f"is 'compressed-tensors', but {e}") from None
    shape = (4096, 4096)  # a typical layer: only the format decides here
    groups = {}
    for i, fmt in enumerate(formats):
        if fmt.kind == "float":
            continue
        try:
            if p.format == "ascend":
                info = plan_layer(f"quant.candidates[{i}]", fmt, shape, "ascend", p.widen)
                if info.type == "W4A16" and info.group_size:
                    groups[info.group_size] = fmt.name
            else:
                compressed_tensors.plan_layer(f"quant.candidates[{i}]", fmt, shape)
        except ExportError as e:
            raise ConfigError("stage.export.format", f"is {p.format!r}, but {e}") from None
    if len(groups) > 1:
        raise ConfigError(
            "stage.export.format",
            f"is 'ascend', but quant.candidates {sorted(groups.values())} use different int4 "
            "group sizes and the ascendv1 description holds one group_size per model",
            "candidates with one int4 group size, or stage.export.format=lowbit",
        )


def check(cfg: ExportConfig, run: RunConfig) -> None:
    check_candidates(cfg, run.quant.formats)
    if run.quant.outliers != "none" and cfg.format != "lowbit":
        raise ConfigError(
            "stage.export.format",
            f"is {cfg.format!r} with quant.outliers={run.quant.outliers}: only the lowbit format "
            "holds kept fp16 outlier columns",
            "stage.export.format=lowbit, or quant.outliers=none",
        )


def run(cfg: ExportConfig, run: RunConfig, io: StageIO) -> dict:
    if not runmodels.quantized_targets(io.inputs):
        raise LowbitError("export found no quantized model: run the quantize stage first")
    src = runmodels.final_target(run.model, io.inputs)
    draft = runmodels.final_draft(run.model, io.inputs) if cfg.include_draft else None
    art = io.out_dir / "artifact"
    t0 = time.time()
    labels = {"source": io.describe(src)} | ({"draft": io.describe(draft)} if draft else {})
    act = activation_plan(cfg, io.inputs)
    manifest = export_artifact(src, art, cfg.options(act), draft, labels, device=io.device)
    seconds = time.time() - t0
    files = manifest["files"]
    draft_bytes = sum(f["bytes"] for k, f in files.items() if k.startswith("draft/"))
    summary = {
        "format": cfg.format,
        "source": labels["source"],
        "draft": labels.get("draft"),
        "artifact_bytes": sum(f["bytes"] for f in files.values()) - draft_bytes,
        "draft_bytes": draft_bytes,
        "weights_bytes": manifest["weights_bytes"],
        "fp16_bytes": manifest["fp16_bytes"],
        "layers": {n: d["type"] for n, d in manifest["layers"].items()},
    }
    (io.out_dir / "export.json").write_text(json.dumps(summary, indent=1))
    log.info(
        "export: %s artifact %.2f MB (weights %.2f MB vs %.2f MB in fp16) in %s",
        cfg.format,
        summary["artifact_bytes"] / 1e6,
        manifest["weights_bytes"] / 1e6,
        manifest["fp16_bytes"] / 1e6,
        art,
    )
    if cfg.log_artifact:
        io.log.log_artifact(art)
    if cfg.register_model and io.log.active:
        from pipeline.runtime.mlflow_model import log_model

        name = cfg.model_name or f"{run.name}-{cfg.format}"
        logged = art.name if cfg.log_artifact else None  # where log_artifact put it in the run
        log_model(io.log.uri, io.log.run_id, art, name,
                  logged_as=logged, single_copy_bytes=cfg.single_copy_bytes)  # fmt: skip
    return {
        "artifact_bytes": float(summary["artifact_bytes"]),
        "weights_bytes": float(manifest["weights_bytes"]),
        "fp16_bytes": float(manifest["fp16_bytes"]),
        "compression": manifest["fp16_bytes"] / max(manifest["weights_bytes"], 1),
        "quantized_layers": float(len(manifest["layers"])),
        "export_seconds": seconds,
    }


STAGE = Stage(
    config=ExportConfig,
    run=run,
    needs=("quantize",),
    uses=("bootstrap", "sensitivity", "distill", "reinforce"),
    # model: the draft; quant: the formats checked against `format`; name: the model's default name
    sections=("name", "model", "quant.candidates", "quant.outliers"),
    check=check,
)
