"""On-policy acceptance training of the draft: the reinforce stage's LightningModule and data.

Each step the draft proposes gamma tokens after a batch of scenario contexts, sampling at the
scheduled temperature T = T0 * (1 + 0.1 * cos(step / 1000)); the frozen target verifies them
exactly as speculative decoding would, and the draft learns from
:func:`pipeline.lit.losses.reinforce_loss` (policy gradient on the speculative reward, TVD on
the verified and on context positions, KL anchor to the starting draft; the trade-offs are
described there).

Dynamic strategy: each step's on-policy acceptance (the mean over ranks) feeds a sliding-window
monitor (:class:`pipeline.speculative.monitor.AcceptanceMonitor`, logged as ``alpha_window``);
when acceptance falls by more than ``lr_drop_threshold`` over the window, the learning rate is
multiplied by ``lr_drop_factor`` for the rest of the run (``monitor/lr_scale``). Non-finite steps
are the NaN/Inf guard's (:class:`pipeline.lit.guards.NanGuard`, a callback the stage adds).

A quantized draft (FakeQuantLinear layers) trains only its step sizes and zero points
(`pipeline.lit.qat.prepare_qat` with `scales`, as the distill stage does), a float draft every
weight (`load_draft`); the target and the reference draft are frozen and kept out of
checkpoints.

Validation (Lightning's loop, every `val_check_interval` steps and at the last step): the
teacher-forced expected acceptance alpha = mean over positions of sum_x min(p, q) = 1 - TVD(p, q)
of the draft against the target on fixed held-out prompts, averaged per scenario and then over
the scenarios (``val/alpha``, larger is better). It is deterministic (no sampling), so two
checkpoints are compared on exactly the same positions. Every rank scores every prompt. The
first validation is Lightning's sanity check before the first step: the starting draft's score
(``val_input``), kept in the checkpoints so a resumed run still knows it.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeline.lit.guards import scale_lr
from pipeline.lit.lm import batch_rows, cosine_with_warmup, next_batch, step_loader
from pipeline.lit.losses import LossWeights, reinforce_loss
from pipeline.lit.qat import prepare_qat
from pipeline.models.quantized import load_model
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.speculative.cost import measure_cost_ratio
from pipeline.speculative.metrics import expected_acceptance
from pipeline.speculative.monitor import AcceptanceMonitor
from pipeline.speculative.rewards import MovingAverageBaseline
from pipeline.speculative.schedule import draft_temperature

log = logging.getLogger(__name__)


class ScenarioBatches(IterableDataset):
    """Endless batches of equal-length contexts, one scenario per batch in turn.

    Batch k is a pure function of (seed, rank, k). Iteration yields the rows of batches
    ``start``, ``start`` + 1, ... (``step_loader`` groups them back), so a resumed run, whose
    loader starts at its restored step (:class:`ReinforceData`), sees the batches it would have
    seen. Contexts are prompt prefixes cut at a random point of the prompt's second half, so a
    few prompts give many contexts; ``long`` prompts stay whole so their contexts stay long.

    Args:
        prompts: {scenario: (N, L) token ids}.
        batch_size: contexts per batch.
        seed, rank: the randomness of this rank's stream.
        start: index of the first batch.
    """

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
    """Fixed validation batches ``(scenario, (B, L) token ids)``, every prompt once, in order.

    An IterableDataset, so Lightning does not shard it: every rank scores every prompt.
    """

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


class DraftReinforce(L.LightningModule):
    """The draft under on-policy acceptance training (see the module docstring).

    ``cost_ratio`` None measures c = draft/target step time when training starts.
    ``lr_drop_threshold`` None only monitors the windowed acceptance.
    Only ``draft`` is a registered submodule: the target and the frozen reference copy are held
    outside the module tree, so DDP neither broadcasts nor checkpoints them.
    """

    def __init__(
        self,
        draft,
        target,
        *,
        gamma: int,
        temperature: float,
        draft_t0: float,
        cost_ratio: float | None,
        weights: LossWeights,
        lr: float,
        warmup: int,
        max_steps: int,
        baseline_momentum: float,
        monitor_window: int,
        seed: int,
        context_positions: int,
        lr_drop_threshold: float | None = None,
        lr_drop_factor: float = 0.5,
    ):
        super().__init__()
        self.draft = draft
        reference = copy.deepcopy(draft).eval().requires_grad_(False)
        self._frozen = (target.eval().requires_grad_(False), reference)
        self.gamma, self.temperature, self.draft_t0 = gamma, temperature, draft_t0
        self.cost_ratio, self.weights, self.seed = cost_ratio, weights, seed
        self.context_positions = context_positions
        self.lr, self.warmup, self.max_steps = lr, warmup, max_steps
        self.baseline = MovingAverageBaseline(baseline_momentum)
        self.monitor = AcceptanceMonitor(monitor_window, lr_drop_threshold)
        self.lr_drop_factor = lr_drop_factor
        self.lr_scale = 1.0  # product of the monitor's lr drops
        # Validation results: the starting draft's (sanity check, step 0) and one per check.
        self.val_input: dict[str, float] | None = None
        self.val_history: list[dict[str, float]] = []
        self._val: dict[str, list[float]] = {}

    def on_fit_start(self) -> None:
        self.draft.train()  # loaded models come in eval mode; Lightning does not switch them
        for model in self._frozen:
            model.to(self.device)
        if self.cost_ratio is None:
            # Measured once, on the training device, by rank 0 for everyone; a resumed run
            # restores it from the checkpoint, so the reward never changes meaning mid-run.
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
            draft_temp=draft_temperature(step, self.draft_t0),
            cost_ratio=self.cost_ratio,
            weights=self.weights,
            advantages=self._advantages,
            context_positions=self.context_positions,
            generator=gen,
        )
        if self._monitor(stats["alpha"]):
            self.lr_scale *= self.lr_drop_factor
            scale_lr(self.trainer, self.lr_drop_factor)
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
        _, beta = expected_acceptance(p_logits, q_logits.to(p_logits.device), self.temperature)
        sums = self._val.setdefault(name, [0.0, 0])
        sums[0] += beta.double().sum().item()
        sums[1] += beta.numel()

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        per_scenario = {name: total / count for name, (total, count) in self._val.items()}
        alpha = sum(per_scenario.values()) / len(per_scenario)  # scenarios weigh alike
        result = {"step": float(self.global_step), "alpha": alpha} | {
            f"alpha_{name}": a for name, a in per_scenario.items()
        }
        if self.trainer.sanity_checking:
            if self.val_input is None:
                self.val_input = result
        else:
            self.val_history.append(result)
        # Identical on every rank (each scores every prompt): syncing averages equal numbers.
        self.log_dict({f"val/{k}": v for k, v in result.items() if k != "step"}, sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cosine_with_warmup(s, self.warmup, self.max_steps)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

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
