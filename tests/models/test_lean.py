"""The lean inference forward: the same logits as transformers' forward on every supported
family, through prefill, single steps, multi-row verification, rollback and batches."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.lean import LeanCache, LeanLM, fits, lean
from pipeline.models.synthetic import synthetic_config
from pipeline.speculative.decoding import CachedLM, plain_generate

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
    seq, _ = plain_generate(model, prompt, 20, temperature=0.0)
    want = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert seq.tolist() == want.tolist()


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
