"""Write an artifact directory: ascendv1 / lowbit layouts (here) or compressed-tensors.

The whole model is planned first (every quantized linear's stored type is decided from the
safetensors headers), so an unsupported layer fails before a byte is written and the error
lists every offending layer. Then tensors stream from the source into shards, the config and
tokenizer files are copied (``quantization_config`` dropped), the description JSON and
manifest.json are written last. The stage writes into its temp folder, which the workflow
renames into place, so a half-written artifact is never visible.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline.export import ascend
from pipeline.export.lowbit_format import LayerInfo, pack_linear, plan_layer
from pipeline.export.manifest import ShardWriter, write_manifest
from pipeline.export.source import Linear, Source
from pipeline.quant.formats import parse_format

log = logging.getLogger("lowbit")
FORMATS = ("ascend", "lowbit", "compressed-tensors")
DESCRIPTION = "quant_model_description.json"
WEIGHTS_STEM = "quant_model_weights"
FLOAT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SKIP = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_SKIP_NAMES = {"lowbit_quant.json", "quant_model_description.json", "manifest.json"}


@dataclass(frozen=True)
class ExportOptions:
    """How to pack (the stage's config, minus MLflow).

    Attributes:
        format: "ascend", "lowbit" or "compressed-tensors".
        widen: ascend only: store 2/3-bit codes as int4 instead of refusing them.
        shard_bytes: Largest weight shard.
        float_dtype: dtype of unquantized tensors ("float16", "bfloat16", "float32", "keep").
        w8a8_dynamic: Tag symmetric per-channel int8 layers W8A8_DYNAMIC.
    """

    format: str = "lowbit"
    widen: bool = False
    shard_bytes: int = 2_000_000_000
    float_dtype: str = "float16"
    w8a8_dynamic: bool = False


def plan(source: Source, opts: ExportOptions) -> dict[str, LayerInfo]:
    """Stored type of every quantized linear; one ExportError listing every refused layer."""
    infos, errors = {}, []
    for name, fmt_name in source.layers.items():
        fmt = parse_format(fmt_name)
        if fmt.kind == "float":
            continue  # a float fallback layer: stored as a FLOAT weight
        try:
            shape = source.shape(f"{name}.codes")
            infos[name] = plan_layer(name, fmt, shape, opts.format, opts.widen, opts.w8a8_dynamic)
        except ascend.ExportError as e:
            errors.append(str(e))
    if errors:
        more = f" ({len(errors) - 1} more layers likewise)" if len(errors) > 1 else ""
        raise ascend.ExportError(errors[0] + more)
    if opts.format == "ascend":
        groups = {i.group_size for i in infos.values() if i.group_size}
        if len(groups) > 1:
            raise ascend.ExportError(
                f"layers use group sizes {sorted(groups)}, but the ascendv1 description holds "
                "one group_size per model: quantize with one group size, or export with "
                "stage.export.format=lowbit"
            )
        types = {i.type for i in infos.values()}
        if len(types) > 1:
            log.warning(
                "export: types %s in one model; MindIE runs one quantized type per "
                "model (plus FLOAT), lowbit-run runs them all",
                sorted(types),
            )
    return infos


def cast_float(t: torch.Tensor, float_dtype: str) -> torch.Tensor:
    if float_dtype == "keep" or not t.is_floating_point():
        return t
    return t.to(FLOAT_DTYPES[float_dtype])


def copy_model_files(src: Path, dst: Path, float_dtype: str) -> dict:
    """Copy config, tokenizer and template files (not weights); returns the written config."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(_SKIP) and p.name not in _SKIP_NAMES:
            shutil.copy2(p, dst / p.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if float_dtype != "keep":
        key = "torch_dtype" if "torch_dtype" in config else "dtype"
        config[key] = float_dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return config


def write_ascendv1(source: Source, out: Path, opts: ExportOptions) -> dict:
    """Write the ascendv1 / lowbit layout of ``source`` into ``out``; returns manifest info."""
    infos = plan(source, opts)
    config = copy_model_files(source.path, out, opts.float_dtype)
    writer = ShardWriter(out, WEIGHTS_STEM, opts.shard_bytes)
    types: dict[str, str] = {}
    fp16_bytes = 0

    def add(name: str, t: torch.Tensor, typ: str) -> None:
        writer.add(name, t)
        types[name] = typ

    for item in source.items():
        if isinstance(item, Linear):
            fp16_bytes += 2 * item.qt.shape[0] * item.qt.shape[1]
            info = infos.get(item.name)
            if info is None:  # `float` format: its fp16 weight
                add(
                    f"{item.name}.weight",
                    cast_float(item.qt.dequantize(torch.float16), opts.float_dtype),
                    "FLOAT",
                )
            else:
                for local, t in pack_linear(item.qt, info).items():
                    add(f"{item.name}.{local}", t, info.type)
            if item.bias is not None:
                fp16_bytes += 2 * item.bias.numel()
                add(f"{item.name}.bias", cast_float(item.bias, opts.float_dtype), "FLOAT")
        else:
            name, t = item
            fp16_bytes += 2 * t.numel() if t.is_floating_point() else t.numel() * t.element_size()
            add(name, cast_float(t, opts.float_dtype), "FLOAT")
    weight_map = writer.close()
    desc = ascend.description(types, {n: i.group_size for n, i in infos.items()})
    (out / DESCRIPTION).write_text(json.dumps(desc, indent=1))
    return {
        "format": opts.format,
        "model_type": config.get("model_type"),
        "description": DESCRIPTION,
        "weights_bytes": writer.total_bytes,
        "fp16_bytes": fp16_bytes,
        "layers": {n: i.to_json() for n, i in infos.items()},
        "tensors": {
            n: {**writer.tensors[n], "type": types[n], "file": weight_map[n]} for n in types
        },
    }


def export_artifact(
    src: Path | str,
    out: Path | str,
    opts: ExportOptions,
    draft: Path | str | None = None,
    labels: dict[str, str] | None = None,
) -> dict:
    """Export the model directory ``src`` (quantized or FP) to the artifact directory ``out``.

    Args:
        src: A quantized model directory (lowbit_quant.json) or an FP HF checkpoint.
        out: The artifact directory to create (must not exist or be empty).
        opts: Format and packing options.
        draft: Optional draft model directory (FP or quantized), exported into ``out/draft``
            so that ``lowbit-run`` can decode speculatively.
        labels: How the manifest names ``src`` and ``draft`` (keys "source", "draft"), e.g.
            paths relative to a run dir, so the artifact does not depend on where that lives;
            the resolved paths by default.

    Returns:
        The manifest written to ``out/manifest.json``.
    """
    from pipeline.export.compressed_tensors import write_compressed_tensors

    if opts.format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {opts.format!r}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; export into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    source = Source.open(src)
    draft_info = None
    if draft is not None:  # first: it is small, and a refusal then costs little
        # Exported as it is (FP: FLOAT tensors). It serves lowbit-run only, so the ascend
        # target writes it in the lowbit layout, which also holds a 2/3-bit or exp4 draft.
        d_opts = replace(opts, format="lowbit" if opts.format == "ascend" else opts.format)
        try:
            d_labels = {"source": labels["draft"]} if labels and "draft" in labels else None
            d_manifest = export_artifact(draft, out / "draft", d_opts, labels=d_labels)
        except ascend.ExportError as e:
            raise ascend.ExportError(
                f"the draft {draft}: {e} (or leave the draft out: stage.export.include_draft=false)"
            ) from None
        draft_info = {"path": "draft", "source": d_manifest["source"]}
    writer = write_compressed_tensors if opts.format == "compressed-tensors" else write_ascendv1
    info = writer(source, out, opts)
    label = (labels or {}).get("source") or str(Path(src).resolve())
    info["source"] = {"path": label, "method": source.method}
    info["draft"] = draft_info
    return write_manifest(out, info)
