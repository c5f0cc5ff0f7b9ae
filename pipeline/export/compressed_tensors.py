"""compressed-tensors "pack-quantized" checkpoints (vLLM's W4A16 / W8A16 on GPUs).

Packing and ``quantization_config`` come from the compressed-tensors library itself (the
``[compressed-tensors]`` extra, imported only here), so the files follow its format; the
layout is in docs/export.md. Every unquantized 2-D weight's module goes in ``ignore``, since
vLLM refuses linear layers that match no config group.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from pipeline.artifact.ascend import ExportError, effective_group
from pipeline.artifact.lowbit_format import LayerInfo, refuse_kept_columns
from pipeline.export.options import ExportOptions, cast_float, copy_model_files
from pipeline.export.source import Linear, Source
from pipeline.io import ShardWriter
from pipeline.quant.formats import Format

FORMAT = "pack-quantized"


def library() -> SimpleNamespace:
    """The compressed-tensors pieces this writer uses; one clear error when it is missing."""
    try:
        from compressed_tensors.compressors import ModelCompressor, pack_to_int32
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationConfig,
            QuantizationScheme,
        )
    except ImportError as e:
        raise ExportError(
            "stage.export.format=compressed-tensors needs the compressed-tensors library "
            f"({e}): pip install 'lowbit[compressed-tensors]'"
        ) from e
    return SimpleNamespace(
        ModelCompressor=ModelCompressor,
        pack_to_int32=pack_to_int32,
        QuantizationArgs=QuantizationArgs,
        QuantizationConfig=QuantizationConfig,
        QuantizationScheme=QuantizationScheme,
    )


def plan_layer(name: str, fmt: Format, shape: tuple[int, int]) -> LayerInfo:
    if fmt.kind != "int" or fmt.bits not in (4, 8):
        raise ExportError(
            f"{name} is {fmt.name}: compressed-tensors (vLLM) runs int4 and int8 weights only. "
            "Export with stage.export.format=lowbit, or quantize with quant=w4g128 / quant=w8."
        )
    n, k = shape
    group = effective_group(fmt, k)
    if group and k % group:
        raise ExportError(
            f"{name} has {k} inputs, not a multiple of its group size {group}: "
            "vLLM needs whole groups; quantize with a group size dividing it"
        )
    return LayerInfo(f"W{fmt.bits}A16", fmt.name, fmt.bits, group, (n, k), fmt.symmetric)


def scheme_key(info: LayerInfo) -> tuple:
    return info.bits, "group" if info.group_size else "channel", info.group_size, info.symmetric


def quantization_config(infos: dict[str, LayerInfo], ignore: list[str]):
    """The library's ``QuantizationConfig``: one scheme per distinct ``scheme_key``."""
    ct = library()
    groups: dict[tuple, list[str]] = {}
    for name, info in infos.items():
        groups.setdefault(scheme_key(info), []).append(name)
    config_groups = {
        f"group_{i}": ct.QuantizationScheme(
            targets=sorted(names),
            weights=ct.QuantizationArgs(
                num_bits=bits,
                type="int",
                symmetric=sym,
                strategy=strategy,
                group_size=group or None,
            ),
            format=FORMAT,
        )
        for i, ((bits, strategy, group, sym), names) in enumerate(sorted(groups.items()))
    }
    return ct.QuantizationConfig(
        config_groups=config_groups,
        format=FORMAT,
        quantization_status="compressed",
        ignore=sorted(ignore),
    )


def write_compressed_tensors(source: Source, out: Path, opts: ExportOptions) -> dict:
    """Write ``source`` as a pack-quantized HF checkpoint into ``out``; returns manifest info."""
    refuse_kept_columns(source.weight_map, source.layers, "compressed-tensors")
    infos, errors = {}, []
    for name, fmt in source.formats.items():
        if fmt.kind == "float":
            continue
        try:
            infos[name] = plan_layer(name, fmt, source.shape(f"{name}.codes"))
        except ExportError as e:
            errors.append(str(e))
    if errors:
        more = f" ({len(errors) - 1} more layers likewise)" if len(errors) > 1 else ""
        raise ExportError(errors[0] + more)
    # Checked before any file is written; an FP model (e.g. the draft) does not need it.
    ct = library() if infos else None
    config = copy_model_files(source.path, out, opts.float_dtype)
    writer = ShardWriter(out, "model", opts.shard_bytes)
    ignore, fp16_bytes = [], 0
    for item in source.items():
        if isinstance(item, Linear):
            fp16_bytes += 2 * item.qt.shape[0] * item.qt.shape[1]
            info = infos.get(item.name)
            if info is None:
                ignore.append(item.name)
                w = cast_float(item.qt.dequantize(torch.float16), opts.float_dtype)
                writer.add(f"{item.name}.weight", w)
            else:
                q, _, offset = item.qt.signed()  # q int8 [n, k]; offset float [n, k/G]
                writer.add(f"{item.name}.weight_packed", ct.pack_to_int32(q, info.bits))
                writer.add(f"{item.name}.weight_scale", item.qt.scales.half())
                writer.add(f"{item.name}.weight_shape", torch.tensor(info.shape))
                if not info.symmetric:
                    zp = ct.pack_to_int32(offset.to(torch.int8), info.bits, packed_dim=0)
                    writer.add(f"{item.name}.weight_zero_point", zp)
            if item.bias is not None:
                fp16_bytes += 2 * item.bias.numel()
                writer.add(f"{item.name}.bias", cast_float(item.bias, opts.float_dtype))
        else:
            name, t = item
            fp16_bytes += 2 * t.numel() if t.is_floating_point() else t.numel() * t.element_size()
            if name.endswith(".weight") and t.dim() == 2:
                ignore.append(name.removesuffix(".weight"))
            writer.add(name, cast_float(t, opts.float_dtype))
    weight_map = writer.close()
    if infos:  # an FP model (e.g. the draft) stays a plain HF checkpoint
        # The library writes its own config.json entry (version, quant_method, sparsity and
        # transform configs), as llm-compressor's save does; ``out`` is still a staging dir.
        qconfig = quantization_config(infos, ignore)
        ct.ModelCompressor(quantization_config=qconfig).update_config(str(out))
    return {
        "format": opts.format,
        "model_type": config.get("model_type"),
        "weights_bytes": writer.total_bytes,
        "fp16_bytes": fp16_bytes,
        "layers": {n: i.to_json() for n, i in infos.items()},
        "tensors": {n: {**m, "file": weight_map[n]} for n, m in writer.tensors.items()},
    }
