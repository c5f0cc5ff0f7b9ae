"""Quantized linear layers of the runtime: the torch backend and torch_npu.

Both start from the same unpacked ``LinearCodes``. ``npu`` runs
``torch_npu.npu_weight_quant_batchmatmul``: ``x @ ((w + antiquant_offset) * antiquant_scale)``
with ``w`` logically (K, N), so ``-offset`` is passed and scale/offset are transposed to
(n_groups, N). W8A8_DYNAMIC layers quantize their input per token to int8 first, as MindIE.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.artifact.lowbit_format import LinearCodes
from pipeline.errors import LowbitError
from pipeline.quant.packing import pack_int4_npu_int32
from pipeline.runtime import kernels
from pipeline.runtime.float_rows import FloatRowsLinear

BACKENDS = ("auto", "torch", "npu")


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve(backend: str) -> tuple[str, str]:
    """("torch" | "npu", device name) for a backend name; "auto" prefers an Ascend NPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "npu" or (backend == "auto" and npu_available()):
        if importlib.util.find_spec("torch_npu") is None:
            raise LowbitError(
                "backend='npu' needs torch_npu (Ascend's PyTorch plug-in); "
                "install it, or use backend='torch'"
            )
        importlib.import_module("torch_npu")
        return "npu", "npu"  # a device type torch knows once torch_npu is imported
    return "torch", "cuda" if torch.cuda.is_available() else "cpu"


def quantize_tokens_int8(x: Tensor) -> Tensor:
    """Per-token symmetric int8 fake quantization of activations (W8A8_DYNAMIC). x: (..., k)"""
    s = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-8) / 127.0  # (..., 1)
    return (torch.round(x.float() / s).clamp(-127, 127) * s).to(x.dtype)


class TorchQuantLinear(nn.Module):
    """Quantized linear of the torch backend: a packed kernel or the reference."""

    def __init__(
        self,
        codes: LinearCodes,
        bias: Tensor | None = None,
        *,
        kernel: str = "reference",
        device: torch.device | str = "cpu",
        name: str = "",
    ) -> None:
        super().__init__()
        info = codes.info
        self.out_features, self.in_features = info.shape
        self.kind, self.group = info.type, codes.group_len
        self.dynamic_act = info.type == "W8A8_DYNAMIC"
        self.impl = kernels.build(codes, device, kernel, name=name)
        self.side = kernels.SideColumns.of(codes, device)
        self.register_buffer("bias", None if bias is None else bias.detach().to(device))

    @property
    def kernel(self) -> str:
        """The kernel this layer runs, e.g. "w4a8pack" or "reference"."""
        return self.impl.name

    def weight_matrix(self) -> Tensor:
        """The dequantized (n, k) float32 weight, kept columns applied (reference layers only)."""
        if not isinstance(self.impl, kernels.Reference):
            raise TypeError(f"a {self.kernel} layer keeps packed codes; build it as reference")
        w = self.impl.weight_matrix()
        if self.side is not None:
            w = w.index_add(1, self.side.idx, self.side.correction)
        return w

    def forward(self, x: Tensor) -> Tensor:
        if self.dynamic_act:
            x = quantize_tokens_int8(x)
        x2 = x.reshape(-1, self.in_features)  # (tokens, k)
        y = self.impl(x2)
        if self.side is not None:
            y = y + self.side(x2)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def rows_fn(self) -> Callable[[Tensor], Tensor] | None:
        """The kernel's ``rows_fn``, or None where the layer adds to it (bias, side columns)."""
        if self.bias is not None or self.side is not None or self.dynamic_act:
            return None
        return self.impl.rows_fn()

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features}, type={self.kind}, group={self.group}, "
            f"kernel={self.kernel}"
        )

    @classmethod
    def joined(cls, layers: list[nn.Module]) -> JoinedLinear | None:
        """``cat([layer(x) for layer in layers], -1)`` in one kernel call, or None where the
        layers' kernels cannot join (docs/kernels.md)."""
        if not all(
            type(layer) is cls
            and isinstance(layer.impl, kernels.W4A8)
            and layer.side is None
            and not layer.dynamic_act
            for layer in layers
        ):
            return None
        impl = kernels.W4A8.joined([layer.impl for layer in layers])
        if impl is None:
            return None
        bias = None
        if any(layer.bias is not None for layer in layers):
            like = next(layer.bias for layer in layers if layer.bias is not None)
            bias = torch.cat(
                [like.new_zeros(layer.out_features) if layer.bias is None else layer.bias
                 for layer in layers]
            )  # fmt: skip
        return JoinedLinear(impl, bias, [layer.out_features for layer in layers])


class JoinedLinear(nn.Module):
    """(..., k) -> (..., sum of ``sizes``): :meth:`TorchQuantLinear.joined`'s layers in order."""

    def __init__(self, impl: kernels.Kernel, bias: Tensor | None, sizes: list[int]) -> None:
        super().__init__()
        self.impl, self.sizes = impl, sizes
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        y = self.impl(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def rows_fn(self) -> Callable[[Tensor], Tensor] | None:
        return None if self.bias is not None else self.impl.rows_fn()


class NpuQuantLinear(nn.Module):
    """Ascend quantized linear through ``torch_npu.npu_weight_quant_batchmatmul``."""

    kernel = "npu_weight_quant_batchmatmul"

    def __init__(self, codes: LinearCodes, bias: Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        info = codes.info
        self.out_features, self.in_features = info.shape
        self.kind = info.type
        self.dynamic_act = info.type == "W8A8_DYNAMIC"
        self.group = info.group_size  # 0 = per channel, as the kernel's antiquant_group_size
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.side = kernels.SideColumns.of(codes, "cpu")  # moves with the module
        if info.type == "W4A16_EXP":  # no LUT kernel: decode once to a dense fp16 weight
            self.kernel = "dense"
            self.register_buffer("weight", codes.dequantize(dtype))  # (n, k)
            return
        qt = codes.q.t().contiguous()  # (k, n): the kernel's logical weight layout
        self.register_buffer("weight", qt if info.bits == 8 else pack_int4_npu_int32(qt))
        self.register_buffer("scale", codes.scale.t().contiguous().to(dtype))  # (n_groups, n)
        self.register_buffer("offset", (-codes.offset).t().contiguous().to(dtype))  # added

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "W4A16_EXP":
            y = F.linear(x, self.weight, self.bias)
            return y if self.side is None else y + self.side(x)
        import torch_npu

        if self.dynamic_act:
            x = quantize_tokens_int8(x)
        x2 = x.reshape(-1, self.in_features)  # (tokens, k)
        y = torch_npu.npu_weight_quant_batchmatmul(
            x2,
            self.weight,
            self.scale,
            antiquant_offset=self.offset,
            bias=self.bias,
            antiquant_group_size=self.group,
        )
        if self.side is not None:
            y = y + self.side(x2)
        return y.view(*x.shape[:-1], self.out_features)


QUANT_LINEARS = (TorchQuantLinear, NpuQuantLinear)


def make_linear(
    backend: str,
    codes: LinearCodes,
    bias: Tensor | None,
    dtype: torch.dtype,
    *,
    kernel: str = "auto",
    device: torch.device | str = "cpu",
    name: str = "",
) -> nn.Module:
    """The backend's quantized linear for one layer, built on ``device``."""
    if backend == "npu":
        return NpuQuantLinear(codes, bias, dtype)
    return TorchQuantLinear(codes, bias, kernel=kernel, device=device, name=name)


def kernel_summary(model: nn.Module) -> str:
    """What the model's linears run, e.g. "int4pack x12, reference x2, f32rows x1"; "" if plain."""
    layers = (*QUANT_LINEARS, FloatRowsLinear)
    counts = Counter(m.kernel for m in model.modules() if isinstance(m, layers) and m.kernel)
    return ", ".join(f"{k} x{n}" for k, n in counts.most_common())
