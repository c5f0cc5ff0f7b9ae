"""Outlier channels outside the int8 activations: float columns beside the W*A8 kernel, the
float-activation fallback, and the column list through the manifest, export and loader."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.artifact.lowbit_format import LayerInfo
from pipeline.export import export_artifact
from pipeline.quant import act8
from pipeline.runtime import kernels
from pipeline.runtime.backends import TorchQuantLinear
from pipeline.runtime.kernels import relative_error
from pipeline.runtime.loader import load
from tests.export.models import export_options, tokens
from tests.runtime.test_kernels import _codes, needs_kernels

OUTLIERS = [5, 70, 200]


def _outlier_input(rows: int = 6, k: int = 256) -> torch.Tensor:
    torch.manual_seed(3)
    x = torch.randn(rows, k)
    x[:, OUTLIERS] *= 60.0  # LLM.int8()-like channels: each stretches its block's int8 scale
    return x


def _with(codes, **fields):
    codes.info = replace(codes.info, **fields)
    return codes


@needs_kernels
@pytest.mark.parametrize("fmt", ["int4g128", "int8", "int2g64"])
def test_float_columns_remove_the_outliers_int8_error(fmt):
    x = _outlier_input()
    _, plain = _codes(fmt, (48, 256))
    want = kernels.Reference(plain)(x)  # float activations
    a8 = kernels.build(plain)
    assert a8.name.endswith("a8pack")
    _, codes = _codes(fmt, (48, 256))
    split = kernels.build(_with(codes, act_columns=tuple(OUTLIERS)))
    assert split.name == f"{a8.name}+f32cols"
    got = split(x)
    # exactly the kernel on x without the channels plus their float product
    rest, kept = act8.split(x, torch.tensor(OUTLIERS))
    w = kernels.Reference(codes).weight_matrix()
    exact = act8.fake_act8(rest) @ w.T + kept @ w[:, OUTLIERS].T
    assert relative_error(got, exact) < 1e-3
    # and much closer to float activations than the plain int8 kernel
    assert relative_error(got, want) < relative_error(a8(x), want) / 3


@needs_kernels
@pytest.mark.parametrize("fmt", ["int4g128", "int8"])
def test_a16_layers_keep_float_activations(fmt):
    x = _outlier_input()
    _, codes = _codes(fmt, (48, 256))
    want = kernels.Reference(codes)(x)
    a8_err = relative_error(kernels.build(codes)(x), want)
    layer = TorchQuantLinear(_with(codes, a16=True), kernel="auto")
    assert not layer.kernel.endswith("a8pack")  # torch's int4/int8 kernels or the reference
    assert relative_error(layer(x), want) < a8_err / 3


@needs_kernels
def test_out_of_range_columns_are_refused():
    _, codes = _codes("int4g128", (48, 256))
    with pytest.raises(ValueError, match="act_columns 300 out of range for 256"):
        kernels.build(_with(codes, act_columns=(3, 300)))


def test_layer_info_writes_activation_fields_only_when_set():
    info = LayerInfo("W4A16", "int4g128", 4, 128, (48, 256), False)
    assert "act_columns" not in info.to_json() and "a16" not in info.to_json()
    assert LayerInfo.from_json(info.to_json()) == info  # manifests without them load as before
    both = replace(info, act_columns=(200, 5), a16=True)
    assert both.to_json()["act_columns"] == [200, 5]
    assert LayerInfo.from_json(both.to_json()) == both


@needs_kernels
def test_export_carries_the_columns_to_the_loaded_runtime(qmodels, tmp_path):
    src = qmodels.get("int4g128")
    act = {
        "model.layers.0.mlp.down_proj": {"act_columns": (1, 9), "a16": False},
        "model.layers.0.self_attn.k_proj": {"act_columns": (), "a16": True},
    }
    art = tmp_path / "a"
    manifest = export_artifact(src, art, export_options(format="lowbit", act=act), draft=src)
    layers = manifest["layers"]
    assert layers["model.layers.0.mlp.down_proj"]["act_columns"] == [1, 9]
    assert layers["model.layers.0.self_attn.k_proj"]["a16"] is True
    assert "act_columns" not in layers["model.layers.0.self_attn.q_proj"]
    rt = load(art, "torch")
    kinds = rt.kernels
    assert kinds["model.layers.0.mlp.down_proj"].endswith("a8pack+f32cols")
    assert not kinds["model.layers.0.self_attn.k_proj"].endswith("a8pack")
    assert kinds["model.layers.0.self_attn.q_proj"].endswith("a8pack")
    # the draft was exported beside it: it gets none of the target's activation fields
    assert all(k.endswith("a8pack") for k in rt.draft.kernels.values())
    ref = load(art, "torch", draft=None, kernel="reference")
    x = tokens()
    with torch.no_grad():
        assert relative_error(rt.model(input_ids=x).logits, ref.model(input_ids=x).logits) < 2e-2
