"""Weight shapes of the quantizable layers from config alone, so allocate can check a budget
before any weight is read (names from the architecture adapter, as sensitivity scores them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ModelSpec
from pipeline.models.adapters import fused_groups, get_adapter, linear_names


@dataclass(frozen=True)
class LayerShapes:
    """``shapes`` {name: (out, in)} in model order (the embedding as (vocab, hidden)), the
    fused groups, and ``exact_vocab``: False while the vocabulary is only the requested one."""

    shapes: dict[str, tuple[int, int]]
    fused: list[list[str]]
    exact_vocab: bool = True


def embed_name(config: dict) -> str:
    return get_adapter(config).embed


def shapes_from_hf_config(config: dict, exact_vocab: bool = True) -> LayerShapes:
    """Shapes from a config.json dict (Llama, Mistral, Qwen2 families)."""
    adapter = get_adapter(config)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    per_linear = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    shapes: dict[str, tuple[int, int]] = {adapter.embed: (vocab, hidden)}
    for name in linear_names(config):
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        shapes[name] = per_linear.get(suffix, (vocab, hidden))  # lm_head: (vocab, hidden)
    if config.get("tie_word_embeddings"):  # one tensor, scored and planned as lm_head
        del shapes[adapter.embed]
    return LayerShapes(shapes, fused_groups(config), exact_vocab)


def shapes_from_spec(spec: ModelSpec, vocab_size: int) -> LayerShapes:
    """Shapes of the bootstrap Llama built from ``model.target`` (see models.hf.llama_config)."""
    config = {
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "vocab_size": vocab_size,
    }
    # The trained BPE may end a few tokens short of the requested vocabulary.
    return shapes_from_hf_config(config, exact_vocab=False)


def shapes_from_dir(path: Path) -> LayerShapes:
    """Shapes from ``path/config.json``."""
    return shapes_from_hf_config(json.loads((Path(path) / "config.json").read_text()))
