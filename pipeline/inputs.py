"""Start checks on the user's own checkpoints and corpus: one line per problem, before compute.

Metadata only (headers, tokenizer files, each text file's first MiB, parquet schemas), so the
cost does not grow with the model or corpus; NaN/Inf weights are found where weights are read.
The rules shared with loading live next to the loaders (``pipeline.models.hf``,
``pipeline.data.text``), so a start check and a stage say the same thing.
"""

from __future__ import annotations

import codecs
import csv
import json
from pathlib import Path

from pipeline.config import DataConfig, ModelConfig
from pipeline.data.chat import require_template
from pipeline.data.text import file_splits, is_saved_dataset, missing_field, too_few_documents
from pipeline.errors import LowbitError
from pipeline.models.hf import check_checkpoint, load_tokenizer, vocabulary_difference

_BINARY_PROBE = 64 << 10  # a NUL byte here means binary or UTF-16: UTF-8 text never holds one
_TEXT_PROBE = 1 << 20  # decoded as UTF-8; further on the loader reads a bad byte as U+FFFD


def check_inputs(models: ModelConfig, data: DataConfig) -> None:
    """Check the user's checkpoints and corpus (null paths: lowbit's own); LowbitError naming
    the key and the fix."""
    dirs = {role: getattr(models, role).local_dir(f"model.{role}") for role in ("target", "draft")}
    for role, path in dirs.items():
        if path is not None:
            check_checkpoint(path, models.allow_bin, key=f"model.{role}.path")
    if dirs["target"] is not None:  # the target's tokenizer is the one lowbit uses
        tokenizer = load_tokenizer(dirs["target"], key="model.target.path")
        if dirs["draft"] is not None:
            check_draft_vocabulary(tokenizer, dirs["target"], dirs["draft"])
        if data.chat_template:
            require_template(
                tokenizer,
                f"data.chat_template=true with model.target.path={models.target.path}",
                "set data.chat_template=false, or add the model's chat template to its "
                "tokenizer files",
            )
    elif data.chat_template:
        raise LowbitError(
            "data.chat_template=true, but the bootstrap model's tokenizer has no chat template; "
            "set model.target.path to a chat model's checkpoint, or data.chat_template=false"
        )
    if data.path is not None or data.name is not None:
        check_data(data)


def check_draft_vocabulary(target_tokenizer, target: Path, draft: Path) -> None:
    """Refuse a draft whose tokenizer is not the target's: every stage tokenizes with the
    target's, so the draft would read and propose ids that mean other tokens to it."""
    if draft.resolve() == target.resolve():
        return
    difference = vocabulary_difference(
        target_tokenizer, load_tokenizer(draft, key="model.draft.path")
    )
    if difference:
        raise LowbitError(
            f"model.draft.path={draft}: its tokenizer is not the one of "
            f"model.target.path={target} ({difference}); speculative decoding needs one "
            "vocabulary: choose a draft of the target's model family, or model.draft.path=null "
            "(the target then drafts for itself)"
        )


def check_data(data: DataConfig) -> None:
    """One line for data a run could not read, too short for a single window, or too few
    documents to carve the splits it lacks from."""
    kind, groups = "saved", {}
    if data.name is not None:
        room = _check_named(data)
    elif is_saved_dataset(Path(data.path)):
        room = _check_saved(data, Path(data.path))
    else:
        kind, groups = file_splits(data)
        files = [f for fs in groups.values() for f in fs]
        room = sum(_check_file(data, kind, f, data.seq_len + 1) for f in files)
    # A byte-level BPE token covers at least one byte and each EOS at least a separator, so
    # `room` bounds the tokens from above; the windowing keeps its own exact check.
    if room < data.seq_len + 1:
        raise LowbitError(
            f"{data.source} holds at most {room} bytes of text, too few for one window "
            f"of data.seq_len={data.seq_len} tokens plus its next-token target; add text or lower "
            "data.seq_len"
        )
    if kind == "text":
        _check_documents(data, groups)


def _check_file(data: DataConfig, kind: str, file: Path, need: int) -> int:
    """Check one source file; returns an upper bound on its tokens (up to `need` for parquet)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(file).names  # the footer only
        if data.text_field not in names:
            raise missing_field(data, file.name, names)
        return _parquet_room(file, data.text_field, need)
    head = _read_text_head(data, file)
    if not head.strip() and file.stat().st_size <= _TEXT_PROBE:
        raise LowbitError(f"{_subject(data, file)} holds only whitespace; add text or remove it")
    if kind == "text":
        fields = ["text"]  # the text builder names its one column so
    elif kind == "csv":
        fields = next(csv.reader(head.splitlines()[:1]), [])
    else:
        fields = _json_fields(data, file, head)
    if fields is not None and data.text_field not in fields:
        where = f"the first record of {file.name}" if kind == "json" else file.name
        raise missing_field(data, where, fields)
    return file.stat().st_size + 1  # + the EOS of a last document without a newline


def _check_documents(data: DataConfig, groups: dict[str, list[Path]]) -> None:
    """One line for train text files too few documents to carve the missing splits from
    (reading stops at the documents needed)."""
    carve = tuple(s for s in ("test", "validation") if s not in groups)
    if not carve or "train" not in groups:
        return
    need, found = len(carve) + 1, 0
    for file in groups["train"]:
        found += _count_documents(file, data.sample_by, need - found)
        if found >= need:
            return
    files = groups["train"]
    where = "the file" if files == [Path(data.path)] else ", ".join(f.name for f in files)
    raise too_few_documents(data, where, found, carve)


def _count_documents(file: Path, sample_by: str, enough: int) -> int:
    """Documents in a text file as the text builder cuts them (non-blank), up to `enough`."""
    if sample_by == "document":
        return 1
    sep = b"\n\n" if sample_by == "paragraph" else b"\n"
    count, rest = 0, b""
    with open(file, "rb") as f:
        while count < enough:
            block = f.read(_TEXT_PROBE)
            if block.endswith(b"\r"):  # keep a CRLF whole: the builder reads universal newlines
                block += f.read(1)
            pieces = (rest + block).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(sep)
            rest = pieces.pop() if block else b""
            count += sum(1 for p in pieces if p.decode("utf-8", "replace").strip())
            if not block:
                break
    return count


def _read_text_head(data: DataConfig, file: Path) -> str:
    """The first MiB of `file` decoded; one line for a binary or non-UTF-8 file."""
    with open(file, "rb") as f:
        head = f.read(_TEXT_PROBE)
    nul = head.find(b"\0", 0, _BINARY_PROBE)
    if nul >= 0:
        raise LowbitError(
            f"{_subject(data, file)} is not text (a NUL byte at byte {nul}: binary, or UTF-16); "
            "save it as UTF-8 text or move it out"
        )
    try:  # incremental, so a character cut at the probe's end is not an error
        return codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _TEXT_PROBE)
    except UnicodeDecodeError as err:
        raise LowbitError(
            f"{_subject(data, file)} is not UTF-8 (byte {err.start} is "
            f"{head[err.start : err.start + 1]!r}); re-encode it, e.g. "
            f"`iconv -f latin1 -t utf-8 {file.name}`"
        ) from None


def _subject(data: DataConfig, file: Path) -> str:
    """`data.path=DIR: FILE`, or `data.path=FILE` when the setting names the file itself."""
    return f"data.path={data.path}" + ("" if file == Path(data.path) else f": {file}")


def _json_fields(data: DataConfig, file: Path, head: str) -> list[str] | None:
    """Keys of the first record of a JSON Lines file or a JSON array; None if not a record."""
    text = head.lstrip("\ufeff \t\r\n")
    text = text[1:] if text.startswith("[") else text
    try:
        record, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except json.JSONDecodeError as err:
        if len(head) >= _TEXT_PROBE and "\n" not in text:
            return None  # a first record longer than the probe: the loader will read it whole
        raise LowbitError(
            f"{_subject(data, file)}: its first record is not JSON ({err.msg}); fix the file or "
            "move it out"
        ) from None
    return list(record) if isinstance(record, dict) else None


def _parquet_room(file: Path, field: str, need: int) -> int:
    """Bytes + rows of the text column, read batch by batch until `need` is reached."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(file)
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return need  # not text at all: the loader says so, naming the split
    room = 0
    # Compression hides the text's size, so it is measured, stopping at `need`.
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        col = batch.column(0)
        room += len(col) + (pc.sum(pc.binary_length(col)).as_py() or 0)
        if room >= need:
            break
    return room


def _check_named(data: DataConfig) -> int:
    """Check data.name in the caches (memory-mapped Arrow, no string read); returns its room."""
    import datasets

    from pipeline.data.cached import load_named

    found = load_named(data)
    parts = {data.split: found} if isinstance(found, datasets.Dataset) else found
    for split, ds in parts.items():
        if data.text_field not in ds.column_names:
            raise missing_field(data, f"split {split!r}", ds.column_names)
    return sum(ds.data.column(data.text_field).nbytes for ds in parts.values())


def _check_saved(data: DataConfig, path: Path) -> int:
    """Check a save_to_disk Dataset or DatasetDict from its descriptors; returns its room."""
    import pyarrow as pa

    try:
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            parts = [(f"split {s!r}", path / s) for s in splits]
        else:
            parts = [("the saved Dataset", path)]
        room = 0
        for where, part in parts:
            fields = list(json.loads((part / "dataset_info.json").read_text())["features"])
            if data.text_field not in fields:
                raise missing_field(data, where, fields)
            for entry in json.loads((part / "state.json").read_text())["_data_files"]:
                # Memory-mapped Arrow: the column's buffer sizes, no string is read.
                with pa.memory_map(str(part / entry["filename"])) as src:
                    room += pa.ipc.open_stream(src).read_all().column(data.text_field).nbytes
    except (OSError, KeyError, TypeError, ValueError, pa.ArrowException) as err:
        raise LowbitError(
            f"data.path={data.path}: the saved dataset is unreadable ({type(err).__name__}: "
            f"{err}); write it again with save_to_disk"
        ) from None
    return room
