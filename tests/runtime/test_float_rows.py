"""The few-row float32 kernel (``float_rows``) against ``F.linear``, and where the runtime
uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import cpu_ext
from pipeline.runtime import float_rows
from pipeline.runtime.backends import kernel_summary
from pipeline.runtime.float_rows import FloatRowsLinear
from pipeline.runtime.inmemory import to_runtime
from pipeline.runtime.kernels import relative_error
from tests.runtime.test_kernels import CODE_ISAS, needs_kernels

TOL = 1e-6  # float32 with another summation order


@pytest.mark.parametrize("isa", CODE_ISAS)
@pytest.mark.parametrize("n, k", [(1030, 1031), (1024, 1024), (1027, 1040)])  # n, k tails
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12])  # 6-12: more than one pass of rows
def test_kernel_matches_f_linear(n, k, rows, isa):
    w = torch.randn(n, k)
    x = torch.randn(rows, k)
    got = cpu_ext.loaded().f32_rows_mm(x, w, isa)
    assert got.shape == (rows, n)
    assert relative_error(got, F.linear(x, w)) < TOL
    # each output row on its own: one row gives what it gives inside the batch
    torch.testing.assert_close(cpu_ext.loaded().f32_rows_mm(x[-2:], w, isa)[-1], got[-1])


@pytest.mark.parametrize("isa", CODE_ISAS)
def test_layer_dispatch_bias_shapes_and_grad(isa):
    lin = nn.Linear(1040, 1024)
    layer = FloatRowsLinear.of(lin, isa)
    assert layer.isa == isa and f"isa={isa}" in repr(layer)
    assert layer.weight is lin.weight and layer.bias is lin.bias  # shared, not copied
    with torch.no_grad():
        x = torch.randn(1, 5, 1040)
        got = layer(x)
        assert got.shape == (1, 5, 1024)
        assert relative_error(got, lin(x)) < TOL
        assert not torch.equal(got, lin(x))  # the kernel ran (sgemm sums in another order)
        for rows in (float_rows.MAX_ROWS + 1, 40):  # more rows than it takes: F.linear, exactly
            x = torch.randn(rows, 1040)
            assert torch.equal(layer(x), lin(x))
        nobias = FloatRowsLinear.of(nn.Linear(1040, 1024, bias=False), isa)
        rows_fn = nobias.rows_fn()  # the decode forward's call: the same routing, no module
        assert layer.rows_fn() is None  # a bias: the module's call
        for rows in (1, 5, float_rows.MAX_ROWS + 1):
            x = torch.randn(rows, 1040)
            assert torch.equal(rows_fn(x), nobias(x))
        xb = torch.randn(4, 1040, dtype=torch.bfloat16)  # other dtypes: F.linear
        assert torch.equal(layer.bfloat16()(xb), lin.bfloat16()(xb))
    layer.float()
    y = layer(torch.randn(3, 1040)).sum()  # with grad: F.linear, so training works
    y.backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def _llama(vocab: int, tied: bool):
    from transformers import AutoModelForCausalLM

    from pipeline.models.synthetic import synthetic_config

    config = synthetic_config(
        hidden=128, layers=1, intermediate=256, heads=2, kv_heads=2, vocab=vocab,
        dtype=torch.float32, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_to_runtime_runs_a_large_float_head_on_it(tied):
    model = _llama(8192, tied)  # lm_head 8192 x 128 float32: 4 MiB, the smallest it takes
    rt = to_runtime(model)
    assert kernel_summary(rt) == f"{float_rows.NAME} x1"  # the decoder's small linears stay
    assert isinstance(rt.lm_head, FloatRowsLinear) and rt.lm_head.isa == cpu_ext.isa()
    assert (rt.lm_head.weight is rt.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 8192, (1, 5))
    with torch.no_grad():
        got, want = rt(input_ids=ids).logits, model(input_ids=ids).logits
    assert relative_error(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert kernel_summary(to_runtime(model, kernel="reference")) == ""  # F.linear everywhere
    assert kernel_summary(rt.to(torch.bfloat16)) == ""  # cast off float32: F.linear, not claimed


def test_small_and_non_float32_layers_are_left_alone():
    model = _llama(4096, tied=False)  # a 2 MiB head: read from cache, sgemm is fine there
    assert kernel_summary(float_rows.convert(model)) == ""
    big = _llama(8192, tied=False).to(torch.bfloat16)
    assert kernel_summary(float_rows.convert(big)) == ""
