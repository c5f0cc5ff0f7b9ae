"""Tiny quantized model directories for export and runtime tests (built, never downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.export import ExportOptions

HIDDEN, INTER, LAYERS = 256, 512, 1  # k = 256 / 512: two or more groups of 128
DOCS = ["the quick brown fox jumps over the lazy dog and runs far away"] * 40


class QuantModels:
    """Builds (and caches) an FP checkpoint and its quantized model directories.

    ``get(formats)`` quantizes the i-th linear of the model with ``formats[i % len]`` by RTN
    and writes it with the project's quantized-model writer; returns the directory.
    """

    def __init__(self, root: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        from pipeline.models.hf import train_tokenizer

        self.root = root
        tok = train_tokenizer(DOCS, 300)
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=256,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        self.fp = root / "fp"
        model.save_pretrained(self.fp)
        tok.save_pretrained(self.fp)
        self._cache: dict[tuple[str, ...], Path] = {}

    def fp_model(self):
        from pipeline.models.hf import load_causal_lm

        return load_causal_lm(self.fp)

    def get(self, formats: tuple[str, ...] | str) -> Path:
        from pipeline.models.quantized import save_quantized_model
        from pipeline.quant.fakequant import FakeQuantLinear
        from pipeline.quant.rtn import quantize_rtn

        formats = (formats,) if isinstance(formats, str) else tuple(formats)
        if formats not in self._cache:
            model = self.fp_model()
            names = [
                n
                for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and n != "lm_head"
            ]
            for i, name in enumerate(names):
                lin = model.get_submodule(name)
                qt = quantize_rtn(lin.weight, formats[i % len(formats)])
                model.set_submodule(name, FakeQuantLinear.from_qtensor(qt, lin.bias))
            out = self.root / ("q-" + "_".join(formats))
            self._cache[formats] = save_quantized_model(model, out, self.fp, "rtn")
        return self._cache[formats]


def tokens(n: int = 12, batch: int = 2, vocab: int = 260, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=g)


def export_options(**changes: Any) -> ExportOptions:
    """The options the export stage builds from its config's defaults, with ``changes``; ``act``
    (which the stage reads from the sensitivity report) among them."""
    from pipeline.stages.export import ExportConfig

    act = changes.pop("act", None)
    cfg = ExportConfig(**changes)
    return cfg.options(act)
