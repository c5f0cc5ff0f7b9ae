"""On-policy acceptance training of the draft: the reinforce stage's LightningModule and data.

The draft proposes gamma tokens at temperature T = T0 * (1 + 0.1 * cos(step / 1000)), the frozen
target verifies them at the serving temperature (greedily at 0), and the draft learns from
:func:`pipeline.lit.losses.reinforce_loss`; a windowed acceptance monitor lowers the lr when
acceptance falls. A quantized draft trains only its step sizes and zero points. Validation, per
scenario then averaged (deterministic, so checkpoints are compared on the same positions):
teacher-forced alpha = mean sum_x min(p, q) and greedy match = the share of positions where the
draft's argmax is the target's; checkpoints are compared on the serving mode's (match at T = 0).
"""

from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeline.config import positive
from pipeline.errors import ConfigError
from pipeline.lit.config import TrainConfig
from pipeline.lit.fit import best_weights
from pipeline.lit.guards import scale_lr
from pipeline.lit.keep import KeepConfig
from pipeline.lit.lm import batch_rows, next_batch, scheduled, step_loader
from pipeline.lit.losses import LossWeights, reinforce_loss
from pipeline.lit.qat import prepare_qat
from pipeline.models.hf import save_hf
from pipeline.models.quantized import (
    is_quantized_dir,
    load_model,
    read_quant_meta,
    save_quantized_model,
)
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.speculative.cost import measure_cost_ratio
from pipeline.speculative.metrics import align_vocab, expected_acceptance
from pipeline.speculative.monitor import AcceptanceMonitor
from pipeline.speculative.rewards import MovingAverageBaseline
from pipeline.speculative.schedule import draft_temperature

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReinforceHParams:
    """What the training reads of `stage.reinforce` (the stage's ReinforceConfig extends it)."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=3e-3, warmup=10))
    gamma: int = 4  # draft tokens proposed per context
    # The decoding temperature the draft is trained, selected and measured for (0: greedy);
    # the defaults node links it to stage.evaluate.temperature (the stage's LINKED).
    serve_temperature: float = 1.0
    greedy_margin: float = 1.0  # nats of log-odds the greedy term asks of the target's argmax
    draft_t0: float = 1.0  # T0 of the draft sampling schedule
    w_acceptance: float = 0.7
    w_throughput: float = 0.3
    baseline_momentum: float = 0.9
    pg_weight: float = 0.1
    tvd_weight: float = 1.0
    kl_weight: float = 0.05  # anchor to the starting draft
    context_tvd_weight: float = 4.0  # DistillSpec's fixed-data term on context positions
    context_positions: int = 64
    # c = draft/target step time of the reward; null: measured once (kept for a resume).
    cost_ratio: float | None = None
    # Window of the acceptance monitor; its halves hold equal batches of each scenario.
    monitor_window: int = 64
    lr_drop_threshold: float | None = 0.05  # null: monitor only
    lr_drop_factor: float = 0.5
    keep: KeepConfig = field(default_factory=KeepConfig)  # when the best check replaces the input

    @property
    def selection_key(self) -> str:
        """The validation metric checkpoints and the keep decision compare: the serving mode's."""
        return "greedy_match" if self.serve_temperature == 0 else "alpha"

    @property
    def alpha_temperature(self) -> float:
        """Where validation measures alpha: serving greedily, at T = 1 (alpha(0) is the match)."""
        return self.serve_temperature or 1.0

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(
            pg=self.pg_weight,
            tvd=self.tvd_weight,
            kl=self.kl_weight,
            w_acceptance=self.w_acceptance,
            w_throughput=self.w_throughput,
            context_tvd=self.context_tvd_weight,
        )

    def check(self, prefix: str) -> None:
        positive(prefix, gamma=self.gamma, draft_t0=self.draft_t0, cost_ratio=self.cost_ratio)
        if not self.serve_temperature >= 0:
            raise ConfigError(
                f"{prefix}.serve_temperature",
                f"is {self.serve_temperature}",
                ">= 0 (0: greedy serving; it follows stage.evaluate.temperature by default)",
            )
        weights = ("w_acceptance", "w_throughput", "pg_weight", "tvd_weight", "kl_weight")
        for key in (*weights, "context_tvd_weight", "context_positions", "greedy_margin"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{prefix}.{key}", f"must be >= 0, got {getattr(self, key)}")
        ranges = (
            ("monitor_window", self.monitor_window >= 2, ">= 2"),
            ("lr_drop_threshold", (self.lr_drop_threshold or 0) >= 0, ">= 0, or null"),
            ("lr_drop_factor", 0 < self.lr_drop_factor <= 1, "0 < lr_drop_factor <= 1"),
            ("baseline_momentum", 0 <= self.baseline_momentum < 1, "0 <= baseline_momentum < 1"),
        )
        for key, ok, allowed in ranges:
            if not ok:
                raise ConfigError(f"{prefix}.{key}", f"is {getattr(self, key)}", allowed)


class ScenarioBatches(IterableDataset):
    """Endless batches of equal-length contexts, one scenario per batch in turn; batch k is a
    pure function of (seed, rank, k), so a resumed run reads the batches it would have read."""

    def __init__(
        self,
        prompts: dict[str, torch.Tensor],
        batch_size: int,
        seed: int,
        rank: int = 0,
        start: int = 0,
    ):
        self.prompts = {k: torch.as_tensor(v, dtype=torch.long) for k, v in prompts.items()}
        self.names = list(self.prompts)
        self.batch_size, self.seed, self.rank, self.start = batch_size, seed, rank, start

    def batch(self, k: int) -> torch.Tensor:
        name = self.names[k % len(self.names)]
        pool = self.prompts[name]  # (N, L)
        rng = np.random.default_rng([self.seed, self.rank, k])
        rows = torch.from_numpy(rng.integers(0, pool.shape[0], self.batch_size))
        length = pool.shape[1]
        if name != "long":
            length = int(rng.integers(max(2, length // 2), length + 1))
        return pool[rows, :length]

    def __iter__(self):
        return batch_rows(self.batch, self.start)


class ScenarioPrompts(IterableDataset):
    """Fixed validation batches ``(scenario, (B, L) ids)``; iterable, so every rank scores all."""

    def __init__(self, prompts: dict[str, torch.Tensor], batch_size: int):
        self.prompts = {k: torch.as_tensor(v, dtype=torch.long) for k, v in prompts.items()}
        self.batch_size = batch_size

    def __iter__(self):
        for name, pool in self.prompts.items():
            for i in range(0, pool.shape[0], self.batch_size):
                yield name, pool[i : i + self.batch_size]


class ReinforceData(L.LightningDataModule):
    """Training contexts (:class:`ScenarioBatches`, each rank its own stream, from the trainer's
    restored step) and the fixed validation prompts (:class:`ScenarioPrompts`, None: none)."""

    def __init__(
        self,
        train: dict[str, torch.Tensor],
        val: dict[str, torch.Tensor] | None,
        batch_size: int,
        seed: int,
    ) -> None:
        super().__init__()
        self.train, self.val, self.batch_size, self.seed = train, val, batch_size, seed

    def train_dataloader(self):
        t = self.trainer
        batches = ScenarioBatches(
            self.train, self.batch_size, self.seed, t.global_rank, start=next_batch(t)
        )
        return step_loader(batches, self.batch_size)

    def val_dataloader(self):
        if self.val is None:
            return []
        return DataLoader(ScenarioPrompts(self.val, self.batch_size), batch_size=None)


def load_draft(path: Path, allow_bin: bool, grad_scale: str) -> torch.nn.Module:
    """The draft at `path`, ready to train: a quantized draft's grid only (`prepare_qat` with
    `scales`: step sizes and zero points, codes frozen), or every weight of a float draft."""
    draft = load_model(path, allow_bin)
    if any(isinstance(m, FakeQuantLinear) for m in draft.modules()):
        prepare_qat(draft, ["scales"], grad_scale)
    else:
        draft.requires_grad_(True)
    return draft


def result_draft(
    fit, draft_dir: Path, allow_bin: bool, grad_scale: str, key: str = "alpha"
) -> torch.nn.Module:
    """A fresh copy of the starting draft: kept as is, or given the best checkpoint's tensors
    (whatever the strategy did to the trained module, e.g. ZeRO-3 partitions); `key`: the
    validation metric the decision compared."""
    if not fit.kept:
        return best_weights(fit, "draft.", lambda: load_draft(draft_dir, allow_bin, grad_scale))
    log.warning(
        "reinforce: no checkpoint beat the starting draft beyond the validation noise (best "
        "teacher-forced %s %.4f at step %d vs %.4f before training; %s): keeping it unchanged",
        key,
        fit.chosen[key],
        fit.chosen["step"],
        fit.before[key],
        fit.margin.text(),
    )
    return load_model(draft_dir, allow_bin)


def save_draft(draft, draft_dir: Path, out: Path, kept: bool, tokenizer) -> None:
    """`draft/`: the input byte for byte when kept, else in the input's representation."""
    if kept and is_quantized_dir(draft_dir):
        shutil.copytree(draft_dir, out)
    elif is_quantized_dir(draft_dir):
        save_quantized_model(draft.cpu(), out, draft_dir, read_quant_meta(draft_dir)["method"])
    else:
        save_hf(draft.cpu(), tokenizer, out)


class DraftReinforce(L.LightningModule):
    """The draft under on-policy acceptance training (see the module docstring)."""

    def __init__(self, draft, target, hp: ReinforceHParams, seed: int):
        super().__init__()
        self.draft, self.hp, self.seed = draft, hp, seed
        reference = copy.deepcopy(draft).eval().requires_grad_(False)
        # Outside the module tree: DDP neither broadcasts nor checkpoints them.
        self._frozen = (target.eval().requires_grad_(False), reference)
        self.gamma, self.temperature = hp.gamma, hp.serve_temperature
        self.cost_ratio = hp.cost_ratio
        self.weights = hp.loss_weights
        self.baseline = MovingAverageBaseline(hp.baseline_momentum)
        self.monitor = AcceptanceMonitor(hp.monitor_window, hp.lr_drop_threshold)
        self.lr_scale = 1.0  # product of the monitor's lr drops
        # Validation results: the starting draft's (sanity check, step 0) and one per check.
        self.val_input: dict[str, float] | None = None
        self.val_history: list[dict[str, float]] = []
        # scenario -> metric ("alpha", "greedy_match") -> one value per validation prompt
        self._val: dict[str, dict[str, list[float]]] = {}

    def on_fit_start(self) -> None:
        self.draft.train()  # loaded models come in eval mode; Lightning does not switch them
        for model in self._frozen:
            model.to(self.device)
        if self.cost_ratio is None:
            # Once, by rank 0 for all; restored on resume, so the reward keeps its meaning.
            c = (
                measure_cost_ratio(self._frozen[0], self.draft, n_iters=30)
                if self.global_rank == 0
                else None
            )
            self.cost_ratio = float(self.trainer.strategy.broadcast(c, src=0))
            log.info("reinforce: measured cost ratio c = %.4f on %s", self.cost_ratio, self.device)

    def _advantages(self, reward: torch.Tensor) -> torch.Tensor:
        """Advantages against one baseline shared by all ranks (the mean over every rank)."""
        if self.trainer.world_size == 1:
            return self.baseline.advantages(reward)
        every = self.all_gather(reward)  # (W, B)
        return self.baseline.advantages(every.flatten()).view_as(every)[self.global_rank]

    def training_step(self, batch: torch.Tensor, _):
        target, reference = self._frozen
        step = self.global_step
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + self.global_rank * 10_007 + step)
        loss, stats = reinforce_loss(
            target,
            self.draft,
            reference,
            batch,
            gamma=self.gamma,
            temperature=self.temperature,
            draft_temp=draft_temperature(step, self.hp.draft_t0),
            cost_ratio=self.cost_ratio,
            weights=self.weights,
            advantages=self._advantages,
            context_positions=self.hp.context_positions,
            generator=gen,
            greedy_margin=self.hp.greedy_margin,
        )
        if self._monitor(stats["alpha"]):
            self.lr_scale *= self.hp.lr_drop_factor
            scale_lr(self.trainer, self.hp.lr_drop_factor)
            log.warning(
                "reinforce: acceptance fell by more than %.3g over the last %d steps (step %d): "
                "learning rate now %.3gx",
                self.monitor.threshold,
                self.monitor.values.maxlen,
                step,
                self.lr_scale,
            )
        stats["alpha_window"] = self.monitor.mean
        stats["monitor/lr_scale"] = self.lr_scale
        self.log_dict(stats, prog_bar=False, sync_dist=False)
        self.log("train_loss", loss.detach(), prog_bar=True)
        return loss

    def _monitor(self, alpha: float) -> bool:
        """Feed the monitor the acceptance averaged over ranks, so every rank decides alike."""
        if self.trainer.world_size > 1:
            alpha = float(self.all_gather(torch.tensor(float(alpha), device=self.device)).mean())
        return self.monitor.update(alpha)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Stopping at max_steps through `should_stop` makes Lightning validate the last step too.
        if 0 < self.trainer.max_steps <= self.global_step:
            self.trainer.should_stop = True

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def validation_step(self, batch, _) -> None:
        name, ids = batch  # ids (B, L)
        p_logits = self._frozen[0](input_ids=ids).logits  # (B, L, V_p)
        q_logits = self.draft(input_ids=ids).logits  # (B, L, V_q)
        p_logits, q_logits = align_vocab(p_logits, q_logits.to(p_logits.device))
        _, beta = expected_acceptance(p_logits, q_logits, self.hp.alpha_temperature)
        match = (p_logits.argmax(-1) == q_logits.argmax(-1)).double()  # (B, L)
        # One value per prompt (a scenario's prompts are equally long: its mean is theirs).
        per = self._val.setdefault(name, {"alpha": [], "greedy_match": []})
        per["alpha"].extend(beta.double().mean(1).tolist())
        per["greedy_match"].extend(match.mean(1).tolist())

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        result: dict = {"step": float(self.global_step)}
        for metric in ("alpha", "greedy_match"):
            per_scenario = {name: _mean(v[metric]) for name, v in self._val.items()}
            result[metric] = _mean(per_scenario.values())  # scenarios weigh alike
            result |= {f"{metric}_{name}": a for name, a in per_scenario.items()}
        # The serving mode's scores, paired prompt by prompt with the input's; grouped by
        # scenario, as the mean weighs them.
        key = self.hp.selection_key
        result["windows"] = [a for per in self._val.values() for a in per[key]]
        result["window_groups"] = [i for i, per in enumerate(self._val.values()) for _ in per[key]]
        if self.trainer.sanity_checking:
            if self.val_input is None:
                self.val_input = result
        else:
            self.val_history.append(result)
        # Identical on every rank (each scores every prompt): syncing averages equal numbers.
        logged = {f"val/{k}": v for k, v in result.items() if isinstance(v, float) and k != "step"}
        self.log_dict(logged, sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hp.train.lr, weight_decay=0.0, betas=(0.9, 0.95))
        return scheduled(opt, self.hp.train)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["reinforce"] = {
            "baseline": self.baseline.state_dict(),
            "monitor": self.monitor.state_dict(),
            "lr_scale": self.lr_scale,
            "cost_ratio": self.cost_ratio,
            "val_input": self.val_input,
            "val_history": self.val_history,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("reinforce", {})
        if "baseline" in state:
            self.baseline.load_state_dict(state["baseline"])
        if "monitor" in state:
            self.monitor.load_state_dict(state["monitor"])
        self.lr_scale = state.get("lr_scale", 1.0)
        if state.get("cost_ratio") is not None:
            self.cost_ratio = state["cost_ratio"]
        self.val_input = state.get("val_input", self.val_input)
        self.val_history = list(state.get("val_history", []))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
