"""The lean inference forward: the same logits as transformers' forward on every supported
family, through prefill, single steps, multi-row verification, rollback and batches; on the
CPU extension's decode ops (one sequence, few rows) as on torch's, with the runtime's kernels."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.lean import FUSED_ROWS, FUSED_SPAN, LeanCache, LeanLM, fits, lean
from pipeline.models.synthetic import synthetic_config
from pipeline.quant.rtn import quantize_rtn
from pipeline.runtime.float_rows import FloatRowsLinear
from pipeline.runtime.inmemory import runtime_linear
from pipeline.runtime.kernels import relative_error
from pipeline.speculative.decoding import CachedLM, plain_generate
from tests.runtime.test_kernels import needs_kernels

SHAPE = dict(hidden=64, layers=3, intermediate=96, heads=4, kv_heads=2, vocab=97)


def _model(arch: str = "llama", **overrides):
    from transformers import AutoModelForCausalLM

    config = synthetic_config(arch=arch, dtype=torch.float32, **{**SHAPE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make every tensor matter
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.ndim == 2 else 0.3))
    return model


CASES = [
    ("llama", {}),
    ("llama", {"kv_heads": 4}),  # no grouping
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {"sliding_window": None}),
]


@pytest.mark.parametrize(("arch", "overrides"), CASES)
@torch.no_grad()
def test_lean_logits_match_transformers_through_steps_and_rollback(arch, overrides):
    model = _model(arch, **overrides)
    assert fits(model)
    ids = torch.randint(0, SHAPE["vocab"], (2, 16), generator=torch.Generator().manual_seed(1))
    hf, ln = CachedLM(model), CachedLM(model)
    hf.model = model  # the reference: transformers' own forward and cache
    assert isinstance(ln.model, LeanLM)
    for lo, hi, keep in ((0, 7, None), (7, 8, 1), (8, 12, 3)):
        torch.testing.assert_close(
            ln.forward(ids[:, lo:hi], keep), hf.forward(ids[:, lo:hi], keep), rtol=1e-5, atol=1e-5
        )
    hf.rollback(9)
    ln.rollback(9)
    assert ln.cache.get_seq_length() == 9
    keep = torch.tensor([0, 2, 4])
    torch.testing.assert_close(ln.forward(ids[:, 9:14], keep), hf.forward(ids[:, 9:14], keep))
    # the next step against the whole sequence in one uncached forward
    want = model(ids[:, :15]).logits[:, -1]
    torch.testing.assert_close(ln.forward(ids[:, 14:15], 1)[:, -1], want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_greedy_decoding_with_the_lean_forward_matches_transformers_generate():
    model = _model()
    prompt = torch.randint(0, SHAPE["vocab"], (1, 5), generator=torch.Generator().manual_seed(2))
    # 70 steps: past the cache's first capacity (64), on the decode ops where they run
    seq, _ = plain_generate(model, prompt, 70, temperature=0.0)
    want = model.generate(prompt, max_new_tokens=70, do_sample=False, min_new_tokens=70)
    assert seq.tolist() == want.tolist()


@needs_kernels
@pytest.mark.parametrize(("arch", "overrides"), CASES)
@torch.no_grad()
def test_one_sequence_runs_the_decode_ops_with_transformers_logits(arch, overrides):
    model = _model(arch, **overrides)
    ids = torch.randint(0, SHAPE["vocab"], (1, 64), generator=torch.Generator().manual_seed(3))
    hf, ln = CachedLM(model), CachedLM(model)
    hf.model = model
    assert ln.model.ops is not None  # float32 on the CPU, SiLU, head_dim 16
    # a prompt past FUSED_SPAN (torch's ops), a catch-up in FUSED_ROWS chunks, then a step and
    # a verification block, on one cache
    p, n = FUSED_SPAN + 2, FUSED_SPAN + FUSED_ROWS + 5
    for lo, hi, keep in ((0, p, None), (p, n, 2), (n, n + 1, 1), (n + 1, n + 5, None)):
        torch.testing.assert_close(
            ln.forward(ids[:, lo:hi], keep), hf.forward(ids[:, lo:hi], keep), rtol=1e-5, atol=1e-5
        )
    hf.rollback(n + 2)
    ln.rollback(n + 2)
    keep = torch.tensor([0, 2])
    torch.testing.assert_close(
        ln.forward(ids[:, n + 2 : n + 6], keep), hf.forward(ids[:, n + 2 : n + 6], keep)
    )


@needs_kernels
@torch.no_grad()
def test_decode_ops_call_the_runtime_kernels_as_functions_with_their_output():
    model = _model(intermediate=128)
    formats = {"q_proj": "int4g32", "k_proj": "int4g32", "v_proj": "int4g32", "o_proj": "int2g32",
               "gate_proj": "int3g32", "up_proj": "int3g32", "down_proj": "exp4g32"}  # fmt: skip
    for name, mod in list(model.named_modules()):
        if name.rpartition(".")[2] in formats:
            qt = quantize_rtn(mod.weight, formats[name.rpartition(".")[2]])
            model.set_submodule(name, runtime_linear(name, qt, mod.bias))
    model.lm_head = FloatRowsLinear.of(model.lm_head)
    fused, plain = LeanLM(model), LeanLM(model)
    plain.ops = None
    assert fused.qkv[0] is not None and fused.gate_up[0] is not None  # joined: one call each
    assert not any(isinstance(fn, torch.nn.Module) for fn in (*fused.rows[0], fused.head))
    ids = torch.randint(0, SHAPE["vocab"], (1, 12), generator=torch.Generator().manual_seed(4))
    caches = LeanCache(SHAPE["layers"]), LeanCache(SHAPE["layers"])
    for lo, hi in ((0, 9), (9, 10), (10, 12)):
        got, want = (lm(ids[:, lo:hi], cache=c).logits for lm, c in zip((fused, plain), caches))
        # the same kernels on inputs that differ by float rounding: int8 activations may flip
        assert relative_error(got, want) < 1e-3


def test_lean_wraps_only_what_it_reproduces_and_only_for_inference():
    assert not fits(_model("mistral", sliding_window=8))  # windowed attention
    assert not fits(torch.nn.Linear(2, 2))
    assert not fits(_model().to("meta"))  # only CPU and CUDA devices
    model = _model()
    assert isinstance(lean(model), LeanLM)
    assert CachedLM(model).model is model  # grad enabled: transformers' forward
    with torch.no_grad():
        assert isinstance(CachedLM(model).model, LeanLM)
        assert CachedLM(model.train()).model is model  # a model in training mode


def test_the_cache_grows_in_place_and_crops_both_ways():
    cache = LeanCache(1)
    for n in (3, 70, 1):  # past the first capacity (64): the held keys move along
        k = torch.randn(1, 2, n, 4)
        keys, values = cache.update(0, k, k + 1)
        cache.length += n
        torch.testing.assert_close(keys[:, :, -n:], k)
        torch.testing.assert_close(values[:, :, -n:], k + 1)
    assert keys.shape[2] == cache.get_seq_length() == 74
    cache.crop(-4)
    assert cache.length == 70
    cache.crop(10)
    assert cache.length == 10


@torch.no_grad()
def test_rotary_rows_come_from_a_table_that_grows_and_matches_the_model():
    ln = LeanLM(_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert ln.static_rope
    x = torch.zeros(1, 1, SHAPE["hidden"])
    first = ln._rope_table(x, 10)[0]
    cos, sin = ln._rope_table(x, 300)  # past the first size (256): rebuilt, twice as long
    assert first.shape[0] == 256 and cos.shape[0] == 600
    want_cos, want_sin = ln._rope(x, torch.arange(600)[None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    # frequencies that change with the length (dynamic NTK): computed per step, no table
    assert not LeanLM(
        _model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ).static_rope
