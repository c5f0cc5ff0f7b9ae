"""A tiny random Llama and calibration windows, built in the test process (no files)."""

from __future__ import annotations

import torch

VOCAB = 40


def tiny_llama(seed: int = 0, tied: bool = False):
    """2 blocks, hidden 8, weights scaled so every layer matters (not HF's near-zero init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return scaled_(LlamaForCausalLM(config)).eval()


def scaled_(model):
    """N(0, 1/fan_in) matrices, in place: every layer matters (not HF's near-zero init), so
    sensitivities differ between layers."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model


def windows(n: int = 6, seq_len: int = 12, seed: int = 1) -> torch.Tensor:
    """Random token windows. # (n, seq_len)"""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, seq_len), generator=g)
