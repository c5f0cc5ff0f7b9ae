"""Weight formats: names, parsing and exact storage cost.

A format name is one of

    int{2,3,4,8}[g{32,64,128}][-sym]   uniform integer; no ``g`` = one scale per output channel
    exp4g{32,64,128}[-design]          4-bit exponential (sign + 3-bit index on a geometric grid);
                                       -design: the grid by the method's formula, not searched
    float                              16-bit float, kept unquantized

Storage, per output row of ``in_features`` weights (this is what ``bits_per_weight`` counts):

* ``int``: ``bits`` per code, one fp16 scale per group, and for asymmetric formats one zero
  point per group stored as a ``bits``-bit unsigned integer (it is a code value). Symmetric
  formats have no stored zero (the origin is the fixed code ``2**(bits-1)``).
* ``exp``: 4 bits per code, fp16 base ``s`` and fp16 ratio ``r`` per group (the 16-entry
  lookup table is derived from them, not stored).
* ``float``: 16 bits per weight (fp16).

Groups run along the input dimension inside each output row. A trailing partial group (when
``in_features`` is not a multiple of the group size) still costs one full set of parameters.

The math of each quantized family (fit, encode, decode, what a group's parameters cost) is its
codec, ``Format.codec`` (``pipeline.quant.codec``); this module only names formats and counts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pipeline.quant.codec import Codec, codec_for

FLOAT_BITS = 16  # fp16 weight for the `float` format
INT_BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)
EXP_BITS = 4

GRAMMAR = (
    "int{2,3,4,8}[g{32,64,128}][-sym] (no g = per output channel), exp4g{32,64,128}[-design], "
    "float; e.g. int4g128, int3g64-sym, int8, exp4g128, exp4g128-design"
)
_INT_RE = re.compile(r"int(?P<bits>\d+)(?:g(?P<group>\d+))?(?P<sym>-sym)?")
_EXP_RE = re.compile(r"exp(?P<bits>\d+)g(?P<group>\d+)(?P<design>-design)?")


@dataclass(frozen=True)
class Format:
    """A parsed weight format.

    Attributes:
        name: The canonical format name, e.g. ``"int4g128"``.
        kind: ``"int"``, ``"exp"`` or ``"float"``.
        bits: Bits per code (16 for ``float``).
        group_size: Weights per group along the input dim; 0 = one group per output channel.
        symmetric: True for ``-sym`` int formats (no zero point). exp formats are sign-magnitude
            and count as symmetric; ``float`` as well.
        variant: ``"design"`` for ``exp4g*-design`` (the method's formula grid), else ``""``.
    """

    name: str
    kind: str
    bits: int
    group_size: int
    symmetric: bool
    variant: str = ""

    @property
    def codec(self) -> Codec:
        """The family's codec; ``float`` has none (ValueError): check ``kind`` first."""
        return codec_for(self.kind, self.bits, self.symmetric, self.variant)

    @property
    def maxq(self) -> int:
        """Largest unsigned code value (``2**bits - 1``)."""
        return (1 << self.bits) - 1

    def group_len(self, in_features: int) -> int:
        """Number of input columns sharing one set of group parameters."""
        return self.group_size if self.group_size > 0 else in_features

    def n_groups(self, in_features: int) -> int:
        """Number of groups per output row (the last one may be partial)."""
        if self.kind == "float":
            return 0
        return math.ceil(in_features / self.group_len(in_features))

    def bits_per_weight(self, in_features: int) -> float:
        """Exact storage cost per weight: codes + scales + zeros, in bits.

        Args:
            in_features: Input dimension of the linear layer (row length).

        Returns:
            Average bits per weight for one output row, parameters included.
        """
        if in_features <= 0:
            raise ValueError(f"in_features must be positive, got {in_features}")
        if self.kind == "float":
            return float(FLOAT_BITS)
        per_group = self.codec.param_bits
        total = self.bits * in_features + per_group * self.n_groups(in_features)
        return total / in_features

    def __str__(self) -> str:
        return self.name


def parse_format(name: str) -> Format:
    """Parse a format name.

    Args:
        name: e.g. ``"int4g128"``, ``"int8"``, ``"int3g64-sym"``, ``"exp4g128"``, ``"float"``.

    Returns:
        The frozen ``Format``.

    Raises:
        ValueError: if the name does not follow the grammar; the message lists it.
    """
    if not isinstance(name, str):
        raise ValueError(
            f"format must be a string, got {type(name).__name__} {name!r}; allowed: {GRAMMAR}"
        )
    text = name.strip()
    if text == "float":
        return Format("float", "float", FLOAT_BITS, 0, True)
    m = _INT_RE.fullmatch(text)
    if m:
        bits = int(m["bits"])
        group = int(m["group"]) if m["group"] else 0
        if bits in INT_BITS and (group == 0 or group in GROUP_SIZES):
            return Format(text, "int", bits, group, bool(m["sym"]))
    m = _EXP_RE.fullmatch(text)
    if m and int(m["bits"]) == EXP_BITS and int(m["group"]) in GROUP_SIZES:
        variant = "design" if m["design"] else ""
        return Format(text, "exp", EXP_BITS, int(m["group"]), True, variant)
    raise ValueError(f"unknown quantization format {name!r}; allowed: {GRAMMAR}")


def as_format(fmt: Format | str) -> Format:
    """``fmt`` itself, or its name parsed: quant's math entry points take either."""
    return fmt if isinstance(fmt, Format) else parse_format(fmt)
