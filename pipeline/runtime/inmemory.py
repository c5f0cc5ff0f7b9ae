"""A run's quantized model as the runtime executes it, without writing an artifact.

Every quantized linear goes through the export's own packing (``plan_layer`` -> ``pack_linear``
-> ``unpack_linear``) and becomes the torch backend's layer, so timings run on the bytes an
export would write, with the kernels ``load`` picks.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from pipeline.artifact.lowbit_format import LinearCodes, pack_linear, plan_layer, unpack_linear
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.quant.qtensor import QTensor
from pipeline.runtime import float_rows
from pipeline.runtime.backends import TorchQuantLinear


def linear_codes(name: str, qt: QTensor) -> LinearCodes:
    """The runtime's unpacked codes of one quantized weight, as a lowbit export stores them."""
    info = plan_layer(name, qt.fmt, qt.shape, "lowbit")
    return unpack_linear(pack_linear(qt, info), info)


def runtime_linear(
    name: str, qt: QTensor, bias: Tensor | None = None, kernel: str = "auto", device="cpu"
) -> TorchQuantLinear:
    """One quantized weight as the torch backend's layer (``kernel``: see ``load``)."""
    return TorchQuantLinear(linear_codes(name, qt), bias, kernel=kernel, device=device, name=name)


@torch.no_grad()
def to_runtime(model: nn.Module, kernel: str = "auto", *, copy_model: bool = True) -> nn.Module:
    """``model`` (a deep copy unless ``copy_model`` is False) in eval mode, every quantized
    FakeQuantLinear replaced by the runtime's layer (``kernel`` as in ``pipeline.runtime.load``).
    """
    out = copy.deepcopy(model) if copy_model else model
    device = next(out.parameters()).device
    for name, mod in list(out.named_modules()):
        if isinstance(mod, FakeQuantLinear) and mod.fmt.kind != "float":
            layer = runtime_linear(name, mod.to_qtensor(), mod.bias, kernel, device)
            out.set_submodule(name, layer)
    if kernel == "auto":
        float_rows.convert(out)
    return out.eval()
