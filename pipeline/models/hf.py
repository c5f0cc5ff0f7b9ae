"""Whole-model HF helpers: load/save checkpoints and tokenizers, build the bootstrap models.

Streaming (segment-at-a-time) access for models larger than memory lives in `checkpoint.py`;
this module is for models that fit: the bootstrap pair, the teacher in distillation, evaluation.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipeline.config import ModelSpec
from pipeline.errors import LowbitError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # checkpoints are local directories, never hub ids


def check_checkpoint(path: Path, allow_bin: bool = False) -> None:
    """One clear error for a directory that is not a loadable HF checkpoint."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise LowbitError(f"{path} is not a HF checkpoint: config.json is missing")
    if not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")) and not allow_bin:
            raise LowbitError(
                f"{path} holds only .bin (pickle) weights, which can run code when loaded. Convert "
                "them to safetensors, or set model.allow_bin=true if you trust the file."
            )
        if not any(path.glob("*.bin")):
            raise LowbitError(f"{path} has no *.safetensors weights")


def load_causal_lm(path: Path | str, dtype=torch.float32, allow_bin: bool = False):
    from transformers import AutoModelForCausalLM

    check_checkpoint(Path(path), allow_bin)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, use_safetensors=not allow_bin, local_files_only=True
    )
    return model.eval()


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.eos_token_id is None:
        raise LowbitError(f"the tokenizer in {path} has no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def train_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE trained on `docs` (seconds on a few MB), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=specials[0], bos_token=specials[0], pad_token=specials[1]
    )


def llama_config(spec: ModelSpec, tokenizer, max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def new_llama(spec: ModelSpec, tokenizer, max_positions: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(spec, tokenizer, max_positions))


def save_hf(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over the windows. windows: (W, T)"""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i : i + batch_size]
        logits = model(input_ids=x).logits[:, :-1].float()  # (B, T-1, V)
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += x[:, 1:].numel()
    return float(torch.exp(torch.tensor(total / count)))
