"""Documents -> train/validation/test splits -> fixed-length token windows.

Splits are assigned per document by a hash of its text, so they are stable when the corpus grows
and identical on every rank and every run. Windows are contiguous slices of the concatenated,
EOS-separated token stream (the usual LM pre-training packing).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from pipeline.config import DataConfig
from pipeline.data.corpus import builtin_documents
from pipeline.errors import LowbitError

_BUILDERS = {
    ".txt": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


def load_documents(data: DataConfig) -> list[str]:
    """The corpus as a list of documents: built-in, or the user's through `datasets`."""
    if data.path is None:
        return builtin_documents()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never reach for the hub
    import datasets

    path = Path(data.path)
    if path.is_dir() and any(
        (path / f).exists() for f in ("dataset_info.json", "dataset_dict.json")
    ):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
    else:
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        files = [f for f in files if f.suffix in _BUILDERS]
        kinds = {_BUILDERS[f.suffix] for f in files}
        if len(kinds) != 1:
            raise LowbitError(
                f"data.path={data.path}: expected files of one kind among "
                f"{sorted(_BUILDERS)}, found {sorted(kinds) or 'none'}"
            )
        ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    if data.text_field not in ds.column_names:
        raise LowbitError(
            f"data.path={data.path} has no column {data.text_field!r}; set data.text_field to one "
            f"of {ds.column_names}"
        )
    docs = [t for t in ds[data.text_field] if isinstance(t, str) and t.strip()]
    if not docs:
        raise LowbitError(f"data.path={data.path} holds no non-empty text in {data.text_field!r}")
    return docs


def split_documents(docs: list[str], data: DataConfig) -> dict[str, list[str]]:
    """Deterministic train/validation/test assignment by a hash of each document."""
    out: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for doc in docs:
        u = int.from_bytes(hashlib.sha1(doc.encode()).digest()[:8], "big") / 2**64
        if u < data.test_fraction:
            out["test"].append(doc)
        elif u < data.test_fraction + data.val_fraction:
            out["validation"].append(doc)
        else:
            out["train"].append(doc)
    if not out["test"] or not out["validation"]:
        # A tiny corpus: fall back to a positional split so every split has text.
        n = max(1, int(len(docs) * data.test_fraction))
        out = {"train": docs[2 * n :], "validation": docs[n : 2 * n], "test": docs[:n]}
    return out


def token_stream(docs: list[str], tokenizer) -> torch.Tensor:
    """All documents tokenised and joined by EOS. # (N,)"""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of seq_len tokens. # (W, seq_len)"""
    n = stream.numel() // seq_len
    if n == 0:
        raise LowbitError(
            f"the corpus has {stream.numel()} tokens, fewer than one window of {seq_len}; "
            "lower data.seq_len or add text"
        )
    w = stream[: n * seq_len].view(n, seq_len)
    return w if limit is None else w[:limit]


def random_windows(stream: torch.Tensor, seq_len: int, count: int, seed: int) -> torch.Tensor:
    """`count` windows at random offsets (calibration sets). # (count, seq_len)"""
    if stream.numel() <= seq_len:
        raise LowbitError(f"the corpus has fewer than {seq_len + 1} tokens; lower seq_len")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len, (count,), generator=g)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


class Corpus:
    """The configured corpus, split and tokenised once per process."""

    def __init__(self, data: DataConfig, tokenizer, splits: dict[str, list[str]] | None = None):
        self.data = data
        self.tokenizer = tokenizer
        self.splits = splits or split_documents(load_documents(data), data)
        self._streams: dict[str, torch.Tensor] = {}

    def stream(self, split: str) -> torch.Tensor:
        if split not in self._streams:
            self._streams[split] = token_stream(self.splits[split], self.tokenizer)
        return self._streams[split]

    def eval_windows(self, seq_len: int | None = None) -> torch.Tensor:
        """The held-out windows every perplexity and acceptance number is computed on."""
        return windows(self.stream("test"), seq_len or self.data.seq_len, self.data.eval_windows)

    def calibration(self, samples: int, seq_len: int, seed: int) -> torch.Tensor:
        return random_windows(self.stream("train"), seq_len, samples, seed)
