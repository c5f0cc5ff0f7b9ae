"""The user's splits are the splits: given train/validation/test text never crosses splits."""

import logging
import re

import pytest

from pipeline.config import DataConfig
from pipeline.data.text import Corpus, load_splits, split_documents, utf8_errors
from pipeline.errors import LowbitError

WORDS = ["river", "hill", "stone", "cloud", "field", "lamp", "bread", "music"]


def _lines(mark: str, n: int) -> list[str]:
    """n distinct lines, each carrying `mark` (a word no other split's lines contain)."""
    return [f"{mark} {i} {WORDS[i % 8]} and {WORDS[(3 * i) % 8]}" for i in range(n)]


def _write(folder, **files: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    for name, lines in files.items():
        (folder / name).write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def divided(tmp_path_factory):
    """A folder with train.txt, validation.txt and test.txt of marked lines."""
    root = tmp_path_factory.mktemp("divided")
    given = {
        "train": _lines("trainline", 150),
        "validation": _lines("valmark", 30),
        "test": _lines("testmark", 30),
    }
    _write(root, **{f"{s}.txt": lines for s, lines in given.items()})
    return root, given


@pytest.fixture(scope="module")
def tokenizer(divided):
    from pipeline.models.hf import train_tokenizer

    _, given = divided
    return train_tokenizer([line for lines in given.values() for line in lines], 300)


def test_files_named_by_split_keep_their_lines(divided):
    root, given = divided
    assert load_splits(DataConfig(path=str(root))) == given
    # The old behaviour, a hash split of every line, would have trained on test lines.
    mixed = split_documents([line for lines in given.values() for line in lines], DataConfig())
    assert any("testmark" in line for line in mixed["train"])


def test_no_held_out_text_in_calibration_or_training_windows(divided, tokenizer):
    from pipeline.lit.lm import RandomWindows

    root, _ = divided
    corpus = Corpus(DataConfig(path=str(root), seq_len=16), tokenizer)
    train_text = tokenizer.decode(corpus.stream("train"))
    calib = [tokenizer.decode(w) for w in corpus.calibration(samples=64, seq_len=16, seed=0)]
    training = RandomWindows(corpus.stream("train"), 16, batch_size=8, seed=0)
    training = [tokenizer.decode(w) for k in range(8) for w in training.batch(k)]
    for text in [train_text, *calib, *training]:
        assert "testmark" not in text and "valmark" not in text
    # The markers survive tokenisation: the same check finds them where they belong.
    assert "trainline" in train_text and any("trainline" in t for t in calib)
    assert "testmark" in tokenizer.decode(corpus.stream("test"))


def test_dataset_dict_keeps_its_splits(tmp_path):
    import datasets

    given = {"train": _lines("a", 40), "valid": _lines("b", 5), "test": _lines("c", 5)}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in given.items()}
    ).save_to_disk(str(tmp_path / "dd"))
    splits = load_splits(DataConfig(path=str(tmp_path / "dd")))
    assert splits == {"train": given["train"], "validation": given["valid"], "test": given["test"]}


def test_several_files_per_split_and_wikitext_names(tmp_path):
    _write(
        tmp_path / "wiki",
        **{
            "wiki.train.raw": _lines("a", 20),
            "extra_train-01.raw": _lines("b", 20),
            "wiki.valid.raw": _lines("c", 5),
            "wiki.test.raw": _lines("d", 5),
        },
    )
    splits = load_splits(DataConfig(path=str(tmp_path / "wiki")))
    assert sorted(splits["train"]) == sorted(_lines("a", 20) + _lines("b", 20))
    assert splits["validation"] == _lines("c", 5) and splits["test"] == _lines("d", 5)


def test_sample_by_paragraph_gives_one_document_per_paragraph(tmp_path):
    paragraphs = [f"{WORDS[i % 8]} paragraph {i}\nits second line {i}" for i in range(12)]
    _write(tmp_path / "p", **{"train.txt": paragraphs, "test.txt": ["a test\nparagraph"]})
    (tmp_path / "p" / "train.txt").write_text("\n\n".join(paragraphs) + "\n")
    by_line = load_splits(DataConfig(path=str(tmp_path / "p")))
    by_paragraph = load_splits(DataConfig(path=str(tmp_path / "p"), sample_by="paragraph"))
    assert len(by_line["train"]) + len(by_line["validation"]) == 24
    docs = [d.strip() for d in by_paragraph["train"] + by_paragraph["validation"]]
    assert sorted(docs) == sorted(paragraphs)
    assert [d.strip() for d in by_paragraph["test"]] == ["a test\nparagraph"]


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_an_undivided_source_is_split_by_hash(tmp_path, layout):
    lines = _lines("doc", 400)
    _write(tmp_path / "u", **{"corpus.txt": lines[:200], "more.txt": lines[200:]})
    if layout == "file":
        (tmp_path / "u" / "corpus.txt").write_text("\n".join(lines) + "\n")
    path = tmp_path / "u" / "corpus.txt" if layout == "file" else tmp_path / "u"
    data = DataConfig(path=str(path))
    splits = load_splits(data)
    assert all(splits[s] for s in ("train", "validation", "test"))
    assert {k: sorted(v) for k, v in splits.items()} == {
        k: sorted(v) for k, v in split_documents(lines, data).items()
    }


def test_missing_validation_is_carved_from_train(tmp_path, caplog):
    train, test = _lines("trainline", 200), _lines("testmark", 20)
    _write(tmp_path / "tt", **{"train.txt": train, "test.txt": test})
    with caplog.at_level(logging.INFO, logger="pipeline.data.text"):
        splits = load_splits(DataConfig(path=str(tmp_path / "tt")))
    assert splits["test"] == test
    assert splits["validation"] and set(splits["validation"]) <= set(train)
    assert sorted(splits["train"] + splits["validation"]) == sorted(train)
    assert not set(splits["train"]) & set(splits["validation"])
    assert [r.message for r in caplog.records if "carving" in r.message] == [
        f"data.path={tmp_path / 'tt'} has no validation split: carving it from train by hash"
    ]


def test_errors_name_the_file(tmp_path):
    _write(tmp_path / "e", **{"train.txt": _lines("a", 20), "test.txt": _lines("b", 3)})
    (tmp_path / "e" / "test.txt").write_text("")
    with pytest.raises(LowbitError, match="test.txt is empty"):
        load_splits(DataConfig(path=str(tmp_path / "e")))
    (tmp_path / "e" / "test.txt").write_text("\n  \n")
    with pytest.raises(LowbitError, match=r"test split \(test.txt\) holds no non-empty text"):
        load_splits(DataConfig(path=str(tmp_path / "e")))
    _write(tmp_path / "e", **{"test.txt": _lines("b", 3), "notes.txt": ["x"]})
    with pytest.raises(LowbitError, match=r"cannot tell the split of \['notes'\]"):
        load_splits(DataConfig(path=str(tmp_path / "e")))
    _write(tmp_path / "t", **{"test.txt": _lines("b", 3)})
    with pytest.raises(LowbitError, match="no train split"):
        load_splits(DataConfig(path=str(tmp_path / "t")))
    (tmp_path / "t" / "train.json").write_text('{"body": "x"}\n')
    with pytest.raises(LowbitError, match="one kind"):
        load_splits(DataConfig(path=str(tmp_path / "t")))
    (tmp_path / "t" / "test.txt").unlink()
    with pytest.raises(LowbitError, match="no column 'text'.*body"):
        load_splits(DataConfig(path=str(tmp_path / "t")))


# ------------------------------------------------------------------------------ input faults
MIB = 1 << 20


def _past_the_first_mib(mark: str) -> bytes:
    """Over a MiB of UTF-8 lines (the start check's probe), so what follows is the loader's."""
    return "".join(f"{line}\n" for line in _lines(mark, 45_000)).encode()


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 1 << 24])
def test_utf8_errors_counts_bad_sequences_not_written_replacement_characters(tmp_path, block_size):
    path = tmp_path / "f.txt"
    # two bad sequences (a Latin-1 é, a lone continuation byte) and a U+FFFD written as text
    path.write_bytes(b"caf" + b"\xe9 ok \xbf, " + "written \ufffd, ünï\n".encode())
    assert utf8_errors(path, block_size) == 2
    path.write_bytes("all fine \ufffd\ufffd ü\n".encode())
    assert utf8_errors(path, block_size) == 0


@pytest.mark.parametrize("kind", ["txt", "csv"])
def test_bad_bytes_past_the_first_mib_are_replaced_and_counted(tmp_path, caplog, kind):
    head = _past_the_first_mib("good")
    assert len(head) > MIB
    path = tmp_path / f"train.{kind}"
    tail = b"caf\xe9 \xff end\n" + "and a written \ufffd\n".encode()
    path.write_bytes((b"text\n" if kind == "csv" else b"") + head + tail)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.text"):
        splits = load_splits(DataConfig(path=str(path)))
    docs = [d for split in splits.values() for d in split]
    assert "caf\ufffd \ufffd end" in docs and "and a written \ufffd" in docs
    assert [r.getMessage() for r in caplog.records] == [
        f"data.path={path}: {path} holds 2 byte sequence(s) that are not UTF-8, read as U+FFFD; "
        f"if the file is in another encoding, re-encode it (e.g. `iconv -f latin1 -t utf-8 "
        f"{path.name}`)"
    ]


def test_json_not_utf8_past_the_first_mib_names_the_file(tmp_path):
    import json

    path = tmp_path / "train.jsonl"
    lines = "".join(json.dumps({"text": t}) + "\n" for t in _lines("good", 30_000)).encode()
    assert len(lines) > MIB
    path.write_bytes(lines + b'{"text": "caf\xe9"}\n')
    with pytest.raises(LowbitError) as info:
        load_splits(DataConfig(path=str(path)))
    assert str(info.value) == (
        f"data.path={path}: {path} holds 1 byte sequence(s) that are not UTF-8 past its first "
        "MiB; re-encode it, e.g. `iconv -f latin1 -t utf-8 train.jsonl`"
    )


@pytest.mark.parametrize("sample_by", ["line", "document"])
def test_one_document_cannot_be_carved_into_splits(tmp_path, sample_by):
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(_lines("one", 50)) + ("\n" if sample_by == "line" else "\n\nmore\n"))
    with pytest.raises(LowbitError) as info:
        load_splits(DataConfig(path=str(path), sample_by=sample_by))
    assert str(info.value).startswith(
        f"data.path={path}: the train split holds 1 document (one per "
        f"{'line' if sample_by == 'line' else 'file'}, data.sample_by={sample_by}), too few to "
        "carve test and validation from"
    )
    # Three documents are enough for one each; two leave train empty and are refused.
    assert all(split_documents(["a", "b", "c"], DataConfig()).values())
    with pytest.raises(LowbitError, match="holds 2 documents"):
        split_documents(["a", "b"], DataConfig())


def _ids(text: str) -> set[str]:
    """The document ids (`id<n>x`) whole in `text`: a window's cut-off ends never match."""
    return set(re.findall(r"id(\d+)x", text))


def test_no_validation_window_holds_a_document_of_the_training_stream(tmp_path):
    """An undivided file split by lowbit: distill's validation windows and reinforce's
    validation prompts are cut from documents the training stream never holds."""
    from pipeline.data.scenarios import SCENARIOS
    from pipeline.evaluation.acceptance import heldout_scenarios
    from pipeline.lit.distill_report import validation_windows
    from pipeline.models.hf import train_tokenizer

    lines = [
        f"id{i}x {WORDS[i % 8]} and {WORDS[(3 * i) % 8]} by the {WORDS[i % 5]}" for i in range(600)
    ]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    tokenizer = train_tokenizer(lines, 300)
    corpus = Corpus(DataConfig(path=str(tmp_path / "corpus.txt"), seq_len=16), tokenizer)
    train_ids = _ids(tokenizer.decode(corpus.stream("train")))
    windows = validation_windows(corpus, 16, 10_000).windows  # every window of the split
    val_ids = set().union(*(_ids(tokenizer.decode(w)) for w in windows))
    prompts = heldout_scenarios(
        tokenizer, corpus.splits["validation"], n_prompts=4, prompt_len=16, long_len=40
    )
    prompt_ids = {i for s in SCENARIOS for p in prompts[s] for i in _ids(tokenizer.decode(p))}
    assert len(train_ids) > 450 and val_ids and prompt_ids  # the ids survive tokenisation
    assert not val_ids & train_ids and not prompt_ids & train_ids


def test_validation_leaves_out_documents_the_train_file_repeats(tmp_path, caplog):
    train, own = _lines("trainline", 50), _lines("valmark", 10)
    files = {"train.txt": train, "validation.txt": own + train[:3], "test.txt": _lines("t", 5)}
    _write(tmp_path / "d", **files)
    with caplog.at_level(logging.INFO, logger="pipeline.data.text"):
        splits = load_splits(DataConfig(path=str(tmp_path / "d")))
    assert splits["validation"] == own and splits["train"] == train
    assert "3 validation document(s) also in the train split are left out" in caplog.text
    _write(tmp_path / "d", **{"validation.txt": train[:3]})
    with pytest.raises(LowbitError, match="every validation document also appears in the train"):
        load_splits(DataConfig(path=str(tmp_path / "d")))
