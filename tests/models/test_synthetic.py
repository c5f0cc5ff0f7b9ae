"""Synthetic checkpoints: deterministic, shard-bounded, loadable by transformers."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from pipeline.models import StreamingCheckpoint
from pipeline.models.synthetic import write_synthetic_checkpoint

SIZES = dict(hidden=32, layers=2, intermediate=48, heads=4, kv_heads=2, vocab=40)


def all_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})  # noqa: SIM118
    return out


def test_same_seed_same_weights_whatever_the_sharding(tmp_path):
    a = write_synthetic_checkpoint(tmp_path / "a", **SIZES, shard_bytes=6_000, seed=3)
    b = write_synthetic_checkpoint(tmp_path / "b", **SIZES, shard_bytes=1 << 30, seed=3)
    c = write_synthetic_checkpoint(tmp_path / "c", **SIZES, shard_bytes=1 << 30, seed=4)
    ta, tb, tc = all_tensors(a), all_tensors(b), all_tensors(c)
    assert ta.keys() == tb.keys() and len(ta) == 1 + 2 * 9 + 2
    assert all(torch.equal(ta[n], tb[n]) for n in ta)
    assert not torch.equal(
        ta["model.layers.0.mlp.up_proj.weight"], tc["model.layers.0.mlp.up_proj.weight"]
    )
    assert (b / "model.safetensors").is_file() and not (b / "model.safetensors.index.json").exists()
    assert {t.dtype for t in ta.values()} == {torch.float16}


def test_shards_respect_the_byte_budget(tmp_path):
    budget = 6_000
    path = write_synthetic_checkpoint(tmp_path, **SIZES, shard_bytes=budget)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) == len(set(index["weight_map"].values())) > 2
    for shard in shards:
        tensors = all_tensors_of(shard)
        # Over budget only when a single tensor is itself larger than the budget.
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert nbytes <= budget or len(tensors) == 1
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in all_tensors(path).values()
    )


def all_tensors_of(file) -> list[torch.Tensor]:
    with safe_open(file, framework="pt") as f:
        return [f.get_tensor(n) for n in f.keys()]  # noqa: SIM118


def test_qwen2_synthetic_has_biases_and_loads_in_transformers(tmp_path):
    path = write_synthetic_checkpoint(tmp_path, **SIZES, arch="qwen2", tie_word_embeddings=True)
    ck = StreamingCheckpoint(path)
    assert "model.layers.1.self_attn.k_proj.bias" in ck and "lm_head.weight" not in ck
    model = ck.full_model()  # transformers accepts the files as they are
    assert model.config.model_type == "qwen2"
    torch.testing.assert_close(model.lm_head.weight, ck.load_lm_head().weight)


def test_synthetic_tokenizer_fills_the_vocabulary_and_encodes_with_trained_ids(tmp_path):
    from transformers import AutoTokenizer

    from pipeline.models.synthetic import synthetic_tokenizer

    docs = ["the quick brown fox jumps over the lazy dog", "lazy dogs sleep", "quick foxes run"]
    tok = synthetic_tokenizer(docs * 4, vocab=1000, reserved=16)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded) == 1000  # the embedding's every row is a token
    assert loaded.convert_ids_to_tokens(999) == "<|reserved_special_token_15|>"
    trained = len(loaded.backend_tokenizer.get_vocab()) - 16
    ids = loaded("the lazy fox sleeps", add_special_tokens=False)["input_ids"]
    assert ids and max(ids) < trained  # fillers and reserved ids are never produced by text
    assert loaded.decode(ids) == "the lazy fox sleeps"
    assert loaded.eos_token_id is not None and loaded.eos_token_id < trained
