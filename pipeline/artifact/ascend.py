"""msModelSlim "ascendv1" tensors (W8A16 / W4A16 / W8A8_DYNAMIC), as MindIE loads them.

Layout and rules: docs/export.md (``format=ascend``); QTensor maps onto it exactly (``signed()``).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from pipeline.errors import LowbitError
from pipeline.quant.formats import Format
from pipeline.quant.packing import pack_int4_ascend, unpack_int4_ascend

ASCEND_TYPES = ("W4A16", "W8A16", "W8A8_DYNAMIC")
W4A16_GROUPS = (64, 128)  # what MindIE's W4A16 kernels (FRACTAL_NZ int4) accept, or per channel
# model_quant_type is "the highest type present": weight bits first, then activation quantization.
TYPE_RANK = ("FLOAT", "W2A16", "W3A16", "W4A16_EXP", "W4A16", "W8A16", "W8A8_DYNAMIC")
DESCRIPTION_VERSION = "1.0.0"  # MindIE reads int4 as packed only from version 1.0.0 on


class ExportError(LowbitError):
    """A model that cannot be exported in the requested format; the message names the fix."""


def effective_group(fmt: Format, k: int) -> int:
    """Group size as stored: 0 (per output channel) when one group spans the whole row."""
    return fmt.group_size if 0 < fmt.group_size < k else 0


def ascend_type(
    name: str, fmt: Format, shape: tuple[int, int], widen: bool, w8a8_dynamic: bool
) -> str:
    """The Ascend type of a quantized linear ``(n_out, k_in)``, or ExportError naming the fix."""
    n, k = shape
    if fmt.kind == "exp":
        raise ExportError(
            f"{name} is {fmt.name}: exponential codes have no Ascend kernel and cannot be widened "
            "to int4 exactly. Export with stage.export.format=lowbit (lowbit-run decodes them "
            "through their lookup table), or quantize with an int recipe such as quant=w4g128."
        )
    bits = fmt.bits
    if bits in (2, 3):
        if not widen:
            raise ExportError(
                f"{name} is {fmt.name}: Ascend runs 4- and 8-bit weights only. Export with "
                "stage.export.format=lowbit for lowbit-run, or set stage.export.widen=true to "
                "store the codes as int4 (same weights, 4 bits of storage)."
            )
        bits = 4
    group = effective_group(fmt, k)
    if bits == 8:
        if w8a8_dynamic and fmt.symmetric and group == 0:
            return "W8A8_DYNAMIC"
        return "W8A16"
    if group and group not in W4A16_GROUPS:
        raise ExportError(
            f"{name} is {fmt.name}: W4A16 runs group sizes {W4A16_GROUPS} or one scale per "
            "channel. Quantize with int4g128 / int4g64, or export with stage.export.format=lowbit."
        )
    check_int4_shape(name, shape, group)
    return "W4A16"


def check_int4_shape(name: str, shape: tuple[int, int], group: int) -> None:
    n, k = shape
    if (n if group else k) % 2:
        dim = "output" if group else "input"
        raise ExportError(
            f"{name} has shape {shape}: packing int4 pairs along its {dim} dim "
            "needs an even size; keep this layer in float (quant.keep_float)"
        )


def pack_int(q: Tensor, scale: Tensor, offset: Tensor, bits: int, group: int) -> dict[str, Tensor]:
    """Ascend tensors of one int linear: (n, k) signed codes, (n, n_groups) scales/offsets."""
    if bits == 4:
        weight = pack_int4_ascend(q, per_group=group > 0)  # (n/2, k) or (n, k/2)
    elif bits == 8:
        weight = q.to(torch.int8)
    else:
        raise ValueError(f"Ascend int layouts hold 4 or 8 bits, got {bits}")
    return {
        "weight": weight.contiguous(),
        "weight_scale": scale.float().contiguous(),
        "weight_offset": offset.float().contiguous(),
    }


def unpack_int(tensors: dict[str, Tensor], bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``pack_int``: ``(q int8 [n, k], scale f32, offset f32)``."""
    w = tensors["weight"]
    q = unpack_int4_ascend(w, per_group=group > 0) if bits == 4 else w.to(torch.int8)
    return q, tensors["weight_scale"].float(), tensors["weight_offset"].float()


def model_quant_type(types: set[str]) -> str:
    """The highest type present (FLOAT when nothing is quantized)."""
    return max(types | {"FLOAT"}, key=TYPE_RANK.index)


def description(tensor_types: dict[str, str], layer_groups: dict[str, int]) -> dict:
    """quant_model_description.json: tensor -> type, plus the global keys.

    ``group_size`` is the most common size; lowbit-run reads each layer's from manifest.json."""
    groups = Counter(g for g in layer_groups.values() if g)
    desc = {
        "model_quant_type": model_quant_type(set(tensor_types.values())),
        "version": DESCRIPTION_VERSION,
        "group_size": groups.most_common(1)[0][0] if groups else 0,
        "metadata": {},
    }
    desc.update(tensor_types)
    return desc
