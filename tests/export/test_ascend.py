"""ascendv1 layout: packing known answers, types, refusals, description, shards."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from pipeline.artifact.ascend import ascend_type, description, pack_int, unpack_int
from pipeline.artifact.lowbit_format import LayerInfo, plan_layer, unpack_linear
from pipeline.export import ExportError, export_artifact
from pipeline.export.source import Linear, Source
from pipeline.quant.formats import parse_format
from tests.export.models import export_options


def test_int4_per_group_known_answer():
    # msModelSlim's own test vector: pairs along the output dim, low nibble first.
    q = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int8)
    scale = torch.ones(2, 2)
    t = pack_int(q, scale, torch.zeros(2, 2), bits=4, group=2)
    assert t["weight"].dtype == torch.int8
    assert t["weight"].tolist() == [[81, 98, 115, -124]]


def test_int4_per_channel_packs_along_k():
    q = torch.tensor([[1, -2, 3, -8], [7, 0, -1, 5]], dtype=torch.int8)
    t = pack_int(q, torch.ones(2, 1), torch.zeros(2, 1), bits=4, group=0)
    assert t["weight"].shape == (2, 2)
    assert t["weight"][0, 0].item() == -31  # 0xE1: q[0,1] = -2 high, q[0,0] = 1 low
    back, _, _ = unpack_int(t, 4, 0)
    assert torch.equal(back, q)


@pytest.mark.parametrize("group", [0, 64])
def test_int4_roundtrip_random(group):
    q = torch.randint(-8, 8, (6, 128), dtype=torch.int8)
    n_groups = 2 if group else 1
    t = pack_int(q, torch.rand(6, n_groups), torch.zeros(6, n_groups), bits=4, group=group)
    assert t["weight"].shape == ((3, 128) if group else (6, 64))
    assert torch.equal(unpack_int(t, 4, group)[0], q)


def _stored(art, manifest):
    sd = {}
    for f in sorted(art.glob("quant_model_weights*.safetensors")):
        sd.update(load_file(f))
    return sd


def _layer(sd, name):
    return {k[len(name) + 1 :]: v for k, v in sd.items() if k.startswith(name + ".")}


def test_ascend_int4_layout_and_dequant(qmodels, tmp_path):
    src = qmodels.get(("int4g128", "int4g128-sym", "int8"))
    art = tmp_path / "a"
    m = export_artifact(src, art, export_options(format="ascend", float_dtype="keep"))
    sd = _stored(art, m)
    ref = {it.name: it.qt for it in Source.open(src).items() if isinstance(it, Linear)}
    for name, d in m["layers"].items():
        info = LayerInfo.from_json(d)
        t = _layer(sd, name)
        n, k = info.shape
        assert t["weight"].dtype == torch.int8
        assert t["weight_scale"].dtype == t["weight_offset"].dtype == torch.float32
        if info.type == "W4A16":
            assert info.group_size == 128 and t["weight"].shape == (n // 2, k)
            assert t["weight_scale"].shape == (n, k // 128)
        else:
            assert info.type == "W8A16" and t["weight"].shape == (n, k)
            assert t["weight_scale"].shape == (n, 1)
        if ref[name].fmt.symmetric:
            assert not t["weight_offset"].any()
        w = unpack_linear(t, info).dequantize()
        assert torch.equal(w, ref[name].dequantize())


def test_description_lists_every_tensor(qmodels, tmp_path):
    art = tmp_path / "a"
    m = export_artifact(qmodels.get("int4g128"), art, export_options(format="ascend"))
    desc = json.loads((art / "quant_model_description.json").read_text())
    saved = set(_stored(art, m))
    assert saved == set(m["tensors"]) and saved <= set(desc)
    assert set(desc) - saved == {"model_quant_type", "version", "group_size", "metadata"}
    assert desc["model_quant_type"] == "W4A16" and desc["version"] == "1.0.0"
    assert desc["group_size"] == 128 and desc["metadata"] == {}
    assert desc["model.embed_tokens.weight"] == desc["lm_head.weight"] == "FLOAT"
    assert desc["model.norm.weight"] == "FLOAT"
    assert desc["model.layers.0.mlp.down_proj.weight_offset"] == "W4A16"
    config = json.loads((art / "config.json").read_text())
    assert "quantization_config" not in config
    # MindIE's keys: `quantize` routes to its quantized loader; transformers 4.x reads torch_dtype.
    assert config["quantize"] == "w4a16" and config["torch_dtype"] == config["dtype"]
    assert (art / "tokenizer.json").is_file() and not (art / "lowbit_quant.json").exists()


@pytest.mark.parametrize(
    ("fmt", "widen", "fix"),
    [
        ("int2g64", False, "stage.export.widen=true"),
        ("int3g128", False, "stage.export.format=lowbit"),
        ("exp4g128", True, "quant=w4g128"),  # exp codes cannot be widened exactly
        ("int4g32", False, "int4g128"),
        ("int2g32", True, "group sizes"),  # widened to int4, whose kernel has no g32
    ],
)
def test_ascend_type_refusals_name_the_fix(fmt, widen, fix):
    with pytest.raises(ExportError, match=re.escape(fix)):
        ascend_type("layer", parse_format(fmt), (256, 256), widen, False)


def test_ascend_per_channel_when_group_spans_row():
    # k = 128 with G = 128: the kernel wants G <= k - 1, a whole-row group is per channel
    info = plan_layer("l", parse_format("int4g128"), (64, 128), "ascend")
    assert info.type == "W4A16" and info.group_size == 0


def test_ascend_refuses_before_writing(qmodels, tmp_path):
    src = qmodels.get(("int4g128", "int2g64", "int3g128"))
    with pytest.raises(ExportError, match=r"int2g64.*\(\d+ more layers likewise\)"):
        export_artifact(src, tmp_path / "a", export_options(format="ascend"))
    assert not any((tmp_path / "a").glob("*.safetensors"))


@pytest.mark.parametrize("fmt", ["int2g64", "int3g128"])
def test_widen_is_exact(qmodels, tmp_path, fmt):
    src = qmodels.get(fmt)
    art = tmp_path / "a"
    m = export_artifact(src, art, export_options(format="ascend", widen=True, shard_bytes=1))
    sd = _stored(art, m)
    for it in Source.open(src).items():
        if isinstance(it, Linear):
            info = LayerInfo.from_json(m["layers"][it.name])
            assert info.type == "W4A16" and info.bits == 4 and info.format == fmt
            q = unpack_linear(_layer(sd, it.name), info)
            assert q.q.min() >= -(1 << (it.qt.fmt.bits - 1))  # codes stayed in their range
            assert torch.equal(q.dequantize(), it.qt.dequantize())
    # shard_bytes=1: one tensor per shard, named HF-style, with an index covering all
    index = json.loads((art / "quant_model_weights.safetensors.index.json").read_text())
    n = len(index["weight_map"])
    assert set(index["weight_map"].values()) == {
        f"quant_model_weights-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    }


def test_w8a8_dynamic_tagging(qmodels, tmp_path):
    art = tmp_path / "a"
    m = export_artifact(
        qmodels.get(("int8-sym", "int8")), art, export_options(format="ascend", w8a8_dynamic=True)
    )
    types = {n: d["type"] for n, d in m["layers"].items()}
    assert types["model.layers.0.self_attn.q_proj"] == "W8A8_DYNAMIC"  # symmetric per channel
    assert types["model.layers.0.self_attn.k_proj"] == "W8A16"  # asymmetric stays weight-only
    desc = json.loads((art / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"


def test_description_unit():
    d = description({"a.weight": "W4A16", "b.weight": "FLOAT"}, {"a": 64})
    assert d["model_quant_type"] == "W4A16" and d["group_size"] == 64
    assert description({"b.weight": "FLOAT"}, {})["model_quant_type"] == "FLOAT"


def test_kept_columns_are_refused_naming_the_fix():
    from pipeline.artifact.lowbit_format import refuse_kept_columns

    layers = {"a": "int4g128", "b": "int4g128"}
    refuse_kept_columns({"a.codes", "b.codes"}, layers, "ascend")  # none kept: fine
    with pytest.raises(ExportError, match=r"1 layers \(e\.g\. b\).*quant\.outliers=none.*lowbit"):
        refuse_kept_columns({"a.codes", "b.codes", "b.keep_idx"}, layers, "ascend")
