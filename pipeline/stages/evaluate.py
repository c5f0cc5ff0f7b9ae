"""evaluate: perplexity of every model the run produced, and acceptance of every draft/target pair.

Models come from the run (FP target and draft, and whichever of quantize, distill and reinforce
ran) and load onto the run's device one at a time (pipeline.evaluation.shelf); the measurements
are pipeline.evaluation's, saved as one EvalResult.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline import runmodels
from pipeline.config import RunConfig, positive
from pipeline.data.heldout import corpus_heldout
from pipeline.data.scenarios import SCENARIOS, new_tokens_by_scenario
from pipeline.data.text import Corpus
from pipeline.evaluation.acceptance import (
    acceptance_table,
    adaptive_gamma,
    heldout_scenarios,
    measure_costs,
    report_acceptance,
    run_pairs,
)
from pipeline.evaluation.drift import error_flows, write_error_flow
from pipeline.evaluation.harness import LmEvalConfig, run_lm_eval
from pipeline.evaluation.perplexity import perplexities
from pipeline.evaluation.result import EvalResult
from pipeline.evaluation.shelf import ModelShelf
from pipeline.evaluation.speed import speed_report
from pipeline.models.hf import load_tokenizer
from pipeline.models.quantized import load_model
from pipeline.stages import Stage, StageIO


@dataclass(frozen=True)
class EvaluateConfig:
    """Perplexity of every model in the run; acceptance of every draft/target pair per scenario."""

    batch_size: int = 8
    # Decoding temperature of every acceptance and speed measurement (0: greedy, the runtime's
    # default); stage.reinforce.serve_temperature follows it. Greedy match and tokens per call
    # of greedy decoding are reported beside it either way.
    temperature: float = 1.0
    scenarios: list[str] = field(default_factory=lambda: ["long", "repetition", "rare", "mix"])
    scenario_prompts: int = 8  # held-out prompts per scenario (teacher-forced alpha uses all)
    prompt_len: int = 128
    long_len: int = 576  # > 512 tokens: the long-context scenario
    spec_prompts: int = 4  # prompts decoded speculatively per scenario
    spec_new_tokens: int = 32
    # Tokens generated per long prompt in the acceptance table; null: spec_new_tokens (the
    # method says 512). Speed is timed on mix prompts at spec_new_tokens either way.
    long_new_tokens: int | None = None
    gamma: int = 4  # the fixed draft length when adaptive is off
    # Draft length from the last `window` verifications: shorter windows swing with single
    # rounds, longer ones lag a change of text.
    adaptive: bool = True
    gamma_min: int = 2
    gamma_max: int = 5
    window: int = 64
    temperature_schedule: bool = False  # draft T = temperature * (1 + 0.1 cos(step / 1000))
    timing: bool = True  # decode speed on the runtime's packed kernels
    speed_repeats: int = 3  # timed passes over the prompts: median, min and max
    # Speed's adaptive gamma may decode plainly where no draft length pays (never slower).
    allow_plain: bool = True
    error_flow_windows: int = 32  # a diagnostic: a few test windows show the trend
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)

    def check(self, prefix: str) -> None:
        positive(prefix, batch_size=self.batch_size, gamma=self.gamma, gamma_min=self.gamma_min)
        positive(prefix, spec_new_tokens=self.spec_new_tokens, long_new_tokens=self.long_new_tokens)
        positive(prefix, scenario_prompts=self.scenario_prompts, spec_prompts=self.spec_prompts)
        positive(prefix, error_flow_windows=self.error_flow_windows)
        from pipeline.errors import ConfigError

        ranges = (
            ("temperature", self.temperature >= 0, ">= 0 (0: greedy)"),
            ("gamma_max", self.gamma_max >= self.gamma_min, f">= gamma_min ({self.gamma_min})"),
            ("speed_repeats", self.speed_repeats >= 3, ">= 3 (median of passes)"),
            ("window", 50 <= self.window <= 100, "50 <= window <= 100"),
        )
        for key, ok, allowed in ranges:
            if not ok:
                raise ConfigError(f"{prefix}.{key}", f"is {getattr(self, key)}", allowed)
        for i, s in enumerate(self.scenarios):
            if s not in SCENARIOS:
                raise ConfigError(f"{prefix}.scenarios[{i}]", f"is {s!r}", ", ".join(SCENARIOS))


def _shelf(run: RunConfig, inputs: dict, device) -> tuple[ModelShelf, list[str], list[str]]:
    """Every model of this run, loaded onto ``device`` when measured; (shelf, targets, drafts)."""
    targets, drafts = runmodels.targets(run.model, inputs), runmodels.drafts(run.model, inputs)

    def loader(path, role: str, allow_bin: bool):
        options = run.model.load_options(role)  # model.device_map, when set, places it instead
        return lambda device: load_model(path, allow_bin, device=device, **options)

    loaders = {n: loader(p, "target", run.model.allow_bin) for n, p in targets.items()}
    # Only the user's own checkpoint may be a .bin one; reinforce writes safetensors.
    bin_ok = {n: run.model.allow_bin and n == "draft_fp" for n in drafts}
    loaders |= {n: loader(p, "draft", bin_ok[n]) for n, p in drafts.items()}
    return ModelShelf(loaders, device), list(targets), list(drafts)


def _speculative(cfg: EvaluateConfig, run: RunConfig, corpus, tokenizer, models, targets, io):
    """Acceptance (and speed) of every pair: the speculative fields of EvalResult."""
    pairs = run_pairs(targets, [n for n in models if n not in targets])
    sets = heldout_scenarios(
        tokenizer,
        corpus.splits["test"],
        n_prompts=cfg.scenario_prompts,
        prompt_len=cfg.prompt_len,
        long_len=cfg.long_len,
        seed=run.seed,
    )
    sets = {s: sets[s] for s in cfg.scenarios}
    prompts = sets["mix"] if "mix" in sets else next(iter(sets.values()))
    out, adaptive = {}, None
    if cfg.adaptive:
        gammas = range(cfg.gamma_min, cfg.gamma_max + 1)
        out["costs"] = measure_costs(models, pairs, prompts[0], gammas)
        adaptive = adaptive_gamma(out["costs"], cfg.gamma_min, cfg.gamma_max, cfg.window)
    decoding = dict(temperature=cfg.temperature, temperature_schedule=cfg.temperature_schedule)
    table = acceptance_table(
        models.only(targets),
        models,
        sets,
        pairs=pairs,
        gamma=cfg.gamma,
        adaptive=adaptive,
        new_tokens=new_tokens_by_scenario(cfg.scenarios, cfg.spec_new_tokens, cfg.long_new_tokens),
        max_prompts=cfg.spec_prompts,
        batch_size=cfg.batch_size,
        seed=run.seed,
        greedy=True,
        **decoding,
    )
    out["speculative"], out["acceptance"] = table, report_acceptance(table, io.out_dir)
    out["temperature"] = cfg.temperature
    if cfg.timing:  # last: it converts the models to the runtime's kernels in place
        window = (cfg.gamma_min, cfg.gamma_max, cfg.window) if cfg.adaptive else None
        out |= speed_report(
            models,
            pairs,
            prompts[: cfg.spec_prompts],
            io.out_dir,
            new_tokens=cfg.spec_new_tokens,
            gamma=cfg.gamma,
            adaptive=window,
            seed=run.seed,
            repeats=cfg.speed_repeats,
            allow_plain=cfg.allow_plain,
            **decoding,
        )
    return out


def run(cfg: EvaluateConfig, run: RunConfig, io: StageIO) -> dict:
    tokenizer = load_tokenizer(runmodels.fp_target(run.model, io.inputs))
    corpus = Corpus(run.data, tokenizer)
    # One model on the device at a time (two where a measurement pairs them), freed before the next.
    models, targets, drafts = _shelf(run, io.inputs, io.device)
    context = models["target_fp"].config.max_position_embeddings if run.model.target.path else None
    test = corpus_heldout(corpus, "test", context)
    io.log.log_input(test.windows, "test", run.data, "test")
    fields = {"ppl": perplexities(models.holding(1), test, cfg.batch_size)}
    fields["ppl_protocol"] = test.describe()
    settings = cfg.lm_eval.resolved(run.data.chat_template)  # no tasks: {}, nothing imported
    lm_models = models.holding(2).only(targets)
    fields["lm_eval"] = run_lm_eval(lm_models, tokenizer, settings, io.device, io.out_dir)
    probe = test.windows[: cfg.error_flow_windows]
    lowbit = [n for n in targets if n != "target_fp"]
    fields["error_flow"] = error_flows(models, "target_fp", lowbit, probe, cfg.batch_size)
    if fields["error_flow"]:
        write_error_flow(fields["error_flow"], io.out_dir)
    if run_pairs(targets, drafts):
        fields.update(_speculative(cfg, run, corpus, tokenizer, models, targets, io))
    models.clear()
    result = EvalResult(**fields)
    result.save(io.out_dir)
    return result.metrics()


STAGE = Stage(
    config=EvaluateConfig,
    run=run,
    needs=("bootstrap",),
    uses=("quantize", "distill", "reinforce"),
    sections=("model", "data"),
    # lm_eval's nulls follow data.chat_template: a contradiction fails before any stage runs
    check=lambda cfg, run: cfg.lm_eval.resolved(run.data.chat_template),
)
