"""Codecs: one per format family, each owning its fit, encode, decode, storage and fake-quant.

* ``IntCodec`` (``pipeline.quant.codec.integer``): uniform codes, per-group scale and zero.
* ``ExpCodec`` (``pipeline.quant.codec.exponential``): 4-bit sign + index on a geometric grid,
  per-group base and ratio, decoded through a 16-entry LUT.

RTN, GPTQ, fake-quant and QTensor take the codec from the format (``fmt.codec``) and never
branch on the family; the interface is ``base.Codec``. The artifact reader and the runtime
import the group layout (``to_groups``, ``expand_groups``) and ``exp_lut`` from here. ``float``
is not a quantized family: it has no codec (fp16 weights are stored as they are).
"""

from __future__ import annotations

from functools import cache

from pipeline.quant.codec.base import (
    Codec,
    expand_groups,
    to_fp16,
    to_groups,
)
from pipeline.quant.codec.exponential import EXP_LEVELS, ExpCodec, exp_lut
from pipeline.quant.codec.integer import IntCodec


@cache
def codec_for(kind: str, bits: int, symmetric: bool) -> Codec:
    """The codec of a quantized format family (``kind`` "int" or "exp")."""
    if kind == "int":
        return IntCodec(bits, symmetric)
    if kind == "exp":
        return ExpCodec()
    raise ValueError(f"{kind!r} weights are not quantized; only int and exp formats have a codec")


__all__ = [
    "EXP_LEVELS",
    "Codec",
    "ExpCodec",
    "IntCodec",
    "codec_for",
    "exp_lut",
    "expand_groups",
    "to_fp16",
    "to_groups",
]
