"""``AutoModelForCausalLM.from_pretrained`` on a lowbit quantized directory."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.errors import LowbitError
from pipeline.models import hf_quantizer
from pipeline.models.quantized import load_quantized, quantized_modules, save_quantized_model
from pipeline.models.synthetic import write_synthetic_checkpoint
from pipeline.quant.fakequant import FakeQuantLinear
from tests.models.test_quantized import TINY, write_rtn

MODULES = ("pipeline.models.hf", "pipeline.models.hf_quantizer", "pipeline.data.text")


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    """The RTN directory of test_quantized: four formats, one part per block, four shards."""
    root = tmp_path_factory.mktemp("hfq")
    src = write_synthetic_checkpoint(root / "src", **TINY, shard_bytes=30_000, dtype=torch.float32)
    layers, _ = write_rtn(src, root / "q")
    return root / "q", layers


def from_pretrained(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)


def test_config_json_names_the_lowbit_quantizer(qdir):
    out, layers = qdir
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg == {"quant_method": "lowbit", "format_version": 1, "method": "rtn",
                    "layers": layers}  # fmt: skip


def test_from_pretrained_matches_load_quantized(qdir):
    out, layers = qdir
    model = from_pretrained(out)
    ref = load_quantized(out)
    assert set(quantized_modules(model)) == set(layers)
    assert model.is_quantized and model.quantization_method == "lowbit"
    ids = torch.randint(0, TINY["vocab"], (2, 10))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_model_dtype_leaves_stored_scales_exact(qdir):
    """bf16 floats around the codes; the fp16 scales are not rounded through bf16 on load."""
    out, _ = qdir
    model = from_pretrained(out, dtype=torch.bfloat16)
    ref = load_quantized(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    name = "model.layers.1.mlp.down_proj"
    got, want = model.get_submodule(name), ref.get_submodule(name)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.codes, want.codes)
    assert not torch.equal(want.scale.bfloat16().float(), want.scale)  # bf16 would change them


def test_kept_outlier_columns_load_through_from_pretrained(tmp_path):
    """quant.outliers=keep_fp16 directories: the side matrix loads, and the logits are
    load_quantized's (which applies it); dropping it would change them."""
    from pipeline.models import StreamingCheckpoint
    from pipeline.models.quantized import QuantizedWriter
    from pipeline.quant.rtn import quantize_rtn

    src = write_synthetic_checkpoint(tmp_path / "src", **TINY, dtype=torch.float32)
    ck, writer = StreamingCheckpoint(src), QuantizedWriter(tmp_path / "q")
    name = "model.layers.0.mlp.down_proj"
    w = ck.tensor(f"{name}.weight")
    w[:, [3, 7]] *= 40  # two outlier columns, far outside the int2 grid of their groups
    qt = quantize_rtn(w, "int2g32").with_kept(w, [3, 7])
    names = [n for n in ck.names() if n != f"{name}.weight"]
    writer.write_part(0, {n: ck.tensor(n) for n in names}, {name: qt})
    out = writer.close(1, src_dir=src, method="rtn", layers={name: "int2g32"}, kept={name: 2})
    model, ref = from_pretrained(out), load_quantized(out)
    got = model.get_submodule(name)
    assert got.keep_idx.tolist() == [3, 7] and torch.equal(got.keep_vals, qt.keep_vals)
    ids = torch.randint(0, TINY["vocab"], (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        plain = replace(qt, keep_idx=None, keep_vals=None).dequantize()
        assert not torch.allclose(got.quantized_weight(), plain)  # the columns were applied


def test_tied_head_quantized_roundtrip(tmp_path):
    src = write_synthetic_checkpoint(tmp_path / "tied", **TINY, dtype=torch.float32,
                                     tie_word_embeddings=True)  # fmt: skip
    model = from_pretrained(src)
    for name in ("model.layers.0.self_attn.o_proj", "lm_head"):
        model.set_submodule(name, FakeQuantLinear.from_linear(model.get_submodule(name), "int4g32"))
    out = save_quantized_model(model, tmp_path / "out", src, "distill", shard_bytes=20_000)
    back = from_pretrained(out)
    assert isinstance(back.lm_head, FakeQuantLinear)
    ids = torch.randint(0, TINY["vocab"], (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_config_that_does_not_match_the_model_fails_clearly(qdir, tmp_path):
    import shutil

    out, layers = qdir
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["layers"] = {"model.norm": "int4g32"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LowbitError, match="model.norm.*not a linear layer"):
        from_pretrained(bad)
    with pytest.raises(LowbitError, match=r"layers\['x'\] = 'int5'"):
        hf_quantizer.LowbitConfig(layers={"x": "int5"})


def test_imports_register_and_set_no_environment():
    """Loading lowbit's model modules registers the quantizer and writes no os.environ
    (HF_HUB_OFFLINE stays the caller's choice: every load passes local_files_only instead)."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    before = dict(os.environ)
    for name in MODULES:  # run each module's top level again, as a fresh import would
        importlib.reload(importlib.import_module(name))
    assert dict(os.environ) == before
    assert AUTO_QUANTIZER_MAPPING["lowbit"].__name__ == "LowbitHfQuantizer"
    hf_quantizer.register()  # a second time is a no-op, not transformers' "already registered"


def test_loads_never_reach_the_hub(qdir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from pipeline.models.hf import load_causal_lm

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        seen.append(kwargs.get("local_files_only"))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    load_causal_lm(qdir[0])
    assert seen == [True]
