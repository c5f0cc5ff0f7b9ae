"""A causal LM's shape from its config.json (or the bootstrap spec), without torch or weights, and
the defaults that scale with its size (`size_defaults`; why: docs/memory.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import LowbitError

# Bytes per element of the dtype names config.json uses (torch_dtype, or transformers 5's dtype).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1}

# From here a checkpoint is a real LLM: calibrated with GPTQ's 128 x 2048 and trained in bf16.
REAL_PARAMS = 1e9
# From here sensitivity streams: "7B" checkpoints hold 6.7-7.2 B parameters (Llama-2-7B: 6.74 B).
LARGE_PARAMS = 6e9


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only LM that set its memory."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False  # lm_head shares the embedding table
    dtype_bytes: int = 4  # as stored in the checkpoint
    head_dim: int | None = None  # null: hidden / heads
    max_positions: int = 2048

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def attn_width(self) -> int:
        """q and o's inner width (heads x head_dim)."""
        return self.heads * self.d_head

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.d_head

    @property
    def block_linear_params(self) -> int:
        """q, k, v, o, gate, up, down of one decoder block."""
        attn = 2 * self.hidden * self.attn_width + 2 * self.hidden * self.kv_width
        return attn + 3 * self.hidden * self.intermediate

    @property
    def block_params(self) -> int:
        return self.block_linear_params + 2 * self.hidden  # plus two RMSNorm weights

    @property
    def linear_params(self) -> int:
        return self.layers * self.block_linear_params

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.embed_params + self.head_params + self.layers * self.block_params + self.hidden

    @property
    def input_widths(self) -> tuple[int, ...]:
        """The in_features of each group of linears sharing an input: (q,k,v), o, (gate,up), down;
        GPTQ keeps one in x in Hessian per group."""
        return (self.hidden, self.attn_width, self.hidden, self.intermediate)

    @property
    def largest_linear(self) -> int:
        """Elements of the largest block linear (gate/up/down: hidden x intermediate)."""
        return max(self.hidden * self.intermediate, self.hidden * self.attn_width)

    def checkpoint_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelShape:
        """From a transformers config.json's fields (Llama, Mistral, Qwen2 and alike)."""
        try:
            heads = int(config["num_attention_heads"])
            shape = cls(
                layers=int(config["num_hidden_layers"]),
                hidden=int(config["hidden_size"]),
                intermediate=int(config["intermediate_size"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                vocab=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                dtype_bytes=DTYPE_BYTES.get(
                    str(config.get("torch_dtype") or config.get("dtype") or "float32"), 4
                ),
                head_dim=config.get("head_dim"),
                max_positions=int(config.get("max_position_embeddings") or 2048),
            )
        except KeyError as e:
            raise LowbitError(
                f"config.json has no {e.args[0]!r}: lowbit plans decoder-only LMs with "
                "Llama-style fields (num_hidden_layers, hidden_size, intermediate_size, "
                "num_attention_heads, vocab_size)"
            ) from None
        return shape

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        """From `path`/config.json (a HF checkpoint or a lowbit quantized model directory)."""
        file = Path(path) / "config.json"
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            problem = f"{file} cannot be read as JSON ({e}): is {path} a checkpoint?"
            raise LowbitError(problem) from None
        return cls.from_hf(config)

    @classmethod
    def from_spec(cls, spec: Any, vocab: int) -> ModelShape:
        """The bootstrap model of `spec` (a pipeline.config.ModelSpec): fp32, untied, MHA."""
        return cls(spec.layers, spec.hidden, spec.intermediate, spec.heads, spec.heads, vocab)


def model_shapes(model: Any) -> dict[str, ModelShape | None]:
    """{"target": shape, "draft": shape or None} of a pipeline.config.ModelConfig; None where a
    checkpoint's config.json cannot be read (the input checks name that problem) or there is no
    draft (a user target with a null draft path)."""
    out: dict[str, ModelShape | None] = {}
    for role in ("target", "draft"):
        spec = getattr(model, role)
        if spec.path is None:
            bootstrap = role == "target" or model.target.path is None
            out[role] = (
                ModelShape.from_spec(spec, model.tokenizer.vocab_size) if bootstrap else None
            )
            continue
        try:
            out[role] = ModelShape.from_dir(spec.local_dir(f"model.{role}"))
        except LowbitError:
            out[role] = None
    return out


@dataclass(frozen=True)
class SizeDefaults:
    """What a null calibration, sensitivity streaming or trainer precision becomes."""

    calib_samples: int
    calib_seq_len: int
    stream_sensitivity: bool
    precision: str  # a Lightning precision; "auto": bf16-mixed where native (pipeline.hardware)
    why: str


def size_defaults(shape: ModelShape | None) -> SizeDefaults:
    """The defaults for a target of `shape` (None: unreadable, planned as a real LLM)."""
    params = shape.params if shape is not None else REAL_PARAMS
    if params < REAL_PARAMS:  # the embedded default and test models: seconds, not hours
        return SizeDefaults(64, 128, False, "32-true", f"{params / 1e6:.1f} M parameters")
    seq_len = min(2048, shape.max_positions) if shape is not None else 2048
    large = params >= LARGE_PARAMS
    return SizeDefaults(128, seq_len, large, "auto", f"{params / 1e9:.1f} B parameters")
