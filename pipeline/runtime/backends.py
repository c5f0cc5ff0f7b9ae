"""Quantized linear layers of the runtime: the torch reference backend and torch_npu.

Both start from the same unpacked form, ``pipeline.export.lowbit_format.LinearCodes`` (signed
int8 codes + float32 scale/offset per group, or exponential codes + base/ratio), produced by
the same unpacking code the export tests check, so the only backend-specific code is the last
step:

* ``torch`` (reference; CPU or CUDA): keeps the int8 codes (1 byte per weight; 2/3/4-bit
  layers are unpacked once at load, not on every call) and computes each forward
  ``W = (q - offset) * scale`` per group, then ``x @ W.T``. Exponential codes are gathered
  from their per-group lookup table. Bit-exact with the fake-quant model in float32.
* ``npu`` (Ascend, when ``torch_npu`` imports): ``torch_npu.npu_weight_quant_batchmatmul``,
  which computes ``x @ ((w + antiquant_offset) * antiquant_scale)`` with ``w`` logically
  (K, N): lowbit's offset is *subtracted*, so ``-offset`` is passed; scale/offset are
  transposed to (n_groups, N). int8 codes go as int8, 2/3/4-bit codes (all inside the int4
  range) as int4 packed eight per int32 (``pack_int4_npu_int32``). Exponential codes are
  decoded through their LUT to an fp16 weight at load and run as a plain matmul. This path
  has not run on Ascend hardware here; its argument layout is tested on CPU against a
  stand-in kernel with the documented semantics.

W8A8_DYNAMIC layers also quantize their input per token to int8 (symmetric, absmax/127) before
the matmul, as MindIE's dynamic W8A8 does, so the runtime's numerics match that target.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import LowbitError
from pipeline.export.lowbit_format import LinearCodes
from pipeline.quant.codec import expand_groups
from pipeline.quant.packing import pack_int4_npu_int32

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
    """Reference quantized linear: dequantize per group, then matmul."""

    def __init__(self, codes: LinearCodes, bias: Tensor | None = None) -> None:
        super().__init__()
        info = codes.info
        self.out_features, self.in_features = info.shape
        self.kind, self.group = info.type, codes.group_len
        self.dynamic_act = info.type == "W8A8_DYNAMIC"
        self.register_buffer("q", codes.q.contiguous())  # (n, k) int8 / uint8 exp codes
        if info.type == "W4A16_EXP":
            self.register_buffer("lut", codes.lut())  # (n, n_groups, 16) float32
        else:
            self.register_buffer("scale", codes.scale)  # (n, n_groups) float32
            self.register_buffer("offset", codes.offset)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def weight_matrix(self) -> Tensor:
        """The dequantized (n, k) float32 weight."""
        n, k, g = self.out_features, self.in_features, self.group
        if self.kind == "W4A16_EXP":
            idx = F.pad(self.q.long(), (0, (-k) % g))  # (n, n_groups * g)
            return torch.gather(self.lut, -1, idx.view(n, -1, g)).view(n, -1)[:, :k]
        if k % g == 0:  # whole groups: broadcast instead of materialising expanded params
            qg = self.q.view(n, k // g, g).float()
            return ((qg - self.offset[..., None]) * self.scale[..., None]).view(n, k)
        scale = expand_groups(self.scale, g, k)
        return (self.q.float() - expand_groups(self.offset, g, k)) * scale

    def forward(self, x: Tensor) -> Tensor:
        if self.dynamic_act:
            x = quantize_tokens_int8(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_matrix().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, type={self.kind}, group={self.group}"


class NpuQuantLinear(nn.Module):
    """Ascend quantized linear through ``torch_npu.npu_weight_quant_batchmatmul``."""

    def __init__(self, codes: LinearCodes, bias: Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        info = codes.info
        self.out_features, self.in_features = info.shape
        self.kind = info.type
        self.dynamic_act = info.type == "W8A8_DYNAMIC"
        self.group = info.group_size  # 0 = per channel, as the kernel's antiquant_group_size
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        if info.type == "W4A16_EXP":  # no LUT kernel: decode once to a dense fp16 weight
            self.register_buffer("weight", codes.dequantize(dtype))  # (n, k)
            return
        qt = codes.q.t().contiguous()  # (k, n): the kernel's logical weight layout
        self.register_buffer("weight", qt if info.bits == 8 else pack_int4_npu_int32(qt))
        self.register_buffer("scale", codes.scale.t().contiguous().to(dtype))  # (n_groups, n)
        self.register_buffer("offset", (-codes.offset).t().contiguous().to(dtype))  # added

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "W4A16_EXP":
            return F.linear(x, self.weight, self.bias)
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
        return y.view(*x.shape[:-1], self.out_features)


def make_linear(
    backend: str, codes: LinearCodes, bias: Tensor | None, dtype: torch.dtype
) -> nn.Module:
    if backend == "npu":
        return NpuQuantLinear(codes, bias, dtype)
    return TorchQuantLinear(codes, bias)
