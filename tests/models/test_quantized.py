"""The quantized model directory: write part by part, load as FakeQuantLinear, save back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.errors import LowbitError
from pipeline.models import CheckpointError, StreamingCheckpoint
from pipeline.models.quantized import (
    QuantizedWriter,
    load_quantized,
    quantized_modules,
    read_quant_meta,
    save_quantized_model,
)
from pipeline.models.synthetic import write_synthetic_checkpoint
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.quant.rtn import quantize_rtn

TINY = dict(hidden=32, layers=2, intermediate=48, heads=4, kv_heads=2, vocab=61)
FORMATS = {"self_attn.q_proj": "int4g32", "self_attn.v_proj": "exp4g32", "mlp.down_proj": "int3g32",
           "mlp.up_proj": "int2g32-sym"}  # fmt: skip


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src")
    return write_synthetic_checkpoint(path, **TINY, shard_bytes=30_000, dtype=torch.float32)


def write_rtn(src: Path, out: Path, parts_dir: Path | None = None) -> tuple[dict, dict]:
    """Quantize FORMATS in every block with RTN, one part per block (as the stage does)."""
    ck = StreamingCheckpoint(src)
    writer = QuantizedWriter(out, parts_dir)
    layers, qts = {}, {}
    writer.write_part(0, {"model.embed_tokens.weight": ck.tensor("model.embed_tokens.weight")})
    for i in range(ck.num_layers):
        prefix = f"model.layers.{i}."
        q = {prefix + n: quantize_rtn(ck.tensor(prefix + n + ".weight"), f)
             for n, f in FORMATS.items()}  # fmt: skip
        floats = {n: ck.tensor(n) for n in ck.names()
                  if n.startswith(prefix) and n[: -len(".weight")] not in q}  # fmt: skip
        writer.write_part(i + 1, floats, q)
        layers.update({n: qt.fmt.name for n, qt in q.items()})
        qts.update(q)
    last = ck.num_layers + 1
    writer.write_part(last, {n: ck.tensor(n) for n in ("model.norm.weight", "lm_head.weight")})
    writer.close(last + 1, src_dir=src, method="rtn", layers=layers)
    return layers, qts


def test_load_quantized_logits_equal_dequantized_reference(src, tmp_path):
    out = tmp_path / "q"
    layers, qts = write_rtn(src, out)
    assert read_quant_meta(out) == {"format_version": 1, "method": "rtn", "layers": layers}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.1.mlp.down_proj.codes"] == (
        "model-00003-of-00004.safetensors")  # fmt: skip
    assert "model.layers.1.mlp.down_proj.weight" not in index["weight_map"]
    assert not (out / ".parts").exists()

    model = load_quantized(out)
    assert set(quantized_modules(model)) == set(layers)
    ref = StreamingCheckpoint(src).full_model(torch.float32)
    with torch.no_grad():
        for name, qt in qts.items():
            ref.get_submodule(name).weight.copy_(qt.dequantize())
    ids = torch.randint(0, TINY["vocab"], (2, 10))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want, StreamingCheckpoint(src).full_model()(input_ids=ids).logits)


def test_save_quantized_model_roundtrip_with_tied_head(tmp_path):
    src = write_synthetic_checkpoint(tmp_path / "tied", **TINY, dtype=torch.float32,
                                     tie_word_embeddings=True)  # fmt: skip
    model = StreamingCheckpoint(src).full_model(torch.float32)
    for name in ("model.layers.0.mlp.gate_proj", "lm_head"):
        model.set_submodule(name, FakeQuantLinear.from_linear(model.get_submodule(name), "int8"))
    out = save_quantized_model(model, tmp_path / "out", src, "distill", shard_bytes=20_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    # The quantized head is no longer the embedding matrix: the copied config unties them.
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    back = load_quantized(out)
    assert set(quantized_modules(back)) == {"model.layers.0.mlp.gate_proj", "lm_head"}
    ids = torch.randint(0, TINY["vocab"], (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_parts_resume_and_damage(src, tmp_path):
    parts = tmp_path / "parts"
    writer = QuantizedWriter(tmp_path / "m", parts)
    writer.write_part(0, {"x": torch.ones(3)})
    assert writer.has_part(0) and not writer.has_part(1)
    part = writer.part_path(0)
    part.write_bytes(part.read_bytes()[:-4])  # a part cut short is not taken as finished
    assert not writer.has_part(0)
    with pytest.raises(LowbitError, match=r"parts \[0\]"):
        writer.close(1, src_dir=src, method="rtn", layers={})


def test_damaged_model_directories_fail_clearly(src, tmp_path):
    out = tmp_path / "q"
    write_rtn(src, out)
    meta = json.loads((out / "lowbit_quant.json").read_text())
    shard = out / "model-00002-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=shard.name):
        load_quantized(out)
    (out / "lowbit_quant.json").write_text(json.dumps({**meta, "format_version": 9}))
    with pytest.raises(LowbitError, match="format_version"):
        load_quantized(out)
    (out / "lowbit_quant.json").unlink()
    with pytest.raises(LowbitError, match="lowbit_quant.json is missing"):
        load_quantized(out)
