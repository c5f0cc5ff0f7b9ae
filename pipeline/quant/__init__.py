"""Quantization math: formats, RTN and GPTQ quantizers, fake-quant layers, bit packing.

Pure tensor code: tensors and small frozen dataclasses in, tensors out.
"""

from pipeline.quant.fakequant import FakeQuantLinear, grad_scale_factor
from pipeline.quant.formats import GRAMMAR, Format, parse_format
from pipeline.quant.gptq import HessianAccumulator, gptq_quantize
from pipeline.quant.packing import (
    pack_bits,
    pack_int4_ascend,
    pack_int4_npu_int32,
    unpack_bits,
    unpack_int4_ascend,
    unpack_int4_npu_int32,
)
from pipeline.quant.qtensor import QTensor, load_qtensors, save_qtensors
from pipeline.quant.rtn import quantize_rtn

__all__ = [
    "GRAMMAR",
    "FakeQuantLinear",
    "Format",
    "HessianAccumulator",
    "QTensor",
    "gptq_quantize",
    "grad_scale_factor",
    "load_qtensors",
    "pack_bits",
    "pack_int4_ascend",
    "pack_int4_npu_int32",
    "parse_format",
    "quantize_rtn",
    "save_qtensors",
    "unpack_bits",
    "unpack_int4_ascend",
    "unpack_int4_npu_int32",
]
