"""Precision-aware distillation: a fake-quant student learns from its frozen FP teacher.

The teacher is a submodule so ZeRO-3 shards it, frozen and out of checkpoints; every rank scores
every validation window. `reweight_every` = N resets the layer weights every N steps to that
step's normalised per-layer distances (summed over ranks; a persistent buffer, kept on resume).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from pipeline.config import positive
from pipeline.errors import ConfigError, LowbitError
from pipeline.lit.config import TrainConfig
from pipeline.lit.keep import KeepConfig
from pipeline.lit.lm import WindowData, scheduled
from pipeline.lit.losses import distill_loss, normalised
from pipeline.lit.qat import keep_full_precision, prepare_qat, train_sets_problem

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DistillHParams:
    """What the training reads of `stage.distill` (the stage's DistillConfig extends it)."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=2e-3, warmup=30))
    weight_lr: float = 1e-5  # latent weights, when `weights` trains (train.lr: scales, norms)
    float_lr: float = 2e-3  # embeddings and lm_head, when `float` trains
    weight_decay: float = 0.0
    # `weights` made the default target worse at every lr tried (`bench/distill_effect.py`).
    trainable: list[str] = field(default_factory=lambda: ["scales", "norms", "float"])
    alpha: float = 1.0  # weight of KL(p_teacher || p_student) at temperature tau
    beta: float = 0.1  # weight of the per-layer matching term (0 disables it)
    temperature: float = 1.0  # tau
    # Off: CE on the training tokens continues pre-training instead of recovering quant error.
    ce: float = 0.0
    match: Literal["attention", "hidden", "both"] = "attention"
    reweight_every: int | None = None  # optimizer steps between layer reweightings; null: static
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"
    fp32_modules: list[str] = field(default_factory=lambda: ["lm_head", "norm"])  # under bf16
    # Recompute each block in the backward: the student keeps one block's dequantized weights
    # and activations instead of every block's (what a 70B student needs), for ~1/3 more compute.
    activation_checkpointing: bool = False
    keep: KeepConfig = field(default_factory=KeepConfig)  # when the best check replaces the input

    @property
    def eager_attention(self) -> bool:
        """Attention maps are matched: both models need eager attention to return them."""
        return self.beta > 0 and self.match != "hidden"

    def check(self, prefix: str) -> None:
        positive(prefix, weight_lr=self.weight_lr, float_lr=self.float_lr)
        positive(prefix, temperature=self.temperature, reweight_every=self.reweight_every)
        if self.reweight_every is not None and self.beta == 0:
            raise ConfigError(
                f"{prefix}.reweight_every",
                f"={self.reweight_every} with beta=0",
                "beta > 0 (the weights scale the matching term), or reweight_every=null",
            )
        problem = train_sets_problem(list(self.trainable))
        if problem:
            raise ConfigError(f"{prefix}.trainable", f"is {list(self.trainable)}", problem)
        terms = {"alpha": self.alpha, "beta": self.beta, "ce": self.ce}
        negative = [k for k, v in terms.items() if v < 0]
        if negative or not any(terms.values()):
            key = (negative or ["alpha"])[0]  # the negative weight, else the KL's
            raise ConfigError(
                f"{prefix}.{key}",
                f"is {terms[key]} (alpha={self.alpha}, beta={self.beta}, ce={self.ce})",
                "all three >= 0 and not all 0",
            )
        if self.weight_decay < 0:
            raise ConfigError(f"{prefix}.weight_decay", f"must be >= 0, got {self.weight_decay}")


def load_student(model_dir: Path, hp: DistillHParams):
    """The fake-quant student: exact quantize-stage weights, trainable sets, gradient scales."""
    from pipeline.models.quantized import load_quantized, quantized_modules

    student = load_quantized(model_dir, learn_weights="weights" in hp.trainable)
    if not quantized_modules(student):
        raise LowbitError(f"{model_dir} has no quantized linear: nothing to distill")
    groups = prepare_qat(student, hp.trainable, hp.train.quant_grad_scale)
    keep_full_precision(student, hp.fp32_modules)
    if hp.activation_checkpointing:
        recompute_blocks(student)
    if hp.eager_attention:
        student.set_attn_implementation("eager")
    return student, groups


def recompute_blocks(model: nn.Module) -> None:
    """transformers' per-block activation checkpointing (non-reentrant: frozen inputs are fine)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_pair(model_dir: Path, target_dir: Path, hp: DistillHParams, allow_bin: bool):
    """The student (`load_student`) and its frozen FP teacher, in `hp.teacher_dtype`."""
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


def window_sums(teacher_logits: Tensor, student_logits: Tensor, ids: Tensor) -> Tensor:
    """Per window: student NLL, teacher NLL and KL(teacher ‖ student) summed over its
    next-token positions. # (B, 3)"""
    target = ids[:, 1:, None]  # (B, T-1, 1)
    log_t = teacher_logits[:, :-1].float().log_softmax(-1)  # (B, T-1, V)
    log_s = student_logits[:, :-1].float().log_softmax(-1)
    s_nll = -log_s.gather(-1, target).sum((1, 2))  # (B,)
    t_nll = -log_t.gather(-1, target).sum((1, 2))
    kl = (log_t.exp() * (log_t - log_s)).sum((1, 2))
    return torch.stack([s_nll, t_nll, kl], dim=1).double()


class HeldoutBatches(IterableDataset):
    """Fixed batches of held-out windows (W, T); iterable, so unsharded: every rank scores all."""

    def __init__(self, windows: Tensor, batch_size: int) -> None:
        self.windows, self.batch_size = windows, batch_size

    def __iter__(self):
        for i in range(0, self.windows.shape[0], self.batch_size):
            yield self.windows[i : i + self.batch_size]


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
        # Checkpoints hold the student only (under DeepSpeed, without the frozen codes either).
        self.strict_loading = False
        # Validation results: the input model's (the sanity check, step 0) and one per check.
        self.val_input: dict[str, float] | None = None
        self.val_history: list[dict[str, float]] = []
        self._val_sums: list[Tensor] = []  # (B, 3) per validation batch

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
            self.log_dict({f"distill/layer_w/{i}": w for i, w in enumerate(self.layer_w)})
            err = self._layer_err
            self._layer_err = per_layer if err is None else err + per_layer
        return terms["total"]

    def on_before_optimizer_step(self, optimizer) -> None:
        # After backward (the graph no longer holds layer_w), before this step's checkpoint.
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
        # `should_stop` at max_steps makes Lightning validate the last step: always a candidate.
        if 0 < self.trainer.max_steps <= self.global_step:
            self.trainer.should_stop = True

    def on_validation_epoch_start(self) -> None:
        self._val_sums = []

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        t = self.teacher(input_ids=batch, use_cache=False).logits  # (B, T, V)
        s = self.student(input_ids=batch, use_cache=False).logits
        self._val_sums.append(window_sums(t, s, batch).cpu() / (batch.shape[1] - 1))

    def on_validation_epoch_end(self) -> None:
        if not self._val_sums:
            return
        per_window = torch.cat(self._val_sums)  # (W, 3) per-token means; windows are equal length
        nll, t_nll, kl = per_window.mean(0).tolist()
        result = {"step": float(self.global_step), "nll": nll, "nll_teacher": t_nll, "kl": kl}
        # The keep decision pairs these with the input's, window by window (`pipeline.lit.keep`).
        result["windows"] = per_window[:, 0].tolist()
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
            ("scales", hp.train.lr, 0.0),
            ("weights", hp.weight_lr, hp.weight_decay),
            ("norms", hp.train.lr, 0.0),
            ("float", hp.float_lr, hp.weight_decay),
        ]
        param_groups = [
            {"params": self.groups[k], "lr": lr, "weight_decay": wd, "name": k}
            for k, lr, wd in spec
            if self.groups[k]
        ]
        # torch's AdamW, not DeepSpeed's fused one: no extension build, same on every strategy.
        opt = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), eps=1e-8)
        return scheduled(opt, hp.train)

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
    """Step-indexed training windows and, optionally, fixed validation windows `val` (W, T)."""

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
