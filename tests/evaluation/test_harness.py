"""run_lm_eval: lm-eval scores a tiny local multiple-choice task offline, FP and quantized alike,
with the chat template, few-shot turns, generation settings and per-sample records it is given.

The tasks are written in the test (a jsonl and task YAMLs under include_path); the model is a
tiny Llama trained for a few dozen steps on the correct answers, so it scores near 1 where a
model with noise weights scores near chance (1/4).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
from pathlib import Path

import datasets.config
import pytest
import torch

from pipeline.config import parse
from pipeline.errors import ConfigError, LowbitError
from pipeline.evaluation.harness import SAMPLES, LmEvalConfig, lm_eval_metrics, run_lm_eval
from pipeline.models.hf import save_hf, train_tokenizer
from pipeline.models.quantized import load_quantized, save_quantized_model
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.stages.evaluate import EvaluateConfig
from tests._require import needs
from tests.data.test_chat import TEMPLATE

pytestmark = needs("lm-eval")

COLOURS = ["red", "blue", "green", "gold", "pink", "gray"]
TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
GEN_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} is"
doc_to_target: " {{{{choices[answer]}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_task(tmp: Path, n_items: int = 40, seed: int = 0) -> tuple[Path, list[str]]:
    """`tiny_mc` (n_items 4-way questions "<two made-up words> is" -> a colour), `tiny_gen` (the
    same questions, the colour generated) and `tiny_missing` (its data file does not exist);
    returns (task dir, correct texts)."""
    rng = random.Random(seed)
    syllables = ["ba", "ko", "ri", "zu", "me", "ta", "lo", "fi", "gu", "ne", "po", "sa"]
    words = sorted({rng.choice(syllables) + rng.choice(syllables) for _ in range(200)})
    items = [
        {"question": " ".join(rng.sample(words, 2)), "choices": rng.sample(COLOURS, 4),
         "answer": rng.randrange(4)}
        for _ in range(n_items)
    ]  # fmt: skip
    (tmp / "items.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK_YAML.format(name="tiny_mc", data=tmp / "items.jsonl"))
    missing = TASK_YAML.format(name="tiny_missing", data=tmp / "gone.jsonl")
    (tasks / "tiny_missing.yaml").write_text(missing)
    (tasks / "tiny_gen.yaml").write_text(GEN_YAML.format(data=tmp / "items.jsonl"))
    return tasks, [f"{x['question']} is {x['choices'][x['answer']]}" for x in items]


def train_tiny_llama(tokenizer, texts: list[str], steps: int = 60, seed: int = 0):
    """A 2-layer Llama that has memorised `texts` (full-batch AdamW)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    batch = tokenizer([tokenizer.eos_token + t for t in texts], return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def quantized_copy(model, fp_dir: Path, out: Path, fmt: str):
    """RTN-quantize every linear but the head, write the lowbit directory, load it back."""
    q = copy.deepcopy(model)
    for name, m in list(q.named_modules()):
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            q.set_submodule(name, FakeQuantLinear.from_linear(m, fmt))
    save_quantized_model(q, out, fp_dir, "rtn")
    return load_quantized(out)


@pytest.fixture(scope="module")
def assets(tmp_path_factory, one_thread):
    tmp = tmp_path_factory.mktemp("harness")
    tasks, texts = write_task(tmp)
    tokenizer = train_tokenizer(texts + [" ".join(COLOURS)] * 4, vocab_size=400)
    model = train_tiny_llama(tokenizer, texts)
    save_hf(model, tokenizer, tmp / "fp")
    return {"tmp": tmp, "tasks": tasks, "tokenizer": tokenizer, "model": model}


def test_trained_and_quantized_models_beat_a_broken_one(assets, monkeypatch):
    tmp, fp = assets["tmp"], assets["model"]
    noise = copy.deepcopy(fp)
    with torch.no_grad():
        for p in noise.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn_like(p) * p.std())
    models = {
        "target_fp": fp,
        "target_quantized": quantized_copy(fp, tmp / "fp", tmp / "int4", "int4g32"),
        "broken": quantized_copy(noise, tmp / "fp", tmp / "broken", "int8"),
    }
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    rng, hub_offline = torch.random.get_rng_state(), datasets.config.HF_HUB_OFFLINE
    cfg = LmEvalConfig(tasks=["tiny_mc"], include_path=str(assets["tasks"]), batch_size=16)

    res = run_lm_eval(models, assets["tokenizer"], cfg, "cpu")

    assert set(res) == set(models)
    for scores in res.values():
        assert set(scores) == {"tiny_mc"}
        assert set(scores["tiny_mc"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    acc = {name: scores["tiny_mc"]["acc"] for name, scores in res.items()}
    assert acc["target_fp"] >= 0.9
    assert acc["target_quantized"] >= acc["target_fp"] - 0.1
    assert acc["broken"] <= acc["target_fp"] - 0.3, acc
    assert res["broken"]["tiny_mc"]["acc_stderr"] > 0  # lm-eval's closed form, not bootstrap
    metrics = lm_eval_metrics(res)
    assert metrics["lm_eval_target_fp_tiny_mc_acc"] == acc["target_fp"]
    assert len(metrics) == 3 * 4
    # The offline switches and the seeds lm-eval sets do not leak out of the call.
    assert "HF_DATASETS_OFFLINE" not in os.environ
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # as the caller (tests/conftest.py) set it
    assert hub_offline == datasets.config.HF_HUB_OFFLINE
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert next(fp.parameters()).device.type == "cpu"


def samples(out: Path, model: str, task: str) -> list[dict]:
    """The per-document records run_lm_eval saved for `model` on `task` under `out`."""
    path = out / SAMPLES / model / f"{task}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("multiturn", [True, False])
def test_the_chat_template_and_few_shot_turns_shape_the_scored_prompts(
    assets, tmp_path, monkeypatch, multiturn
):
    monkeypatch.setattr(assets["tokenizer"], "chat_template", TEMPLATE)
    cfg = LmEvalConfig(
        tasks=["tiny_mc"], include_path=str(assets["tasks"]), limit=3, num_fewshot=2,
        apply_chat_template=True, fewshot_as_multiturn=multiturn, log_samples=True,
    )  # fmt: skip
    res = run_lm_eval({"target_fp": assets["model"]}, assets["tokenizer"], cfg, "cpu", tmp_path)

    rows = samples(tmp_path, "target_fp", "tiny_mc")
    assert [r["doc_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        context = row["arguments"][0][0]  # (context, continuation) of the first choice
        assert context.startswith("<user>")
        assert context.endswith(f"{row['doc']['question']} is</user><assistant>")
        # Two examples and the question: each its own turn, or all in one user turn.
        assert context.count("<user>") == context.count("<assistant>") == (3 if multiturn else 1)
    assert res["target_fp"]["tiny_mc"]["acc"] == pytest.approx(sum(r["acc"] for r in rows) / 3)


def test_without_the_chat_template_prompts_are_plain_and_no_samples_are_written(assets, tmp_path):
    cfg = LmEvalConfig(tasks=["tiny_mc"], include_path=str(assets["tasks"]), limit=2)
    run_lm_eval({"m": assets["model"]}, assets["tokenizer"], cfg, "cpu", tmp_path)
    assert not (tmp_path / SAMPLES).exists()
    cfg = dataclasses.replace(cfg, log_samples=True)
    run_lm_eval({"m": assets["model"]}, assets["tokenizer"], cfg, "cpu", tmp_path)
    for row in samples(tmp_path, "m", "tiny_mc"):
        assert row["arguments"][0][0] == f"{row['doc']['question']} is"


def test_gen_kwargs_override_the_tasks_generation_settings(assets, tmp_path):
    tok, lengths = assets["tokenizer"], {}
    for name, gen_kwargs, cap in (("own", {}, 8), ("given", {"max_gen_toks": 2}, 2)):
        cfg = LmEvalConfig(
            tasks=["tiny_gen"], include_path=str(assets["tasks"]), limit=4, log_samples=True,
            gen_kwargs=gen_kwargs,
        )  # fmt: skip
        run_lm_eval({"m": assets["model"]}, tok, cfg, "cpu", tmp_path / name)
        rows = samples(tmp_path / name, "m", "tiny_gen")
        for row in rows:
            settings = row["arguments"][0][1]  # (context, generation settings)
            assert settings["max_gen_toks"] == cap and settings["until"] == ["."]
        lengths[name] = [
            len(tok(r["resps"][0][0], add_special_tokens=False).input_ids) for r in rows
        ]
    assert max(lengths["given"]) <= 2 < max(lengths["own"]), lengths


def test_a_chat_template_the_tokenizer_lacks_is_one_line_before_any_model_runs(assets):
    assert assets["tokenizer"].chat_template is None
    cfg = LmEvalConfig(
        tasks=["tiny_mc"], include_path=str(assets["tasks"]), apply_chat_template=True
    )
    not_a_model = torch.nn.Identity()  # would fail another way if lm-eval got to it
    with pytest.raises(LowbitError, match="stage.evaluate.lm_eval.apply_chat_template") as err:
        run_lm_eval({"m": not_a_model}, assets["tokenizer"], cfg, "cpu")
    assert "no chat template" in str(err.value) and "\n" not in str(err.value)


def test_the_chat_settings_follow_data_chat_template_unless_set():
    def decided(cfg: LmEvalConfig, data_chat: bool) -> tuple:
        out = cfg.resolved(data_chat)
        return out.apply_chat_template, out.fewshot_as_multiturn

    assert decided(LmEvalConfig(), True) == (True, True)  # lm-eval's pairing
    assert decided(LmEvalConfig(), False) == (False, False)
    assert decided(LmEvalConfig(fewshot_as_multiturn=False), True) == (True, False)
    assert decided(LmEvalConfig(apply_chat_template=False), True) == (False, False)
    assert decided(LmEvalConfig(apply_chat_template=True), False) == (True, True)
    with pytest.raises(ConfigError, match="stage.evaluate.lm_eval.fewshot_as_multiturn"):
        LmEvalConfig(fewshot_as_multiturn=True).resolved(False)


def test_unknown_task_or_missing_data_names_the_task_and_include_path(assets):
    for task in ("no_such_task", "tiny_missing"):
        cfg = LmEvalConfig(tasks=[task], include_path=str(assets["tasks"]))
        with pytest.raises(LowbitError, match="stage.evaluate.lm_eval.include_path") as err:
            run_lm_eval({"m": assets["model"]}, assets["tokenizer"], cfg, "cpu")
        assert repr(task) in str(err.value) and "\n" not in str(err.value)


def test_config_is_validated_on_entry(tmp_path):
    def evaluate_cfg(**lm_eval):
        return parse({"lm_eval": lm_eval}, EvaluateConfig, "stage.evaluate").lm_eval

    assert evaluate_cfg() == LmEvalConfig()
    assert evaluate_cfg(tasks=["a"], limit=0.5, include_path=str(tmp_path)).limit == 0.5
    bad = [
        ({"limit": 1.5}, "stage.evaluate.lm_eval.limit"),
        ({"limit": 0}, "stage.evaluate.lm_eval.limit"),
        ({"num_fewshot": -1}, "stage.evaluate.lm_eval.num_fewshot"),
        ({"batch_size": 0}, "stage.evaluate.lm_eval.batch_size"),
        ({"tasks": ["a", "a"]}, r"stage.evaluate.lm_eval.tasks\[1\]"),
        ({"include_path": str(tmp_path / "nope")}, "stage.evaluate.lm_eval.include_path"),
        ({"task": ["a"]}, "stage.evaluate.lm_eval.task"),
        ({"gen_kwargs": {"until": [1]}}, "stage.evaluate.lm_eval.gen_kwargs.until"),
        ({"gen_kwargs": {"temperature": None}}, "stage.evaluate.lm_eval.gen_kwargs.temperature"),
        ({"gen_kwargs": 3}, "stage.evaluate.lm_eval.gen_kwargs"),
        (
            {"fewshot_as_multiturn": True, "apply_chat_template": False},
            "stage.evaluate.lm_eval.fewshot_as_multiturn",
        ),
    ]
    for values, key in bad:
        with pytest.raises(ConfigError, match=key):
            evaluate_cfg(**values)
    assert run_lm_eval({}, None, LmEvalConfig(), "cpu") == {}  # no tasks: off, nothing imported
