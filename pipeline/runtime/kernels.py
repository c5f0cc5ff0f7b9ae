"""Packed matmul kernels of the runtime's torch backend: which one a layer gets, and its call.

Which format gets which kernel on which device, and why: docs/kernels.md. :func:`build` checks
each chosen kernel against the reference at load and falls back when it disagrees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import cpu_ext
from pipeline.artifact.lowbit_format import LinearCodes
from pipeline.quant import act8
from pipeline.quant.codec import expand_groups
from pipeline.runtime import cpu_lut16, cpu_w4a8

log = logging.getLogger(__name__)

KERNELS = ("auto", "reference")  # what a user chooses; "auto": docs/kernels.md
ACT_DTYPE = torch.bfloat16  # the activation dtype the packed kernels are fast in
INT4_BLOCKS = (256, 128, 64, 32)  # the group sizes the int4 kernels accept, largest first
TOLERANCE = 2e-2  # relative L2 error vs the reference (bf16 activations and scales: ~4e-3)
_INT4_MIN = -8  # signed codes of 2/3/4-bit layers lie in [-8, 7]


class Kernel(nn.Module):
    """One layer's packed weight and its matmul: (tokens, k) -> (tokens, n), caller's dtype."""

    name = "reference"

    def rows_fn(self) -> Callable[[Tensor], Tensor] | None:
        """The matmul as a function of (rows, k) contiguous float32, no module call, or None."""
        return None


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
        # (q - offset) * s = (u - 8) * s + (-offset * s); a block never straddles two groups.
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
    """int2/3/4/8 codes, each packed at its own width, times int8 activations: w<bits>a8pack."""

    name = "w4a8pack"

    def __init__(self, codes: LinearCodes | None, isa: str | None = None) -> None:
        super().__init__()
        if codes is None:  # filled by `joined`
            return
        self.name = w_a8_name(codes.info.bits)
        self.isa = isa or cpu_ext.isa()
        self.group = codes.group_len
        packed, scale, zero = cpu_w4a8.pack(codes)
        self.register_buffer("packed", packed)  # (n / 16, k / 32, 64 * bits) uint8
        self.register_buffer("scale", scale)  # (n / 16, n_groups, 16) float16
        self.register_buffer("zero", zero)

    @classmethod
    def joined(cls, parts: list[W4A8]) -> W4A8 | None:
        """One kernel for ``parts``' outputs side by side (each the part's own, bit for bit), or
        None where their codes differ; the parts' buffers become views of the joined ones."""
        first = parts[0]
        done = getattr(first, "joined_into", (None,))[0]
        if done is not None and all(
            p.joined_into == (done, i, len(parts))
            and p.packed.untyped_storage().data_ptr() == done.packed.untyped_storage().data_ptr()
            for i, p in enumerate(parts)
        ):
            return done  # joined before: no new copy
        same = ("name", "group", "isa")
        if any(getattr(p, a) != getattr(first, a) for p in parts for a in same) or any(
            p.packed.shape[1:] != first.packed.shape[1:] for p in parts
        ):
            return None
        out = cls(None)
        out.name, out.isa, out.group = first.name, first.isa, first.group
        for buffer in ("packed", "scale", "zero"):
            out.register_buffer(buffer, torch.cat([getattr(p, buffer) for p in parts]))
        start = 0
        for i, p in enumerate(parts):
            tiles = p.packed.shape[0]
            for buffer in ("packed", "scale", "zero"):
                setattr(p, buffer, getattr(out, buffer)[start : start + tiles])
            p.joined_into = (out, i, len(parts))  # a tuple: not registered as a submodule
            start += tiles
        return out

    def forward(self, x: Tensor) -> Tensor:
        y = cpu_w4a8.matmul(x, self.packed, self.scale, self.zero, self.group, self.isa)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def rows_fn(self) -> Callable[[Tensor], Tensor]:
        mm, args = cpu_ext.runnable(self.isa)[0].w4a8_mm, (self.packed, self.scale, self.zero)
        return lambda x: mm(x, *args, self.group, self.isa)

    def extra_repr(self) -> str:
        return f"isa={self.isa}"


class FloatColumns(Kernel):
    """An int8-activation kernel whose input channels ``idx`` stay float: x = x_rest + x_idx,
    x_rest (those channels zeroed) through the kernel, whose per-32 scales then no longer
    stretch to the outliers, x_idx through the dequantized columns W[:, idx] in float32."""

    def __init__(self, inner: Kernel, idx: Tensor, columns: Tensor) -> None:
        super().__init__()
        self.inner, self.name = inner, f"{inner.name}+f32cols"
        self.register_buffer("idx", idx)  # (c,) int64
        self.register_buffer("columns", columns)  # (n, c) float32

    @classmethod
    def around(cls, inner: Kernel, codes: LinearCodes) -> Kernel:
        """``inner`` with ``codes.info.act_columns`` in float, or ``inner`` itself without any."""
        cols = codes.info.act_columns
        if not cols:
            return inner
        k = codes.info.shape[1]
        bad = [c for c in cols if not 0 <= c < k]
        if bad:
            raise ValueError(f"act_columns {bad[0]} out of range for {k} input channels")
        idx = torch.tensor(cols, dtype=torch.int64, device=inner.packed.device)
        return cls(inner, idx, codes.dequantize()[:, idx.cpu()].to(idx.device).contiguous())

    def forward(self, x: Tensor) -> Tensor:  # (tokens, k) -> (tokens, n)
        rest, kept = act8.split(x, self.idx)
        return self.inner(rest) + F.linear(kept.float(), self.columns).to(x.dtype)

    def extra_repr(self) -> str:
        return f"float columns={self.idx.numel()}"


def w_a8_name(bits: int) -> str:
    """lowbit's CPU kernel's name on ``bits``-bit codes: "w2a8pack" ... "w8a8pack"."""
    return f"w{bits}a8pack"


class Int8Pack(Kernel):
    """int8 codes, one scale per output channel, through ``_weight_int8pack_mm``."""

    name = "int8pack"

    def __init__(self, codes: LinearCodes, device: torch.device) -> None:
        super().__init__()
        scale = codes.scale[:, 0]  # (n,)
        # A fresh (aligned) allocation: a misaligned q from a safetensors buffer segfaults.
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


class Lut16(Kernel):
    """Exponential codes at 4 bits a weight, decoded by a 16-entry table lookup in the kernel."""

    name = "exp4lut"

    def __init__(self, codes: LinearCodes, isa: str | None = None) -> None:
        super().__init__()
        self.isa = isa or cpu_ext.isa()
        self.group = codes.group_len
        packed, base, ridx, tables = cpu_lut16.pack(codes)
        self.register_buffer("packed", packed)  # (n, k / 2) uint8
        self.register_buffer("base", base)  # (n, n_groups) float16
        self.register_buffer("ridx", ridx)  # (n, n_groups) uint8
        self.register_buffer("tables", tables)  # (T, 16) float32

    def forward(self, x: Tensor) -> Tensor:
        args = (self.packed, self.base, self.ridx, self.tables, self.group, self.isa)
        y = cpu_lut16.matmul(x, *args)
        return y.to(x.dtype)

    def rows_fn(self) -> Callable[[Tensor], Tensor]:
        mm, args = cpu_ext.runnable(self.isa)[0].lut16_mm, (self.packed, self.base, self.ridx)
        return lambda x: mm(x, *args, self.tables, self.group, self.isa)

    def extra_repr(self) -> str:
        return f"isa={self.isa}"


class SideColumns(nn.Module):
    """Kept outlier columns: ``x[:, idx] @ S.T``, ``S = W[:, idx] - Wq[:, idx]``, added on top."""

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
    """The packed kernel for this layer on ``device`` (docs/kernels.md), or None (reference)."""
    if device.type not in ("cpu", "cuda"):
        return None
    info = codes.info
    if info.type == "W4A16_EXP":
        ours = cpu_lut16.fits(codes) and _w4a8_runs_on(device)
        return Lut16(codes) if ours else DenseBf16(codes, device)
    if cpu_w4a8.fits(codes) and _w4a8_runs_on(device) and not info.a16:
        return FloatColumns.around(W4A8(codes), codes)
    block = _int4_block(codes)
    if block is not None:
        return Int4Pack(codes, block, device)
    # The int8 kernel reads k in unchecked steps of 16 (a segfault, not an error): check here.
    if info.bits == 8 and info.group_size == 0 and info.shape[1] % 16 == 0:
        return Int8Pack(codes, device)
    return None


def _w4a8_runs_on(device: torch.device) -> bool:
    """Whether lowbit's CPU kernels serve ``device``: a CPU where lowbit's extension runs."""
    return device.type == "cpu" and cpu_ext.extension() is not None


def int_kernel_name(device: torch.device | str = "cpu", bits: int = 4) -> str:
    """The kernel ``bits``-bit int layers of ordinary shapes get on ``device`` ("w2a8pack",
    "w4a8pack", "int8pack"...)."""
    if _w4a8_runs_on(torch.device(device)):
        return w_a8_name(bits)
    return Int8Pack.name if bits == 8 else Int4Pack.name


def exp_kernel_name(device: torch.device | str = "cpu") -> str:
    """The kernel exponential layers of ordinary shapes get on ``device``."""
    return Lut16.name if _w4a8_runs_on(torch.device(device)) else DenseBf16.name


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
    """The packed kernel for one layer, or the reference where ``check`` finds it off on a probe."""
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
