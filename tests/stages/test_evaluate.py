"""evaluate: its config checks, one run recording costs and the draft length, and the chat
template reaching perplexity and lm-eval."""

import gc
import weakref

import pytest

from pipeline import workflow
from pipeline.errors import ConfigError
from pipeline.evaluation.harness import SAMPLES
from pipeline.evaluation.result import EvalResult
from pipeline.stages import evaluate
from tests._require import needs
from tests.conftest import smoke_cfg

STAGES = "stages=[bootstrap,evaluate]"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("stage.evaluate.window=16", "window"),
        ("stage.evaluate.window=200", "window"),
        ("stage.evaluate.gamma_min=0", "gamma_min"),
        ("stage.evaluate.gamma_max=1", "gamma_max"),
        ("stage.evaluate.speed_repeats=2", "speed_repeats"),
        ("stage.evaluate.temperature=-0.1", "temperature"),
        ("stage.evaluate.long_new_tokens=0", "long_new_tokens"),
        # null apply_chat_template follows data.chat_template, false here
        ("stage.evaluate.lm_eval.fewshot_as_multiturn=true", "lm_eval.fewshot_as_multiturn"),
    ],
)
def test_check_names_the_bad_key(tmp_path, override, key):
    cfg = smoke_cfg(tmp_path, "tracking=none", STAGES, override)
    with pytest.raises(ConfigError, match=f"stage.evaluate.{key}"):
        workflow.check_stage(cfg, "evaluate")


def test_defaults_adapt_gamma_2_to_5_over_64_verifications():
    cfg = evaluate.EvaluateConfig()
    assert cfg.adaptive and (cfg.gamma_min, cfg.gamma_max, cfg.window) == (2, 5, 64)
    assert not cfg.temperature_schedule
    assert cfg.allow_plain and cfg.speed_repeats == 3


@pytest.mark.parametrize(("adaptive", "temperature"), [(True, 1.0), (False, 0.0)])
def test_end_to_end_records_costs_and_the_draft_length(boot, tmp_path, adaptive, temperature):
    from tests.stages.conftest import boot_cfg

    tiny = ("stage.evaluate.timing=false", "stage.evaluate.scenarios=[mix]")
    decoding = (f"stage.evaluate.adaptive={adaptive}", f"stage.evaluate.temperature={temperature}")
    cfg = boot_cfg(boot, tmp_path, STAGES, *tiny, *decoding)
    metrics = workflow.run(cfg)["evaluate"]["metrics"]
    ev = EvalResult.load(tmp_path / "run" / "evaluate")
    row = ev.speculative["draft_fp@target_fp"]["mix"]
    assert metrics["tau_draft_fp-vs-target_fp_mean"] == pytest.approx(row["tau"])
    # Greedy decoding's numbers beside the temperature's, in eval.json and the metrics.
    assert ev.temperature == temperature
    assert 0 <= row["greedy_match"] <= 1 and row["tau_greedy"] >= 1
    if temperature == 0:  # greedy already: the same numbers, decoded once
        assert (row["greedy_match"], row["tau_greedy"]) == (row["alpha_tf"], row["tau"])
    key = "draft_fp-vs-target_fp"
    assert metrics[f"greedy_match_{key}_mean"] == pytest.approx(row["greedy_match"])
    assert metrics[f"tau_greedy_{key}_mean"] == pytest.approx(row["tau_greedy"])
    if not adaptive:
        assert ev.costs is None and row["gamma"] <= 4  # fixed gamma 4 (shorter at the end)
        return
    cost = ev.costs["draft_fp@target_fp"]
    assert cost["cost_ratio"] > 0 and set(cost["verify_cost"]) == {2, 3, 4, 5}
    assert 1 <= row["gamma"] <= 5


def test_the_speed_table_covers_fp_and_the_quantized_target(boot, tmp_path, monkeypatch):
    from tests.stages.conftest import boot_cfg

    live, counts = weakref.WeakSet(), []
    load_model = evaluate.load_model

    def counted(*args, **kwargs):  # the real loader, counting the models alive at each load
        gc.collect()
        model = load_model(*args, **kwargs)
        live.add(model)
        counts.append(len(live))
        return model

    monkeypatch.setattr(evaluate, "load_model", counted)

    cfg = boot_cfg(
        boot,
        tmp_path,
        "stages=[bootstrap,quantize,evaluate]",
        "quant=w4g128",
        "stage.evaluate.scenarios=[mix]",
        "stage.evaluate.spec_new_tokens=6",
    )
    metrics = workflow.run(cfg)["evaluate"]["metrics"]
    out = tmp_path / "run" / "evaluate"
    table = EvalResult.load(out).speed_table
    rows = {r["row"]: r for r in table["rows"]}
    assert list(rows) == [
        "FP plain",
        "FP + FP draft",
        "target_quantized plain",
        "target_quantized + draft_fp",
    ]
    fp, low = rows["FP plain"], rows["target_quantized plain"]
    assert fp["x_fp_plain"] == 1.0 and fp["alpha"] is None
    assert low["weight_bytes"] < fp["weight_bytes"]  # packed int4 codes, not float weights
    spec = rows["target_quantized + draft_fp"]
    assert 0 <= spec["alpha"] <= 1 and spec["tau"] >= 1 and 0 <= spec["plain_share"] <= 1
    assert spec["weight_bytes"] > low["weight_bytes"] and spec["kv_bytes"] > low["kv_bytes"]
    for r in rows.values():
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
    assert metrics["x_fp_plain_target_quantized_plain"] == low["x_fp_plain"]
    assert (out / "speed.png").exists()
    # Perplexity loads FP target, quantized target and draft one at a time; pairs hold two.
    assert counts[:3] == [1, 1, 1] and max(counts) == 2


@needs("lm-eval")
def test_data_chat_template_reaches_perplexity_and_lm_eval_and_reruns_the_stage(
    boot, tmp_path, chat_target
):
    from tests.evaluation.test_harness import samples, write_task

    tasks, _ = write_task(tmp_path)
    cfg = (
        "tracking=none", "model=hf", f"model.target.path={chat_target}",
        f"model.draft.path={boot['draft']}", "stages=[evaluate]", "stage.evaluate.timing=false",
        "stage.evaluate.scenarios=[mix]", "stage.evaluate.adaptive=false",
        "stage.evaluate.lm_eval.tasks=[tiny_mc]",
        f"stage.evaluate.lm_eval.include_path={tasks}", "stage.evaluate.lm_eval.limit=2",
        "stage.evaluate.lm_eval.log_samples=true", "data.eval_seq_len=64",
    )  # fmt: skip
    out = tmp_path / "run" / "evaluate"
    runs = {}
    for chat in (False, True):
        done = workflow.run(smoke_cfg(tmp_path, *cfg, f"data.chat_template={chat}"))["evaluate"]
        prompts = [r["arguments"][0][0] for r in samples(out, "target_fp", "tiny_mc")]
        runs[chat] = done, EvalResult.load(out).ppl_protocol, prompts
        assert f"{SAMPLES}/target_fp/tiny_mc.jsonl" in done["outputs"]  # hashed with the rest

    (plain, plain_ppl, plain_prompts), (chat, chat_ppl, chat_prompts) = runs[False], runs[True]
    assert chat["fingerprint"] != plain["fingerprint"]
    # The same test documents, each wrapped in its user turn: more tokens (64-token windows).
    assert chat_ppl["split"] == plain_ppl["split"] == "test"
    assert chat_ppl["tokens"] > plain_ppl["tokens"]
    # lm_eval.apply_chat_template is null: it follows data.chat_template.
    assert all(p.startswith("<user>") and p.endswith("</user><assistant>") for p in chat_prompts)
    assert not any("<user>" in p for p in plain_prompts)
