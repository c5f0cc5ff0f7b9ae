"""reinforce stage: end to end on the smoke bootstrap models, resume, quantized pairs, skips, and
the choice of the best validated checkpoint (or of the starting draft when none beats it)."""

import json
import shutil

import pytest
import torch

from pipeline import workflow
from pipeline.config import data_cfg
from pipeline.data.text import load_splits
from pipeline.errors import ConfigError
from pipeline.evaluation.acceptance import heldout_scenarios
from pipeline.lit import reinforce_report
from pipeline.models.hf import load_causal_lm, load_tokenizer
from pipeline.speculative.metrics import teacher_forced_acceptance
from pipeline.stages import reinforce
from tests.conftest import smoke_cfg
from tests.stages.conftest import boot_cfg

# Tiny sizes (long_len is far below 576 here: the smoke models only need the code path).
STAGES = "stages=[bootstrap,reinforce]"
TINY = (
    "stage.reinforce.train.steps=4",
    "stage.reinforce.train.batch=2",
    "stage.reinforce.train_prompts=4",
    "stage.reinforce.eval_prompts=2",
    "stage.reinforce.prompt_len=24",
    "stage.reinforce.long_len=80",
    "stage.reinforce.eval_new_tokens=6",
    "stage.reinforce.train.val_every=2",
    "stage.reinforce.val_prompts=8",
    "trainer.enable_progress_bar=false",
)


def force(monkeypatch, steps: dict[int, float], at_start: float = 1.0) -> None:
    """Make DraftReinforce's effect forced, the same on every CPU: the draft's final norm gain,
    so its logits, is multiplied by `at_start` before the first validation and by steps[k] at
    step k (1 when absent), and each step returns its loss times 0, so every gradient is
    exactly 0 and AdamW (no weight decay) leaves every weight as it is. Negated logits put the
    draft's mass on the tokens the target finds least likely, and 16x sharper ones on the
    draft's top token alone: each far below a trained draft's acceptance."""
    cls = reinforce.DraftReinforce
    start, step = cls.on_fit_start, cls.training_step

    def scale(self, factor: float) -> None:
        with torch.no_grad():
            self.draft.model.norm.weight.mul_(factor)

    def on_fit_start(self):
        start(self)
        scale(self, at_start)

    def training_step(self, batch, batch_idx):
        scale(self, steps.get(self.global_step, 1.0))
        return step(self, batch, batch_idx) * 0.0

    monkeypatch.setattr(cls, "on_fit_start", on_fit_start)
    monkeypatch.setattr(cls, "training_step", training_step)


def val_alpha(cfg, target, draft, temperature: float = 1.0) -> float:
    """Teacher-forced alpha on the stage's validation prompts, mean over scenarios (reference);
    at temperature 0, the share of positions where the argmaxes agree."""
    tokenizer = load_tokenizer(target)
    docs = load_splits(data_cfg(cfg), tokenizer)["validation"]
    sets = heldout_scenarios(tokenizer, docs, n_prompts=8, prompt_len=24, long_len=80, seed=0)
    t, d = load_causal_lm(target).eval(), load_causal_lm(draft).eval()
    alphas = [
        teacher_forced_acceptance(t, d, [torch.tensor(v)], temperature) for v in sets.values()
    ]
    return sum(alphas) / len(alphas)


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead
    yield
    torch.set_num_threads(threads)


def test_end_to_end_writes_a_better_draft_and_the_report(boot, tmp_path):
    cfg = boot_cfg(boot, tmp_path, STAGES, *TINY, "stage.reinforce.train.val_every=3")
    done = workflow.run(cfg)["reinforce"]
    out = tmp_path / "run" / "reinforce"
    assert (out / "draft" / "model.safetensors").is_file()
    assert (out / "draft" / "tokenizer.json").is_file() and (out / "acceptance.png").is_file()
    report = json.loads((out / "reinforce.json").read_text())
    assert report["target"] == "target_fp" and report["steps"] == 4
    assert report["pairs"] == {
        "before": "draft_fp@target_fp",
        "after": "draft_reinforced@target_fp",
    }
    for side in ("before", "after"):
        alpha = report["summary"]["alpha"][side]
        assert set(alpha) == {"long", "repetition", "rare", "mix", "mean"}
        assert all(0.0 < a < 1.0 for a in alpha.values())
    assert report["eval_prompts"]["long"] == [2, 80]
    assert done["metrics"]["alpha_gain_mean"] == pytest.approx(report["summary"]["gain"]["mean"])
    val = report["validation"]
    assert val["split"] == "validation" and val["prompts"]["long"] == [8, 80]
    assert [r["step"] for r in val["history"]] == [3, 4]  # every val_every steps, and the last
    assert report["kept_input"] is False and done["metrics"]["kept_input"] == 0
    metrics = done["metrics"]
    assert metrics["val_alpha_tf_after_mean"] > metrics["val_alpha_tf_before_mean"]
    # The keep decision pairs 8 prompts of each of the 4 scenarios, and its gain held.
    assert val["keep"]["trained"] is True and metrics["keep_windows"] == 32
    assert 0 < metrics["keep_ci_low"] <= metrics["keep_gain"] <= metrics["keep_ci_high"]
    gain = metrics["val_alpha_tf_after_mean"] - metrics["val_alpha_tf_before_mean"]
    assert metrics["keep_gain"] == pytest.approx(gain)
    assert sorted(set(val["input"]["window_groups"])) == [0, 1, 2, 3]
    new, old = load_causal_lm(out / "draft"), load_causal_lm(boot["draft"])
    assert not torch.equal(new.lm_head.weight, old.lm_head.weight)
    assert not list((tmp_path / "run").glob(".work/reinforce-*"))  # checkpoints dropped when done


def test_rerun_after_a_crash_resumes_from_the_checkpoint(boot, tmp_path, monkeypatch):
    cfg = boot_cfg(boot, tmp_path, STAGES, *TINY)

    measure = reinforce_report.measure

    def crash(cfg, seed, target_name, target, drafts, scenarios):
        if "draft_reinforced" in drafts:
            raise RuntimeError("killed after training")
        return measure(cfg, seed, target_name, target, drafts, scenarios)

    monkeypatch.setattr(reinforce_report, "measure", crash)
    with pytest.raises(Exception, match="killed"):
        workflow.run(cfg)
    work = next((tmp_path / "run" / ".work").glob("reinforce-*"))
    assert (work / "checkpoints" / "last.ckpt").is_file() and (work / "before.json").is_file()
    assert (work / "checkpoints" / "best.ckpt").is_file()
    # c (measured: no stage.reinforce.cost_ratio) is recorded, for a rerun to reuse.
    saved = torch.load(work / "checkpoints" / "last.ckpt", weights_only=True)
    measured = saved["reinforce"]["cost_ratio"]
    monkeypatch.undo()
    steps = []
    original = reinforce.DraftReinforce.training_step
    monkeypatch.setattr(
        reinforce.DraftReinforce,
        "training_step",
        lambda self, *a: steps.append(1) or original(self, *a),
    )
    workflow.run(cfg)
    assert steps == []  # all 4 steps came from the checkpoint
    report = json.loads((tmp_path / "run" / "reinforce" / "reinforce.json").read_text())
    assert report["steps"] == 4 and report["cost_ratio"] == measured
    # The validation state came back too: the step-0 score and the checks at steps 2 and 4.
    assert report["validation"]["input"]["step"] == 0
    assert [r["step"] for r in report["validation"]["history"]] == [2, 4]


def test_quantized_target_and_draft(boot, tmp_path):
    from pipeline.models.quantized import load_quantized, save_quantized_model
    from pipeline.quant.fakequant import FakeQuantLinear
    from pipeline.workflow import StageIO, stage_config

    def quantize(src, dst, fmt):
        model = load_causal_lm(src)
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        setattr(parent, name, FakeQuantLinear.from_linear(child, fmt))
        save_quantized_model(model, dst, src, "rtn")

    quantize(boot["target"], tmp_path / "quantize" / "model", "int4g32")
    quantize(boot["draft"], tmp_path / "qdraft", "int4g32")
    cfg = smoke_cfg(
        tmp_path, "tracking=none", STAGES, *TINY, f"model.draft.path={tmp_path / 'qdraft'}"
    )
    run_dir = tmp_path / "run"
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    inputs = {"bootstrap": boot["run_dir"] / "bootstrap", "quantize": tmp_path / "quantize"}
    io = StageIO("reinforce", out, work, run_dir, inputs)
    metrics = reinforce.run(*stage_config(cfg, "reinforce"), io)
    report = json.loads((out / "reinforce.json").read_text())
    assert report["target"] == "target_quantized" and report["draft_quantized"]
    assert report["pairs"]["reference"] == "draft_quantized@target_fp"
    assert set(report["summary"]["alpha"]) == {"before", "after", "reference"}
    assert "alpha_after_mean" in metrics
    new, old = load_quantized(out / "draft"), load_quantized(tmp_path / "qdraft")
    q_new = new.model.layers[0].self_attn.q_proj
    q_old = old.model.layers[0].self_attn.q_proj
    assert isinstance(q_new, FakeQuantLinear) and torch.equal(q_new.codes, q_old.codes)
    # The trained step sizes are handed on, or, where 4 steps did not beat the input beyond the
    # validation noise (as on a bf16-trained smoke bootstrap), the input whole.
    trained = not torch.equal(q_new.scale, q_old.scale)
    assert trained != bool(metrics["kept_input"])
    assert torch.equal(new.model.embed_tokens.weight, old.model.embed_tokens.weight)


def test_no_checkpoint_better_than_the_start_keeps_the_draft(boot, tmp_path, monkeypatch, caplog):
    """Training that only makes things worse (its first step negates the logits, the next
    change nothing) hands on the starting draft unchanged, says so, and early stopping ends it
    after 2 checks."""
    force(monkeypatch, {0: -1.0})
    overrides = ("stage.reinforce.train.val_every=1", "stage.reinforce.train.patience=1")
    cfg = boot_cfg(boot, tmp_path, STAGES, *TINY, *overrides)
    with caplog.at_level("WARNING", logger="pipeline"):
        metrics = workflow.run(cfg)["reinforce"]["metrics"]
    assert "keeping it unchanged" in caplog.text
    assert metrics["kept_input"] == 1 and metrics["steps"] == 2  # stopped early
    assert metrics["val_alpha_tf_after_mean"] == metrics["val_alpha_tf_before_mean"]
    assert metrics["val_alpha_tf_best_mean"] < metrics["val_alpha_tf_before_mean"]
    out = tmp_path / "run" / "reinforce"
    report = json.loads((out / "reinforce.json").read_text())
    assert report["kept_input"] is True
    assert report["summary"]["alpha"]["after"] == report["summary"]["alpha"]["before"]
    weights = "model.safetensors"
    assert (out / "draft" / weights).read_bytes() == (boot["draft"] / weights).read_bytes()


def test_the_result_is_the_best_checkpoint_not_the_last(boot, tmp_path, monkeypatch):
    """A damaged start (negated logits), step 1 undoes it, step 3 sharpens the logits 16x: the
    written draft is step 2's, the starting one. Forced steps, not trained ones, so the
    trajectory is the same on every CPU (a real one's first steps depend on the float kernels)."""
    force(monkeypatch, {0: -1.0, 2: 16.0}, at_start=-1.0)
    cfg = boot_cfg(boot, tmp_path, STAGES, *TINY, "stage.reinforce.train.val_every=2")
    metrics = workflow.run(cfg)["reinforce"]["metrics"]
    report = json.loads((tmp_path / "run" / "reinforce" / "reinforce.json").read_text())
    val = report["validation"]
    by_step = {r["step"]: r["alpha"] for r in val["history"]}
    assert sorted(by_step) == [2, 4] and by_step[2] > by_step[4]
    assert by_step[2] > val["input"]["alpha"]
    assert metrics["best_step"] == 2 and metrics["kept_input"] == 0
    written = val_alpha(cfg, boot["target"], tmp_path / "run" / "reinforce" / "draft")
    assert written == pytest.approx(by_step[2], rel=1e-5)
    assert written == pytest.approx(val_alpha(cfg, boot["target"], boot["draft"]), rel=1e-5)


def test_no_draft_means_self_speculation_and_a_skip(boot, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(boot["target"], target)
    cfg = smoke_cfg(tmp_path, "tracking=none", "stages=[reinforce]", f"model.target.path={target}")
    assert "nothing to reinforce" in reinforce.skip_reason(*workflow.stage_config(cfg, "reinforce"))
    assert "reinforce" not in workflow.run(cfg)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("stage.reinforce.scenarios=[long,poetry]", "scenarios"),
        ("stage.reinforce.baseline_momentum=1.0", "baseline_momentum"),
        ("stage.reinforce.train.quant_grad_scale=fancy", "train.quant_grad_scale"),
        ("stage.reinforce.tvd_weight=-1", "tvd_weight"),
        ("stage.reinforce.context_tvd_weight=-1", "context_tvd_weight"),
        ("stage.reinforce.context_positions=-4", "context_positions"),
        ("stage.reinforce.val_prompts=0", "val_prompts"),
        ("stage.reinforce.train.val_every=0", "train.val_every"),
        ("stage.reinforce.train.patience=0", "train.patience"),
        ("stage.reinforce.train.grad_clip=0.5", "train.grad_clip"),
        ("stage.reinforce.monitor_window=1", "monitor_window"),
        ("stage.reinforce.lr_drop_threshold=-0.1", "lr_drop_threshold"),
        ("stage.reinforce.lr_drop_factor=0", "lr_drop_factor"),
        ("stage.reinforce.lr_drop_factor=1.5", "lr_drop_factor"),
        ("stage.reinforce.keep.min_gain=-0.01", "keep.min_gain"),
        ("stage.reinforce.serve_temperature=-0.5", "serve_temperature"),
        ("stage.evaluate.temperature=-1", "serve_temperature"),  # what it follows by default
        ("stage.reinforce.greedy_margin=-1", "greedy_margin"),
        ("stage.reinforce.long_new_tokens=0", "long_new_tokens"),
        ("stage.reinforce.train.schedule=linear", "train.schedule"),
        ("stage.reinforce.train.step_gamma=1.2", "train.step_gamma"),
    ],
)
def test_check_names_the_bad_key(tmp_path, override, key):
    cfg = smoke_cfg(tmp_path, "tracking=none", STAGES, override)
    with pytest.raises(ConfigError, match=f"stage.reinforce.{key}"):
        workflow.check_stage(cfg, "reinforce")


def test_a_clip_outside_1_to_3_is_refused_with_the_range(tmp_path):
    cfg = smoke_cfg(tmp_path, "tracking=none", STAGES, "stage.reinforce.train.grad_clip=5")
    with pytest.raises(
        ConfigError, match=r"stage.reinforce.train.grad_clip.*1.0 <= grad_clip <= 3.0"
    ):
        workflow.check_stage(cfg, "reinforce")
    for ok in ("1.0", "3.0"):
        cfg = smoke_cfg(tmp_path, "tracking=none", STAGES, f"stage.reinforce.train.grad_clip={ok}")
        workflow.check_stage(cfg, "reinforce")


def nan_at(step: int):
    """A sabotaged DraftReinforce.training_step: a non-finite loss at `step`."""
    original = reinforce.DraftReinforce.training_step

    def training_step(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        return loss * float("nan") if self.global_step == step else loss

    return training_step


def test_a_nan_step_is_skipped_by_the_guard(boot, tmp_path, monkeypatch):
    monkeypatch.setattr(reinforce.DraftReinforce, "training_step", nan_at(1))
    cfg = boot_cfg(boot, tmp_path, STAGES, *TINY)  # nan_guard: true by default
    metrics = workflow.run(cfg)["reinforce"]["metrics"]
    report = json.loads((tmp_path / "run" / "reinforce" / "reinforce.json").read_text())
    assert report["training"]["nan_skipped"] == 1 and report["training"]["guard_lr_scale"] == 0.5
    assert metrics["nan_skipped"] == 1.0
    draft = load_causal_lm(tmp_path / "run" / "reinforce" / "draft")
    assert all(torch.isfinite(p).all() for p in draft.parameters())


def test_serve_temperature_follows_evaluate_and_moves_the_fingerprint(tmp_path):
    """One setting drives both stages: evaluate's temperature is reinforce's serving one unless
    set apart (or through the old name, `temperature`), and each value is its own fingerprint."""
    from pipeline.config import run_config
    from pipeline.stageplan import fingerprint

    def stage(*overrides):
        cfg = smoke_cfg(tmp_path, "tracking=none", STAGES, *overrides)
        return workflow.make_stage(cfg, "reinforce", run_config(cfg))

    default = stage()
    assert default.cfg.serve_temperature == 1.0 and default.cfg.selection_key == "alpha"
    greedy = {
        name: stage(*overrides)
        for name, overrides in {
            "evaluate": ["stage.evaluate.temperature=0"],
            "own": ["stage.reinforce.serve_temperature=0"],
            "old name": ["stage.reinforce.temperature=0"],
        }.items()
    }
    assert all(s.cfg.serve_temperature == 0 for s in greedy.values())
    assert greedy["own"].cfg.selection_key == "greedy_match"
    prints = {name: fingerprint(s, {}) for name, s in greedy.items()}
    assert len(set(prints.values())) == 1 and fingerprint(default, {}) not in prints.values()
    apart = stage("stage.evaluate.temperature=0", "stage.reinforce.serve_temperature=0.7")
    assert apart.cfg.serve_temperature == 0.7
    assert fingerprint(apart, {}) not in {fingerprint(default, {}), *prints.values()}


def test_serving_greedily_trains_and_keeps_on_greedy_match(boot, tmp_path):
    cfg = boot_cfg(boot, tmp_path, STAGES, *TINY, "stage.evaluate.temperature=0")
    metrics = workflow.run(cfg)["reinforce"]["metrics"]
    report = json.loads((tmp_path / "run" / "reinforce" / "reinforce.json").read_text())
    val = report["validation"]
    assert report["serve_temperature"] == 0 and metrics["serve_temperature"] == 0
    assert val["selected_on"] == "greedy_match" and val["alpha_temperature"] == 1.0
    # The keep decision paired the per-prompt greedy matches: its gain is theirs.
    best = val["input"] if report["kept_input"] else val["best"]
    assert metrics["keep_windows"] == 32 and len(val["input"]["windows"]) == 32
    gain = val["best"]["greedy_match"] - val["input"]["greedy_match"]
    assert metrics["keep_gain"] == pytest.approx(gain)
    assert metrics["val_greedy_match_after_mean"] == best["greedy_match"]
    reference = val_alpha(cfg, boot["target"], boot["draft"], temperature=0.0)
    assert metrics["val_greedy_match_before_mean"] == pytest.approx(reference, rel=1e-6)
    assert 0 < reference < 1


def test_with_data_chat_template_the_prompts_are_cut_from_rendered_documents(
    boot, tmp_path, chat_target
):
    chat = (
        "tracking=none", "model=hf", f"model.target.path={chat_target}",
        f"model.draft.path={boot['draft']}", "stages=[reinforce]", "data.chat_template=true",
    )  # fmt: skip
    cfg = smoke_cfg(tmp_path, *chat, *TINY, "stage.reinforce.train.steps=2")
    workflow.run(cfg)
    report = json.loads((tmp_path / "run" / "reinforce" / "reinforce.json").read_text())
    start = report["validation"]["input"]["alpha"]  # the starting draft on the validation prompts
    assert start == pytest.approx(val_alpha(cfg, chat_target, boot["draft"]), rel=1e-5)
    plain = smoke_cfg(tmp_path, *chat[:-1], *TINY)
    assert start != pytest.approx(val_alpha(plain, chat_target, boot["draft"]), rel=1e-3)
