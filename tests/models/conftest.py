"""Tiny checkpoints for the model-loading tests, written once per session."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from pipeline.models.synthetic import synthetic_config, write_synthetic_checkpoint

TINY = dict(hidden=32, layers=3, intermediate=48, heads=4, kv_heads=2, vocab=61)


def save_hf_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised HF model with ``save_pretrained`` (several small shards).

    HF's own writer is the reference: a checkpoint our synthetic writer and our loader both
    got wrong in the same way would still fail against it.
    """
    from transformers import AutoModelForCausalLM

    config = synthetic_config(arch=arch, dtype=torch.float32, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make every tensor matter
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.ndim == 2 else 0.1))
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(path, max_shard_size="16KB")
    return path


def poison_tensor(ckpt: Path, name: str, at: int, value: float) -> Path:
    """Overwrite flat element `at` of the float32 tensor `name` in its shard; returns the shard."""
    from pipeline.models.shards import read_safetensors_header

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shard = ckpt / index[name]
    dtype, _, start, _ = read_safetensors_header(shard)[name]
    assert dtype == torch.float32
    raw = bytearray(shard.read_bytes())
    raw[start + 4 * at : start + 4 * at + 4] = struct.pack("<f", value)
    shard.write_bytes(bytes(raw))
    return shard


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A 3-layer fp32 Llama written by our synthetic writer in many shards."""
    path = tmp_path_factory.mktemp("llama")
    return write_synthetic_checkpoint(path, **TINY, shard_bytes=20_000, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """HF-written checkpoints: llama, llama tied, mistral (sliding window), qwen2 (biases)."""
    specs = {
        "llama": ("llama", {}),
        "llama_tied": ("llama", {"tie_word_embeddings": True}),
        # A window shorter than the test sequence, so the sliding mask really is used.
        "mistral": ("mistral", {"sliding_window": 4}),
        # Layers >= max_window_layers use the sliding window: a mix of mask kinds.
        "qwen2": (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        ),
    }
    return {
        key: save_hf_checkpoint(tmp_path_factory.mktemp(key), arch, **kw)
        for key, (arch, kw) in specs.items()
    }
