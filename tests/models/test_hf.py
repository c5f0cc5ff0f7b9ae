"""Whole-model loading: the checkpoint's dtype, direct placement, the model section's options."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import ModelConfig, parse
from pipeline.errors import ConfigError, LowbitError
from pipeline.models.hf import load_causal_lm, placement
from pipeline.models.quantized import load_model
from pipeline.models.synthetic import write_synthetic_checkpoint
from tests.models.test_quantized import TINY, write_rtn


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    return write_synthetic_checkpoint(path, **TINY, dtype=torch.bfloat16)


def dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_auto_keeps_the_saved_dtype(bf16_dir):
    assert dtypes(load_causal_lm(bf16_dir, dtype="auto")) == {torch.bfloat16}
    assert dtypes(load_causal_lm(bf16_dir, dtype="float16")) == {torch.float16}
    # The default stays float32: stages that train call it without a dtype.
    assert dtypes(load_causal_lm(bf16_dir)) == {torch.float32}
    with pytest.raises(LowbitError, match="dtype 'fp8' is not one of: auto, float32"):
        load_causal_lm(bf16_dir, dtype="fp8")


def test_quantized_dir_auto_dtype_is_the_source_checkpoints(tmp_path):
    src = write_synthetic_checkpoint(tmp_path / "src", **TINY, dtype=torch.bfloat16)
    layers, _ = write_rtn(src, tmp_path / "q")
    model = load_model(tmp_path / "q", allow_bin=False, dtype="auto")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    name = next(iter(layers))
    assert model.get_submodule(name).scale.dtype == torch.float32  # trained in fp32 regardless
    with pytest.raises(LowbitError, match="model.device_map='auto' splits a model"):
        load_model(tmp_path / "q", allow_bin=False, device_map="auto")


def test_device_map_is_honoured(bf16_dir):
    model = load_causal_lm(bf16_dir, dtype="auto", device_map="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert placement() == {} and placement("cpu") == {}
    # Another device is placed while loading, not after a full copy in host memory.
    assert placement("cuda:1") == {"device_map": torch.device("cuda:1")}
    assert placement("cuda:1", device_map="auto") == {"device_map": "auto"}


def test_device_map_without_accelerate_names_the_install(bf16_dir, monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    with pytest.raises(LowbitError, match="pip install accelerate"):
        load_causal_lm(bf16_dir, device_map="auto")
    assert placement("cuda:0") == {}  # a plain device still works: load on CPU, then move


def test_model_section_options(tmp_path):
    cfg = parse(
        {"target": {"path": str(tmp_path), "dtype": "bfloat16"}, "device_map": "npu:1"},
        ModelConfig,
        "model",
    )
    assert cfg.load_options("target") == {"dtype": "bfloat16", "device_map": "npu:1"}
    assert cfg.load_options("draft") == {"dtype": "auto", "device_map": "npu:1"}
    with pytest.raises(ConfigError, match="model.target.dtype"):
        parse({"target": {"dtype": "fp8"}}, ModelConfig, "model")
    with pytest.raises(ConfigError, match=r"model.device_map.*'gpu0'.*cuda:0"):
        parse({"device_map": "gpu0"}, ModelConfig, "model")


def test_bootstrap_models_load_in_float32_under_auto(tmp_path):
    """The bootstrap stage trains and saves float32 (fp32 master weights): "auto", the default
    of model.<role>.dtype, loads them as float32, so their training is unchanged."""
    from pipeline.config import ModelSpec
    from pipeline.models.hf import new_llama, save_hf, train_tokenizer

    tok = train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    spec = ModelSpec(layers=1, hidden=32, heads=2, intermediate=64)
    save_hf(new_llama(spec, tok, max_positions=32, seed=0), tok, tmp_path / "target")
    assert dtypes(load_causal_lm(tmp_path / "target", dtype=spec.dtype)) == {torch.float32}
