"""The lowbit artifact layout: ascendv1 extended with 2-bit, 3-bit and exponential tensors.

Types W2A16 / W3A16 (b-bit two's-complement fields per row) and W4A16_EXP (4-bit codes indexing
the per-group table ``lut = [0, s, s*r, ..., -s*r**6]``, rebuilt at load with the quantizer's
arithmetic, so bit-exact), plus optional kept columns (``P.keep_idx``, ``P.keep_vals``) that
override the decoded codes. Tensor shapes: docs/export.md (``format=lowbit``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from pipeline.artifact import ascend
from pipeline.quant.codec import exp_lut, expand_groups, to_groups
from pipeline.quant.formats import Format
from pipeline.quant.packing import pack_bits, unpack_bits
from pipeline.quant.qtensor import QTensor

LOWBIT_TYPES = ("W2A16", "W3A16", "W4A16_EXP")
TYPE_BITS = {"W2A16": 2, "W3A16": 3, "W4A16": 4, "W4A16_EXP": 4, "W8A16": 8, "W8A8_DYNAMIC": 8}
TARGETS = ("ascend", "lowbit")
KEEP_FIELDS = ("keep_idx", "keep_vals")  # a layer's side matrix, stored beside its codes


def refuse_kept_columns(keys, layers, fmt: str) -> None:
    """ExportError when a layer of ``layers`` has kept columns: only ``lowbit`` holds them."""
    kept = sorted(n for n in layers if f"{n}.keep_idx" in keys)
    if kept:
        raise ascend.ExportError(
            f"{len(kept)} layers (e.g. {kept[0]}) keep outlier input columns in fp16, which the "
            f"{fmt} format cannot hold: quantize with quant.outliers=none, or export with "
            "stage.export.format=lowbit"
        )


@dataclass(frozen=True)
class LayerInfo:
    """How one linear is stored (manifest.json ``layers``); ``group_size`` 0 = per channel.

    ``act_columns`` (input channels) and ``a16`` tell runtimes that quantize activations to int8
    which channels, or whether the whole input, to keep in float (``pipeline.quant.act8``).
    """

    type: str
    format: str
    bits: int
    group_size: int
    shape: tuple[int, int]
    symmetric: bool
    act_columns: tuple[int, ...] = ()
    a16: bool = False

    def to_json(self) -> dict:
        out = asdict(self) | {"shape": list(self.shape), "act_columns": list(self.act_columns)}
        # Written only when set: layers without them read as before in any runtime.
        return {k: v for k, v in out.items() if k not in _ACT_FIELDS or v}

    @classmethod
    def from_json(cls, d: dict) -> LayerInfo:
        return cls(
            d["type"],
            d["format"],
            int(d["bits"]),
            int(d["group_size"]),
            tuple(int(x) for x in d["shape"]),
            bool(d["symmetric"]),
            tuple(int(c) for c in d.get("act_columns", ())),
            bool(d.get("a16", False)),
        )


_ACT_FIELDS = ("act_columns", "a16")


def plan_layer(
    name: str,
    fmt: Format,
    shape: tuple[int, int],
    target: str,
    widen: bool = False,
    w8a8_dynamic: bool = False,
) -> LayerInfo:
    """Choose the stored type of a quantized linear for ``target`` ("ascend" | "lowbit")."""
    group = ascend.effective_group(fmt, shape[1])
    if target == "ascend":
        typ = ascend.ascend_type(name, fmt, shape, widen, w8a8_dynamic)
    elif fmt.kind == "exp":
        typ = "W4A16_EXP"
    elif fmt.bits == 8:
        typ = "W8A8_DYNAMIC" if w8a8_dynamic and fmt.symmetric and group == 0 else "W8A16"
    elif fmt.bits == 4:
        ascend.check_int4_shape(name, shape, group)
        typ = "W4A16"
    else:
        typ = f"W{fmt.bits}A16"
    bits = TYPE_BITS[typ]
    return LayerInfo(typ, fmt.name, bits, group, tuple(shape), fmt.symmetric)


def pack_rows(codes: Tensor, bits: int) -> Tensor:
    """(n, k) unsigned codes -> (n, ceil(k/8) * bits) uint8, each row packed on its own."""
    n, k = codes.shape
    pad = (-k) % 8  # 8 codes fill whole bytes for every width
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, pad))
    return pack_bits(c, bits).view(n, -1)


def unpack_rows(packed: Tensor, bits: int, k: int) -> Tensor:
    """Inverse of ``pack_rows``: (n, k) uint8 codes."""
    n = packed.shape[0]
    k8 = k + (-k) % 8
    return unpack_bits(packed.reshape(-1), bits, (n, k8))[:, :k]


def to_field(q: Tensor, bits: int) -> Tensor:
    """Signed codes -> their ``bits``-bit two's-complement fields (uint8)."""
    return (q.to(torch.int16) & ((1 << bits) - 1)).to(torch.uint8)


def from_field(f: Tensor, bits: int) -> Tensor:
    """Inverse of ``to_field``: sign-extended int8."""
    half = 1 << (bits - 1)
    return ((f.to(torch.int16) ^ half) - half).to(torch.int8)


@dataclass
class LinearCodes:
    """A stored linear, unpacked: (n, k) codes, float32 (n, n_groups) scale, offset or ratio."""

    info: LayerInfo
    q: Tensor
    scale: Tensor
    offset: Tensor | None = None
    ratio: Tensor | None = None
    keep_idx: Tensor | None = None  # (k,) int64 kept input columns
    keep_vals: Tensor | None = None  # (n, k) float32 their exact weights

    def side(self) -> tuple[Tensor, Tensor] | None:
        """``(idx, S = keep_vals - Wq[:, idx])``, added as ``x[..., idx] @ S.T``; or None."""
        if self.keep_idx is None:
            return None
        return self.keep_idx, self.keep_vals - self.dequantize()[:, self.keep_idx]

    @property
    def group_len(self) -> int:
        return self.info.group_size or self.info.shape[1]

    def lut(self) -> Tensor:
        """(n, n_groups, 16) float32 decode table (exp only)."""
        return exp_lut(self.scale, self.ratio)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (n, k) weight, bit-exact in float32; kept columns not applied (:meth:`side`)."""
        k = self.info.shape[1]
        if self.info.type == "W4A16_EXP":
            idx = to_groups(self.q.long(), self.group_len)  # (n, n_groups, G)
            return torch.gather(self.lut(), -1, idx).flatten(1)[:, :k].to(dtype)
        scale = expand_groups(self.scale, self.group_len, k)
        offset = expand_groups(self.offset, self.group_len, k)
        return ((self.q.float() - offset) * scale).to(dtype)


def pack_linear(qt: QTensor, info: LayerInfo) -> dict[str, Tensor]:
    """The stored tensors of one linear, by local name (``weight``, ``weight_scale``, ...)."""
    side = {f: getattr(qt, f) for f in KEEP_FIELDS if getattr(qt, f) is not None}
    return {**_pack_codes(qt, info), **side}


def _pack_codes(qt: QTensor, info: LayerInfo) -> dict[str, Tensor]:
    if info.type == "W4A16_EXP":
        return {
            "weight": pack_rows(qt.codes, 4),
            "weight_scale": qt.scales.half(),
            "weight_ratio": qt.ratios.half(),
        }
    q, scale, offset = qt.signed()
    if info.type in ascend.ASCEND_TYPES:
        return ascend.pack_int(q, scale, offset, info.bits, info.group_size)
    out = {"weight": pack_rows(to_field(q, info.bits), info.bits), "weight_scale": qt.scales.half()}
    if not info.symmetric:
        out["weight_offset"] = offset.to(torch.int8)  # integer code offsets, exact
    return out


def unpack_linear(tensors: dict[str, Tensor], info: LayerInfo) -> LinearCodes:
    """Inverse of ``pack_linear`` (shared by every runtime backend)."""
    codes = _unpack_codes(tensors, info)
    if "keep_idx" in tensors:
        idx, vals = tensors["keep_idx"].long(), tensors["keep_vals"].float()
        if tuple(vals.shape) != (info.shape[0], idx.numel()):
            raise ValueError(f"keep_vals {tuple(vals.shape)} does not match {info.shape}")
        codes.keep_idx, codes.keep_vals = idx, vals
    return codes


def _unpack_codes(tensors: dict[str, Tensor], info: LayerInfo) -> LinearCodes:
    n, k = info.shape
    if info.type == "W4A16_EXP":
        codes = unpack_rows(tensors["weight"], 4, k)
        return LinearCodes(
            info, codes, tensors["weight_scale"].float(), ratio=tensors["weight_ratio"].float()
        )
    if info.type in ascend.ASCEND_TYPES:
        q, scale, offset = ascend.unpack_int(tensors, info.bits, info.group_size)
    else:
        q = from_field(unpack_rows(tensors["weight"], info.bits, k), info.bits)
        scale = tensors["weight_scale"].float()
        off = tensors.get("weight_offset")
        offset = torch.zeros_like(scale) if off is None else off.float()
    if tuple(q.shape) != (n, k) or scale.shape != offset.shape or scale.shape[0] != n:
        raise ValueError(
            f"stored tensors do not match {info.type} {info.shape}: weight "
            f"{tuple(q.shape)}, scale {tuple(scale.shape)}"
        )
    return LinearCodes(info, q, scale, offset)
