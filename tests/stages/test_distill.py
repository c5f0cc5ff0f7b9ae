"""The distill stage: end to end on the smoke models, config errors, resume after a kill, the
choice of the best validated checkpoint (or of the input when none beats it), and 2-rank DDP /
DeepSpeed ZeRO-2 / ZeRO-3 runs on CPU that must produce a loadable model."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pipeline import workflow
from pipeline.config import data_cfg
from pipeline.data.heldout import heldout
from pipeline.data.text import Corpus
from pipeline.errors import ConfigError
from pipeline.lit.distill import DistillModule
from pipeline.lit.losses import layer_weights
from pipeline.models.hf import load_tokenizer
from pipeline.models.quantized import (
    load_quantized,
    quantized_modules,
    read_quant_meta,
    save_quantized_model,
)
from pipeline.rundir import outputs_digest, record_outputs
from tests._require import needs
from tests.conftest import REPO, smoke_cfg
from tests.stages.conftest import boot_cfg

QUANT = "quant=w2g64"
ZERO2 = pytest.param("deepspeed_zero2", marks=needs("deepspeed"))
ZERO3 = pytest.param("deepspeed_zero3", marks=needs("deepspeed"))
DETUNE = 0.5  # every step size of `detuned`: a power of 2, so x 1/DETUNE restores it exactly
SMALL = (
    "stage.distill.train.steps=4",
    "stage.distill.train.batch=4",
    "stage.distill.train.warmup=1",
    "stage.distill.train.checkpoint_every=2",
    "stage.distill.val_windows=4",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quantized(boot, tmp_path_factory):
    """A run dir with the smoke bootstrap and its w2g64 quantize stage done."""
    tmp = tmp_path_factory.mktemp("distill-q")
    workflow.run(boot_cfg(boot, tmp, "stages=[bootstrap,quantize]", QUANT))
    return tmp / "run"


@pytest.fixture(scope="module")
def detuned(quantized, tmp_path_factory):
    """`quantized` with every step size halved: a gap for distillation to recover (the smoke
    model loses almost nothing at 2 bits, so there training can only make it worse), wide
    enough that a few steps close part of it whatever the CPU's float kernels (at 0.7x an AVX2
    host's first steps widened it, where an AVX-512 one's narrowed it)."""
    run = tmp_path_factory.mktemp("distill-detuned") / "run"
    shutil.copytree(quantized, run)
    q_dir = run / "quantize" / "model"
    model = load_quantized(q_dir)
    with torch.no_grad():
        for m in quantized_modules(model).values():
            m.scale.mul_(DETUNE)
    staged = run / "detuned"
    save_quantized_model(model, staged, src_dir=q_dir, method=read_quant_meta(q_dir)["method"])
    shutil.rmtree(q_dir)
    staged.rename(q_dir)
    # Recorded as quantize's own result, or the workflow would find the folder damaged and redo it.
    done_file = run / "quantize" / "_done.json"
    done = json.loads(done_file.read_text())
    done["outputs"] = record_outputs(run / "quantize")
    done["outputs_digest"] = outputs_digest(done["outputs"])
    done_file.write_text(json.dumps(done))
    return run


def forced_steps(scales: dict[int, float] | None = None, sharpen: dict[int, float] | None = None):
    """A DistillModule.training_step whose effect is forced, the same on every CPU: step k first
    multiplies every step size by scales[k] and the final norm's gain, so the logits, by
    sharpen[k] (1 when absent), then returns its loss times 0, so every gradient is exactly 0
    and AdamW (no weight decay) leaves every parameter as it is. Logits 16x too sharp cost the
    smoke model nats of NLL: worse than any damage to its step sizes."""
    original = DistillModule.training_step

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            for m in quantized_modules(self.student).values():
                m.scale.mul_((scales or {}).get(self.global_step, 1.0))
            self.student.model.norm.weight.mul_((sharpen or {}).get(self.global_step, 1.0))
        return original(self, batch, batch_idx) * 0.0

    return training_step


def val_nll(cfg, model, n_windows: int) -> float:
    """Mean next-token NLL of `model` on the stage's validation windows (a direct reference)."""
    target = cfg.run_dir + "/bootstrap/target"
    corpus = Corpus(data_cfg(cfg), load_tokenizer(target))
    w = heldout(corpus.stream("validation"), "validation", 64, limit=n_windows).windows
    with torch.no_grad():
        logits = model(input_ids=w).logits[:, :-1]  # (W, T-1, V)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), w[:, 1:]).item()


def distill_args(quantized, tmp_path, *overrides: str) -> list[str]:
    """Overrides for a distill run whose run dir starts with copies of bootstrap and quantize.

    Only `distill` is selected: bootstrap's fingerprint covers the trainer section, so listing
    it with another trainer (ddp, bf16) would retrain it; the finished folders are read as is.
    """
    run = tmp_path / "run"
    for stage in ("bootstrap", "quantize"):
        if not (run / stage).exists():
            shutil.copytree(quantized / stage, run / stage)
    return ["tracking=none", "stages=[distill]", QUANT, *SMALL, *overrides]


def check_output(run, steps: int) -> dict:
    """The distill model loads, keeps quantize's formats and codes (scales-only training),
    and its learned scales differ from quantize's."""
    done = json.loads((run / "distill" / "_done.json").read_text())
    assert done["metrics"]["steps"] == steps
    q_dir, d_dir = run / "quantize" / "model", run / "distill" / "model"
    assert read_quant_meta(d_dir)["method"] == "distill"
    assert read_quant_meta(d_dir)["layers"] == read_quant_meta(q_dir)["layers"]
    q_mods = quantized_modules(load_quantized(q_dir))
    d_model = load_quantized(d_dir)
    d_mods = quantized_modules(d_model)
    assert all(torch.equal(q_mods[n].codes, d_mods[n].codes) for n in q_mods)
    assert any(not torch.equal(q_mods[n].scale, d_mods[n].scale) for n in q_mods)
    with torch.no_grad():
        logits = d_model(input_ids=torch.arange(16)[None]).logits
    assert torch.isfinite(logits).all()
    return done["metrics"]


def test_end_to_end_bf16_with_attention_and_hidden_matching(detuned, tmp_path):
    args = distill_args(
        detuned,
        tmp_path,
        "trainer.precision=bf16-mixed",
        "stage.distill.teacher_dtype=bfloat16",
        "stage.distill.match=both",
        "stage.distill.train.val_every=3",
    )
    workflow.run(smoke_cfg(tmp_path, *args))
    metrics = check_output(tmp_path / "run", steps=4)
    for key in (
        "val_ppl_fp",
        "val_ppl_quantized",
        "val_ppl_distilled",
        "val_kl_quantized",
        "val_kl_distilled",
        "final_loss_kl",
        "final_loss_attn",
        "final_loss_hidden",
    ):
        assert key in metrics and metrics[key] >= 0, key
    # Labelled: 4 validation windows of 64 tokens, 63 scored positions each.
    assert (metrics["val_window"], metrics["val_windows"], metrics["val_tokens"]) == (64, 4, 252)
    assert metrics["val_ppl_quantized"] != metrics["val_ppl_fp"]
    assert metrics["kept_input"] == 0
    assert metrics["val_ppl_distilled"] < metrics["val_ppl_quantized"]
    report = json.loads((tmp_path / "run" / "distill" / "distill_report.json").read_text())
    assert abs(sum(report["layer_weights"]) - 1) < 1e-6
    # Static weights (reweight_every null): no history, no picture.
    assert "layer_weights_history" not in report
    assert not (tmp_path / "run" / "distill" / "layer_weights.png").exists()
    assert metrics["resumed"] == 0 and metrics["nan_skipped"] == 0
    val = report["validation"]
    assert val["split"] == "validation" and report["kept_input"] is False
    assert [r["step"] for r in val["history"]] == [3, 4]  # every val_every steps, and the last
    assert val["best"]["nll"] < val["input"]["nll"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("stage.distill.train.grad_clip=0.5", "stage.distill.train.grad_clip"),
        ("stage.distill.train.grad_clip=3.5", "stage.distill.train.grad_clip"),
        ("stage.distill.trainable=[weights]", "stage.distill.trainable"),
        ("stage.distill.trainable=[scales,embeddings]", "stage.distill.trainable"),
        ("stage.distill.float_lr=0", "stage.distill.float_lr"),
        ("stage.distill.train.quant_grad_scale=sqrt", "stage.distill.train.quant_grad_scale"),
        ("stage.distill.teacher_dtype=float8", "stage.distill.teacher_dtype"),
        ("stage.distill.match=logits", "stage.distill.match"),
        ("+stage.distill.lr_sched=linear", "stage.distill.lr_sched"),
        ("stage.distill.val_windows=0", "stage.distill.val_windows"),
        ("stage.distill.train.val_every=0", "stage.distill.train.val_every"),
        ("stage.distill.train.schedule=linear", "stage.distill.train.schedule"),
        ("stage.distill.train.patience=0", "stage.distill.train.patience"),
        ("stage.distill.clip_norm=0.5", "stage.distill.train.grad_clip"),
        ("stage.distill.reweight_every=0", "stage.distill.reweight_every"),
        ("stage.distill.ce=-1", "stage.distill.ce"),
        ("stage.distill.beta=-0.1", "stage.distill.beta"),
        ("stage.distill.keep.confidence=1.0", "stage.distill.keep.confidence"),
        ("+stage.distill.keep.level=0.9", "stage.distill.keep.level"),
    ],
)
def test_check_names_the_bad_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        workflow.check_stage(smoke_cfg(tmp_path, override), "distill")


def test_the_loss_weights_cannot_all_be_zero(tmp_path):
    with pytest.raises(ConfigError, match="not all 0"):
        cfg = smoke_cfg(tmp_path, "stage.distill.alpha=0", "stage.distill.beta=0")
        workflow.check_stage(cfg, "distill")


def test_reweighting_needs_the_matching_term(tmp_path):
    cfg = smoke_cfg(tmp_path, "stage.distill.beta=0", "stage.distill.reweight_every=5")
    with pytest.raises(ConfigError, match=r"stage\.distill\.reweight_every.*beta > 0"):
        workflow.check_stage(cfg, "distill")


def test_reweighted_layer_weights_are_reported_and_plotted(detuned, tmp_path):
    args = distill_args(detuned, tmp_path, "stage.distill.reweight_every=2")
    workflow.run(smoke_cfg(tmp_path, *args))
    out = tmp_path / "run" / "distill"
    report = json.loads((out / "distill_report.json").read_text())
    history = report["layer_weights_history"]
    assert [h["step"] for h in history] == [0, 2, 4]
    # Started from quantize's errors (a direct reference), reported as they were at step 0.
    layers = json.loads((tmp_path / "run" / "quantize" / "quant_report.json").read_text())
    errors = {name: r["rel_output_error"] for name, r in layers["layers"].items()}
    static = layer_weights(errors, len(history[0]["weights"])).tolist()
    assert history[0]["weights"] == report["layer_weights"] == static
    for h in history:
        assert len(h["weights"]) == len(history[0]["weights"])
        assert sum(h["weights"]) == pytest.approx(1.0, abs=1e-6)
    assert history[1]["weights"] != history[0]["weights"]  # they followed the training
    assert "layer_weights.png" in json.loads((out / "_done.json").read_text())["outputs"]


def test_check_refuses_an_unknown_trainer_argument(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.max_stepz"):
        workflow.check_stage(smoke_cfg(tmp_path, "+trainer.max_stepz=3"), "distill")


def test_rerun_after_a_kill_resumes_from_the_last_checkpoint(detuned, tmp_path, monkeypatch):
    original = DistillModule.training_step

    def dies_at_step_3(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("node lost")
        return original(self, batch, batch_idx)

    args = distill_args(detuned, tmp_path, "stage.distill.train.val_every=2")
    monkeypatch.setattr(DistillModule, "training_step", dies_at_step_3)
    with pytest.raises(Exception, match="node lost"):
        workflow.run(smoke_cfg(tmp_path, *args))
    ckpts = list((tmp_path / "run" / ".work").glob("distill-*/checkpoints/*.ckpt"))
    assert sorted(c.name for c in ckpts) == ["best.ckpt", "last.ckpt"]  # both in the work dir
    assert torch.load(ckpts[0].parent / "last.ckpt", weights_only=False)["global_step"] == 2
    monkeypatch.setattr(DistillModule, "training_step", original)
    metrics = workflow.run(smoke_cfg(tmp_path, *args))["distill"]["metrics"]
    assert metrics["resumed"] == 1 and metrics["steps"] == 4
    assert not list((tmp_path / "run" / ".work").glob("distill-*"))  # dropped once done
    check_output(tmp_path / "run", steps=4)
    # The step-0 score came back from the checkpoint, not from the resumed weights: it is the
    # input's (a direct reference), whatever the two steps after it did.
    report = json.loads((tmp_path / "run" / "distill" / "distill_report.json").read_text())
    assert report["validation"]["input"]["step"] == 0
    cfg = smoke_cfg(tmp_path, *args)
    before = val_nll(cfg, load_quantized(tmp_path / "run" / "quantize" / "model"), 4)
    assert report["validation"]["input"]["nll"] == pytest.approx(before, rel=1e-5)


def test_no_checkpoint_better_than_the_input_keeps_it_byte_identical(
    detuned, tmp_path, monkeypatch, caplog
):
    """Training that only makes things worse (its first step sharpens the logits 16x, the next
    change nothing) hands on the quantize stage's model unchanged, says so, and early stopping
    ends it after 2 checks."""
    monkeypatch.setattr(DistillModule, "training_step", forced_steps(sharpen={0: 16.0}))
    args = distill_args(
        detuned, tmp_path, "stage.distill.train.val_every=1", "stage.distill.train.patience=1"
    )
    with caplog.at_level("WARNING", logger="pipeline"):
        metrics = workflow.run(smoke_cfg(tmp_path, *args))["distill"]["metrics"]
    assert "keeping the quantize stage's model unchanged" in caplog.text
    assert metrics["kept_input"] == 1 and metrics["steps"] == 2  # stopped early
    assert metrics["val_ppl_distilled"] == metrics["val_ppl_quantized"] < metrics["val_ppl_best"]
    report = json.loads((tmp_path / "run" / "distill" / "distill_report.json").read_text())
    assert report["kept_input"] is True
    before = report["validation"]["input"]["nll"]
    assert all(r["nll"] > before for r in report["validation"]["history"])
    q_dir, d_dir = tmp_path / "run" / "quantize" / "model", tmp_path / "run" / "distill" / "model"
    files = sorted(p.name for p in q_dir.iterdir())
    assert files == sorted(p.name for p in d_dir.iterdir())
    assert all((q_dir / f).read_bytes() == (d_dir / f).read_bytes() for f in files)


def test_the_result_is_the_best_checkpoint_not_the_last(quantized, detuned, tmp_path, monkeypatch):
    """Step 1 undoes the damage, step 3 sharpens the logits 16x: the written model is step 2's.
    Forced steps, not trained ones, so the trajectory is the same on every CPU (a real one's
    first steps depend on the float kernels)."""
    forced = forced_steps(scales={0: 1 / DETUNE}, sharpen={2: 16.0})
    monkeypatch.setattr(DistillModule, "training_step", forced)
    args = distill_args(detuned, tmp_path, "stage.distill.train.val_every=2")
    cfg = smoke_cfg(tmp_path, *args)
    metrics = workflow.run(cfg)["distill"]["metrics"]
    report = json.loads((tmp_path / "run" / "distill" / "distill_report.json").read_text())
    val = report["validation"]
    by_step = {r["step"]: r["nll"] for r in val["history"]}
    assert sorted(by_step) == [2, 4] and by_step[2] < val["input"]["nll"] < by_step[4]
    repaired = val_nll(cfg, load_quantized(quantized / "quantize" / "model"), 4)
    assert by_step[2] == pytest.approx(repaired, rel=1e-5)  # step 2 is the undamaged model
    assert metrics["best_step"] == 2 and metrics["kept_input"] == 0
    written = val_nll(cfg, load_quantized(tmp_path / "run" / "distill" / "model"), 4)
    assert written == pytest.approx(by_step[2], rel=1e-5)
    assert metrics["val_ppl_distilled"] == pytest.approx(math.exp(written), rel=1e-5)


KEEP_KEYS = ("keep_gain", "keep_ci_low", "keep_ci_high", "keep_windows", "keep_resamples")


def test_useless_training_keeps_the_input_and_records_the_decision(quantized, tmp_path, caplog):
    """A learning rate too small to move a float32 parameter: every check scores the input's
    windows exactly, so the gain is 0 with no spread, and 0 is not a gain: the input is kept,
    and the decision with its margin is in _done.json, the metrics and distill_report.json."""
    args = distill_args(
        quantized,
        tmp_path,
        "stage.distill.train.lr=1e-12",
        "stage.distill.float_lr=1e-12",
        "stage.distill.train.val_every=2",
        "stage.distill.keep.resamples=500",
    )
    with caplog.at_level("WARNING", logger="pipeline"):
        workflow.run(smoke_cfg(tmp_path, *args))
    out = tmp_path / "run" / "distill"
    metrics = json.loads((out / "_done.json").read_text())["metrics"]
    assert metrics["kept_input"] == 1 and metrics["keep_gain"] == 0
    assert metrics["keep_ci_low"] == metrics["keep_ci_high"] == 0
    assert (metrics["keep_windows"], metrics["keep_resamples"]) == (4, 500)
    assert "keeping the quantize stage's model unchanged" in caplog.text
    assert "gain +0, 95% bounds [+0, +0] over 4 windows" in caplog.text
    report = json.loads((out / "distill_report.json").read_text())
    keep = report["validation"]["keep"]
    assert keep["trained"] is False and keep["gain"] == 0 and keep["windows"] == 4
    assert len(report["validation"]["input"]["windows"]) == 4
    assert "windows" not in report["validation"]["history"][0]  # means only per check
    q_dir = tmp_path / "run" / "quantize" / "model"
    assert all((q_dir / f.name).read_bytes() == f.read_bytes() for f in (out / "model").iterdir())


def test_a_gain_below_min_gain_keeps_the_input(detuned, tmp_path, monkeypatch, caplog):
    """Step 1 undoes the detuning, a clear gain on every window; a min_gain above it still keeps
    the input, and the report says by how much the gain fell short."""
    monkeypatch.setattr(DistillModule, "training_step", forced_steps(scales={0: 1 / DETUNE}))
    args = distill_args(detuned, tmp_path, "stage.distill.keep.min_gain=100")
    with caplog.at_level("WARNING", logger="pipeline"):
        metrics = workflow.run(smoke_cfg(tmp_path, *args))["distill"]["metrics"]
    assert all(key in metrics for key in KEEP_KEYS)
    assert 0 < metrics["keep_ci_low"] <= metrics["keep_gain"] < 100
    assert (
        metrics["kept_input"] == 1 and metrics["val_ppl_distilled"] == metrics["val_ppl_quantized"]
    )
    assert "keeping the quantize stage's model unchanged" in caplog.text


def two_ranks(detuned, tmp_path, trainer: str, *overrides: str) -> tuple[dict, dict]:
    """A 2-rank distill run on CPU through the CLI: (its metrics, its distill_report.json)."""
    args = distill_args(
        detuned,
        tmp_path,
        f"trainer={trainer}",
        f"run_dir={tmp_path / 'run'}",
        "experiment=smoke",
        "stage.distill.train.steps=3",
        *overrides,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = check_output(tmp_path / "run", steps=3)
    assert metrics["world_size"] == 2
    report = json.loads((tmp_path / "run" / "distill" / "distill_report.json").read_text())
    return metrics, report


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ddp", ZERO2, ZERO3])
def test_two_ranks_on_cpu(detuned, tmp_path, trainer):
    _, report = two_ranks(detuned, tmp_path, trainer)
    expected = "DDPStrategy" if trainer == "ddp" else "AnyDeviceDeepSpeedStrategy"
    assert report["strategy"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ddp", ZERO3])
def test_two_ranks_reweight_from_errors_summed_over_ranks(detuned, tmp_path, trainer):
    """Each rank trains on its half of the batch; the weights come from both halves' errors
    (an all-reduce every rank joins at the same step), then go on training on every rank."""
    _, report = two_ranks(detuned, tmp_path, trainer, "stage.distill.reweight_every=1")
    history = report["layer_weights_history"]
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert all(sum(h["weights"]) == pytest.approx(1.0, abs=1e-6) for h in history)
