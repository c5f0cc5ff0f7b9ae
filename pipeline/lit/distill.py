"""Precision-aware distillation: a fake-quant student learns from its frozen FP teacher.

The student is the quantized model with every quantized linear a FakeQuantLinear (straight-
through estimator); the teacher is the FP model. Both see the same windows; the loss is
`pipeline.lit.losses.distill_loss` (α·KL at temperature τ + β·Σ_l w_l·d_l, plus
ce·CE on the windows' own tokens when `ce` > 0). What trains is a
choice (EfficientQAT trains step sizes alone end to end, at a fraction of the memory; on the
default model that recovered a quarter of a 2-bit gap, and re-fitting the float-kept layers most
of the rest, docs/benchmarks.md): `scales` (scale/zero of every quantized linear, codes
frozen), `weights` (also the latent weights, codes re-derived by rounding), `norms` (also the
RMSNorm gains) and `float` (also the layers the quantizer kept in float, `quant.keep_float`:
embeddings and lm_head, which stay float in every export, so the model can re-fit its output
layer to the quantized body).

The teacher is a registered submodule so that DeepSpeed ZeRO-3 shards it like the student (a
70B teacher does not fit one device); it stays frozen and in eval mode, and its tensors are
dropped from Lightning checkpoints (it is reloaded from the FP checkpoint on resume).

Validation (Lightning's loop, every `val_check_interval` steps and at the last step): the
student's mean next-token NLL on fixed held-out windows of the validation split, plus the
teacher's NLL and KL(teacher ‖ student) from the same two forwards. Every rank scores every
window (the loader is not sharded), so the number is exact and identical on all ranks and ZeRO-3
ranks run the same forwards. The first validation is Lightning's sanity check, run on all
windows before the first step: that is the input model's score (`val_input`), measured by the
same code, strategy and precision as the checkpoints it is compared with, and kept in every
checkpoint so a resumed run still knows it.

Layer weights w_l of the matching term start from the quantize stage's errors (or uniform). With
`reweight_every` = N they follow the training instead: every N optimizer steps they become the
normalised current per-layer distances d_l of the batch that step trained on (the same d_l the
loss multiplies by w_l, so no extra forward), summed over ranks first so that every rank holds
the same weights. The idea: the layers training has not yet repaired keep the matching term's
attention, the repaired ones release it to the KL term. The trade-off: one batch is a noisy
measure, and d_l of a deep layer includes the error it inherits from the layers below it. The
weights are then a persistent buffer (in every checkpoint, so a resumed run continues with the
weights the killed one had) and their history is kept in the checkpoint like the validations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from pipeline.errors import LowbitError
from pipeline.lit.lm import WindowData, cosine_with_warmup
from pipeline.lit.losses import distill_loss, normalised
from pipeline.lit.qat import keep_full_precision, prepare_qat

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DistillHParams:
    """What the training side reads of the parsed `stage.distill` config (`DistillHParams.of`)."""

    max_steps: int
    lr: float
    weight_lr: float
    float_lr: float
    warmup_steps: int
    weight_decay: float
    alpha: float
    beta: float
    temperature: float
    match: str  # attention | hidden | both
    train: Sequence[str]
    grad_scale: str
    fp32_modules: Sequence[str]
    teacher_dtype: str  # float32 | bfloat16
    reweight_every: int | None = None  # optimizer steps between layer reweightings; None: static
    ce: float = 0.0  # weight of the student's cross-entropy on the windows' tokens

    @classmethod
    def of(cls, cfg) -> DistillHParams:
        """The fields of `cfg` (the stage's DistillConfig) that carry these names."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def eager_attention(self) -> bool:
        """Attention maps are matched: both models need eager attention to return them."""
        return self.beta > 0 and self.match != "hidden"


# ------------------------------------------------------------------ the two models
def load_student(model_dir: Path, hp: DistillHParams):
    """The fake-quant student: exact quantize-stage weights, trainable sets, gradient scales.

    Returns:
        (student, {trainable set: its parameters}, see `pipeline.lit.qat.prepare_qat`).
    """
    from pipeline.models.quantized import load_quantized, quantized_modules

    student = load_quantized(model_dir, learn_weights="weights" in hp.train)
    if not quantized_modules(student):
        raise LowbitError(f"{model_dir} has no quantized linear: nothing to distill")
    groups = prepare_qat(student, hp.train, hp.grad_scale)
    keep_full_precision(student, hp.fp32_modules)
    if hp.eager_attention:
        student.set_attn_implementation("eager")
    return student, groups


def load_pair(model_dir: Path, target_dir: Path, hp: DistillHParams, allow_bin: bool):
    """The student (`load_student`) and its frozen FP teacher, in `hp.teacher_dtype`.

    Returns:
        (student, teacher, {trainable set: the student's parameters}).
    """
    from pipeline.models.hf import load_causal_lm

    student, groups = load_student(model_dir, hp)
    teacher = load_causal_lm(target_dir, dtype=_DTYPES[hp.teacher_dtype], allow_bin=allow_bin)
    if teacher.config.vocab_size != student.config.vocab_size:
        raise LowbitError(
            f"the teacher {target_dir} and the quantized {model_dir} differ in "
            "vocabulary: re-run quantize on this target"
        )
    keep_full_precision(teacher, hp.fp32_modules)
    if hp.eager_attention:
        teacher.set_attn_implementation("eager")
    return student, teacher, groups


# ------------------------------------------------------------------ validation
def heldout_sums(teacher_logits: Tensor, student_logits: Tensor, ids: Tensor) -> Tensor:
    """Summed student NLL, teacher NLL and KL(teacher ‖ student) over next-token positions.

    Args:
        teacher_logits, student_logits: (B, T, V).
        ids: (B, T) the windows both models read.

    Returns:
        (3,) float64 sums over the B·(T−1) scored positions.
    """
    target = ids[:, 1:, None]  # (B, T-1, 1)
    log_t = teacher_logits[:, :-1].float().log_softmax(-1)  # (B, T-1, V)
    log_s = student_logits[:, :-1].float().log_softmax(-1)
    s_nll = -log_s.gather(-1, target).sum()
    t_nll = -log_t.gather(-1, target).sum()
    kl = (log_t.exp() * (log_t - log_s)).sum()
    return torch.stack([s_nll, t_nll, kl]).double()


class HeldoutBatches(IterableDataset):
    """Fixed batches of held-out windows (W, T), the same on every rank.

    An IterableDataset, so Lightning does not give it a DistributedSampler: every rank scores
    every window (exact, no padding duplicates, equal forwards on every ZeRO-3 rank).
    """

    def __init__(self, windows: Tensor, batch_size: int) -> None:
        self.windows, self.batch_size = windows, batch_size

    def __iter__(self):
        for i in range(0, self.windows.shape[0], self.batch_size):
            yield self.windows[i : i + self.batch_size]


# ------------------------------------------------------------------ Lightning
class DistillModule(L.LightningModule):
    """Teacher → fake-quant student distillation (see the module docstring)."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        hp: DistillHParams,
        layer_weights: Tensor,
        groups: dict[str, list[nn.Parameter]],
    ) -> None:
        super().__init__()
        self.student, self.teacher, self.hp = student, teacher, hp
        self.teacher.requires_grad_(False)
        self.groups = groups  # the trainable sets `prepare_qat` chose
        # (L,) Static weights are the stage's input, not state; reweighted ones are training state.
        self.register_buffer(
            "layer_w", layer_weights.float().clone(), persistent=hp.reweight_every is not None
        )
        self._layer_err: Tensor | None = None  # (L,) d_l summed over this step's micro-batches
        self.layer_w_history: list[dict] = []  # {"step", "weights"} at each reweighting
        # Checkpoints hold the student only; under DeepSpeed the frozen teacher and codes are
        # also left out of them (pipeline.lit.fit).
        self.strict_loading = False
        # Validation results: the input model's (the sanity check, step 0) and one per check.
        self.val_input: dict[str, float] | None = None
        self.val_history: list[dict[str, float]] = []
        self._val_sums: Tensor | None = None
        self._val_count = 0

    def on_fit_start(self) -> None:
        self.train()  # loaded models come in eval mode; Lightning does not switch them

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # no dropout or other train-mode behaviour in the reference
        return self

    def _outputs(self, model: nn.Module, batch: Tensor):
        attn = self.hp.beta > 0 and self.hp.match in ("attention", "both")
        hidden = self.hp.beta > 0 and self.hp.match in ("hidden", "both")
        return model(
            input_ids=batch, output_attentions=attn, output_hidden_states=hidden, use_cache=False
        )

    def losses(self, batch: Tensor) -> dict[str, Tensor]:
        """The loss terms on one batch of token windows (B, T)."""
        with torch.no_grad():
            t = self._outputs(self.teacher, batch)
        s = self._outputs(self.student, batch)
        t_hidden = t.hidden_states[1:] if t.hidden_states is not None else None
        s_hidden = s.hidden_states[1:] if s.hidden_states is not None else None
        return distill_loss(
            t.logits,
            s.logits,
            self.layer_w,
            self.hp.alpha,
            self.hp.beta,
            self.hp.temperature,
            t.attentions,
            s.attentions,
            t_hidden,
            s_hidden,
            self.hp.ce,
            batch,
        )

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        terms = self.losses(batch)
        per_layer = terms.pop("layers")
        self.log_dict({f"loss/{k}": v.detach() for k, v in terms.items()}, on_step=True)
        if self.hp.reweight_every:
            # The weights this step's loss used, one curve per layer.
            self.log_dict({f"distill/layer_w/{i}": w for i, w in enumerate(self.layer_w)})
            err = self._layer_err
            self._layer_err = per_layer if err is None else err + per_layer
        return terms["total"]

    def on_before_optimizer_step(self, optimizer) -> None:
        # Once per optimizer step, after backward (the loss's graph no longer holds layer_w) and
        # before any checkpoint of this step is written.
        err, self._layer_err = self._layer_err, None
        if err is None or (self.global_step + 1) % self.hp.reweight_every:
            return
        if self._trainer is not None:  # every rank calls this at the same step
            err = self.trainer.strategy.reduce(err, reduce_op="sum")
        if bool(torch.isfinite(err).all()):  # a non-finite step (the NaN guard's) keeps them
            self.layer_w.copy_(normalised(err))
            self.layer_w_history.append(
                {"step": self.global_step + 1, "weights": self.layer_w.tolist()}
            )

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Stopping at max_steps through `should_stop` makes Lightning validate the last step too,
        # whatever val_check_interval: the final weights are always a candidate.
        if 0 < self.trainer.max_steps <= self.global_step:
            self.trainer.should_stop = True

    def on_validation_epoch_start(self) -> None:
        self._val_sums, self._val_count = torch.zeros(3, dtype=torch.float64), 0

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        t = self.teacher(input_ids=batch, use_cache=False).logits  # (B, T, V)
        s = self.student(input_ids=batch, use_cache=False).logits
        self._val_sums += heldout_sums(t, s, batch).cpu()
        self._val_count += batch[:, 1:].numel()

    def on_validation_epoch_end(self) -> None:
        if not self._val_count:
            return
        nll, t_nll, kl = (self._val_sums / self._val_count).tolist()
        result = {"step": float(self.global_step), "nll": nll, "nll_teacher": t_nll, "kl": kl}
        if self.trainer.sanity_checking:
            if self.val_input is None:
                self.val_input = result
        else:
            self.val_history.append(result)
        # Identical on every rank (each scores every window): syncing averages equal numbers.
        self.log_dict(
            {"val/nll": nll, "val/ppl": math.exp(min(nll, 50.0)), "val/kl": kl}, sync_dist=True
        )

    def configure_optimizers(self):
        hp = self.hp
        spec = [
            ("scales", hp.lr, 0.0),
            ("weights", hp.weight_lr, hp.weight_decay),
            ("norms", hp.lr, 0.0),
            ("float", hp.float_lr, hp.weight_decay),
        ]
        param_groups = [
            {"params": self.groups[k], "lr": lr, "weight_decay": wd, "name": k}
            for k, lr, wd in spec
            if self.groups[k]
        ]
        # torch's AdamW, not DeepSpeed's fused one: no extension build, same on every strategy.
        opt = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), eps=1e-8)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: cosine_with_warmup(step, hp.warmup_steps, hp.max_steps)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict")
        if state is not None:  # (DeepSpeed writes its own module states)
            for key in [k for k in state if k.startswith("teacher.")]:
                del state[key]
        checkpoint["distill_val"] = {"input": self.val_input, "history": self.val_history}
        if self.hp.reweight_every:
            checkpoint["distill_layer_w"] = self.layer_w_history

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        val = checkpoint.get("distill_val", {})
        self.val_input = val.get("input", self.val_input)
        self.val_history = list(val.get("history", []))
        self.layer_w_history = list(checkpoint.get("distill_layer_w", []))


class DistillData(WindowData):
    """Step-indexed random training windows of the train split (`pipeline.lit.lm.RandomWindows`:
    a resumed run reads the batches the uninterrupted one would have), and optionally fixed
    validation windows `val` (W, T), scored whole on every rank."""

    def __init__(
        self,
        stream: Tensor,
        seq_len: int,
        batch_size: int,
        seed: int,
        val: Tensor | None = None,
    ) -> None:
        super().__init__(stream, seq_len, batch_size, seed)
        self.val = val

    def val_dataloader(self) -> DataLoader | list:
        if self.val is None:
            return []
        return DataLoader(HeldoutBatches(self.val, self.batch_size), batch_size=None)
