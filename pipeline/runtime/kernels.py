"""Packed matmul kernels of the runtime's torch backend: which one a layer gets, and its call.

A quantized linear computes ``x @ W.T`` with ``W = (q - offset) * scale`` per group (integer
codes) or ``W = lut[code]`` per group (exponential codes). Dequantizing W on every call, as the
reference does, reads the codes *and* writes and re-reads a float32 W: slower than FP. The
kernels here read the packed codes instead. What each format gets was chosen by measurement
(this CPU: 2 AVX-512 cores, torch 2.13; one 4096 -> 11008 GEMV, batch 1, milliseconds):

=============================================  =====  =========================================
path                                            ms    note
=============================================  =====  =========================================
FP32 ``F.linear``                               8.8
BF16 ``F.linear``                               5.4
``_weight_int4pack_mm_for_cpu``, bf16 input     1.2   int4 codes, 4 bits read per weight
``_weight_int4pack_mm_for_cpu``, fp32 input    38.6   torch's fp32 path is not vectorised
``_weight_int8pack_mm``, bf16 input             1.8
``_weight_int8pack_mm``, fp32 input            22.4
LUT gather per call, then FP32 matmul         175.0   exponential codes
=============================================  =====  =========================================

Speculative decoding verifies M = gamma + 1 tokens in one forward, so what a kernel costs at
M > 1 matters as much (same layer, int4 g128, 1 thread, ms, best of 30 interleaved rounds; the
int8 rows: int8 per channel, best of 15 calls; int4pack's and int8pack's time grows with M
because they convert their weights per row block):

=============================================  =====  =====  ==================================
path                                           M = 1  M = 5  note
=============================================  =====  =====  ==================================
FP32 ``F.linear``                              10.1   36.3   MKL sgemm: ~one weight pass per row
``_weight_int4pack_mm_for_cpu``, bf16 input    2.6    7.1
W4A8, AVX-512 VNNI (``cpu_w4a8``)              1.2    1.9    bound by vpdpbusd throughput at M=5
``_weight_int8pack_mm``, bf16 input, int8      3.7    9.5
W8A8, AVX-512 VNNI (``cpu_w4a8``), int8        2.3    3.3
=============================================  =====  =====  ==================================

Hence (``bench/decode_speed.py`` measures them again on a whole model):

* ``w4a8pack`` (CPUs with AVX-512 VNNI or AVX2 where the extension builds, on the ISA
  ``cpu_ext.isa()`` picks): int2/int3/int4 codes, ``n % 16 == 0``, a group length that is a
  multiple of 32 and divides k. Activations are
  quantized to int8 per 32 columns (~5e-3 relative error); the output returns in the caller's
  dtype. Faster than int4pack at every M measured (1 to 128; 34 against 139 ms at 128), so on
  such CPUs it replaces int4pack instead of sharing the layer: one packed copy of the weights.
* ``w8a8pack``: the same kernel on int8 codes (``u = q + 128``, 512 bytes a block), per
  channel or per group of a multiple of 32 columns; replaces int8pack where it runs for the
  same reason (1.6x faster at M = 1, 2.9x at M = 5).
* ``int4pack``: the other int2/int3/int4 layers (CUDA, CPUs without AVX2, a partial last group)
  whose group length is a multiple of 32; per-channel layers repeat their scale per
  256/128/64/32-column block. Activations enter in bf16, the output returns in the caller's
  dtype.
* ``int8pack``: other int8 codes with one scale per output channel and ``in_features % 16 == 0``;
  an asymmetric row's offset is folded as ``- sum(x) * offset * scale``. bf16 activations.
* ``dense-bf16``: exponential codes, decoded once through their LUT to a bf16 weight at load
  (gathering per call loses 30x; no LUT kernel exists in torch). 16 bits per weight in memory.
* ``reference``: dequantize then matmul in the caller's dtype; the oracle, bit-exact with the
  fake-quant model in float32, and the fallback for every layer a kernel cannot take
  (int8 with groups where w8a8pack cannot run, shapes a kernel refuses).

Float layers a model keeps (lm_head) are not built here: ``float_rows`` gives float32 CPU
linears their few-row kernel.

On CUDA, int2/int3/int4 layers take int4pack through ``_weight_int4pack_mm`` (tinygemm, bf16)
and int8 ones ``_weight_int8pack_mm``. They have not run here (no GPU); :func:`build` therefore
checks every kernel against the reference on a random probe at load and falls back, with a
warning naming the layer, when a kernel raises or disagrees beyond ``TOLERANCE``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.artifact.lowbit_format import LinearCodes
from pipeline.quant.codec import expand_groups
from pipeline.runtime import cpu_ext, cpu_w4a8

log = logging.getLogger(__name__)

W8A8_NAME = "w8a8pack"  # the W4A8 kernel on 8-bit codes
KERNELS = ("auto", "reference")  # what a user chooses; "auto" = the table above
ACT_DTYPE = torch.bfloat16  # the activation dtype the packed kernels are fast in
INT4_BLOCKS = (256, 128, 64, 32)  # the group sizes the int4 kernels accept, largest first
TOLERANCE = 2e-2  # relative L2 error vs the reference (bf16 activations and scales: ~4e-3)
_INT4_MIN = -8  # signed codes of 2/3/4-bit layers lie in [-8, 7]


class Kernel(nn.Module):
    """One layer's packed weight and its matmul: (tokens, k) -> (tokens, n), caller's dtype."""

    name = "reference"


class Reference(Kernel):
    """Dequantize per group, then matmul: the oracle every kernel is tested against."""

    name = "reference"

    def __init__(self, codes: LinearCodes) -> None:
        super().__init__()
        self.shape, self.group, self.kind = codes.info.shape, codes.group_len, codes.info.type
        self.register_buffer("q", codes.q.contiguous())  # (n, k) int8 / uint8 exp codes
        if self.kind == "W4A16_EXP":
            self.register_buffer("lut", codes.lut())  # (n, n_groups, 16) float32
        else:
            self.register_buffer("scale", codes.scale)  # (n, n_groups) float32
            self.register_buffer("offset", codes.offset)

    def weight_matrix(self) -> Tensor:
        """The dequantized (n, k) float32 weight."""
        (n, k), g = self.shape, self.group
        if self.kind == "W4A16_EXP":
            idx = F.pad(self.q.long(), (0, (-k) % g))  # (n, n_groups * g)
            return torch.gather(self.lut, -1, idx.view(n, -1, g)).view(n, -1)[:, :k]
        if k % g == 0:  # whole groups: broadcast instead of materialising expanded params
            qg = self.q.view(n, k // g, g).float()
            return ((qg - self.offset[..., None]) * self.scale[..., None]).view(n, k)
        scale = expand_groups(self.scale, g, k)
        return (self.q.float() - expand_groups(self.offset, g, k)) * scale

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_matrix().to(x.dtype))


def _int4_block(codes: LinearCodes) -> int | None:
    """The int4 kernel's group size for this layer, or None when it cannot take the layer."""
    info = codes.info
    n, k = info.shape
    if info.type == "W4A16_EXP" or info.bits > 4 or n % 16:
        return None
    return next((b for b in INT4_BLOCKS if codes.group_len % b == 0 and k % b == 0), None)


class Int4Pack(Kernel):
    """int2/3/4 codes through torch's int4 kernel: ``(u - 8) * scale + zero`` per block."""

    name = "int4pack"

    def __init__(self, codes: LinearCodes, block: int, device: torch.device) -> None:
        super().__init__()
        n, k = codes.info.shape
        self.block, self.cuda = block, device.type == "cuda"
        u = (codes.q.to(torch.int32) - _INT4_MIN).to(device)  # (n, k) in [0, 15]
        # (q - offset) * s = (u - 8) * s + (-offset * s): the kernel's zero is -offset * s.
        # A block never straddles two groups (the group length is a multiple of the block).
        first_col = torch.arange(0, k, block) // codes.group_len
        scale = codes.scale[:, first_col]  # (n, k / block)
        zero = -codes.offset[:, first_col] * scale
        sz = torch.stack([scale.t(), zero.t()], dim=-1)  # (k / block, n, 2)
        self.register_buffer("scale_zero", sz.contiguous().to(device, ACT_DTYPE))
        if self.cuda:  # tinygemm takes two codes per byte, the even column in the high nibble
            u8 = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(u8, 8 if k % 128 == 0 else 2)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        self.register_buffer("packed", packed)

    def forward(self, x: Tensor) -> Tensor:
        op = (
            torch.ops.aten._weight_int4pack_mm
            if self.cuda
            else torch.ops.aten._weight_int4pack_mm_for_cpu
        )
        return op(x.to(ACT_DTYPE), self.packed, self.block, self.scale_zero).to(x.dtype)


class W4A8(Kernel):
    """int2/3/4 codes (``w4a8pack``) and int8 ones (``w8a8pack``) times int8 activations on
    AVX-512 VNNI or AVX2 (``cpu_w4a8``; ``isa``, default ``cpu_ext.isa()``): weights read (and
    unpacked) once for all token rows, so more rows cost multiplies, not memory traffic."""

    name = "w4a8pack"

    def __init__(self, codes: LinearCodes, isa: str | None = None) -> None:
        super().__init__()
        if codes.info.bits == 8:
            self.name = W8A8_NAME
        self.isa = isa or cpu_ext.isa()
        self.group = codes.group_len
        packed, scale, zero = cpu_w4a8.pack(codes)
        self.register_buffer("packed", packed)  # (n / 16, k / 32, 256) uint8
        self.register_buffer("scale", scale)  # (n / 16, n_groups, 16) float16
        self.register_buffer("zero", zero)

    def forward(self, x: Tensor) -> Tensor:
        y = cpu_w4a8.matmul(x, self.packed, self.scale, self.zero, self.group, self.isa)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"isa={self.isa}"


class Int8Pack(Kernel):
    """int8 codes, one scale per output channel, through ``_weight_int8pack_mm``."""

    name = "int8pack"

    def __init__(self, codes: LinearCodes, device: torch.device) -> None:
        super().__init__()
        scale = codes.scale[:, 0]  # (n,)
        # A fresh allocation: the kernel uses aligned vector loads, and codes unpacked from a
        # safetensors buffer may start anywhere (a misaligned q segfaults, it does not raise).
        q = torch.empty(codes.q.shape, dtype=torch.int8, device=device).copy_(codes.q)
        self.register_buffer("q", q)  # (n, k)
        self.register_buffer("scale", scale.to(device, ACT_DTYPE))
        shift = codes.offset[:, 0] * scale  # (q - o) * s = q * s - o * s
        self.register_buffer("shift", shift.to(device) if shift.any() else None)

    def forward(self, x: Tensor) -> Tensor:
        xb = x.to(ACT_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale).to(x.dtype)
        if self.shift is not None:
            y = y - xb.to(x.dtype).sum(-1, keepdim=True) * self.shift.to(x.dtype)
        return y


class DenseBf16(Kernel):
    """Exponential codes decoded once through their LUT to a bf16 weight."""

    name = "dense-bf16"

    def __init__(self, codes: LinearCodes, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("weight", codes.dequantize(ACT_DTYPE).to(device))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(ACT_DTYPE), self.weight).to(x.dtype)


class SideColumns(nn.Module):
    """Kept outlier columns (``quant.outliers=keep_fp16``): ``x[:, idx] @ S.T`` with the
    correction ``S = W[:, idx] - Wq[:, idx]`` (``LinearCodes.side``), added to whatever kernel
    runs the dense codes. k is ~1% of the columns, so this is a small dense matmul in the
    caller's dtype; the kernels above stay as they are."""

    def __init__(self, idx: Tensor, correction: Tensor, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("idx", idx.to(device))  # (k,)
        self.register_buffer("correction", correction.to(device))  # (n, k) float32

    @classmethod
    def of(cls, codes: LinearCodes, device: torch.device | str) -> SideColumns | None:
        side = codes.side()
        return None if side is None else cls(*side, device)

    def forward(self, x: Tensor) -> Tensor:  # (tokens, in) -> (tokens, n)
        return F.linear(x.index_select(-1, self.idx), self.correction.to(x.dtype))


def _candidate(codes: LinearCodes, device: torch.device) -> Kernel | None:
    """The measured-fastest kernel for this layer on ``device``, or None (reference)."""
    if device.type not in ("cpu", "cuda"):
        return None
    info = codes.info
    if info.type == "W4A16_EXP":
        return DenseBf16(codes, device)
    if cpu_w4a8.fits(codes) and _w4a8_runs_on(device):
        return W4A8(codes)
    block = _int4_block(codes)
    if block is not None:
        return Int4Pack(codes, block, device)
    # The int8 kernel reads k in steps of 16 without a bounds check (other k: garbage or a
    # segfault, not an error), so the precondition is checked here, not by the probe.
    if info.bits == 8 and info.group_size == 0 and info.shape[1] % 16 == 0:
        return Int8Pack(codes, device)
    return None


def _w4a8_runs_on(device: torch.device) -> bool:
    """Whether the W4A8 kernel serves ``device``: a CPU where ``cpu_ext.isa()`` is an ISA
    (AVX-512 VNNI or AVX2, unless ``LOWBIT_CPU_ISA`` says otherwise) and the extension built."""
    return device.type == "cpu" and cpu_ext.extension() is not None


def int_kernel_name(device: torch.device | str = "cpu", bits: int = 4) -> str:
    """The kernel int layers of ordinary shapes get on ``device``: on a CPU that runs lowbit's
    kernel "w4a8pack" (2/3/4-bit codes) or "w8a8pack" (8-bit), else "int4pack" / "int8pack"."""
    if _w4a8_runs_on(torch.device(device)):
        return W8A8_NAME if bits == 8 else W4A8.name
    return Int8Pack.name if bits == 8 else Int4Pack.name


def relative_error(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in float32."""
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-12))


@torch.no_grad()
def build(
    codes: LinearCodes,
    device: torch.device | str = "cpu",
    kernel: str = "auto",
    *,
    check: bool = True,
    name: str = "",
) -> Kernel:
    """The kernel for one layer on ``device``: the measured choice, or the reference.

    Args:
        codes: The layer's unpacked codes (``unpack_linear``).
        device: Where the layer runs; packed layouts are device-specific.
        kernel: "auto" (the table in the module docstring) or "reference".
        check: Compare the chosen kernel with the reference on a random probe (two tokens);
            a kernel that raises or disagrees beyond ``TOLERANCE`` is replaced by the reference.
        name: The layer's name, for the fallback warning.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    device = torch.device(device)
    ref = Reference(codes)
    if kernel == "reference":
        return ref.to(device)
    try:
        chosen = _candidate(codes, device)
        if chosen is None or not check:
            return chosen or ref.to(device)
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(2, codes.info.shape[1], generator=gen)
        err = relative_error(chosen(probe.to(device)).cpu(), ref(probe))
        if err <= TOLERANCE:
            return chosen
        why = f"differs from the reference by {err:.2e} (tolerance {TOLERANCE:.0e})"
    except (RuntimeError, NotImplementedError) as e:  # a kernel refusing this shape/device
        why = f"raised {type(e).__name__}: {str(e).splitlines()[0]}"
    log.warning("runtime: %s: the packed kernel %s; using the reference", name or "layer", why)
    return ref.to(device)
