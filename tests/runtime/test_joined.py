"""Quantized q/k/v and gate/up joined into one kernel call each by the lean forward: every
layer's own output bit for bit, the layers still working on views of the joined codes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.models.lean import LeanLM
from pipeline.quant.rtn import quantize_rtn
from pipeline.runtime.backends import TorchQuantLinear
from pipeline.runtime.inmemory import runtime_linear
from tests.models.test_lean import SHAPE, _model
from tests.runtime.test_kernels import needs_kernels


def _quantized(arch: str, formats: dict[str, str]) -> nn.Module:
    model = _model(arch)
    layers = model.model.layers
    for name, mod in list(layers.named_modules()):
        if isinstance(mod, nn.Linear):
            fmt = formats.get(name.rsplit(".", 1)[-1], "int4g32")
            layers.set_submodule(
                name, runtime_linear(name, quantize_rtn(mod.weight, fmt), mod.bias)
            )
    return model.eval()


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@torch.no_grad()
def test_joined_layers_give_each_layers_own_output(arch):
    model = _quantized(arch, {})
    ids = torch.randint(0, SHAPE["vocab"], (2, 9), generator=torch.Generator().manual_seed(3))
    h = torch.randn(2, 3, SHAPE["hidden"])
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    alone = [attn.q_proj(h), attn.k_proj(h), attn.v_proj(h), mlp.gate_proj(h), mlp.up_proj(h)]
    want = model(ids).logits  # transformers' forward, one call per layer
    ln = LeanLM(model)
    assert all(j is not None and j.impl.name == "w4a8pack" for j in ln.qkv + ln.gate_up)
    qkv, gate_up = (
        ln.qkv[1](h).split(ln.qkv[1].sizes, -1),
        ln.gate_up[1](h).split(ln.gate_up[1].sizes, -1),
    )
    for got, ref in zip([*qkv, *gate_up], alone, strict=True):
        assert torch.equal(got, ref)
    torch.testing.assert_close(ln(ids).logits, want, rtol=1e-5, atol=1e-5)
    # the layers now read views of the joined codes and compute what they did
    assert attn.q_proj.impl.packed.untyped_storage().data_ptr() == ln.qkv[1].impl.packed.data_ptr()
    assert torch.equal(attn.v_proj(h), alone[2]) and torch.equal(model(ids).logits, want)
    # each decoding run wraps the model anew: the codes are joined once, not copied again
    assert LeanLM(model).qkv[1].impl is ln.qkv[1].impl


@needs_kernels
def test_layers_whose_kernels_differ_stay_separate_calls():
    model = _quantized("llama", {"v_proj": "int8", "up_proj": "int4g64"})
    ln = LeanLM(model)
    assert ln.qkv == [None] * SHAPE["layers"] and ln.gate_up == [None] * SHAPE["layers"]
    assert (
        TorchQuantLinear.joined([model.model.layers[0].self_attn.q_proj, nn.Linear(64, 8)]) is None
    )
    ids = torch.randint(0, SHAPE["vocab"], (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ln(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
