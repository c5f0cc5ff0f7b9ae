"""A run's quantized model as the runtime executes it, without writing an artifact.

Every quantized linear goes through the export's own packing (``plan_layer`` -> ``pack_linear``
-> ``unpack_linear``) and becomes the torch backend's layer, so timings run on the bytes an
export would write, with the kernels ``load`` picks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.artifact.lowbit_format import LinearCodes, pack_linear, plan_layer, unpack_linear
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.quant.qtensor import QTensor
from pipeline.runtime import float_rows
from pipeline.runtime.backends import TorchQuantLinear


def linear_codes(name: str, qt: QTensor, act: Mapping[str, Any] | None = None) -> LinearCodes:
    """The runtime's unpacked codes of one quantized weight, as a lowbit export stores them;
    ``act``: its activation fields (``SensitivityReport.activation_plan``)."""
    info = replace(plan_layer(name, qt.fmt, qt.shape, "lowbit"), **(act or {}))
    return unpack_linear(pack_linear(qt, info), info)


def runtime_linear(
    name: str,
    qt: QTensor,
    bias: Tensor | None = None,
    kernel: str = "auto",
    device="cpu",
    act: Mapping[str, Any] | None = None,
) -> TorchQuantLinear:
    """One quantized weight as the torch backend's layer (``kernel``: see ``load``)."""
    codes = linear_codes(name, qt, act)
    return TorchQuantLinear(codes, bias, kernel=kernel, device=device, name=name)


@torch.no_grad()
def to_runtime(
    model: nn.Module,
    kernel: str = "auto",
    *,
    copy_model: bool = True,
    act: Mapping[str, Mapping[str, Any]] | None = None,
) -> nn.Module:
    """``model`` (a deep copy unless ``copy_model`` is False) in eval mode, every quantized
    FakeQuantLinear replaced by the runtime's layer (``kernel`` as in ``pipeline.runtime.load``);
    ``act``: {layer: activation fields}, as an export with a sensitivity report writes them.
    """
    out = copy.deepcopy(model) if copy_model else model
    device = next(out.parameters()).device
    for name, mod in list(out.named_modules()):
        if isinstance(mod, FakeQuantLinear) and mod.fmt.kind != "float":
            fields = (act or {}).get(name)
            layer = runtime_linear(name, mod.to_qtensor(), mod.bias, kernel, device, fields)
            out.set_submodule(name, layer)
    if kernel == "auto":
        float_rows.convert(out)
    return out.eval()
