"""data.chat_template: conversations and plain text through the tokenizer's chat template, in the
splits they have without it, and one line for what cannot be rendered."""

import copy
import json

import pytest

from pipeline.config import DataConfig
from pipeline.data.chat import conversation
from pipeline.data.text import Corpus, load_splits
from pipeline.errors import LowbitError

WORDS = ["river", "hill", "stone", "cloud", "field", "lamp", "bread", "music"]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
USER_FIRST = (
    "{% if messages[0]['role'] != 'user' %}"
    "{{ raise_exception('a conversation starts with a user turn') }}{% endif %}" + TEMPLATE
)


def _lines(mark: str, n: int) -> list[str]:
    return [f"{mark} {i} {WORDS[i % 8]} and {WORDS[(3 * i) % 8]}" for i in range(n)]


def _chats(mark: str, n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"{mark} asks {i}"},
                      {"role": "assistant", "content": f"{WORDS[i % 8]} answer {i}"}]}
        for i in range(n)
    ]  # fmt: skip


def _jsonl(path, records: list[dict]) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rendered(record: dict) -> str:
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in record["messages"])


@pytest.fixture(scope="module")
def plain():
    """A tokenizer without a chat template."""
    from pipeline.models.hf import train_tokenizer

    return train_tokenizer(_lines("w", 100) + ["<user></user><assistant></assistant>"] * 20, 300)


@pytest.fixture(scope="module")
def tokenizer(plain):
    tok = copy.deepcopy(plain)
    tok.chat_template = TEMPLATE
    return tok


def chat_data(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), text_field="messages", chat_template=True, **kw)


def test_conversations_render_whole_in_their_files_splits(tmp_path, tokenizer):
    train, test = _chats("trainmark", 60), _chats("testmark", 5)
    _jsonl(tmp_path / "c" / "train.jsonl", train)
    _jsonl(tmp_path / "c" / "test.jsonl", test)
    splits = load_splits(chat_data(tmp_path / "c"), tokenizer)

    assert splits["test"] == [_rendered(r) for r in test]
    assert splits["test"][1] == "<user>testmark asks 1</user><assistant>hill answer 1</assistant>"
    carved = splits["train"] + splits["validation"]
    assert splits["validation"] and not any("testmark" in d for d in carved)
    assert sorted(carved) == sorted(_rendered(r) for r in train)


def test_plain_text_becomes_one_user_turn_and_keeps_its_split(tmp_path, tokenizer):
    (tmp_path / "corpus.txt").write_text("\n".join(_lines("doc", 300)) + "\n")
    data = DataConfig(path=str(tmp_path / "corpus.txt"))
    as_text = load_splits(data)
    as_chat = load_splits(DataConfig(path=data.path, chat_template=True), tokenizer)
    assert all(as_text[s] for s in ("train", "validation", "test"))
    assert as_chat == {s: [f"<user>{d}</user>" for d in docs] for s, docs in as_text.items()}


def test_calibration_and_training_windows_carry_the_template(tmp_path, tokenizer):
    _jsonl(tmp_path / "c" / "train.jsonl", _chats("trainmark", 40))
    corpus = Corpus(chat_data(tmp_path / "c", seq_len=16), tokenizer)
    text = tokenizer.decode(corpus.stream("train"))
    assert text.count("<user>") == text.count("</assistant>") == len(corpus.splits["train"])
    # A turn is far shorter than 64 tokens: every calibration window holds a role tag.
    calib = [tokenizer.decode(w) for w in corpus.calibration(samples=8, seq_len=64, seed=0)]
    assert all("user>" in w for w in calib)


def test_a_tokenizer_without_a_template_is_one_line_naming_the_setting(tmp_path, plain):
    (tmp_path / "corpus.txt").write_text("\n".join(_lines("doc", 50)) + "\n")
    data = DataConfig(path=str(tmp_path / "corpus.txt"), chat_template=True)
    for tok in (plain, None):
        with pytest.raises(LowbitError) as err:
            load_splits(data, tok)
        message = str(err.value)
        assert message.startswith(f"data.chat_template=true (data.path={data.path}, ")
        assert "the tokenizer has no chat template" in message
        assert "set data.chat_template=false" in message and "\n" not in message


def test_conversations_without_the_setting_are_one_line_naming_it(tmp_path):
    _jsonl(tmp_path / "c" / "train.jsonl", _chats("trainmark", 20))
    with pytest.raises(LowbitError, match=r"holds conversations .* set data.chat_template=true"):
        load_splits(DataConfig(path=str(tmp_path / "c"), text_field="messages"))


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([{"role": "user"}], "has no role or content"),
        ([{"content": "hi"}], "has no role or content"),
        (["hi"], "a conversation holds 'hi'"),
    ],
)
def test_a_record_that_is_no_conversation_is_named(messages, problem):
    with pytest.raises(LowbitError, match=problem):
        conversation(messages, "data.path=x (train.jsonl)")


def test_same_messages_are_one_conversation_whatever_the_key_order():
    a = conversation([{"role": "user", "content": "hi"}], "here")
    b = conversation([{"content": "hi", "role": "user"}], "here")
    assert a == b and hash(a) == hash(b) and conversation([], "here") is None


def test_a_conversation_the_template_refuses_names_the_document_and_split(tmp_path, tokenizer):
    records = _chats("trainmark", 20)
    records[7]["messages"].reverse()  # assistant first
    _jsonl(tmp_path / "c" / "test.jsonl", records)
    _jsonl(tmp_path / "c" / "train.jsonl", _chats("other", 20))
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = USER_FIRST
    with pytest.raises(LowbitError) as err:
        load_splits(chat_data(tmp_path / "c"), strict)
    message = str(err.value)
    assert message.startswith(f"data.path={tmp_path / 'c'}, test split: the chat template ")
    assert "refuses document 7" in message and "starts with a user turn" in message
