"""Random-weight HF checkpoints of any size, one shard at a time (tests and benchmarks only).

Tensor names and shapes come from the architecture's own decoder layer on the meta device; each
tensor is drawn from ``(seed, name)``, so the weights do not depend on ``shard_bytes``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.io import ShardWriter
from pipeline.models.adapters import ADAPTERS, get_adapter

_ARCHES = {a.name: a for a in ADAPTERS.values()}


def synthetic_config(
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    arch: str = "llama",
    dtype: torch.dtype = torch.float16,
    tie_word_embeddings: bool = False,
    **overrides: Any,
) -> Any:
    """A transformers config of the given family and size (``overrides`` pass through)."""
    from transformers import AutoConfig

    if arch not in _ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(_ARCHES)}")
    adapter = _ARCHES[arch]
    return AutoConfig.for_model(
        adapter.model_types[0],
        architectures=list(adapter.architectures[:1]),
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        **overrides,
    )


def _tensor_specs(config: Any) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every stored tensor, in checkpoint order."""
    adapter = get_adapter(config)
    hidden, vocab = config.hidden_size, config.vocab_size
    yield adapter.embed + ".weight", (vocab, hidden)
    for i in range(config.num_hidden_layers):
        # A meta-device layer lists the exact parameters (and biases) without allocating them.
        with torch.device("meta"):
            layer = adapter.decoder_layer_class()(config, layer_idx=i)
        for name, t in layer.state_dict().items():
            yield adapter.block_prefix(i) + name, tuple(t.shape)
    yield adapter.final_norm + ".weight", (hidden,)
    if not config.tie_word_embeddings:
        yield adapter.lm_head + ".weight", (vocab, hidden)


def _random(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, layers: int
) -> torch.Tensor:
    """One tensor, reproducible from (seed, name) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g, dtype=dtype)
    if name.endswith("norm.weight"):  # RMSNorm gains near 1
        return t.mul_(0.1).add_(1.0)
    if name.endswith(".bias"):
        return t.mul_(0.02)
    if len(shape) == 2 and "embed" not in name:
        # 1/sqrt(fan_in), and 1/sqrt(2L) on residual writers (GPT-2) so deep models stay O(1).
        std = shape[1] ** -0.5
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= (2 * layers) ** 0.5
        return t.mul_(std)
    return t


def write_synthetic_checkpoint(
    path: str | Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    arch: str = "llama",
    shard_bytes: int = 1 << 30,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight HF checkpoint (config.json, shards of at most ``shard_bytes``,
    index) to ``path``; ``config_overrides`` are extra config fields."""
    config = synthetic_config(
        hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
        kv_heads=kv_heads, vocab=vocab, arch=arch, dtype=dtype,
        tie_word_embeddings=tie_word_embeddings, **config_overrides,
    )  # fmt: skip
    writer = ShardWriter(path, "model", shard_bytes)
    for name, shape in _tensor_specs(config):
        writer.add(name, _random(name, shape, seed, dtype, layers))
    writer.close()
    config.save_pretrained(path)
    return Path(path)


RESERVED = 256  # Llama 3's reserved special tokens at the top of its 128256-token vocabulary


def synthetic_tokenizer(docs: list[str], vocab: int, reserved: int = RESERVED):
    """A byte-level BPE of exactly ``vocab`` tokens, built offline from ``docs``.

    As many merges as ``docs`` yield up to ``vocab - reserved``, then unreachable filler tokens
    up to that size (a small corpus runs out of merges long before 128k) and ``reserved`` special
    tokens at the top, as Llama 3 lays out its 128256 ids: every id a model of that vocabulary
    embeds is a token of its tokenizer, and text encodes to ids of the trained part only.
    """
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from pipeline.models.hf import train_tokenizer

    if vocab <= reserved + 256 + 2:  # the byte alphabet and the two specials, plus the reserve
        raise ValueError(f"vocab {vocab} leaves no room for merges beside {reserved} reserved")
    trained = train_tokenizer(docs, vocab - reserved)
    spec = json.loads(trained.backend_tokenizer.to_str())
    table = spec["model"]["vocab"]  # token -> id, ids 0..n-1
    for i in range(len(table), vocab - reserved):
        table[f"<|filler_{i}|>"] = i  # no merge produces it: decodable, never encoded
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token=trained.eos_token,
        bos_token=trained.bos_token,
        pad_token=trained.pad_token,
    )
    tok.add_special_tokens(
        {"additional_special_tokens": [f"<|reserved_special_token_{i}|>" for i in range(reserved)]}
    )
    return tok
