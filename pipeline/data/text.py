"""Documents -> train/validation/test splits -> fixed-length token windows.

The user's splits are kept (rules in README.md); an undivided source is split per document by a
hash of its text, stable as the corpus grows and identical on every rank and run. Windows are
contiguous slices of the EOS-joined token stream.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.config import DataConfig
from pipeline.data.chat import Conversation, Document, conversation, render_documents
from pipeline.data.corpus import builtin_documents
from pipeline.errors import LowbitError

log = logging.getLogger(__name__)

_BUILDERS = {
    ".txt": "text",
    ".raw": "text",  # WikiText's wiki.{train,valid,test}.raw
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_SPLIT_WORDS = {
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
}
_SPLIT_RULE = (
    "name each file (or DatasetDict split) with exactly one of the words train | validation, "
    "valid, val, dev | test, cut at . _ - (e.g. train.txt, validation.txt, test.txt)"
)


def load_splits(data: DataConfig, tokenizer=None) -> dict[str, list[str]]:
    """The corpus's "train", "validation" and "test" documents; the user's own splits if given.
    With data.chat_template, each as `tokenizer`'s chat template writes it (pipeline.data.chat)."""
    if data.path is None and data.name is None:
        given = {"train": builtin_documents(data.builtin_max_chars, data.builtin_packages)}
    else:
        given = _read_splits(data)
    if "train" not in given:
        raise LowbitError(f"{data.source} has {sorted(given)} but no train split; " + _SPLIT_RULE)
    # A missing split is carved from train rather than refused (many datasets hold only train).
    missing = tuple(s for s in ("test", "validation") if s not in given)
    if missing and len(given) > 1:
        log.info(
            "%s has no %s split: carving it from train by hash",
            data.source,
            " or ".join(missing),
        )
    splits = split_documents(given.pop("train"), data, carve=missing) | given
    splits["validation"] = unseen_validation(splits, data)
    if data.chat_template:  # after the split: a document's split does not depend on the template
        where = f"data.path={data.path}"
        return {s: render_documents(d, tokenizer, f"{where}, {s} split") for s, d in splits.items()}
    return splits


def unseen_validation(splits: dict[str, list[Document]], data: DataConfig) -> list[Document]:
    """The validation documents training never reads: the training stages keep a model only
    for a gain on text they did not train on. A carved split holds none of train's documents
    (a document's split is a function of its text); a user's files may repeat one."""
    seen = set(splits["train"])
    unseen = [doc for doc in splits["validation"] if doc not in seen]
    dropped = len(splits["validation"]) - len(unseen)
    if dropped and not unseen:
        raise LowbitError(
            f"{data.source}: every validation document also appears in the train "
            "split; give a validation file with text of its own, or remove it to carve one"
        )
    if dropped:
        log.info(
            "%s: %d validation document(s) also in the train split are left out of validation",
            data.source,
            dropped,
        )
    return unseen


def _read_splits(data: DataConfig) -> dict[str, list[Document]]:
    """The user's documents per split (data.path or data.name); all in "train" when undivided."""
    import datasets

    groups: dict[str, list[Path]] = {}  # split -> the user's files (none for a dataset)
    replaced = False  # whether bad bytes are read as U+FFFD (else they raise)
    if data.name is not None:
        from pipeline.data.cached import load_named

        parts = _dataset_parts(load_named(data), data, f"split {data.split!r}")
    elif is_saved_dataset(Path(data.path)):
        parts = _dataset_parts(datasets.load_from_disk(data.path), data, "the saved Dataset")
    else:
        kind, groups = file_splits(data)
        # sample_by is the text builder's option; the other builders reject unknown options.
        options = {"sample_by": data.sample_by} if kind == "text" else {}
        replaced = kind in ("text", "csv")
        if replaced:
            # Past the first MiB (checked at start): counted below, not failing minutes in.
            options["encoding_errors"] = "replace"
        with _utf8_or_one_line(data, groups):
            dd = datasets.load_dataset(
                kind,
                data_files={s: [str(f) for f in fs] for s, fs in groups.items()},
                download_config=datasets.DownloadConfig(local_files_only=True),
                **options,
            )
        parts = {s: [(", ".join(f.name for f in fs), dd[s])] for s, fs in groups.items()}
    out = {}
    for split, sources in parts.items():
        with _utf8_or_one_line(data, groups):  # JSON's bad bytes surface as its strings are read
            out[split] = [doc for where, ds in sources for doc in _texts(ds, data, where)]
        if not out[split]:
            raise LowbitError(
                f"{data.source}: the {split} split "
                f"({'; '.join(where for where, _ in sources)}) holds no non-empty text in "
                f"{data.text_field!r}"
            )
        if replaced and any("\ufffd" in doc for doc in out[split]):
            _log_replaced(data, groups[split])
    return out


def _dataset_parts(ds, data: DataConfig, alone: str) -> dict[str, list]:
    """A DatasetDict's splits by name; a single Dataset (described by `alone`) is train."""
    import datasets

    if isinstance(ds, datasets.Dataset):
        return {"train": [(alone, ds)]}
    return _group([(k, (f"split {k!r}", ds[k])) for k in ds], data)


def file_splits(data: DataConfig) -> tuple[str, dict[str, list[Path]]]:
    """The `datasets` builder and data.path's files per split ("train" alone if undivided)."""
    kind, files = source_files(data)
    if not Path(data.path).is_dir():  # one file is one undivided source whatever its name
        return kind, {"train": files}
    return kind, _group([(f.stem, f) for f in files], data)


_FFFD = "\ufffd".encode()


def utf8_errors(file: Path, block_size: int = 1 << 24) -> int:
    """How many byte sequences of `file` are not UTF-8 (each one U+FFFD when replaced)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    count, tail = 0, b""
    with open(file, "rb") as f:
        while block := f.read(block_size):
            # A U+FFFD in the file is text, not damage (`tail`: one straddling two blocks).
            count += decoder.decode(block).count("\ufffd") - (tail + block).count(_FFFD)
            tail = (tail + block)[-2:]
    return count + decoder.decode(b"", final=True).count("\ufffd")


def _log_replaced(data: DataConfig, files: list[Path]) -> None:
    for file in files:
        if n := utf8_errors(file):
            log.warning(
                "data.path=%s: %s holds %d byte sequence(s) that are not UTF-8, read as U+FFFD; "
                "if the file is in another encoding, re-encode it (e.g. `iconv -f latin1 -t "
                "utf-8 %s`)",
                data.path,
                file,
                n,
                file.name,
            )


def _not_utf8(data: DataConfig, groups: dict[str, list[Path]]) -> LowbitError | None:
    """The error naming the first file that is not UTF-8, None when all are."""
    for file in (f for files in groups.values() for f in files):
        if n := utf8_errors(file):
            return LowbitError(
                f"data.path={data.path}: {file} holds {n} byte sequence(s) that are not UTF-8 "
                f"past its first MiB; re-encode it, e.g. `iconv -f latin1 -t utf-8 {file.name}`"
            )
    return None


@contextmanager
def _utf8_or_one_line(data: DataConfig, groups: dict[str, list[Path]]):
    """A UnicodeDecodeError from `datasets` or Arrow becomes one line naming the file."""
    try:
        yield
    except Exception as err:
        bad = groups and _caused_by(err, UnicodeDecodeError) and _not_utf8(data, groups)
        if not bad:
            raise
        raise bad from None


def _caused_by(err: BaseException | None, kind: type) -> bool:
    for _ in range(16):  # a chain, not a cycle
        if err is None or isinstance(err, kind):
            return err is not None
        err = err.__cause__ or err.__context__
    return False


def _group(named: list[tuple[str, object]], data: DataConfig) -> dict[str, list]:
    """Items by the split their name says; all in "train" when no name says one."""
    splits = [
        {_SPLIT_WORDS.get(w) for w in re.split(r"[._-]", name.lower())} - {None}
        for name, _ in named
    ]
    if not any(splits):
        return {"train": [item for _, item in named]}
    unclear = [name for (name, _), s in zip(named, splits, strict=True) if len(s) != 1]
    if unclear:
        raise LowbitError(f"{data.source}: cannot tell the split of {unclear}; " + _SPLIT_RULE)
    out: dict[str, list] = {}
    for (_, item), s in zip(named, splits, strict=True):
        out.setdefault(s.pop(), []).append(item)
    return out


def _texts(ds, data: DataConfig, where: str) -> list[Document]:
    """The non-empty texts of data.text_field; with data.chat_template its conversations too."""
    if data.text_field not in ds.column_names:
        raise missing_field(data, where, ds.column_names)
    docs: list[Document] = []
    for value in ds[data.text_field]:
        if isinstance(value, str) and value.strip():
            docs.append(value)
        elif isinstance(value, list) and value:
            if not data.chat_template:
                raise LowbitError(
                    f"data.path={data.path} ({where}): {data.text_field!r} holds conversations "
                    "(lists of role/content messages), not text; set data.chat_template=true to "
                    "render them through the tokenizer's chat template"
                )
            if chat := conversation(value, f"data.path={data.path} ({where})"):
                docs.append(chat)
    return docs


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a `datasets.save_to_disk` directory (a Dataset or a DatasetDict)."""
    return path.is_dir() and any(
        (path / f).exists() for f in ("dataset_info.json", "dataset_dict.json")
    )


def source_files(data: DataConfig) -> tuple[str, list[Path]]:
    """The `datasets` builder and the non-empty files data.path names (a file or a folder)."""
    path = Path(data.path)
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    files = [f for f in files if f.suffix in _BUILDERS]
    kinds = sorted({_BUILDERS[f.suffix] for f in files})
    if not kinds:
        raise LowbitError(
            f"data.path={data.path}: no {', '.join(sorted(_BUILDERS))} file there; point it at "
            "such files (one, or a folder of them) or at a datasets.save_to_disk directory"
        )
    if len(kinds) > 1:
        raise LowbitError(
            f"data.path={data.path}: expected files of one kind among {sorted(_BUILDERS)}, found "
            f"{kinds}; move the others out"
        )
    for f in files:
        if f.stat().st_size == 0:  # `datasets` fails on it with a bare StopIteration
            raise LowbitError(f"data.path={data.path}: {f} is empty; add text or remove it")
    return kinds[0], files


def missing_field(data: DataConfig, where: str, fields: list[str]) -> LowbitError:
    """The error for a source without data.text_field, naming the fields it does have."""
    return LowbitError(
        f"{data.source} ({where}) has no column {data.text_field!r}; set "
        f"data.text_field to one of {list(fields)}"
    )


def split_documents(
    docs: list[Document], data: DataConfig, carve: tuple[str, ...] = ("test", "validation")
) -> dict[str, list[Document]]:
    """Deterministic assignment by a hash of each document; train keeps what `carve` leaves."""
    # Fixed hash intervals, so a document's carved split does not depend on which are carved.
    out: dict[str, list[Document]] = {"train": []} | {s: [] for s in carve}
    for doc in docs:
        raw = (doc.json if isinstance(doc, Conversation) else doc).encode()
        u = int.from_bytes(hashlib.sha1(raw).digest()[:8], "big") / 2**64
        if u < data.test_fraction:
            out["test" if "test" in carve else "train"].append(doc)
        elif u < data.test_fraction + data.val_fraction:
            out["validation" if "validation" in carve else "train"].append(doc)
        else:
            out["train"].append(doc)
    if not all(out[s] for s in carve):
        # A tiny corpus: fall back to a positional split so every split has text.
        if len(docs) < len(carve) + 1:
            raise too_few_documents(data, "the train split", len(docs), carve)
        n = max(1, int(len(docs) * data.test_fraction))
        out = {s: docs[i * n : (i + 1) * n] for i, s in enumerate(carve)}
        out["train"] = docs[len(carve) * n :]
    return out


_UNIT = {"line": "one per line", "paragraph": "one per blank-line-separated paragraph",
         "document": "one per file"}  # fmt: skip


def too_few_documents(data: DataConfig, where: str, n: int, carve: tuple[str, ...]) -> LowbitError:
    """The error for a train split of `n` documents, too few to carve `carve` from."""
    return LowbitError(
        f"{data.source}: {where} holds {n} document{'s' if n != 1 else ''} "
        f"({_UNIT[data.sample_by]}, data.sample_by={data.sample_by}), too few to carve "
        f"{' and '.join(carve)} from; split the text into more documents, or give each split "
        "its own file (a folder of train.txt, validation.txt, test.txt)"
    )


def token_stream(docs: list[str], tokenizer, num_proc: int = 1) -> torch.Tensor:
    """All documents tokenised (`Dataset.map`, batched, over `num_proc` processes) and joined by
    EOS. # (N,)"""
    import datasets
    import pyarrow.compute as pc

    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [doc + [eos] for doc in ids]}

    mapped = datasets.Dataset.from_dict({"text": docs}).map(
        encode,
        batched=True,
        num_proc=num_proc if num_proc > 1 and len(docs) > 1 else None,
        remove_columns=["text"],
        features=datasets.Features({"ids": datasets.List(datasets.Value("int64"))}),
        new_fingerprint="token-stream",  # in memory, never cached: spare hashing the tokenizer
    )
    flat = pc.list_flatten(mapped.data.column("ids")).to_numpy()
    return torch.from_numpy(flat.copy()).long()


def windows(stream: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of seq_len tokens; `limit` of them spread evenly over the stream
    (a prefix would be a few documents, not the split). # (W, seq_len)"""
    n = stream.numel() // seq_len
    if n == 0:
        raise LowbitError(
            f"the corpus has {stream.numel()} tokens, fewer than one window of {seq_len}; "
            "lower data.seq_len or add text"
        )
    w = stream[: n * seq_len].view(n, seq_len)
    if limit is None or limit >= n:
        return w
    return w[torch.arange(limit) * n // limit]


def random_windows(stream: torch.Tensor, seq_len: int, count: int, seed: int) -> torch.Tensor:
    """`count` windows at random offsets (calibration sets). # (count, seq_len)"""
    if stream.numel() <= seq_len:
        raise LowbitError(
            f"the train split has {stream.numel()} tokens, fewer than the {seq_len + 1} of one "
            "calibration window; lower quant.calib.seq_len or add text"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len, (count,), generator=g)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


class Corpus:
    """The configured corpus, split and tokenised once per process."""

    def __init__(self, data: DataConfig, tokenizer, splits: dict[str, list[str]] | None = None):
        self.data = data
        self.tokenizer = tokenizer
        self.splits = splits or load_splits(data, tokenizer)
        self._streams: dict[str, torch.Tensor] = {}

    def stream(self, split: str) -> torch.Tensor:
        if split not in self._streams:
            docs, procs = self.splits[split], self.data.num_proc
            self._streams[split] = token_stream(docs, self.tokenizer, procs)
        return self._streams[split]

    def calibration(self, samples: int, seq_len: int, seed: int) -> torch.Tensor:
        return random_windows(self.stream("train"), seq_len, samples, seed)
