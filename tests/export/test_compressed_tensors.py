"""compressed-tensors export, checked with the real compressed-tensors library."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.export import ExportError, export_artifact
from pipeline.export.compressed_tensors import pack_int32
from pipeline.export.source import Linear, Source
from tests.export.models import export_options

ct = pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_int32_matches_library(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (6, 100), dtype=torch.int8)
    assert torch.equal(pack_int32(q, bits), pack_to_int32(q, bits))
    zp = torch.randint(-half, half, (10, 3), dtype=torch.int8)
    assert torch.equal(pack_int32(zp.t(), bits).t(), pack_to_int32(zp, bits, packed_dim=0))


def test_decompressing_gives_the_same_weights(qmodels, tmp_path):
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from compressed_tensors.quantization import QuantizationConfig

    src = qmodels.get(("int4g128", "int4g128-sym", "int8", "int4"))
    art = tmp_path / "ct"
    m = export_artifact(
        src, art, export_options(format="compressed-tensors", float_dtype="keep"), draft=qmodels.fp
    )
    assert m["format"] == "compressed-tensors"
    draft_config = json.loads((art / "draft" / "config.json").read_text())
    assert "quantization_config" not in draft_config  # the FP draft stays a plain checkpoint
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qcfg)  # the library accepts the config as written
    assert qcfg["format"] == "pack-quantized" and "lm_head" in qcfg["ignore"]
    stored = load_file(art / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    weights = CompressedTensorsDequantizer(art, dtype=torch.float32).validate(dict(stored))
    n = 0
    for it in Source.open(src).items():
        if isinstance(it, Linear):
            # the library multiplies in the scale's dtype (fp16): one rounding of the exact value
            ref = it.qt.dequantize().half().float()
            assert torch.equal(weights[f"{it.name}.weight"], ref), it.name
            n += 1
    assert n == 7


def test_transformers_loads_symmetric_checkpoint(qmodels, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.models.quantized import load_quantized
    from tests.export.models import tokens

    src = qmodels.get(("int4g128-sym", "int8-sym"))
    art = tmp_path / "ct"
    export_artifact(src, art, export_options(format="compressed-tensors", float_dtype="keep"))
    model = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32).eval()
    x = tokens()
    with torch.no_grad():
        got, ref = model(input_ids=x).logits, load_quantized(src)(input_ids=x).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_refuses_formats_vllm_cannot_run(qmodels, tmp_path):
    with pytest.raises(ExportError, match="int4 and int8 weights only"):
        export_artifact(
            qmodels.get(("int4g128", "int3g128")),
            tmp_path / "ct",
            export_options(format="compressed-tensors"),
        )
