"""On-policy acceptance training of the draft: the reinforce stage's loss and LightningModule.

Each step the draft proposes gamma tokens after a batch of scenario contexts, sampling at the
scheduled temperature T = T0 * (1 + 0.1 * cos(step / 1000)); the frozen target verifies them
exactly as speculative decoding would (:func:`pipeline.spec.rollout.draft_rollout`). The loss
(terms from :mod:`pipeline.spec.rewards`) is

    pg_weight * -(A * sum_k log q_T(x_k))             A = R - moving baseline,
  + tvd_weight * TVD(p, q) on the verified positions   (= 1 - expected acceptance there),
  + context_tvd_weight * TVD(p, q) on K context positions (teacher-forced),
  + kl_weight * KL(q || q_start)                        (anchor to the starting draft),

with R = w_a * accepted / gamma + w_t * (accepted + 1) / ((gamma * c + 1) * (gamma + 1)).
Verified positions are the accepted ones plus the first rejection: position k is verified with
probability prod_{j<k} beta_j, so averaging the TVD gradient over them is an unbiased estimate
of sum_k P(reach k) * grad beta_k, the direct (pathwise) part of the gradient of the expected
accepted length; the policy-gradient term carries the part through the sampled tokens. Tokens
after the first rejection influence no reward and are left out of both terms (pure variance).

Trade-off: the TVD term alone is on-policy distillation (DistillSpec); the reward adds what it
cannot see (acceptance compounding along the block, the draft's cost), at the price of a noisy
gradient, hence the baseline and the small default weight of the KL anchor. The on-policy terms
see at most gamma positions per context; the context term is DistillSpec's fixed-data half: the
same TVD on K random positions of the scenario text itself, teacher-forced, whose target logits
come from the verification forward (no extra target pass). It gives the small draft K/gamma
times more signal per step, on the text it will be asked to continue.

A quantized draft (FakeQuantLinear layers) trains only its step sizes and zero points, as the
distill stage does; the target and the reference draft are frozen and kept out of checkpoints.

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
import inspect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeline.lit.lm import batch_rows, cosine_with_warmup, next_batch, step_loader
from pipeline.spec.cost import measure_cost_ratio
from pipeline.spec.metrics import expected_acceptance
from pipeline.spec.rewards import (
    MovingAverageBaseline,
    draft_temperature,
    kl_to_reference,
    policy_gradient_loss,
    sampled_logprobs,
    speculative_reward,
    tvd_loss,
)
from pipeline.spec.rollout import draft_rollout

log = logging.getLogger("lowbit")


@dataclass(frozen=True)
class LossWeights:
    pg: float = 0.1
    tvd: float = 1.0
    kl: float = 0.05
    w_acceptance: float = 0.7
    w_throughput: float = 0.3
    context_tvd: float = 0.0


def logits_at(model: torch.nn.Module, sequences: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logits of ``sequences`` (B, S) at the positions ``rows`` (K,) -> (B, K, V)."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        # Only these rows go through the vocabulary projection.
        return model(input_ids=sequences, logits_to_keep=rows.to(sequences.device)).logits
    return model(input_ids=sequences).logits[:, rows.to(sequences.device)]


def proposal_logits(model: torch.nn.Module, sequences: torch.Tensor, gamma: int) -> torch.Tensor:
    """Logits predicting the last gamma tokens of ``sequences`` (B, T + G) -> (B, G, V)."""
    s = sequences.shape[1]
    return logits_at(model, sequences, torch.arange(s - gamma - 1, s - 1))


def reinforce_loss(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    reference: torch.nn.Module,
    contexts: torch.Tensor,
    *,
    gamma: int,
    temperature: float,
    draft_temp: float,
    cost_ratio: float,
    weights: LossWeights,
    advantages: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator | None = None,
    context_positions: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One on-policy round on ``contexts`` (B, T) and the loss of the module docstring.

    Args:
        advantages: rewards (B,) -> advantages (B,), e.g. ``MovingAverageBaseline.advantages``.
        context_positions: K, the context positions (drawn from ``generator``, the same for
            every row) of the context TVD term; used when ``weights.context_tvd`` > 0.

    Returns:
        (loss with gradient into ``draft``, detached statistics for logging).
    """
    t = contexts.shape[1]
    rows = None  # (K,) context positions of the context term, each predicting the next token
    if weights.context_tvd > 0 and context_positions > 0 and t > 1:
        device = generator.device if generator is not None else "cpu"
        perm = torch.randperm(t - 1, generator=generator, device=device)
        rows = perm[:context_positions].sort().values.cpu()
    ro = draft_rollout(
        target,
        draft,
        contexts,
        gamma,
        temperature=temperature,
        draft_temperature=draft_temp,
        generator=generator,
        context_positions=rows,
    )
    ver = ro.verification
    # (B, G) positions whose acceptance test ran: the accepted prefix and the first rejection.
    mask = torch.arange(gamma, device=ver.n_verified.device) < ver.n_verified[:, None]
    # One draft forward (with grad) for the context rows, if any, and the proposals.
    proposed = torch.arange(t - 1, t + gamma - 1)
    keep = proposed if rows is None else torch.cat([rows, proposed])
    q_all = logits_at(draft, ro.sequences, keep)  # (B, K + G, V_q)
    q_logits = q_all[:, -gamma:]
    context_tvd = (
        torch.zeros((), device=q_all.device)
        if rows is None
        else tvd_loss(ro.p_context.to(q_all.device), q_all[:, :-gamma], None, temperature)
    )
    with torch.no_grad():
        ref_logits = proposal_logits(reference, ro.sequences, gamma)
    vocab = min(q_logits.shape[-1], ro.p_logits.shape[-1])  # proposals come from the shared rows
    reward = speculative_reward(
        ver.n_accepted, gamma, cost_ratio, weights.w_acceptance, weights.w_throughput
    )  # (B,)
    adv = advantages(reward)
    logq = sampled_logprobs(q_logits[..., :vocab], ro.tokens.to(q_logits.device), draft_temp)
    pg = policy_gradient_loss(logq, adv.to(logq.device), mask)
    tvd = tvd_loss(ro.p_logits[:, :gamma].to(q_logits.device), q_logits, mask, temperature)
    kl = kl_to_reference(q_logits, ref_logits, mask)
    loss = weights.pg * pg + weights.tvd * tvd + weights.kl * kl + weights.context_tvd * context_tvd
    stats = {
        "reward": reward.mean().item(),
        "acceptance": ver.n_accepted.float().mean().item() / gamma,
        "alpha": (ver.beta * mask).sum().item() / mask.sum().clamp_min(1).item(),
        "tvd": tvd.item(),
        "context_tvd": context_tvd.item(),
        "kl": kl.item(),
        "pg": pg.item(),
        "draft_temperature": draft_temp,
    }
    return loss, stats


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


def prepare_trainable(draft: torch.nn.Module, quant_grad_scale: str = "bits") -> list[str]:
    """Choose what trains: every weight of a float draft, or a quantized draft's grid only.

    Returns:
        Names of the trainable parameters.
    """
    from pipeline.quant.fakequant import FakeQuantLinear, grad_scale_factor

    fq = {n: m for n, m in draft.named_modules() if isinstance(m, FakeQuantLinear)}
    if not fq:
        draft.requires_grad_(True)
    else:
        draft.requires_grad_(False)
        for m in fq.values():
            numel = m.out_features * m.in_features
            for p in (m.scale, m.zero):
                if p is not None:
                    p.requires_grad_(True)
            m.set_grad_scale(grad_scale_factor(quant_grad_scale, m.fmt, numel))
    return [n for n, p in draft.named_parameters() if p.requires_grad]


class DraftReinforce(L.LightningModule):
    """The draft under on-policy acceptance training (see the module docstring).

    ``cost_ratio`` None measures c = draft/target step time when training starts.
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
        baseline_momentum: float = 0.9,
        monitor_window: int = 20,
        seed: int = 0,
        context_positions: int = 0,
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
        self.window: deque[float] = deque(maxlen=monitor_window)
        # Validation results: the starting draft's (sanity check, step 0) and one per check.
        self.val_input: dict[str, float] | None = None
        self.val_history: list[dict[str, float]] = []
        self._val: dict[str, list[float]] = {}

    def on_fit_start(self) -> None:
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
        self.window.append(stats["alpha"])
        stats["alpha_window"] = sum(self.window) / len(self.window)
        self.log_dict(stats, prog_bar=False, sync_dist=False)
        self.log("train_loss", loss.detach(), prog_bar=True)
        return loss

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
            "window": list(self.window),
            "cost_ratio": self.cost_ratio,
            "val_input": self.val_input,
            "val_history": self.val_history,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("reinforce", {})
        if "baseline" in state:
            self.baseline.load_state_dict(state["baseline"])
        self.window.extend(state.get("window", []))
        if state.get("cost_ratio") is not None:
            self.cost_ratio = state["cost_ratio"]
        self.val_input = state.get("val_input", self.val_input)
        self.val_history = list(state.get("val_history", []))
