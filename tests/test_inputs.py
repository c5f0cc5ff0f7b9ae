"""Bad user checkpoints and data fail at start, each in one line naming the key and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline import inputs
from pipeline.config import data_cfg, model_cfg
from pipeline.errors import LowbitError
from pipeline.inputs import check_inputs
from tests.conftest import make_cfg


def check(cfg) -> None:
    """check_inputs on the parsed sections of the composed `cfg`, as the workflow calls it."""
    check_inputs(model_cfg(cfg), data_cfg(cfg))


LINES = [f"line {i} of the tiny corpus, river stone cloud {i % 7}" for i in range(60)]


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF llama with its tokenizer, and a folder of train/test text."""
    from pipeline.models.hf import train_tokenizer
    from tests.models.conftest import save_hf_checkpoint

    root = tmp_path_factory.mktemp("valid")
    tok = train_tokenizer(LINES, 300)
    ckpt = save_hf_checkpoint(root / "ckpt", "llama", vocab=len(tok))
    tok.save_pretrained(ckpt)
    data = root / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(LINES[:50]) + "\n")
    (data / "test.txt").write_text("\n".join(LINES[50:]) + "\n")
    return {"ckpt": ckpt, "data": data}


@pytest.fixture
def ckpt(valid, tmp_path) -> Path:
    """A private copy of the valid checkpoint that a test may damage."""
    return Path(shutil.copytree(valid["ckpt"], tmp_path / "ckpt"))


def fails(*overrides: str) -> str:
    """check_inputs' message for `lowbit <overrides>`, asserted to be one line."""
    with pytest.raises(LowbitError) as info:
        check(make_cfg(*overrides))
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    return message


def model_fails(path: Path, *overrides: str) -> str:
    message = fails("model=hf", f"model.target.path={path}", *overrides)
    assert message.startswith(f"model.target.path={path}"), message
    return message


def data_fails(valid, path: Path, *overrides: str) -> str:
    message = fails(
        "model=hf", f"model.target.path={valid['ckpt']}", "data=local", f"data.path={path}",
        *overrides,
    )  # fmt: skip
    assert message.startswith(f"data.path={path}"), message
    return message


# ------------------------------------------------------------------------------ passing
@pytest.mark.parametrize("layout", ["text", "jsonl", "parquet", "saved"])
def test_valid_checkpoint_and_data_pass(valid, tmp_path, layout):
    import datasets

    path = valid["data"]
    if layout == "jsonl":
        path = tmp_path / "train.jsonl"
        path.write_text(
            "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(LINES))
        )
    elif layout == "parquet":
        path = tmp_path / "corpus.parquet"
        datasets.Dataset.from_dict({"text": ["the same line"] * 200}).to_parquet(str(path))
    elif layout == "saved":
        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": LINES}).save_to_disk(str(path))
    cfg = make_cfg(
        "model=hf", f"model.target.path={valid['ckpt']}", f"model.draft.path={valid['ckpt']}",
        "data=local", f"data.path={path}",
    )  # fmt: skip
    check(cfg)


def test_builtin_corpus_and_bootstrap_models_are_not_checked(monkeypatch):
    def called(*args, **kwargs):
        raise AssertionError("checked an input lowbit makes itself")

    for name in ("check_checkpoint", "load_tokenizer", "check_data"):
        monkeypatch.setattr(inputs, name, called)
    check(make_cfg())
    with pytest.raises(AssertionError, match="checked an input"):  # the patch does take effect
        check(make_cfg("data=local", "data.path=/"))


# ------------------------------------------------------------------------------ checkpoints
def test_empty_dir_has_no_config(tmp_path):
    message = model_fails(tmp_path)
    assert "config.json is missing" in message and "save_pretrained" in message


def test_draft_is_checked_too(valid, tmp_path):
    message = fails(
        "model=hf", f"model.target.path={valid['ckpt']}", f"model.draft.path={tmp_path}"
    )
    assert message.startswith(f"model.draft.path={tmp_path}") and "config.json" in message


@pytest.mark.parametrize(
    "config, expect",
    [
        ("{not json", "config.json is not valid JSON"),
        ({"architectures": ["LlamaForCausalLM"]}, "has no model_type; re-save"),
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'; supported: LlamaForCausalLM"),
        (
            {"model_type": "mystery", "architectures": ["LlamaForCausalLM"]},
            "'mystery' is not a causal LM that the installed transformers",
        ),
    ],
    ids=["not-json", "no-model-type", "unsupported", "unknown-to-transformers"],
)
def test_bad_config(ckpt, config, expect):
    (ckpt / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    assert expect in model_fails(ckpt)


def test_no_weights(ckpt):
    for f in ckpt.glob("model*.safetensors*"):
        f.unlink()
    message = model_fails(ckpt)
    assert "no model.safetensors, model.safetensors.index.json or *.safetensors" in message
    assert message.endswith("copy the complete checkpoint there (all its *.safetensors)")


def test_bin_weights_need_allow_bin(ckpt):
    for f in ckpt.glob("model*.safetensors*"):
        f.unlink()
    torch.save({"w": torch.zeros(2)}, ckpt / "pytorch_model.bin")
    message = model_fails(ckpt)
    assert "pickled .bin" in message and "model.allow_bin=true" in message
    check(make_cfg("model=hf", f"model.target.path={ckpt}", "model.allow_bin=true"))


@pytest.mark.parametrize(
    "damage, expect",
    [
        (lambda b: b[:-100], "truncated"),  # an interrupted download
        (lambda b: b[:8] + b"{not json" + b[17:], "unreadable header"),
    ],
    ids=["truncated", "garbled-header"],
)
def test_corrupt_shard_names_the_file(ckpt, damage, expect):
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    shard.write_bytes(damage(shard.read_bytes()))
    message = model_fails(ckpt)
    assert f"corrupt safetensors file {shard}" in message and expect in message


def test_index_names_a_missing_shard(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert f"shard {shard} named in" in model_fails(ckpt)


@pytest.mark.parametrize(
    "damage, expect",
    [
        ("remove", "holds no tokenizer files"),
        ("garble", "the tokenizer does not load (JSONDecodeError: "),
    ],
)
def test_tokenizer_that_does_not_load(ckpt, damage, expect):
    if damage == "remove":
        for f in ckpt.glob("*token*"):
            f.unlink()
    else:
        (ckpt / "tokenizer.json").write_text('{"model": ')
    message = model_fails(ckpt)
    assert expect in message and "sentencepiece" not in message


def _edit_index(ckpt: Path, edit) -> Path:
    """Apply `edit` to the checkpoint's weight_map (name -> shard); returns the index file."""
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index["weight_map"])
    index_file.write_text(json.dumps(index))
    return index_file


def test_index_names_a_tensor_its_shard_does_not_hold(ckpt):
    moved = {}

    def point_elsewhere(weight_map):
        shards = list(weight_map.values())
        home = next(s for s in shards if shards.count(s) > 1)  # the index still names it after
        name = next(n for n, s in weight_map.items() if s == home)
        moved.update(name=name, home=home, wrong=next(s for s in shards if s != home))
        weight_map[name] = moved["wrong"]

    index_file = _edit_index(ckpt, point_elsewhere)
    name, home, wrong = moved["name"], moved["home"], moved["wrong"]
    assert (
        f"{index_file} says {name} is in {wrong}, but {ckpt / wrong} does not hold it "
        f"({home} does): the index and the shards come from different checkpoints"
    ) in model_fails(ckpt)


def test_index_names_a_tensor_no_shard_holds(ckpt):
    index_file = _edit_index(ckpt, lambda wm: wm.update({"model.extra.weight": wm[min(wm)]}))
    message = model_fails(ckpt)
    assert f"{index_file} says model.extra.weight is in " in message
    assert "does not hold it: the index and the shards" in message


def test_a_shard_holds_a_tensor_the_index_does_not_list(ckpt):
    dropped = {}
    index_file = _edit_index(ckpt, lambda wm: dropped.update({max(wm): wm.pop(max(wm))}))
    ((name, shard),) = dropped.items()
    message = model_fails(ckpt)
    assert f"{ckpt / shard} holds {name}, which {index_file} does not list" in message


# ------------------------------------------------------------------------------ draft vocabulary
@pytest.fixture
def draft(valid, tmp_path) -> Path:
    """A copy of the valid checkpoint whose tokenizer a test replaces."""
    path = Path(shutil.copytree(valid["ckpt"], tmp_path / "draft"))
    for f in path.glob("*token*"):
        f.unlink()
    return path


def draft_fails(valid, draft: Path) -> str:
    message = fails("model=hf", f"model.target.path={valid['ckpt']}", f"model.draft.path={draft}")
    assert message.startswith(f"model.draft.path={draft}"), message
    return message


def test_a_draft_with_another_vocabulary_is_refused(valid, draft):
    from pipeline.models.hf import load_tokenizer, train_tokenizer

    other = train_tokenizer([f"other words {i} for another vocabulary" for i in range(40)], 280)
    other.save_pretrained(draft)
    target, theirs = load_tokenizer(valid["ckpt"]), load_tokenizer(draft)
    first = next(
        i
        for i in range(len(target))
        if target.convert_ids_to_tokens(i) != theirs.convert_ids_to_tokens(i)
    )
    message = draft_fails(valid, draft)
    assert f"its tokenizer is not the one of model.target.path={valid['ckpt']}" in message
    assert f"({len(target)} tokens in the target, {len(theirs)} in the draft;" in message
    assert (
        f"the first differing id is {first}: {target.convert_ids_to_tokens(first)!r} in the "
        f"target, {theirs.convert_ids_to_tokens(first)!r} in the draft)"
    ) in message
    assert "speculative decoding needs one vocabulary" in message


def test_a_draft_with_the_same_vocabulary_in_another_tokenizer_object_passes(valid, draft):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(valid["ckpt"])
    tok.model_max_length = 77  # another config, another object: the vocabulary is what counts
    tok.chat_template = "{{ messages[0]['content'] }}"
    tok.save_pretrained(draft)
    assert json.loads((draft / "tokenizer_config.json").read_text())["model_max_length"] == 77
    check(make_cfg("model=hf", f"model.target.path={valid['ckpt']}", f"model.draft.path={draft}"))


def test_a_draft_without_tokenizer_files_cannot_be_checked(valid, draft):
    assert "holds no tokenizer files" in draft_fails(valid, draft)


def test_data_chat_template_needs_a_target_tokenizer_that_has_one(valid, ckpt):
    from transformers import AutoTokenizer

    message = fails("model=hf", f"model.target.path={ckpt}", "data.chat_template=true")
    assert message.startswith(f"data.chat_template=true with model.target.path={ckpt}: the ")
    assert "tokenizer has no chat template" in message and "data.chat_template=false" in message
    assert "bootstrap model's tokenizer has no chat template" in fails("data.chat_template=true")
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(ckpt)
    check(make_cfg("model=hf", f"model.target.path={ckpt}", "data.chat_template=true"))


# ------------------------------------------------------------------------------ data
def test_no_file_of_a_supported_kind(valid, tmp_path):
    (tmp_path / "notes.md").write_text("\n".join(LINES))
    assert "no .csv, .json, .jsonl, .parquet, .raw, .txt file there" in data_fails(valid, tmp_path)


def test_empty_file(valid, tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(LINES))
    (tmp_path / "test.txt").touch()
    assert f"{tmp_path / 'test.txt'} is empty" in data_fails(valid, tmp_path)


def test_binary_file_gives_the_offset(valid, tmp_path):
    path = tmp_path / "train.txt"
    path.write_bytes(b"some text\n" * 30 + b"\x00\x01\x02")
    assert f"{path} is not text (a NUL byte at byte 300" in data_fails(valid, path)


def test_non_utf8_file_gives_the_offset(valid, tmp_path):
    path = tmp_path / "train.txt"
    path.write_bytes(("some text\n" * 30 + "café\n").encode("latin-1"))
    assert f"{path} is not UTF-8 (byte 303 is b'\\xe9')" in data_fails(valid, path)


def test_whitespace_only_file(valid, tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(LINES))
    (tmp_path / "test.txt").write_text("\n  \n\t\n")
    assert f"{tmp_path / 'test.txt'} holds only whitespace" in data_fails(valid, tmp_path)


@pytest.mark.parametrize("line_end", ["\n", "\r\n", ""])
def test_a_single_line_cannot_be_split(valid, tmp_path, line_end):
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(LINES) + line_end, newline="")  # one long line
    assert (
        "the file holds 1 document (one per line, data.sample_by=line), too few to carve test "
        "and validation from; split the text into more documents"
    ) in data_fails(valid, path)
    path.write_text("\n".join(LINES[:3]) + line_end, newline="")  # one line each for the splits
    check(make_cfg("data=local", f"data.path={path}", "data.seq_len=16"))


def test_a_train_file_of_one_line_next_to_test_is_refused(valid, tmp_path):
    (tmp_path / "train.txt").write_text(" ".join(LINES) + "\n\n\n")
    (tmp_path / "test.txt").write_text("\n".join(LINES[:5]))
    message = data_fails(valid, tmp_path)
    assert (
        "train.txt holds 1 document (one per line" in message and "carve validation from" in message
    )
    message = data_fails(valid, tmp_path, "data.sample_by=paragraph")
    assert "train.txt holds 1 document (one per blank-line-separated paragraph" in message
    (tmp_path / "train.txt").write_text("\n".join(LINES[:2]))  # two lines: train and validation
    check(make_cfg("data=local", f"data.path={tmp_path}"))


def test_jsonl_first_record_without_the_field(valid, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"body": t, "id": 1}) + "\n" for t in LINES))
    message = data_fails(valid, path)
    assert "(the first record of train.jsonl) has no column 'text'" in message
    assert "set data.text_field to one of ['body', 'id']" in message


def test_broken_json_is_reported_before_loading(valid, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        '{"text": "a line", }\n' + "".join(json.dumps({"text": t}) + "\n" for t in LINES)
    )
    assert "its first record is not JSON (Expecting property name" in data_fails(valid, tmp_path)


def test_parquet_schema_without_the_field(valid, tmp_path):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_dict({"content": LINES}).to_parquet(str(path))
    assert "set data.text_field to one of ['content']" in data_fails(valid, path)


@pytest.mark.parametrize("saved", ["Dataset", "DatasetDict"])
def test_saved_dataset_without_the_field(valid, tmp_path, saved):
    import datasets

    ds = datasets.Dataset.from_dict({"content": LINES})
    (ds if saved == "Dataset" else datasets.DatasetDict({"train": ds})).save_to_disk(
        str(tmp_path / "saved")
    )
    message = data_fails(valid, tmp_path / "saved")
    where = "the saved Dataset" if saved == "Dataset" else "split 'train'"
    assert f"({where}) has no column 'text'" in message and "['content']" in message


def test_text_files_have_only_the_text_field(valid):
    message = data_fails(valid, valid["data"], "data.text_field=body")
    assert "has no column 'body'; set data.text_field to one of ['text']" in message


@pytest.mark.parametrize("layout", ["txt", "parquet"])
def test_too_short_for_one_window(valid, tmp_path, layout):
    import datasets

    path = tmp_path / f"train.{layout}"
    if layout == "txt":
        path.write_text("a short\ncor\nps\n")  # 15 bytes in three lines, one per split
    else:
        datasets.Dataset.from_dict({"text": ["a short corpus."]}).to_parquet(str(path))
    message = data_fails(valid, path, "data.seq_len=16")
    assert "holds at most 16 bytes of text" in message and "data.seq_len=16 tokens" in message
    check(  # one byte fewer needed: it passes
        make_cfg("data=local", f"data.path={path}", "data.seq_len=15")
    )
