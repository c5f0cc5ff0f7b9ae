"""``AutoModelForCausalLM.from_pretrained`` for lowbit quantized model directories.

Their config.json's ``quantization_config`` (``quant_method: lowbit``, the content of
``lowbit_quant.json``) resolves to :class:`LowbitHfQuantizer`, which swaps each listed linear for
a :class:`StoredQTensor` before loading (transformers fills the stored fields in their own
dtypes) and for the same ``FakeQuantLinear`` as ``load_quantized`` after it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from pipeline.errors import LowbitError
from pipeline.models.qtensor_io import FORMAT_VERSION, QUANT_METHOD
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.quant.formats import Format, parse_format
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn


class LowbitConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a lowbit quantized model directory (unlisted linears
    stay float; ``kept_columns``: ``{name: k}`` outlier input columns kept in fp16)."""

    def __init__(
        self,
        layers: dict[str, str] | None = None,
        method: str = "rtn",
        format_version: int = FORMAT_VERSION,
        kept_columns: dict[str, int] | None = None,
        **kwargs: Any,  # transformers passes the dict whole; quant_method is fixed here
    ) -> None:
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.method = method
        self.layers = dict(layers or {})
        self.kept_columns = dict(kept_columns or {})
        self.formats: dict[str, Format] = {}  # the layers' formats, parsed here once
        if format_version != FORMAT_VERSION:
            raise LowbitError(
                f"quantization_config.format_version is {format_version!r}; this lowbit reads "
                f"version {FORMAT_VERSION}: re-run the stage that wrote the directory"
            )
        for name, fmt in self.layers.items():
            try:
                self.formats[name] = parse_format(fmt)
            except ValueError as err:
                raise LowbitError(
                    f"quantization_config.layers[{name!r}] = {fmt!r} is not a lowbit format "
                    f"({err}); re-run the stage that wrote the directory"
                ) from None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "quant_method": self.quant_method,
            "format_version": self.format_version,
            "method": self.method,
            "layers": dict(self.layers),
        }
        if self.kept_columns:  # absent when none are kept, as in lowbit_quant.json
            out["kept_columns"] = dict(self.kept_columns)
        return out


class StoredQTensor(nn.Module):
    """Placeholder for one quantized linear while transformers loads the weights: frozen
    parameters mirroring ``QTensor.to_state_dict(name)`` (plus ``bias``)."""

    def __init__(self, linear: nn.Linear, fmt: Format, kept: int = 0) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        shapes = {
            key: (tail if key == "format" else (out_features, *tail), dtype)
            for key, (tail, dtype) in _fields(fmt, in_features).items()
        }
        if kept:  # the side matrix QTensor stores beside the codes (quant.outliers=keep_fp16)
            shapes["keep_idx"] = ((kept,), torch.int32)
            shapes["keep_vals"] = ((out_features, kept), torch.float16)
        for key, (shape, dtype) in shapes.items():
            empty = torch.empty(shape, dtype=dtype, device=linear.weight.device)
            self.register_parameter(key, nn.Parameter(empty, requires_grad=False))
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)

    def to_fake_quant(self) -> FakeQuantLinear:
        fields: dict[str, Tensor] = {k: p.data for k, p in self.named_parameters() if k != "bias"}
        qt = QTensor.from_state_dict(fields)
        bias = self.bias.data if "bias" in self._parameters else None
        return FakeQuantLinear.from_qtensor(qt, bias)


@functools.cache
def _fields(fmt: Format, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{field: (shape after the row dim, dtype)}`` of a stored ``fmt`` weight, read off a
    quantized 1-row example so the layout is stated once, in the codec."""
    w = torch.zeros(1, in_features, device="cpu")
    qt = QTensor.from_float(w) if fmt.kind == "float" else quantize_rtn(w, fmt)
    return {
        key: (tuple(t.shape) if key == "format" else tuple(t.shape[1:]), t.dtype)
        for key, t in qt.to_state_dict().items()
    }


class LowbitHfQuantizer(HfQuantizer):
    """Loads lowbit's pre-quantized directories; quantizing on the fly is lowbit's own stage."""

    requires_calibration = True  # codes come from the quantize/distill stages, not from here

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for name, fmt in self.quantization_config.formats.items():
            try:
                linear = model.get_submodule(name)
            except AttributeError:
                linear = None
            if not isinstance(linear, nn.Linear):
                raise LowbitError(
                    f"quantization_config lists {name!r}, which is not a linear layer of "
                    f"{type(model).__name__}; the config.json does not match the weights"
                )
            kept = self.quantization_config.kept_columns.get(name, 0)
            model.set_submodule(name, StoredQTensor(linear, fmt, kept))
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for name in self.quantization_config.layers:
            holder = model.get_submodule(name)
            model.set_submodule(name, holder.to_fake_quant())
        return model

    def is_serializable(self) -> bool:
        # save_pretrained would write FakeQuantLinear's trained fields (scale, zero), not the
        # stored layout; pipeline.models.quantized.save_quantized_model writes the directory.
        return False

    @property
    def is_trainable(self) -> bool:
        return True  # FakeQuantLinear trains its scales (the distill stage's step-size QAT)


def register() -> None:
    """Make transformers resolve ``quant_method: lowbit`` (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(LowbitConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(LowbitHfQuantizer)


# Importing this module is enough for ``AutoModelForCausalLM.from_pretrained``.
register()
