"""The reinforce loss and LightningModule on tiny Llama pairs."""

import copy
from dataclasses import replace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pipeline.lit.config import TrainConfig
from pipeline.lit.fit import Selection, pick_best
from pipeline.lit.lm import step_loader
from pipeline.lit.losses import LossWeights, proposal_logits, reinforce_loss, round_weights
from pipeline.lit.qat import prepare_qat
from pipeline.lit.reinforce import (
    DraftReinforce,
    ReinforceData,
    ReinforceHParams,
    ScenarioBatches,
)
from pipeline.speculative.metrics import expected_acceptance
from pipeline.speculative.rewards import MovingAverageBaseline
from pipeline.speculative.rollout import draft_rollout
from tests.speculative.conftest import VOCAB, perturbed, tiny_llama

# The stage's default weights, without its context term.
WEIGHTS = LossWeights(pg=0.1, tvd=1.0, kl=0.05, w_acceptance=0.7, w_throughput=0.3, context_tvd=0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0).requires_grad_(False)


def _draft(target, seed):
    """A trainable noisy copy of the target: partial acceptance, room to improve."""
    return perturbed(target, 0.05, seed=seed).requires_grad_(True)


def _contexts(n=8, t=12, seed=0):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return {
        "long": torch.randint(0, VOCAB, (4, 24), generator=gen),
        "mix": torch.randint(0, VOCAB, (4, 12), generator=gen),
    }


def test_one_step_increases_expected_acceptance(target):
    draft = _draft(target, 1).train()
    reference = copy.deepcopy(draft).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ro = draft_rollout(target, draft, _contexts(), 4, generator=torch.Generator().manual_seed(0))

    def alpha() -> float:  # expected acceptance at the proposal positions of a fixed rollout
        with torch.no_grad():
            p = proposal_logits(target, ro.sequences, 4)
            return expected_acceptance(p, proposal_logits(draft, ro.sequences, 4))[0].item()

    before = alpha()
    opt = torch.optim.SGD(draft.parameters(), lr=0.5)
    loss, stats = reinforce_loss(
        target,
        draft,
        reference,
        _contexts(),
        gamma=4,
        temperature=1.0,
        draft_temp=1.05,
        cost_ratio=0.3,
        weights=WEIGHTS,
        advantages=MovingAverageBaseline().advantages,
        generator=gen,
    )
    loss.backward()
    opt.step()
    assert 0.0 <= stats["acceptance"] <= 1.0 and 0.0 < stats["alpha"] < 1.0
    assert alpha() > before + 1e-3


def test_context_term_raises_teacher_forced_acceptance_on_the_contexts(target):
    """The context term moves the draft towards the target on the text itself: after one step
    its teacher-forced acceptance over every context position gains more than after a step of
    the on-policy TVD term alone (which sees at most gamma positions per context)."""
    contexts = _contexts(8, 24)

    def context_alpha(draft) -> float:  # over every context position, all rows
        with torch.no_grad():
            p, q = target(input_ids=contexts).logits, draft(input_ids=contexts).logits
            return expected_acceptance(p[:, :-1], q[:, :-1])[0].item()

    gains = {}
    for name, weights in {
        "on_policy": replace(WEIGHTS, pg=0.0, tvd=1.0, kl=0.0),
        "context": replace(WEIGHTS, pg=0.0, tvd=0.0, kl=0.0, context_tvd=1.0),
    }.items():
        draft = _draft(target, 3).train()
        reference = copy.deepcopy(draft).requires_grad_(False)
        opt = torch.optim.SGD(draft.parameters(), lr=0.5)
        before = context_alpha(draft)
        loss, stats = reinforce_loss(
            target,
            draft,
            reference,
            contexts,
            gamma=2,
            temperature=1.0,
            draft_temp=1.0,
            cost_ratio=0.3,
            weights=weights,
            advantages=MovingAverageBaseline().advantages,
            generator=torch.Generator().manual_seed(0),
            context_positions=16,
        )
        loss.backward()
        opt.step()
        assert (stats["context_tvd"] > 0) == (name == "context")
        gains[name] = context_alpha(draft) - before
    assert gains["context"] > max(gains["on_policy"], 0.0) + 1e-3, gains


def test_proposal_logits_match_the_rollout(target):
    draft = _draft(target, 2)
    gen = torch.Generator().manual_seed(1)
    ro = draft_rollout(target, draft, _contexts(3, 7), 3, generator=gen)
    with torch.no_grad():
        q = proposal_logits(draft, ro.sequences, 3)
        p = proposal_logits(target, ro.sequences, 3)
    assert torch.allclose(q, ro.q_logits, atol=1e-5)
    assert torch.allclose(p, ro.p_logits[:, :3], atol=1e-5)


def test_batches_are_deterministic_equal_length_and_resume():
    prompts = _prompts()
    a = ScenarioBatches(prompts, batch_size=3, seed=1)
    b = ScenarioBatches(prompts, batch_size=3, seed=1, start=4)
    first_b = next(iter(step_loader(b, 3)))
    assert torch.equal(first_b, a.batch(4))  # resumed streams continue where they left off
    assert not torch.equal(a.batch(0), ScenarioBatches(prompts, 3, seed=1, rank=1).batch(0))
    long, mix = a.batch(0), a.batch(1)  # scenarios take turns
    assert long.shape == (3, 24)  # long contexts keep their full length
    assert mix.shape[0] == 3 and 6 <= mix.shape[1] <= 12
    assert any(torch.equal(mix[0], row[: mix.shape[1]]) for row in prompts["mix"])


def test_quantized_draft_trains_only_its_grid(target):
    from pipeline.quant.fakequant import FakeQuantLinear

    draft = _draft(target, 3)
    for layer in draft.model.layers:
        attn = layer.self_attn
        attn.q_proj = FakeQuantLinear.from_linear(attn.q_proj, "int4g32")
    prepare_qat(draft, ["scales"], "bits")
    names = [n for n, p in draft.named_parameters() if p.requires_grad]
    assert names and all(n.endswith((".scale", ".zero")) for n in names)
    scale = draft.model.layers[0].self_attn.q_proj.scale
    before = scale.detach().clone()
    loss, _ = reinforce_loss(
        target,
        draft,
        copy.deepcopy(draft),
        _contexts(4, 10),
        gamma=3,
        temperature=1.0,
        draft_temp=1.0,
        cost_ratio=0.3,
        weights=WEIGHTS,
        advantages=MovingAverageBaseline().advantages,
        generator=torch.Generator().manual_seed(0),
    )
    torch.optim.SGD([p for p in draft.parameters() if p.requires_grad], lr=1.0).zero_grad()
    loss.backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0
    assert draft.model.embed_tokens.weight.grad is None
    assert torch.equal(scale.detach(), before)


class _Record(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append((trainer.global_step, batch.clone()))


def _fit(tmp_path, target, draft, steps, ckpt=None, callbacks=(), **kwargs):
    train = TrainConfig(lr=1e-3, warmup=kwargs.pop("warmup", 1), steps=kwargs.pop("lr_steps", 5))
    hp = dict(
        gamma=3, cost_ratio=None, monitor_window=20, context_positions=0, context_tvd_weight=0.0
    )
    module = DraftReinforce(draft, target, ReinforceHParams(train=train, **(hp | kwargs)), seed=0)
    data = ReinforceData(_prompts(), None, 2, seed=0)
    record = _Record()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        default_root_dir=tmp_path,
        callbacks=[
            record,
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=1, save_last=True),
            *callbacks,
        ],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt, weights_only=True)
    return module, record


def test_lightning_module_trains_checkpoints_and_resumes(tmp_path, target):
    draft = _draft(target, 4)
    start = copy.deepcopy(draft)
    first, _ = _fit(tmp_path, target, draft, 3)
    assert first.global_step == 3 and first.cost_ratio > 0
    assert any(not torch.equal(a, b) for a, b in zip(draft.parameters(), start.parameters()))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)  # plain values only
    assert saved["global_step"] == 3
    assert saved["reinforce"]["baseline"]["value"] == first.baseline.value
    assert all(not k.startswith(("target", "reference")) for k in saved["state_dict"])

    resumed, record = _fit(tmp_path, target, _draft(target, 9), 5, ckpt=str(tmp_path / "last.ckpt"))
    assert resumed.global_step == 5
    assert [s for s, _ in record.seen] == [3, 4]  # the two missing steps, not a fresh start
    assert torch.equal(record.seen[0][1], ScenarioBatches(_prompts(), 2, seed=0).batch(3))
    assert resumed.cost_ratio == first.cost_ratio  # c is measured once per run
    assert len(resumed.monitor.values) == 5  # the windowed acceptance survives the resume
    loaded = {k.removeprefix("draft."): v for k, v in saved["state_dict"].items()}
    fresh = _draft(target, 9)
    fresh.load_state_dict(loaded)
    assert not torch.equal(fresh.lm_head.weight, resumed.draft.lm_head.weight)  # trained on


def test_rollout_draft_temperature_is_what_the_draft_samples_at(target):
    draft = _draft(target, 5)
    gen = torch.Generator().manual_seed(0)
    ro = draft_rollout(target, draft, _contexts(4, 6), 3, draft_temperature=0.0, generator=gen)
    assert torch.equal(ro.tokens, ro.q_logits.argmax(-1))  # a greedy draft, sampled target
    # A sampling draft, a greedy target: accepted while the proposals are the target's argmax.
    ro = draft_rollout(
        target, draft, _contexts(4, 6), 3, temperature=0.0, draft_temperature=1.0, generator=gen
    )
    assert not torch.equal(ro.tokens, ro.q_logits.argmax(-1))
    match = ro.tokens == ro.p_logits[:, :3].argmax(-1)
    assert torch.equal(ro.verification.n_accepted, match.long().cumprod(-1).sum(-1))


def test_greedy_round_weights_favour_a_round_s_early_positions():
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert round_weights(mask, 0.0).tolist() == [[1.0, 0.75, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert torch.equal(round_weights(mask, 0.7), mask)  # sampled: every verified position alike


def _greedy_match(target, draft, contexts) -> float:
    """Teacher-forced share of positions where the draft's argmax is the target's."""
    with torch.no_grad():
        p, q = target(input_ids=contexts).logits, draft(input_ids=contexts).logits
    return (p.argmax(-1) == q.argmax(-1)).float().mean().item()


def _train_greedy_match(target, serve_temperature: float, steps: int = 12) -> tuple[float, float]:
    """Greedy match on unseen contexts before and after `steps` of the reinforce objective."""
    draft = perturbed(target, 0.05, seed=11).requires_grad_(True).train()
    reference = copy.deepcopy(draft).requires_grad_(False)
    held_out = _contexts(16, 12, seed=99)
    before = _greedy_match(target, draft, held_out)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    baseline = MovingAverageBaseline()
    for step in range(steps):
        loss, stats = reinforce_loss(
            target,
            draft,
            reference,
            _contexts(8, 12, seed=step),
            gamma=4,
            temperature=serve_temperature,
            draft_temp=1.0,
            cost_ratio=0.3,
            weights=replace(WEIGHTS, context_tvd=1.0),
            advantages=baseline.advantages,
            generator=torch.Generator().manual_seed(step),
            context_positions=8,
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    term = "margin" if serve_temperature == 0 else "tvd"
    assert {term, f"context_{term}", "greedy_match"} <= set(stats)
    return before, _greedy_match(target, draft, held_out)


def test_serving_greedily_the_objective_raises_the_greedy_match_tvd_at_1_does_not(target):
    """The same steps on the same tiny pair: the serve_temperature = 0 objective raises the
    argmax agreement on contexts it never saw, the T = 1 one (TVD) leaves it where it was."""
    before, greedy = _train_greedy_match(target, 0.0)
    same, sampled = _train_greedy_match(target, 1.0)
    assert before == same
    assert greedy > before + 0.05 and greedy > sampled + 0.05, (before, greedy, sampled)


def _validated(target, draft, serve_temperature: float) -> dict:
    """The validation record DraftReinforce writes for `draft` (a real Lightning validation)."""
    hp = ReinforceHParams(serve_temperature=serve_temperature, cost_ratio=0.3)
    module = DraftReinforce(draft, target, hp, seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = {
        "mix": torch.randint(0, VOCAB, (8, 12), generator=gen),
        "long": torch.randint(0, VOCAB, (8, 24), generator=gen),
    }
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module, dataloaders=ReinforceData(prompts, prompts, 4, 0).val_dataloader())
    return module.val_history[-1]


def test_serving_greedily_the_keep_decision_compares_greedy_match(target):
    """The input: the target with 4x sharper logits (its argmax everywhere, a poor alpha at
    T = 1); the "trained" draft: a noisy copy (a better alpha at T = 1, some argmaxes lost).
    Serving at T = 1 the noisy copy is handed on; serving greedily the input is kept."""
    sharp = copy.deepcopy(target)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(4.0)
    noisy = perturbed(target, 0.01, seed=12)
    decided = {}
    for t in (1.0, 0.0):
        before, after = _validated(target, sharp, t), _validated(target, noisy, t)
        assert after["alpha"] > before["alpha"] and before["greedy_match"] == 1.0
        assert after["greedy_match"] < before["greedy_match"]
        key = ReinforceHParams(serve_temperature=t).selection_key
        # The paired windows are the serving mode's per-prompt scores (8 prompts a scenario).
        assert sum(after["windows"]) / 16 == pytest.approx(after[key])
        select = Selection(f"val/{key}", key, larger_is_better=True, seed=0)
        chosen, kept, margin = pick_best("reinforce", before, [after], select)
        decided[t] = (key, kept, margin.gain)
    assert decided[1.0][:2] == ("alpha", False) and decided[1.0][2] > 0
    assert decided[0.0][:2] == ("greedy_match", True) and decided[0.0][2] < 0


def _scripted_loss(monkeypatch, alphas=None, nan_at=None):
    """reinforce_loss with the step's on-policy acceptance replaced by ``alphas[step]``, and/or
    a non-finite loss at step ``nan_at``."""
    from pipeline.lit import reinforce

    real, calls = reinforce.reinforce_loss, []

    def scripted(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        step = len(calls)
        calls.append(step)
        if alphas is not None:
            stats["alpha"] = alphas[step]
        if step == nan_at:
            loss = loss * float("nan")
        return loss, stats

    monkeypatch.setattr(reinforce, "reinforce_loss", scripted)


def _lr(module) -> float:
    return module.trainer.optimizers[0].param_groups[0]["lr"]


@pytest.mark.parametrize("falling", [False, True])
def test_the_lr_is_lowered_when_windowed_acceptance_falls(tmp_path, target, monkeypatch, falling):
    # Eight steps, window 8: the first half at 0.8, the second at 0.6 (a fall of 0.2 > 0.1) or
    # at 0.8 (flat). Only the fall halves the learning rate, from the step it is seen on.
    alphas = [0.8] * 4 + ([0.6] * 4 if falling else [0.8] * 4)
    _scripted_loss(monkeypatch, alphas)
    kwargs = dict(cost_ratio=0.3, monitor_window=8, lr_drop_threshold=0.1, lr_drop_factor=0.5)
    kwargs |= dict(warmup=0, lr_steps=100)  # lr ~ constant over 8 steps: the ratio is clean
    module, _ = _fit(tmp_path, target, _draft(target, 6), 8, **kwargs)
    assert module.monitor.drops == int(falling)
    assert module.lr_scale == (0.5 if falling else 1.0)
    from pipeline.lit.lm import cosine_with_warmup

    scheduled = 1e-3 * cosine_with_warmup(8, 0, 100)
    assert _lr(module) == pytest.approx(scheduled * module.lr_scale)
    assert len(module.monitor.values) == (0 if falling else 8)  # the window starts over


def test_a_nan_step_is_skipped_restored_and_halves_the_lr(tmp_path, target, monkeypatch):
    from pipeline.lit.guards import NanGuard

    _scripted_loss(monkeypatch, nan_at=2)
    guard = NanGuard(lr_key="stage.reinforce.train.lr")
    kwargs = dict(cost_ratio=0.3, warmup=0, lr_steps=100)
    module, _ = _fit(tmp_path, target, _draft(target, 7), 4, callbacks=[guard], **kwargs)
    assert guard.skipped == 1 and guard.lr_scale == 0.5
    assert all(torch.isfinite(p).all() for p in module.draft.parameters())
    from pipeline.lit.lm import cosine_with_warmup

    assert _lr(module) == pytest.approx(1e-3 * cosine_with_warmup(4, 0, 100) * 0.5)
