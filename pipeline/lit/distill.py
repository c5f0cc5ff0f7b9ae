"""Precision-aware distillation: a fake-quant student learns from its frozen FP teacher.

The student is the quantized model with every quantized linear a FakeQuantLinear (straight-
through estimator); the teacher is the FP model. Both see the same windows; the loss is
`pipeline.quant.losses.distill_loss` (α·KL at temperature τ + β·Σ_l w_l·d_l). What trains is a
choice (EfficientQAT's finding is that step sizes alone recover most of the gap at a fraction of
the memory): `scales` (scale/zero of every quantized linear, codes frozen), `weights` (also the
latent weights, codes re-derived by rounding) and `norms` (also the RMSNorm gains).

The teacher is a registered submodule so that DeepSpeed ZeRO-3 shards it like the student (a
70B teacher does not fit one device); it stays frozen and in eval mode, and its tensors are
dropped from Lightning checkpoints (it is reloaded from the FP checkpoint on resume).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from pipeline.lit.lm import RandomWindows, cosine_with_warmup
from pipeline.quant.fakequant import FakeQuantLinear, grad_scale_factor
from pipeline.quant.losses import distill_loss

TRAINABLE = ("scales", "weights", "norms")


@dataclass(frozen=True)
class DistillHParams:
    """Optimisation and loss settings of one distillation run."""

    max_steps: int
    lr: float = 1e-4
    weight_lr: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    alpha: float = 1.0
    beta: float = 1.0
    temperature: float = 1.0
    match: str = "attention"  # attention | hidden | both


# ------------------------------------------------------------------ student set-up
def set_trainable(student: nn.Module, train: list[str]) -> dict[str, list[nn.Parameter]]:
    """Freeze the student except the chosen sets; returns {set: its parameters}."""
    unknown = set(train) - set(TRAINABLE)
    if unknown or "scales" not in train:
        raise ValueError(f"train={train}: must contain 'scales' and only {', '.join(TRAINABLE)}")
    student.requires_grad_(False)
    groups: dict[str, list[nn.Parameter]] = {k: [] for k in TRAINABLE}
    for module in student.modules():
        if isinstance(module, FakeQuantLinear):
            groups["scales"] += [p for p in (module.scale, module.zero) if p is not None]
            if "weights" in train:
                groups["weights"] += [p for p in (module.weight, module.bias) if p is not None]
        elif "norms" in train and "norm" in type(module).__name__.lower():
            groups["norms"] += list(module.parameters(recurse=False))
    for params in groups.values():
        for p in params:
            p.requires_grad_(True)
    return groups


def apply_grad_scale(student: nn.Module, mode: str) -> dict[str, float]:
    """Give every FakeQuantLinear its scale/zero gradient factor; returns {name: factor}."""
    factors = {}
    for name, m in student.named_modules():
        if isinstance(m, FakeQuantLinear):
            factors[name] = grad_scale_factor(mode, m.fmt, m.out_features * m.in_features)
            m.set_grad_scale(factors[name])
    return factors


def _fp32_forward(forward, module: nn.Module):
    def wrapped(*args, **kwargs):
        p = next(module.parameters(), None)
        dtype = p.dtype if p is not None else torch.float32

        def cast(x):
            return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

        with torch.autocast(device_type=p.device.type if p is not None else "cpu", enabled=False):
            return forward(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    return wrapped


def keep_full_precision(model: nn.Module, patterns: list[str]) -> list[str]:
    """Run modules matching `patterns` outside autocast, in their parameters' dtype.

    A pattern matches a module when it is a substring of the module's own name (`norm` matches
    `input_layernorm` and `model.norm`) or an fnmatch pattern of its full name. Under bf16
    autocast this keeps e.g. the lm_head's logits (the KL's input) and the norms in fp32.
    Returns the matched names (children of a matched module are covered by it).
    """
    matched: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(m + ".") for m in matched):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if any(p in leaf or fnmatch.fnmatch(name, p) for p in patterns):
            module.forward = _fp32_forward(module.forward, module)
            matched.append(name)
    return matched


# ------------------------------------------------------------------ Lightning
class DistillModule(L.LightningModule):
    """Teacher → fake-quant student distillation (see the module docstring)."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        hp: DistillHParams,
        layer_weights: Tensor,
        train: list[str],
    ) -> None:
        super().__init__()
        self.student, self.teacher, self.hp = student, teacher, hp
        self.teacher.requires_grad_(False)
        self.groups = set_trainable(student, train)
        self.register_buffer("layer_w", layer_weights.float(), persistent=False)  # (L,)
        self.strict_loading = False  # checkpoints hold the student only

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
        )

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        terms = self.losses(batch)
        self.log_dict({f"loss/{k}": v.detach() for k, v in terms.items()}, on_step=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True)
        return terms["total"]

    def configure_optimizers(self):
        hp = self.hp
        spec = [
            ("scales", hp.lr, 0.0),
            ("weights", hp.weight_lr, hp.weight_decay),
            ("norms", hp.lr, 0.0),
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


class DistillData(L.LightningDataModule):
    """Random training windows of the corpus's train split (seeded, identical on every rank)."""

    def __init__(
        self, stream: Tensor, seq_len: int, batch_size: int, samples: int, seed: int
    ) -> None:
        super().__init__()
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.samples, self.seed = samples, seed

    def train_dataloader(self) -> DataLoader:
        ds = RandomWindows(self.stream, self.seq_len, self.samples, self.seed)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=0)
