"""Stream a Hugging Face checkpoint one decoder block at a time.

Opening reads only the safetensors headers; each piece (embeddings, block ``i``, norm, lm_head)
is built on the meta device and filled with exactly its tensors, so peak memory is one segment
of blocks whatever the depth. Tensors are ``readinto`` their final buffers at the header's
offsets: a memory map's pages would count as resident next to the copies, doubling the peak.
Pickled ``.bin`` weights are refused unless allowed (``convert_bin_to_safetensors`` rewrites them).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.models.adapters import Adapter, attention_kind, get_adapter
from pipeline.models.shards import (
    CheckpointError,
    CheckpointNotFoundError,
    Entry,
    check_finite,
    load_bin,
    read_json,
    read_safetensors_header,
    read_tensors,
    tensor_locations,
    weight_files,
)


class StreamingCheckpoint:
    """Lazy view of a HF causal-LM checkpoint directory; ``dtype`` None keeps the stored one.

    Opening raises CheckpointNotFoundError, UnsupportedArchitectureError or CheckpointError
    (corrupt, truncated or mis-indexed shards), naming the file; loading a NaN/Inf tensor too.
    """

    def __init__(
        self,
        path: str | Path,
        allow_bin: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        attn_implementation: str = "sdpa",
    ) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {self.path} does not exist")
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointNotFoundError(f"{cfg_file} is missing: not a Hugging Face checkpoint")
        # Refuse unsupported families before transformers parses (and maybe rejects) the config.
        self.adapter: Adapter = get_adapter(read_json(cfg_file))

        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        self.config._attn_implementation = attn_implementation
        self.allow_bin = allow_bin
        self.device = torch.device(device)
        self._files, self._index, self.is_bin = weight_files(self.path, allow_bin)
        self._where, self._info = self._index_tensors()
        embed = self.adapter.embed + ".weight"
        if embed not in self._info:
            raise CheckpointError(
                f"checkpoint {self.path} has no {embed}: the checkpoint is incomplete"
            )
        self.dtype = dtype or self._info[embed][0]
        self._rotary: nn.Module | None = None
        self._check_layers()

    def _index_tensors(self) -> tuple[dict[str, Path], dict[str, Entry]]:
        """Map every tensor name to its file and (dtype, shape, offsets), reading headers only."""

        def pickled(file: Path) -> dict[str, Entry]:
            return {n: (t.dtype, list(t.shape), -1, -1) for n, t in load_bin(file).items()}

        read = pickled if self.is_bin else read_safetensors_header
        found = tensor_locations(self._files, self._index, read)
        return {n: f for n, (f, _) in found.items()}, {n: e for n, (_, e) in found.items()}

    def _check_layers(self) -> None:
        for i in range(self.num_layers):
            prefix = self.adapter.block_prefix(i)
            if not self._by_prefix(prefix):
                raise CheckpointError(
                    f"checkpoint {self.path} has no tensors for {prefix} although config.json "
                    f"declares {self.num_layers} layers"
                )

    def _by_prefix(self, prefix: str) -> list[str]:
        return [n for n in self._where if n.startswith(prefix)]

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def block_nbytes(self, i: int) -> int:
        """Bytes decoder block ``i`` occupies once loaded (in ``self.dtype``), from headers only."""
        numel = sum(
            torch.Size(self._info[n][1]).numel()
            for n in self._by_prefix(self.adapter.block_prefix(i))
        )
        return numel * self.dtype.itemsize

    def _read_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Materialise exactly ``names`` (cast, on ``self.device``), opening each shard once."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            if name not in self._where:
                raise KeyError(f"tensor {name} is not in checkpoint {self.path}")
            by_file[self._where[name]].append(name)
        out: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            if self.is_bin:
                state = load_bin(file)
                # clone() detaches each tensor from the memory-mapped file.
                raw = {n: state[n].clone() for n in group}
            else:
                raw = read_tensors(file, {n: self._info[n] for n in group})
            for n, t in raw.items():
                check_finite(t, n, file)  # before any compute uses it, in the stored dtype
                if t.is_floating_point() and t.dtype != self.dtype:
                    t = t.to(self.dtype)
                out[n] = t.to(self.device)
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """Materialise one tensor (cast to ``self.dtype`` if floating, on ``self.device``)."""
        return self._read_many([name])[name]

    def _fill(self, module: nn.Module, prefix: str, what: str) -> nn.Module:
        """Assign the checkpoint tensors under ``prefix`` to a meta-device ``module``."""
        state = {n[len(prefix) :]: t for n, t in self._read_many(self._by_prefix(prefix)).items()}
        result = module.load_state_dict(state, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            raise CheckpointError(
                f"checkpoint {self.path}: {what} does not match config.json "
                f"(missing {result.missing_keys}, unexpected {result.unexpected_keys})"
            )
        left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if left:  # e.g. a non-persistent buffer the checkpoint cannot provide
            raise CheckpointError(f"{what}: tensors {left} are not stored in the checkpoint")
        return module.eval()

    def load_block(self, i: int) -> nn.Module:
        """Decoder block ``i`` with its real weights; no other block is read or allocated."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"block {i} out of range: the model has {self.num_layers} layers")
        with torch.device("meta"):
            block = self.adapter.decoder_layer_class()(self.config, layer_idx=i)
        return self._fill(block, self.adapter.block_prefix(i), f"block {i}")

    def load_embeddings(self) -> nn.Embedding:
        cfg = self.config
        with torch.device("meta"):
            emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        return self._fill(emb, self.adapter.embed + ".", "embeddings")

    def load_norm(self) -> nn.Module:
        with torch.device("meta"):
            norm = self.adapter.norm_class()(self.config.hidden_size, eps=self.config.rms_norm_eps)
        return self._fill(norm, self.adapter.final_norm + ".", "final norm")

    def load_lm_head(self) -> nn.Linear:
        """Output projection; a copy of the embeddings when the checkpoint ties them."""
        cfg, a = self.config, self.adapter
        tied = getattr(cfg, "tie_word_embeddings", False)
        prefix = a.embed + "." if tied else a.lm_head + "."
        if prefix + "weight" not in self:
            raise CheckpointError(
                f"checkpoint {self.path} has no {a.lm_head}.weight and config.json does not set "
                "tie_word_embeddings: the checkpoint is incomplete"
            )
        with torch.device("meta"):
            head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        return self._fill(head, prefix, "lm_head")

    def rotary(self) -> nn.Module:
        """The architecture's rotary embedding module (built once, on ``self.device``)."""
        if self._rotary is None:
            with self.device:
                self._rotary = self.adapter.rotary_class()(config=self.config)
        return self._rotary

    def block_forward_inputs(
        self, shape_or_seq_len: int | tuple[int, ...] | torch.Size, layer_idx: int = 0
    ) -> dict[str, Any]:
        """Keyword arguments for ``block(hidden, **kwargs)`` on a causal, unpadded batch of
        any size: mask (sliding for some layers), ``position_ids`` and rotary (cos, sin)."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        seq_len = shape_or_seq_len if isinstance(shape_or_seq_len, int) else shape_or_seq_len[1]
        # Only the shape, dtype and device of this stand-in are read by the mask builders.
        probe = torch.empty(1, seq_len, 0, dtype=self.dtype, device=self.device)  # (1, T, 0)
        position_ids = torch.arange(seq_len, device=self.device)[None]  # (1, T)
        sliding = attention_kind(self.config, layer_idx) == "sliding_attention"
        make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        mask = make_mask(self.config, probe, attention_mask=None, cache=None)
        return {
            "attention_mask": mask,
            "position_ids": position_ids,
            "position_embeddings": self.rotary()(probe, position_ids),
        }

    def verify(self) -> dict[str, int]:
        """Re-check every shard's header offsets against its file size (reads no weights)."""
        where, _ = self._index_tensors()
        return {
            "files": len(self._files),
            "tensors": len(where),
            "bytes": sum(f.stat().st_size for f in self._files),
        }

    def full_model(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The whole HF model, loaded normally. For tests and small models only."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            self.path,
            dtype=dtype or self.dtype,
            attn_implementation=self.config._attn_implementation,
            use_safetensors=not self.is_bin,
            local_files_only=True,
        ).eval()

    def __repr__(self) -> str:
        return (
            f"StreamingCheckpoint({str(self.path)!r}, arch={self.adapter.name}, "
            f"layers={self.num_layers}, files={len(self._files)}, dtype={self.dtype})"
        )
