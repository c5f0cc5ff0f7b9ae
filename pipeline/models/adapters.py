"""Architecture adapters: where the pieces of a causal LM live in its checkpoint.

Llama, Mistral and Qwen2 share one block structure and differ in names, q/k/v biases and
sliding windows; an :class:`Adapter` holds those differences as data, so tensors and linears are
addressed by name without building the model. Transformers classes are import paths resolved on
first use, so a family missing from the installed transformers fails only when used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipeline.errors import LowbitError

# Linears of one decoder block, in execution order (relative to "model.layers.{i}.").
LLAMA_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# Linears that read the same input; a deployed kernel fuses them, so they share one format.
LLAMA_FUSED = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


class UnsupportedArchitectureError(LowbitError, ValueError):
    """A checkpoint whose model family has no adapter."""


@dataclass(frozen=True)
class Adapter:
    """Names of one architecture family: classes as import paths, tensor-name prefixes
    (``layer`` formats ``{i}``), a block's linears in execution order and its fused groups."""

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    decoder_layer: str
    rotary: str
    norm: str
    embed: str = "model.embed_tokens"
    layer: str = "model.layers.{i}."
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    linears: tuple[str, ...] = LLAMA_LINEARS
    fused: tuple[tuple[str, ...], ...] = LLAMA_FUSED

    def decoder_layer_class(self) -> type[nn.Module]:
        return _resolve(self.decoder_layer)

    def rotary_class(self) -> type[nn.Module]:
        return _resolve(self.rotary)

    def norm_class(self) -> type[nn.Module]:
        return _resolve(self.norm)

    def block_prefix(self, i: int) -> str:
        """Tensor-name prefix of decoder block ``i``, e.g. ``model.layers.3.``."""
        return self.layer.format(i=i)


def _family(name: str, module: str, prefix: str, arch: str) -> Adapter:
    base = f"transformers.models.{module}.modeling_{module}."
    return Adapter(
        name=name,
        model_types=(module,),
        architectures=(arch,),
        decoder_layer=base + f"{prefix}DecoderLayer",
        rotary=base + f"{prefix}RotaryEmbedding",
        norm=base + f"{prefix}RMSNorm",
    )


ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        _family("llama", "llama", "Llama", "LlamaForCausalLM"),
        _family("mistral", "mistral", "Mistral", "MistralForCausalLM"),
        _family("qwen2", "qwen2", "Qwen2", "Qwen2ForCausalLM"),
    )
}


def _resolve(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _config_of(config_or_model: Any) -> Any:
    # Accept a transformers config, a model carrying one, or a plain config.json dict.
    return getattr(config_or_model, "config", config_or_model)


def _field(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def supported() -> list[str]:
    """Architecture class names that have an adapter."""
    return [arch for a in ADAPTERS.values() for arch in a.architectures]


def get_adapter(config_or_model: Any) -> Adapter:
    """The adapter of a config, model or config.json dict; else UnsupportedArchitectureError."""
    config = _config_of(config_or_model)
    model_type = _field(config, "model_type")
    archs = tuple(_field(config, "architectures") or ())
    for adapter in ADAPTERS.values():
        if model_type in adapter.model_types or set(archs) & set(adapter.architectures):
            return adapter
    what = f"architecture {archs[0]!r}" if archs else f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"unsupported {what}; supported: {', '.join(supported())}. "
        "Use a checkpoint of one of these families."
    )


def attention_kind(config: Any, layer_idx: int) -> str:
    """``"full_attention"`` or ``"sliding_attention"`` for decoder block ``layer_idx``."""
    layer_types = _field(config, "layer_types")
    if layer_types:  # Qwen2 (and newer configs) state the kind per layer
        return layer_types[layer_idx]
    # Mistral v0.1 applies its window to every layer; v0.2+ sets sliding_window to null.
    return "sliding_attention" if _field(config, "sliding_window") else "full_attention"


def linear_names(config_or_model: Any, *, include_lm_head: bool = True) -> list[str]:
    """Full dotted names of every linear in the model, block by block, then ``lm_head``."""
    config = _config_of(config_or_model)
    adapter = get_adapter(config)
    names = [
        adapter.block_prefix(i) + lin
        for i in range(int(_field(config, "num_hidden_layers")))
        for lin in adapter.linears
    ]
    return [*names, adapter.lm_head] if include_lm_head else names


def fused_groups(config_or_model: Any) -> list[list[str]]:
    """Full dotted names of the linears that share an input, per block (q/k/v, gate/up)."""
    config = _config_of(config_or_model)
    adapter = get_adapter(config)
    return [
        [adapter.block_prefix(i) + lin for lin in group]
        for i in range(int(_field(config, "num_hidden_layers")))
        for group in adapter.fused
    ]
