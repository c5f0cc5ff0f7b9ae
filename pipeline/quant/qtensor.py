"""QTensor: a quantized weight matrix (codes + group parameters) and its flat state dict.

* ``codes``: unpacked uint8 ``[out, in]``, column ``j`` in group ``j // G`` (``G = fmt.group_size``
  or ``in``); group parameters ``[out, n_groups]``, the last group may be partial.
* ``int``: ``W = (codes - zeros) * scales``, ``scales`` fp16, ``zeros`` uint8 codes in
  ``[0, 2**b - 1]`` (asymmetric) or None (symmetric: the origin is the code ``2**(b-1)``).
* ``exp``: ``W = lut[codes]`` per group (``codec.exponential``); ``scales``, ``ratios``: fp16 s, r.
* ``float``: ``codes`` is the int16 bit pattern of the fp16 weight; no group parameters.
* Kept columns (``keep_fp16``): ``W[:, keep_idx] = keep_vals``, ``keep_idx`` int32 ``[k]``
  ascending, ``keep_vals`` fp16 ``[out, k]``; those columns' codes are stored but never read.

``signed()``: Ascend's ``W = (q - offset) * scale`` exactly, ``q = codes - 2**(b-1)`` int8,
``offset = zeros - 2**(b-1)`` (0 if symmetric). ``to_state_dict(prefix)`` writes
``{prefix}.<field>`` and ``{prefix}.format`` (the name in ASCII): a state dict rebuilds it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pipeline.quant.formats import Format, parse_format

_FIELDS = ("codes", "scales", "zeros", "ratios", "keep_idx", "keep_vals")
STATE_FIELDS = (*_FIELDS, "format")  # every ``{prefix}.<field>`` key ``to_state_dict`` may write


@dataclass
class QTensor:
    """A quantized ``[out, in]`` weight; see the module docstring for the convention."""

    codes: Tensor  # (out, in) uint8 (int16 fp16 bits for `float`)
    scales: Tensor | None  # (out, n_groups) fp16; exp: the base s
    zeros: Tensor | None  # (out, n_groups) uint8; asymmetric int only
    fmt: Format
    shape: tuple[int, int]
    ratios: Tensor | None = None  # (out, n_groups) fp16; exp only
    keep_idx: Tensor | None = None  # (k,) int32 kept input columns, ascending
    keep_vals: Tensor | None = None  # (out, k) fp16 their exact weights

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        if tuple(self.codes.shape) != self.shape:
            raise ValueError(f"codes shape {tuple(self.codes.shape)} != shape {self.shape}")
        if (self.keep_idx is None) != (self.keep_vals is None):
            raise ValueError("keep_idx and keep_vals come together")
        if self.keep_idx is not None:
            k = self.keep_idx.numel()
            if self.fmt.kind == "float" or tuple(self.keep_vals.shape) != (self.shape[0], k):
                raise ValueError(
                    f"keep_vals shape {tuple(self.keep_vals.shape)} != ({self.shape[0]}, {k}) "
                    f"or a float layer ({self.fmt.name}) with kept columns"
                )
        if self.fmt.kind != "float":
            n_groups = self.fmt.n_groups(self.shape[1])
            for name in ("scales", "zeros", "ratios"):
                t = getattr(self, name)
                if t is not None and tuple(t.shape) != (self.shape[0], n_groups):
                    raise ValueError(
                        f"{name} shape {tuple(t.shape)} != "
                        f"({self.shape[0]}, {n_groups}) for {self.fmt.name}"
                    )

    @classmethod
    def from_params(cls, codes: Tensor, fmt: Format, p1: Tensor, p2: Tensor) -> QTensor:
        """From int64 codes (out, in) and the codec's float32 group parameters (out, n_groups)."""
        scales, zeros, ratios = fmt.codec.store(p1, p2)
        return cls(codes.to(torch.uint8), scales, zeros, fmt, tuple(codes.shape), ratios)

    @classmethod
    def from_float(cls, w: Tensor) -> QTensor:
        """The ``float`` format: fp16 weights stored as their int16 bit pattern."""
        h = w.detach().to(torch.float16)
        if not torch.isfinite(h).all():
            raise ValueError(
                "weight has values that are not finite in fp16 (|w| > 65504 or "
                "NaN/Inf); keep this layer in its original dtype outside lowbit"
            )
        return cls(
            h.view(torch.int16).contiguous(), None, None, parse_format("float"), tuple(h.shape)
        )

    def with_kept(self, w: Tensor, columns: Tensor | list[int] | None) -> QTensor:
        """This QTensor with ``columns`` of ``w`` (out, in) kept exactly (fp16); none: as is."""
        if columns is None or len(columns) == 0:
            return self
        idx = torch.as_tensor(columns, dtype=torch.int64, device=w.device).sort().values
        vals = w.detach()[:, idx].to(torch.float16)
        if not torch.isfinite(vals).all():
            raise ValueError("kept columns have values that are not finite in fp16")
        return replace(self, keep_idx=idx.to(torch.int32), keep_vals=vals.contiguous())

    @property
    def kept(self) -> int:
        """Number of kept columns."""
        return 0 if self.keep_idx is None else self.keep_idx.numel()

    @property
    def group_len(self) -> int:
        return self.fmt.group_len(self.shape[1])

    def params(self) -> tuple[Tensor, Tensor]:
        """The codec's float32 group parameters ``(p1, p2)`` (not for ``float``)."""
        return self.fmt.codec.load(self.scales, self.zeros, self.ratios)

    @property
    def lut(self) -> Tensor | None:
        """(out, n_groups, 16) float32 decode table for exp formats; None otherwise."""
        if self.fmt.kind == "float":
            return None
        return self.fmt.codec.lut(*self.params())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Reconstruct the ``[out, in]`` weight."""
        if self.fmt.kind == "float":
            return self.codes.view(torch.float16).to(dtype)
        w = self.fmt.codec.dequantize(self.codes, *self.params(), self.group_len)
        if self.keep_idx is not None:
            w[:, self.keep_idx.long()] = self.keep_vals.to(w)
        return w.to(dtype)

    def signed(self) -> tuple[Tensor, Tensor, Tensor]:
        """Ascend's ``W = (q - offset) * scale``: q int8, scale and offset float32 (out, groups)."""
        if self.fmt.kind != "int":
            raise ValueError(
                f"signed() needs an int format, got {self.fmt.name}; exp codes "
                "decode through .lut and float weights through dequantize()"
            )
        return self.fmt.codec.signed(self.codes, *self.params())

    def to(self, device: torch.device | str) -> QTensor:
        moved = {n: getattr(self, n).to(device) for n in _FIELDS if getattr(self, n) is not None}
        return replace(self, **moved)

    def to_state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """Flat tensors (format name included) under ``{prefix}.<field>``."""
        sd = {
            _key(prefix, n): getattr(self, n).contiguous()
            for n in _FIELDS
            if getattr(self, n) is not None
        }
        sd[_key(prefix, "format")] = torch.tensor(list(self.fmt.name.encode()), dtype=torch.uint8)
        return sd

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor], prefix: str = "") -> QTensor:
        """Inverse of ``to_state_dict``."""
        fkey = _key(prefix, "format")
        if fkey not in sd or _key(prefix, "codes") not in sd:
            raise KeyError(
                f"no quantized tensor under prefix {prefix!r} "
                f"(expected keys {fkey!r} and {_key(prefix, 'codes')!r})"
            )
        fmt = parse_format(bytes(sd[fkey].tolist()).decode())
        fields = {n: sd.get(_key(prefix, n)) for n in _FIELDS}
        return cls(fmt=fmt, shape=tuple(fields["codes"].shape), **fields)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
