"""Write random-weight HF checkpoints of any size, one shard at a time.

Memory benchmarks need checkpoints larger than what a test may hold (e.g. 4 GB), and tests
need tiny multi-shard ones; neither may come from a hub. :func:`write_synthetic_checkpoint`
creates the tensor names and shapes from the architecture's own decoder layer (built on the
meta device, so biases and head layouts are always right), draws each tensor from a
generator seeded by ``(seed, name)``, and hands it to a :class:`ShardWriter` that keeps at
most one shard in memory. The same seed gives the same weights whatever ``shard_bytes`` is.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.models.adapters import ADAPTERS, get_adapter

_ARCHES = {a.name: a for a in ADAPTERS.values()}


class ShardWriter:
    """Collects tensors into ``*.safetensors`` shards of at most ``shard_bytes`` each.

    A tensor larger than ``shard_bytes`` gets a shard of its own. On :meth:`close` the shards
    are named like ``save_pretrained`` names them (``model-00001-of-00003.safetensors`` plus
    ``model.safetensors.index.json``, or a single ``model.safetensors``).

    Args:
        path: Output directory (created).
        shard_bytes: Byte budget of one shard.
    """

    def __init__(self, path: str | Path, shard_bytes: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        tensor = tensor.detach().to("cpu").contiguous()
        # A view (or tied weight) shares storage, which safetensors refuses.
        if tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone()
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self._pending, self.path / f"_shard{len(self._shards)}.tmp")
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard and the index; return the shard paths."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [
            "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            for k in range(n)
        ]
        for k, name in enumerate(names):
            (self.path / f"_shard{k}.tmp").replace(self.path / name)
        if n > 1:
            weight_map = {t: names[k] for k, shard in enumerate(self._shards) for t in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return [self.path / name for name in names]


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
        # 1/sqrt(fan_in) keeps activations O(1); the residual-stream writers are scaled by
        # 1/sqrt(2L) (GPT-2 style) so deep random models do not blow up.
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
    """Write a random-weight HF checkpoint (config.json + safetensors shards + index).

    Args:
        path: Output directory.
        hidden, layers, intermediate, heads, kv_heads, vocab: Model size.
        arch: "llama", "mistral" or "qwen2" (q/k/v biases).
        shard_bytes: Byte budget per shard; also the writer's peak memory.
        dtype: Stored dtype.
        seed: Weights depend only on the seed and the tensor names.
        tie_word_embeddings: Omit lm_head.weight and tie it to the embeddings.
        **config_overrides: Extra config fields (e.g. ``sliding_window=None``).

    Returns:
        ``path``.
    """
    config = synthetic_config(
        hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
        kv_heads=kv_heads, vocab=vocab, arch=arch, dtype=dtype,
        tie_word_embeddings=tie_word_embeddings, **config_overrides,
    )  # fmt: skip
    writer = ShardWriter(path, shard_bytes)
    for name, shape in _tensor_specs(config):
        writer.add(name, _random(name, shape, seed, dtype, layers))
    writer.close()
    config.save_pretrained(path)
    return Path(path)
