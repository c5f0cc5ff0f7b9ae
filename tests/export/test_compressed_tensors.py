"""compressed-tensors export, checked with the real compressed-tensors library."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from pipeline.export import ExportError, export_artifact
from pipeline.export.source import Linear, Source
from tests._require import needs
from tests.export.models import export_options

pytestmark = needs("compressed-tensors")


@pytest.fixture(scope="module")
def mixed(qmodels, tmp_path_factory):
    """A target with asymmetric and symmetric int4 groups, int8 and int4 per channel."""
    src = qmodels.get(("int4g128", "int4g128-sym", "int8", "int4"))
    art = tmp_path_factory.mktemp("ct") / "ct"
    m = export_artifact(
        src, art, export_options(format="compressed-tensors", float_dtype="keep"), draft=qmodels.fp
    )
    return src, art, m


def reference_weights(src) -> dict[str, torch.Tensor]:
    # the library multiplies in the scale's dtype (fp16): one rounding of the exact value
    return {
        it.name: it.qt.dequantize().half().float()
        for it in Source.open(src).items()
        if isinstance(it, Linear)
    }


def test_decompressing_gives_the_same_weights(mixed):
    import compressed_tensors
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )

    src, art, m = mixed
    assert m["format"] == "compressed-tensors"
    draft_config = json.loads((art / "draft" / "config.json").read_text())
    assert "quantization_config" not in draft_config  # the FP draft stays a plain checkpoint
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors"
    assert qcfg["version"] == compressed_tensors.__version__
    assert qcfg["format"] == "pack-quantized" and "lm_head" in qcfg["ignore"]
    stored = load_file(art / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    weights = CompressedTensorsDequantizer(art, dtype=torch.float32).validate(dict(stored))
    ref = reference_weights(src)
    assert len(ref) == 7
    for name, w in ref.items():
        assert torch.equal(weights[f"{name}.weight"], w), name


def test_library_parses_the_config_and_unpacks_each_layer_by_it(mixed):
    """Our config, parsed back by the library, drives its own decompression of each layer."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src, art, _ = mixed
    written = json.loads((art / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(written)
    assert parsed.quantization_status == "compressed"
    by_layer = {t: s for s in parsed.config_groups.values() for t in s.targets}
    # four formats, four schemes: int4 g128 asym / sym, int8 and int4 per channel
    kinds = {
        (s.weights.num_bits, s.weights.strategy, s.weights.group_size, s.weights.symmetric)
        for s in parsed.config_groups.values()
    }
    assert kinds == {
        (4, "group", 128, False),
        (4, "group", 128, True),
        (8, "channel", None, False),
        (4, "channel", None, False),
    }
    stored = load_file(art / "model.safetensors")
    for name, ref in reference_weights(src).items():
        state = {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(name)}
        assert ("weight_zero_point" in state) == (not by_layer[name].weights.symmetric), name
        got = PackedQuantizationCompressor.decompress(state, by_layer[name])["weight"]
        assert torch.equal(got.float(), ref), name


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


def test_missing_library_names_the_extra(qmodels, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "compressed_tensors.compressors", None)  # not installed
    with pytest.raises(ExportError, match=r"pip install 'lowbit\[compressed-tensors\]'"):
        export_artifact(
            qmodels.get("int4g128-sym"),
            tmp_path / "ct",
            export_options(format="compressed-tensors"),
        )
    assert not any((tmp_path / "ct").iterdir())  # refused before anything was written
