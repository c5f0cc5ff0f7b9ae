"""Write the ascendv1 family of layouts: ``ascend`` (what MindIE loads) and ``lowbit``.

Every layer's stored type is planned from the safetensors headers first, so an unsupported
layer fails before a byte is written, with every offending layer listed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.artifact import ascend
from pipeline.artifact.lowbit_format import (
    LayerInfo,
    pack_linear,
    plan_layer,
    refuse_kept_columns,
)
from pipeline.export.options import ExportOptions, cast_float, copy_model_files
from pipeline.export.source import Linear, Source
from pipeline.io import ShardWriter, write_json

log = logging.getLogger(__name__)
DESCRIPTION = "quant_model_description.json"
WEIGHTS_STEM = "quant_model_weights"


def plan(source: Source, opts: ExportOptions) -> dict[str, LayerInfo]:
    """Stored type of every quantized linear; one ExportError listing every refused layer."""
    if opts.format == "ascend":
        refuse_kept_columns(source.weight_map, source.layers, "ascend")
    infos, errors = {}, []
    for name, fmt in source.formats.items():
        if fmt.kind == "float":
            continue  # a float fallback layer: stored as a FLOAT weight
        try:
            shape = source.shape(f"{name}.codes")
            info = plan_layer(name, fmt, shape, opts.format, opts.widen, opts.w8a8_dynamic)
            infos[name] = replace(info, **opts.act.get(name, {})) if opts.act else info
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
    write_json(out / DESCRIPTION, desc, indent=1)
    if opts.format == "ascend" and desc["model_quant_type"] != "FLOAT":
        # MindIE routes on config.json `quantize` (msModelSlim's MindIE hook writes it), and its
        # transformers 4.x readers know `torch_dtype`, not transformers 5's `dtype`.
        config["quantize"] = desc["model_quant_type"].lower()
        if "torch_dtype" not in config and "dtype" in config:
            config["torch_dtype"] = config["dtype"]
        write_json(out / "config.json", config, indent=2)
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
