"""Kept outlier columns through the quantized directory, the lowbit artifact and the runtime."""

from __future__ import annotations

import pytest
import torch

from pipeline.artifact.lowbit_format import pack_linear, plan_layer, unpack_linear
from pipeline.export import ExportError, export_artifact
from pipeline.models.quantized import load_quantized, save_quantized_model
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.quant.rtn import quantize_rtn
from pipeline.runtime.backends import TorchQuantLinear
from pipeline.runtime.kernels import relative_error
from pipeline.runtime.loader import load
from tests.export.models import export_options, tokens

KEEP = [0, 7, 100]


@pytest.fixture(scope="module")
def kept_dir(qmodels, tmp_path_factory):
    """The export tests' model, every linear but lm_head int4g128 with columns KEEP kept."""
    model = qmodels.fp_model()
    for name, lin in list(model.named_modules()):
        if isinstance(lin, torch.nn.Linear) and name != "lm_head":
            qt = quantize_rtn(lin.weight, "int4g128", keep=KEEP)
            model.set_submodule(name, FakeQuantLinear.from_qtensor(qt, lin.bias))
    out = tmp_path_factory.mktemp("kept") / "q"
    return save_quantized_model(model, out, qmodels.fp, "rtn")


@pytest.mark.parametrize("fmt", ["int2g64", "int4g128", "int8", "exp4g128"])
@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_layer_with_kept_columns_equals_fake_quant(fmt, kernel):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    qt = quantize_rtn(w, fmt, keep=KEEP)
    info = plan_layer("l", qt.fmt, qt.shape, "lowbit")
    codes = unpack_linear(pack_linear(qt, info), info)
    layer = TorchQuantLinear(codes, kernel=kernel)
    x = torch.randn(5, 256)
    x[:, KEEP] *= 20.0  # outlier channels: the kept columns dominate the output
    want = FakeQuantLinear.from_qtensor(qt)(x).detach()
    if kernel == "reference":
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(layer.weight_matrix(), qt.dequantize(), rtol=0, atol=1e-6)
    else:  # bf16 activations in the packed kernels; the side matrix is added in fp32
        assert relative_error(layer(x), want) < 2e-2
    # Without its side matrix the layer computes something else: the kept columns count.
    no_side = TorchQuantLinear(unpack_linear(pack_linear(quantize_rtn(w, fmt), info), info))
    assert relative_error(no_side(x), want) > 1e-4


def test_quantized_dir_keeps_columns_and_runtime_matches_it(kept_dir, tmp_path):
    model = load_quantized(kept_dir)
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    assert layer.keep_idx.tolist() == KEEP
    art = tmp_path / "a"
    manifest = export_artifact(kept_dir, art, export_options(format="lowbit", float_dtype="keep"))
    assert manifest["tensors"]["model.layers.0.mlp.down_proj.keep_vals"]["dtype"] in (
        "F16",
        "float16",
    )
    rt = load(art, "torch", draft=None, kernel="reference")
    sides = [m.side for m in rt.model.modules() if isinstance(m, TorchQuantLinear)]
    assert len(sides) == 7 and all(s is not None for s in sides)
    x = tokens()
    with torch.no_grad():
        want = model(input_ids=x).logits
        torch.testing.assert_close(rt.model(input_ids=x).logits, want, atol=1e-4, rtol=1e-4)
        fast = load(art, "torch", draft=None)
        assert relative_error(fast.model(input_ids=x).logits, want) < 2e-2


def test_ascend_export_refuses_kept_columns_naming_the_fix(kept_dir, tmp_path):
    with pytest.raises(ExportError, match=r"quant\.outliers=none.*format=lowbit"):
        export_artifact(kept_dir, tmp_path / "a", export_options(format="ascend"))
