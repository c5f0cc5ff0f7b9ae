"""run_lm_eval: lm-eval scores a tiny local multiple-choice task offline, FP and quantized alike.

The task is written in the test (a jsonl and a task YAML under include_path); the model is a
tiny Llama trained for a few dozen steps on the correct answers, so it scores near 1 where a
model with noise weights scores near chance (1/4).
"""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import datasets.config
import pytest
import torch

from pipeline.config import parse
from pipeline.errors import ConfigError, LowbitError
from pipeline.evaluation.harness import LmEvalConfig, lm_eval_metrics, run_lm_eval
from pipeline.models.hf import save_hf, train_tokenizer
from pipeline.models.quantized import load_quantized, save_quantized_model
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.stages.evaluate import EvaluateConfig
from tests._require import needs

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


def write_task(tmp: Path, n_items: int = 40, seed: int = 0) -> tuple[Path, list[str]]:
    """`tiny_mc` (n_items 4-way questions "<two made-up words> is" -> a colour) and
    `tiny_missing` (its data file does not exist); returns (task dir, correct texts)."""
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
    ]
    for values, key in bad:
        with pytest.raises(ConfigError, match=key):
            evaluate_cfg(**values)
    assert run_lm_eval({}, None, LmEvalConfig(), "cpu") == {}  # no tasks: off, nothing imported
