"""DistillModule on a tiny Llama whose linears are fake-quantized here: loss, STE gradients,
gradient scaling, trainable sets, full-precision modules, the NaN guard and resume."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from pipeline.lit.config import TrainConfig
from pipeline.lit.distill import DistillData, DistillHParams, DistillModule, recompute_blocks
from pipeline.lit.guards import NanGuard
from pipeline.lit.qat import apply_grad_scale, keep_full_precision, prepare_qat
from pipeline.lit.resume import ResumeCheckpoint, best_and_last, load_checkpoint, resume_path
from pipeline.quant.fakequant import FakeQuantLinear, grad_scale_factor

VOCAB, SEQ = 64, 8


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_pair(seed: int = 0, fmt: str = "int2g32", learn_weights: bool = False):
    """(teacher, student): a random 2-layer Llama and its copy with fake-quant decoder linears."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    teacher = LlamaForCausalLM(cfg).eval()
    student = copy.deepcopy(teacher)
    for name, mod in list(student.named_modules()):
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            fq = FakeQuantLinear.from_linear(mod, fmt, learn_weights=learn_weights)
            student.set_submodule(name, fq)
    return teacher, student


def hparams(steps=10, lr=1e-3, **changes) -> DistillHParams:
    """Settings of a short test run (every field is the stage config's to give)."""
    train = TrainConfig(steps=steps, lr=lr, warmup=0, quant_grad_scale="none")
    base = dict(
        train=train,
        weight_lr=1e-3,
        float_lr=5e-4,
        weight_decay=0.0,
        alpha=1.0,
        beta=1.0,
        temperature=1.0,
        match="attention",
        trainable=["scales"],
        fp32_modules=[],
        teacher_dtype="float32",
    )
    return DistillHParams(**(base | changes))


def make_module(cls=DistillModule, train=("scales",), lr=1e-3, max_steps=10, seed=0, **hp):
    teacher, student = tiny_pair(seed, learn_weights="weights" in train)
    params = hparams(steps=max_steps, lr=lr, weight_lr=lr, trainable=list(train), **hp)
    groups = prepare_qat(student, params.trainable, params.train.quant_grad_scale)
    return cls(student, teacher, params, torch.tensor([0.5, 0.5]), groups)


def batch(seed: int = 0, n: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def scales(module) -> list[torch.Tensor]:
    return [
        m.scale.detach().clone() for m in module.student.modules() if isinstance(m, FakeQuantLinear)
    ]


def test_one_training_step_reduces_the_loss():
    module = make_module(beta=1.0, match="both")
    opt = module.configure_optimizers()["optimizer"]
    x = batch()
    before = module.losses(x)
    assert before["kl"] > 0 and before["attn"] > 0 and before["hidden"] > 0
    before["total"].backward()
    opt.step()
    with torch.no_grad():
        after = module.losses(x)["total"]
    assert after < before["total"].detach()


def test_activation_checkpointing_gives_the_same_gradients():
    plain, recomputed = make_module(beta=1.0, match="both"), make_module(beta=1.0, match="both")
    recompute_blocks(recomputed.student)
    x = batch()
    for m in (plain, recomputed):
        m.train()
        m.losses(x)["total"].backward()
    assert recomputed.student.is_activation_checkpointing
    assert not plain.student.is_activation_checkpointing
    for a, b in zip(scales_grads(plain), scales_grads(recomputed), strict=True):
        torch.testing.assert_close(b, a)


def scales_grads(module) -> list[torch.Tensor]:
    return [m.scale.grad for m in module.student.modules() if isinstance(m, FakeQuantLinear)]


def test_gradients_reach_scales_and_scaling_multiplies_them():
    plain, scaled = make_module(), make_module()  # same seed: identical students
    factors = apply_grad_scale(scaled.student, "bits")
    assert set(factors.values()) == {2.0**-2}  # int2: 2^-bits
    x = batch()
    for m in (plain, scaled):
        m.losses(x)["total"].backward()
    pairs = [
        (a, b)
        for a, b in zip(plain.student.modules(), scaled.student.modules())
        if isinstance(a, FakeQuantLinear)
    ]
    assert len(pairs) == 14  # 7 linears per decoder layer
    for a, b in pairs:
        assert a.weight is None  # codes frozen: only scale and zero are parameters
        assert a.scale.grad is not None and a.scale.grad.abs().sum() > 0
        torch.testing.assert_close(b.scale.grad, a.scale.grad * 0.25)
        torch.testing.assert_close(b.zero.grad, a.zero.grad * 0.25)


def test_ste_reaches_latent_weights_and_scales_when_weights_train():
    plain, scaled = (make_module(train=("scales", "weights")) for _ in range(2))
    for m in (plain, scaled):  # move the latent weights off the grid, identically
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for fq in m.student.modules():
                if isinstance(fq, FakeQuantLinear):
                    fq.weight.add_(torch.randn(fq.weight.shape, generator=g) * 1e-3)
    apply_grad_scale(scaled.student, "bits")
    x = batch()
    for m in (plain, scaled):
        m.losses(x)["total"].backward()
    fqs = [
        (a, b)
        for a, b in zip(plain.student.modules(), scaled.student.modules())
        if isinstance(a, FakeQuantLinear)
    ]
    for a, b in fqs:
        assert a.weight.grad is not None and a.weight.grad.abs().sum() > 0  # round() passed by STE
        assert a.scale.grad.abs().sum() > 0  # LSQ: round(v) - v, non-zero off the grid
        torch.testing.assert_close(b.weight.grad, a.weight.grad)  # weights are not rescaled
        torch.testing.assert_close(b.scale.grad, a.scale.grad * 0.25)


def test_lsq_factor_follows_the_layer_size():
    module = make_module()
    factors = apply_grad_scale(module.student, "lsq")
    q_proj = module.student.model.layers[0].self_attn.q_proj  # 32x32, int2 asymmetric: Q_P = 3
    name = "model.layers.0.self_attn.q_proj"
    assert factors[name] == pytest.approx(1 / (32 * 32 * 3) ** 0.5)
    assert q_proj.grad_scale == factors[name] == grad_scale_factor("lsq", "int2g32", 32 * 32)


@pytest.mark.parametrize(
    "train",
    [
        ["scales"],
        ["scales", "weights"],
        ["scales", "weights", "norms"],
        ["scales", "norms", "float"],
        ["scales", "weights", "norms", "float"],
    ],
)
def test_trainable_sets(train):
    module = make_module(train=tuple(train))
    names = {n for n, p in module.student.named_parameters() if p.requires_grad}
    assert names and all(n.endswith((".scale", ".zero", ".weight", ".bias")) for n in names)
    assert any(n.endswith(".scale") for n in names)
    assert any(n.endswith("proj.weight") for n in names) == ("weights" in train)
    assert any("norm" in n for n in names) == ("norms" in train)
    floats = {"model.embed_tokens.weight", "lm_head.weight"} & set(
        dict(module.student.named_parameters())
    )
    assert (floats <= names if "float" in train else not floats & names) and floats
    # Every trainable parameter is in exactly one optimizer group.
    groups = module.configure_optimizers()["optimizer"].param_groups
    grouped = [id(p) for g in groups for p in g["params"]]
    assert len(grouped) == len(set(grouped)) == len(names)
    assert not any(p.requires_grad for p in module.teacher.parameters())
    for bad in (["weights"], ["scales", "scales"], ["scales", "head"]):
        with pytest.raises(ValueError, match="scales"):
            prepare_qat(module.student, bad, "none")


def test_full_precision_modules_under_bf16_autocast():
    _, student = tiny_pair()
    x = batch(n=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert student(input_ids=x).logits.dtype == torch.bfloat16
    matched = keep_full_precision(student, ["lm_head", "norm"])
    assert "lm_head" in matched and "model.norm" in matched
    assert "model.layers.0.input_layernorm" in matched
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert student(input_ids=x).logits.dtype == torch.float32


# ------------------------------------------------------------------ Lightning runs
class Recorder(L.Callback):
    """Scales after every step and the global step of every batch start."""

    def __init__(self):
        self.after, self.starts, self.at_start = [], [], None

    def on_train_start(self, trainer, module):
        self.at_start = scales(module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.starts.append(trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append(scales(module))


class NanAtStep2(DistillModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == 2 else loss


class CrashAtStep3(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 3:
            raise RuntimeError("killed")


def fit(module, max_steps, callbacks, ckpt_path=None, val=None, val_every=None):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(hasattr(c, "dirpath") for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        val_check_interval=val_every,
        check_val_every_n_epoch=None if val_every else 1,
    )
    stream = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(1))
    data = DistillData(stream, SEQ, batch_size=2, seed=0, val=val)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_nan_guard_skips_restores_and_halves_lr():
    module = make_module(NanAtStep2, max_steps=5)
    guard, rec = NanGuard(), Recorder()
    trainer = fit(module, 5, [guard, rec])
    assert guard.skipped == 1 and guard.lr_scale == 0.5
    # The NaN step left no trace: state after it == state after the step before.
    for a, b in zip(rec.after[2], rec.after[1]):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(rec.after[3], rec.after[2]))
    assert all(torch.isfinite(s).all() for s in rec.after[-1])
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.base_lrs[0] == pytest.approx(0.5e-3)
    assert trainer.callback_metrics["guard/lr_scale"] == 0.5


def test_resume_continues_at_the_checkpointed_step(tmp_path):
    """The stages' checkpoints (best_and_last, written after each validation) resume a killed
    run at the step of its last validation, with that step's weights."""
    val = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(2))

    def run(callbacks, ckpt_path=None):
        _, ckpts = best_and_last(tmp_path, "val/nll", "min", None)
        return fit(make_module(max_steps=5), 5, [*ckpts, *callbacks], ckpt_path, val, 2)

    def step_of(path) -> int:
        return torch.load(path, map_location="cpu", weights_only=True)["global_step"]

    first = Recorder()
    with pytest.raises(RuntimeError, match="killed"):
        run([CrashAtStep3(), first])
    ckpt = resume_path(tmp_path)
    assert ckpt.exists() and step_of(ckpt) == 2
    second = Recorder()
    trainer = run([second], ckpt_path=str(ckpt))
    assert second.starts[0] == 2 and trainer.global_step == 5
    for a, b in zip(second.at_start, first.after[1]):  # the weights of step 2, not the init's
        assert torch.equal(a, b)
    assert step_of(resume_path(tmp_path)) == 5  # the last step is validated and checkpointed


# ------------------------------------------------------------------ reweighting
def detune_layer(module, layer: int, factor: float) -> None:
    """Scale the step sizes of one decoder layer's fake-quant linears: more error there."""
    with torch.no_grad():
        for fq in module.student.model.layers[layer].modules():
            if isinstance(fq, FakeQuantLinear):
                fq.scale.mul_(factor)


class LayerErrors(L.Callback):
    """The per-layer distances d_l of each step's batch, measured before the step trains."""

    def __init__(self):
        self.at_step: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        with torch.no_grad():
            self.at_step[trainer.global_step] = module.losses(batch)["layers"]


class GrowErrorAt(L.Callback):
    """Detune `layer` by `factor` before the batch of step `step`."""

    def __init__(self, step: int, layer: int, factor: float):
        self.step, self.layer, self.factor = step, layer, factor

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            detune_layer(module, self.layer, self.factor)


def test_reweighting_sets_the_normalised_current_errors_every_n_steps():
    module = make_module(max_steps=4, reweight_every=2)
    initial = torch.tensor([0.5, 0.5])
    module = DistillModule(module.student, module.teacher, module.hp, initial, module.groups)
    detune_layer(module, 1, 2.0)  # layer 1 far worse than layer 0
    errors = LayerErrors()
    trainer = fit(module, 4, [errors])
    # Steps 2 and 4 take the weights from the batch each step trained on (steps 1 and 3).
    assert [h["step"] for h in module.layer_w_history] == [2, 4]
    for h, measured_at in zip(module.layer_w_history, (1, 3)):
        d = errors.at_step[measured_at]
        torch.testing.assert_close(torch.tensor(h["weights"]), d / d.sum())
    w = module.layer_w
    assert w[1] > w[0] and w.sum() == pytest.approx(1.0)
    assert torch.equal(initial, torch.tensor([0.5, 0.5]))  # the caller's weights stay as given
    # The curve logged at the last step is the weights that step trained with (step 2's).
    logged = [trainer.callback_metrics[f"distill/layer_w/{i}"] for i in (0, 1)]
    torch.testing.assert_close(
        torch.stack(logged), torch.tensor(module.layer_w_history[0]["weights"])
    )


def test_static_weights_stay_and_train_differently():
    runs = {}
    for every in (None, 2):
        module = make_module(max_steps=4, reweight_every=every)
        detune_layer(module, 1, 2.0)
        trainer = fit(module, 4, [])
        runs[every] = module
        assert any(k.startswith("distill/layer_w") for k in trainer.callback_metrics) == bool(every)
    static = runs[None]
    assert torch.equal(static.layer_w, torch.tensor([0.5, 0.5])) and not static.layer_w_history
    assert "layer_w" not in static.state_dict()  # the stage's input, not training state
    assert "layer_w" in runs[2].state_dict()
    # The reweighted loss gave other gradients: the students parted after the first reweighting.
    assert any(not torch.equal(a, b) for a, b in zip(scales(static), scales(runs[2])))


def test_weight_moves_toward_the_layer_whose_error_grows():
    """lr = 0, so only the detuning changes the errors: layer 0's weight rises once its error
    grows, against the same run without it."""
    history = {}
    for grow in (False, True):
        module = make_module(max_steps=5, lr=0.0, reweight_every=1)
        callbacks = [GrowErrorAt(step=2, layer=0, factor=2.0)] if grow else []
        fit(module, 5, callbacks)
        history[grow] = [h["weights"][0] for h in module.layer_w_history]
    before, after = history[False], history[True]
    assert len(before) == len(after) == 5
    assert after[:2] == before[:2]  # steps 1-2 trained before the detuning
    assert all(a > b + 0.05 for a, b in zip(after[2:], before[2:]))


def test_resume_with_reweighting_ends_where_the_uninterrupted_run_ends(tmp_path):
    """The reweighted layer weights are training state: a run killed after a checkpoint and
    resumed ends with the uninterrupted run's weights, scales and layer-weight history."""

    def run(path, callbacks, ckpt_path=None):
        module = make_module(max_steps=6, reweight_every=2)
        detune_layer(module, 1, 2.0)
        fit(module, 6, [ResumeCheckpoint(path, every=2), *callbacks], ckpt_path)
        return module

    whole = run(tmp_path / "a", [])
    assert [h["step"] for h in whole.layer_w_history] == [2, 4, 6]
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "b", [CrashAtStep3()])
    saved = load_checkpoint(tmp_path / "b" / "last.ckpt")
    assert saved["global_step"] == 2 and "layer_w" in saved["state_dict"]
    resumed = run(tmp_path / "b", [], ckpt_path=str(tmp_path / "b" / "last.ckpt"))
    assert resumed.layer_w_history == whole.layer_w_history
    assert torch.equal(resumed.layer_w, whole.layer_w)
    for a, b in zip(scales(resumed), scales(whole), strict=True):
        assert torch.equal(a, b)
