"""Runtime.generate through transformers' generate: top-k, stop strings, streaming, chat."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.artifact.manifest import ArtifactError
from pipeline.export import export_artifact
from pipeline.runtime import load
from tests.export.models import export_options

PROMPTS = ("the quick", "a lazy dog")
N = 12
TEMPLATE = (
    "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}"
    "{% if add_generation_prompt %}<bot>{% endif %}"
)


@pytest.fixture(scope="module")
def rt(qmodels, tmp_path_factory):
    art = tmp_path_factory.mktemp("hf") / "artifact"
    export_artifact(qmodels.get("int4g128"), art, export_options(), draft=qmodels.fp)
    return load(art, "torch")


@pytest.fixture(scope="module")
def greedy(rt):
    """lowbit's own greedy decode of each prompt (speculative with the artifact's draft)."""
    return {p: rt.generate(p, N) for p in PROMPTS}


@pytest.mark.parametrize("speculative", [True, False])
def test_top_k_1_sampling_is_greedy(rt, greedy, speculative):
    for p in PROMPTS:
        got = rt.generate(p, N, temperature=1.5, top_k=1, seed=3, speculative=speculative)
        assert got.tokens == greedy[p].tokens and got.text == greedy[p].text


def test_top_p_samples_and_the_seed_repeats_it(rt, greedy):
    draws = [rt.generate("the quick", N, 2.0, top_p=0.95, seed=s).tokens for s in (0, 0, 1)]
    assert draws[0] == draws[1] and draws[0] != draws[2]
    assert draws[0] != greedy["the quick"].tokens  # sampled at T = 2, not the argmax


@pytest.mark.parametrize("speculative", [True, False])
def test_stop_string_cuts_the_output(rt, greedy, speculative):
    full = greedy["the quick"]
    # A stop string that first completes at the 7th new token.
    head = rt.tokenizer.decode(full.tokens[:7], skip_special_tokens=True)
    stop = head[-2:]
    assert stop not in rt.tokenizer.decode(full.tokens[:6], skip_special_tokens=True)
    got = rt.generate("the quick", N, stop=[stop, "never-seen"], speculative=speculative)
    assert got.text == head and got.tokens == full.tokens[:7]
    assert len(got.text) < len(full.text)
    assert rt.generate("the quick", N, stop=stop, speculative=speculative).text == head


@pytest.mark.parametrize("stop", [[], ["the"]])
def test_streaming_prints_the_returned_text(rt, capsys, stop):
    for p in PROMPTS:
        got = rt.generate(p, N, stream=True, stop=stop)
        assert capsys.readouterr().out == got.text + "\n"
        assert got.tokens == rt.generate(p, N, stop=stop).tokens


def test_chat_applies_the_tokenizer_template(rt, greedy, monkeypatch):
    monkeypatch.setattr(rt.tokenizer, "chat_template", TEMPLATE)
    ids = rt.encode("the quick", chat=True)
    expected = rt.tokenizer("<user>the quick</user><bot>", add_special_tokens=False).input_ids
    assert ids[0].tolist() == expected
    chat = rt.generate("the quick", N, chat=True)
    assert chat.tokens == rt.generate("<user>the quick</user><bot>", N).tokens
    assert chat.tokens != greedy["the quick"].tokens
    assert rt.generate("the quick", N, chat=True, top_k=1, temperature=1.0).tokens == chat.tokens


def test_chat_without_template_is_an_artifact_error(rt):
    assert rt.tokenizer.chat_template is None
    with pytest.raises(ArtifactError, match="no chat template"):
        rt.generate("the quick", N, chat=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 3}, "temperature > 0"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be >= 1"),
        ({"stop": [""]}, "must not be empty"),
        ({"stop": ["x"], "gamma": 3}, "use one set"),
        ({"stream": True, "pipelined": True}, "use one set"),
    ],
)
def test_bad_option_combinations(rt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rt.generate("the quick", N, **kwargs)


def test_every_eos_of_a_generation_config_list_ends_the_output(rt, greedy, qmodels, tmp_path):
    """generation_config.json may list several eos ids (Llama-3 Instruct's `<|eot_id|>` beside
    `<|end_of_text|>`); every decoder stops on any of them, not only on the tokenizer's."""
    full = greedy["the quick"].tokens
    k = next(i for i in range(2, N) if full[i] not in full[:i])  # its first appearance
    src = tmp_path / "src"
    shutil.copytree(qmodels.get("int4g128"), src)
    eos = [rt.tokenizer.eos_token_id, full[k]]
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    export_artifact(src, tmp_path / "artifact", export_options(), draft=qmodels.fp)
    listed = load(tmp_path / "artifact", "torch")
    for options in ({}, {"speculative": False}, {"pipelined": True, "gamma": 3},
                    {"temperature": 1.5, "top_k": 1}, {"stop": ["never-seen"]}):  # fmt: skip
        got = listed.generate("the quick", N, **options)
        assert got.tokens == full[: k + 1], options
