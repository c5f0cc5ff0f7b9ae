"""Runtime loading: logits equal the fake-quant model's (reference kernels) or are close to them
(packed kernels); generation plain and speculative."""

from __future__ import annotations

import pytest
import torch

from pipeline.export import ArtifactError, export_artifact
from pipeline.models.quantized import load_quantized
from pipeline.runtime import load
from pipeline.runtime.backends import TorchQuantLinear
from pipeline.runtime.kernels import exp_kernel_name, int_kernel_name, relative_error
from pipeline.speculative.decoding import plain_generate
from tests.export.models import export_options, tokens

FORMATS = ["int2g64", "int3g128", "int4g128", "int4g128-sym", "int8", "exp4g128"]
BITS = {"int2g64": 2, "int3g128": 3, "int8": 8}  # the others: 4


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_equal_fake_quant(qmodels, tmp_path, fmt):
    src = qmodels.get(fmt)
    art = tmp_path / "a"
    export_artifact(src, art, export_options(format="lowbit", float_dtype="keep"))
    rt = load(art, "torch", draft=None, kernel="reference")
    quantized = [m for m in rt.model.modules() if isinstance(m, TorchQuantLinear)]
    assert len(quantized) == 7 and rt.backend == "torch"
    assert set(rt.kernels.values()) == {"reference"}
    x = tokens()
    ref = _logits(load_quantized(src), x)
    torch.testing.assert_close(_logits(rt.model, x), ref, atol=1e-5, rtol=1e-5)
    # The default packed kernels (bf16 activations): close, and each layer says what it ran.
    fast = load(art, "torch", draft=None)
    # w<bits>a8pack / exp4lut where the CPU runs lowbit's kernels, else int4pack / int8pack /
    # dense-bf16
    want = exp_kernel_name() if fmt.startswith("exp") else int_kernel_name(bits=BITS.get(fmt, 4))
    assert set(fast.kernels.values()) == {want}
    assert fast.kernel_summary() == f"{want} x7"
    assert relative_error(_logits(fast.model, x), ref) < 2e-2


def test_mixed_model_ascend_widened_and_fp16(qmodels, tmp_path):
    src = qmodels.get(("int4g128", "int2g128", "int8", "int3g128"))
    ref = _logits(load_quantized(src), tokens())
    art = tmp_path / "a"
    export_artifact(src, art, export_options(format="ascend", widen=True, float_dtype="keep"))
    rt = load(art, "torch", draft=None, kernel="reference")
    assert {i.type for i in rt.layers.values()} == {"W4A16", "W8A16"}
    torch.testing.assert_close(_logits(rt.model, tokens()), ref, atol=1e-5, rtol=1e-5)
    # default float16 storage of embeddings/norms/lm_head: close, not exact
    art16 = tmp_path / "b"
    export_artifact(src, art16, export_options(format="lowbit"))
    got = _logits(load(art16, "torch", draft=None, kernel="reference").model, tokens())
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_speculative_from_artifacts_equals_greedy_target(qmodels, tmp_path):
    src = qmodels.get(("int4g128", "int3g128"))
    art = tmp_path / "a"
    export_artifact(src, art, export_options(float_dtype="keep"), draft=qmodels.get("int2g64"))
    rt = load(art, "torch", kernel="reference")
    assert rt.draft is not None and len(rt.draft.layers) == 7  # the artifact's own draft
    assert set(rt.draft.kernels.values()) == {"reference"}  # the draft follows the target
    prompt = "the quick brown fox"
    spec = rt.generate(prompt, max_new_tokens=24, temperature=0.0)
    plain = rt.generate(prompt, max_new_tokens=24, temperature=0.0, speculative=False)
    assert spec.stats.drafted > 0 and plain.stats.drafted == 0
    assert spec.tokens == plain.tokens and len(spec.tokens) > 0
    assert rt.cost_ratio is not None and rt.cost_ratio > 0  # measured for the adaptive gamma
    piped = rt.generate(prompt, max_new_tokens=24, temperature=0.0, pipelined=True)
    assert piped.tokens == plain.tokens and piped.stats.drafted > 0
    # ... and equal greedy decoding of the fake-quant model the artifact came from
    ids = rt.tokenizer(prompt, return_tensors="pt").input_ids
    seq, _ = plain_generate(
        load_quantized(src), ids, 24, temperature=0.0, eos_token_id=rt.tokenizer.eos_token_id
    )
    assert seq[0, ids.shape[1] :].tolist() == plain.tokens
    # a separately given draft artifact works too, and sampling runs
    other = tmp_path / "d"
    export_artifact(qmodels.fp, other, export_options())
    rt2 = load(art, "torch", draft=other, kernel="reference")
    assert rt2.generate(prompt, 24, 0.0).tokens == plain.tokens
    assert len(rt2.generate(prompt, 8, temperature=1.0, seed=3).tokens) <= 8


def test_compressed_tensors_artifact_is_refused(qmodels, tmp_path):
    art = tmp_path / "ct"
    export_artifact(qmodels.get("int4g128"), art, export_options(format="compressed-tensors"))
    with pytest.raises(ArtifactError, match="vLLM"):
        load(art, "torch")


def test_an_artifact_in_the_hf_cache_loads_by_its_hub_id(qmodels, tmp_path, hf_home):
    from pipeline.errors import LowbitError
    from tests.conftest import put_in_hub_cache

    art = tmp_path / "a"
    export_artifact(qmodels.get("int4g128"), art, export_options(format="lowbit"))
    snapshot = put_in_hub_cache(art, hf_home / "hub", "org/tiny-int4", "d4" * 20)
    rt = load("org/tiny-int4", "torch", draft=None, kernel="reference")
    assert rt.root == snapshot  # every file hashed against the manifest, through the cache's links
    local = load(art, "torch", draft=None, kernel="reference")
    torch.testing.assert_close(_logits(rt.model, tokens()), _logits(local.model, tokens()))
    with pytest.raises(LowbitError, match=r"^artifact=org/absent .*`hf download org/absent`"):
        load("org/absent", "torch")
