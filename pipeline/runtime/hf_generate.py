"""Decoding through transformers' ``generate``: top-p / top-k, stop strings and streaming.

The runtime's model is a transformers causal LM, so ``generate(assistant_model=draft)`` runs on
it unchanged. Assisted generation checks stop strings only after each accepted block, so the
text, tokens and streamed output are cut here at the first stop string (included).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import StoppingCriteriaList, StopStringCriteria, TextStreamer

from pipeline.speculative.stats import SpecStats


def eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Every token that ends a generation: the model's generation_config `eos_token_id`, an int
    or a list (Llama-3 Instruct stops on `<|eot_id|>` as well as `<|end_of_text|>`), and the
    tokenizer's EOS token."""
    given = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [given] if isinstance(given, int) else list(given or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


def stop_end(text: str, stop: Sequence[str]) -> int | None:
    """End index of the stop string that completes first in ``text``; None when none does."""
    ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
    return min(ends) if ends else None


class StopStreamer(TextStreamer):
    """transformers' TextStreamer (stdout, prompt skipped) that goes quiet after a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.stop, self.text, self.stopped = tuple(stop), "", False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if not self.stopped:
            start = len(self.text)
            self.text += text
            end = stop_end(self.text, self.stop)
            if end is not None:
                self.stopped, text = True, self.text[start:end]
            print(text, end="", flush=True)
        if stream_end:
            print(flush=True)


def check_options(
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    stop: Sequence[str],
    stream: bool,
    gamma: int | None,
    pipelined: bool,
    temperature_schedule: bool,
) -> bool:
    """Validate the decoding options together; True when transformers' generate decodes."""
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if any(not s for s in stop):
        raise ValueError("stop strings must not be empty")
    if (top_p is not None or top_k is not None) and temperature == 0:
        raise ValueError("top_p / top_k shape sampling: give a temperature > 0 with them")
    use_hf = top_p is not None or top_k is not None or bool(stop) or stream
    if use_hf and (gamma is not None or pipelined or temperature_schedule):
        raise ValueError(
            "gamma, pipelined and temperature_schedule belong to lowbit's decoder, while "
            "top_p, top_k, stop and stream decode through transformers' generate: use one set"
        )
    return use_hf


def hf_generate(
    model: torch.nn.Module,
    tokenizer,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    *,
    draft: torch.nn.Module | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    stop: Sequence[str] = (),
    stream: bool = False,
    seed: int = 0,
) -> tuple[str, list[int], SpecStats]:
    """Continue the (1, T) prompt ``ids`` with ``model.generate`` (``draft`` as assistant model).

    ``top_p`` / ``top_k`` None = off; ``stop``: the output ends with the first stop string;
    ``seed`` seeds sampling, the caller's RNG state restored. Returns (text, new token ids, stats
    of tokens and seconds).
    """
    stats = SpecStats()
    if max_new_tokens == 0:
        return "", [], stats
    eos = eos_ids(model, tokenizer)
    kwargs = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": max_new_tokens,
        "do_sample": temperature > 0,
        "eos_token_id": eos or None,
        "pad_token_id": next(i for i in (tokenizer.pad_token_id, *eos, None) if i is not None),
        "assistant_model": draft,
    }
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=top_p or 1.0, top_k=top_k or 0)
    if stop:
        # Not ``stop_strings``: those reach the assistant's generate, which has no tokenizer.
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [StopStringCriteria(tokenizer, list(stop))]
        )
    if stream:
        kwargs["streamer"] = StopStreamer(tokenizer, stop)
    devices = [ids.device] if ids.device.type == "cuda" else []
    start = time.perf_counter()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        seq = model.generate(ids, **kwargs)
    stats.seconds = time.perf_counter() - start
    new = seq[0, ids.shape[1] :].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    end = stop_end(text, stop)
    if end is not None:
        text = text[:end]
        prefixes = (
            tokenizer.decode(new[:i], skip_special_tokens=True) for i in range(len(new) + 1)
        )
        new = new[: next(i for i, t in enumerate(prefixes) if stop_end(t, stop) is not None)]
    stats.new_tokens = len(new)
    return text, new, stats
