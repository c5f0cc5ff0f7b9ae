"""The distill stage: end to end on the smoke models, config errors, resume after a kill, and
2-rank DDP / DeepSpeed ZeRO-2 / ZeRO-3 runs on CPU that must produce a loadable model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pipeline import workflow
from pipeline.errors import ConfigError
from pipeline.lit.distill import DistillModule
from pipeline.models.quantized import load_quantized, quantized_modules, read_quant_meta
from tests.conftest import REPO, smoke_cfg
from tests.stages.conftest import boot_cfg

QUANT = "quant=w2g64"
SMALL = (
    "stage.distill.max_steps=4",
    "stage.distill.batch_size=4",
    "stage.distill.warmup_steps=1",
    "stage.distill.ckpt_every=2",
    "stage.distill.val_windows=4",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quantized(boot, tmp_path_factory):
    """A run dir with the smoke bootstrap and its w2g64 quantize stage done."""
    tmp = tmp_path_factory.mktemp("distill-q")
    workflow.run(boot_cfg(boot, tmp, "stages=[bootstrap,quantize]", QUANT))
    return tmp / "run"


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


def test_end_to_end_bf16_with_attention_and_hidden_matching(quantized, tmp_path):
    args = distill_args(
        quantized,
        tmp_path,
        "trainer.precision=bf16-mixed",
        "stage.distill.teacher_dtype=bfloat16",
        "stage.distill.match=both",
    )
    workflow.run(smoke_cfg(tmp_path, *args))
    metrics = check_output(tmp_path / "run", steps=4)
    for key in (
        "ppl_fp",
        "ppl_quantized",
        "ppl_distilled",
        "final_loss_kl",
        "final_loss_attn",
        "final_loss_hidden",
    ):
        assert key in metrics and metrics[key] >= 0, key
    # The student starts from the quantize stage's codes, not from the FP weights (on the
    # barely trained smoke model 2 bits need not cost perplexity, so no direction is asserted).
    assert metrics["ppl_quantized"] != metrics["ppl_fp"]
    report = json.loads((tmp_path / "run" / "distill" / "distill_report.json").read_text())
    assert abs(sum(report["layer_weights"]) - 1) < 1e-6
    assert metrics["resumed"] == 0 and metrics["nan_skipped"] == 0


@pytest.mark.parametrize(
    "override, key",
    [
        ("stage.distill.clip_norm=0.5", "stage.distill.clip_norm"),
        ("stage.distill.clip_norm=3.5", "stage.distill.clip_norm"),
        ("stage.distill.train=[weights]", "stage.distill.train"),
        ("stage.distill.grad_scale=sqrt", "stage.distill.grad_scale"),
        ("stage.distill.teacher_dtype=float8", "stage.distill.teacher_dtype"),
        ("stage.distill.match=logits", "stage.distill.match"),
        ("+stage.distill.lr_sched=linear", "stage.distill.lr_sched"),
    ],
)
def test_validate_names_the_bad_key(tmp_path, override, key):
    from pipeline.stages.distill import validate

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(smoke_cfg(tmp_path, override))


def test_alpha_and_beta_cannot_both_be_zero(tmp_path):
    from pipeline.stages.distill import validate

    with pytest.raises(ConfigError, match="not both 0"):
        validate(smoke_cfg(tmp_path, "stage.distill.alpha=0", "stage.distill.beta=0"))


def test_rerun_after_a_kill_resumes_from_the_last_checkpoint(quantized, tmp_path, monkeypatch):
    original = DistillModule.training_step

    def dies_at_step_3(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("node lost")
        return original(self, batch, batch_idx)

    args = distill_args(quantized, tmp_path)
    monkeypatch.setattr(DistillModule, "training_step", dies_at_step_3)
    with pytest.raises(RuntimeError, match="node lost"):
        workflow.run(smoke_cfg(tmp_path, *args))
    ckpts = list((tmp_path / "run" / ".work").glob("distill-*/checkpoints/step=000002.ckpt"))
    assert len(ckpts) == 1
    monkeypatch.setattr(DistillModule, "training_step", original)
    metrics = workflow.run(smoke_cfg(tmp_path, *args))["distill"]["metrics"]
    assert metrics["resumed"] == 1 and metrics["steps"] == 4
    assert not list((tmp_path / "run" / ".work").glob("distill-*"))  # dropped once done
    check_output(tmp_path / "run", steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ddp", "deepspeed_zero2", "deepspeed_zero3"])
def test_two_ranks_on_cpu(quantized, tmp_path, trainer):
    args = distill_args(
        quantized,
        tmp_path,
        f"trainer={trainer}",
        f"run_dir={tmp_path / 'run'}",
        "experiment=smoke",
        "stage.distill.max_steps=3",
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
    expected = "DDPStrategy" if trainer == "ddp" else "AnyDeviceDeepSpeedStrategy"
    assert report["strategy"] == expected
