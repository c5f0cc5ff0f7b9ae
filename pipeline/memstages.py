"""Each stage's peak memory per rank, term by term, as its code holds it (`pipeline.memplan`);
the terms per stage are listed in docs/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from pipeline.memfacts import (
    SHARD_BYTES,
    Estimate,
    Fixes,
    RunFacts,
    Terms,
    forward_activations,
    logits,
    nested,
    peak,
    quantized_model,
    smallest_group,
    train_activations,
    with_facts,
    with_quant,
)
from pipeline.modelshape import ModelShape


def _on_device(facts: RunFacts, cfg: Any) -> bool:
    """A stage's own `device` key, where it has one: cpu keeps it on the host, anything else
    follows the trainer's accelerator."""
    return getattr(cfg, "device", "auto") != "cpu"


def _scored(s: ModelShape, cfg: Any) -> int:
    head = s.embed_params if s.tied else s.head_params
    embed = 0 if s.tied else s.embed_params
    return s.linear_params + head * cfg.include_lm_head + embed * cfg.include_embeddings


def _hessians(s: ModelShape, blocks: int) -> int:
    """Float32 input Hessians of `blocks` blocks: one per distinct linear input."""
    return blocks * sum(w * w for w in s.input_widths) * 4


def _sensitivity(facts: RunFacts, cfg: Any) -> tuple[Terms, Terms]:
    s, (n, seq) = facts.target, facts.calib
    host: Terms = {"calibration": n * seq * 8}
    if cfg.stream:
        return _streamed(facts, cfg, host)
    scored = _scored(s, cfg)
    compute: Terms = {"weights fp32": s.params * 4}
    if cfg.method == "gptq_proxy":
        compute["input Hessians"] = _hessians(s, s.layers) + s.hidden**2 * 4
        compute["activations"] = forward_activations(s, cfg.batch_size * seq, seq, 4)
        compute["logits"] = logits(s, cfg.batch_size * seq, 1)
    else:
        compute["gradients"] = scored * 4
        compute["Fisher sums"] = scored * 4
        compute["activations"] = train_activations(s, seq, seq, 4)
        compute["logits"] = logits(s, seq, 3)
        if cfg.method == "hutchinson" or cfg.importance == "combined":
            compute["probes and Hv"] = scored * 8  # its double backward keeps the graph twice
            compute["activations"] *= 2
    compute["scoring"] = max(s.largest_linear, s.embed_params) * 4 * 4  # Q(w) - w per format
    if cfg.delta == "gptq":  # every input Hessian until scored; one layer's GPTQ at a time
        if cfg.method != "gptq_proxy":
            compute["input Hessians"] = _hessians(s, s.layers) + s.hidden**2 * 4
        largest = max(s.largest_linear, (s.head_params or s.embed_params) * cfg.include_lm_head)
        compute["GPTQ factors and copies"] = 5 * max(s.input_widths) ** 2 * 4 + largest * 32
    if facts.device != "cpu" and _on_device(facts, cfg):
        host["shard read"] = min(s.checkpoint_bytes(), SHARD_BYTES)
    return facts.split(_on_device(facts, cfg), compute, host)


def _kept_caches(facts: RunFacts, count: int, one: int, batch: int) -> int:
    """`count` activation caches of `one` bytes each: in memory up to the budget, the rest
    spilled to files, whose pages are dropped after each access (a batch resident)."""
    budget = facts.run.quant.activation_budget_gb * 2**30
    fit = min(count, int(budget // one)) if one else count
    return fit * one + (batch if fit < count else 0)


def _streamed(facts: RunFacts, cfg: Any, host: Terms) -> tuple[Terms, Terms]:
    s, q, (n, seq) = facts.target, facts.run.quant, facts.calib
    rows = math.ceil(n / facts.ranks)
    one = rows * seq * s.hidden * 4  # (rows, T, C) float32
    batch = min(cfg.batch_size, rows) * seq * s.hidden * 4
    fisher = cfg.method == "fisher"
    k = q.segment_size if fisher else 1
    segments = math.ceil(s.layers / k)
    # The walk's own cache, then (Fisher) every segment's input, the last output and its gradient.
    host["activation caches"] = _kept_caches(facts, 1 + (segments + 2) * fisher, one, batch)
    copies = 3 if fisher else 1  # weights, gradients, Fisher sums
    segment = {"segment fp32": k * s.block_params * 4 * copies}
    if fisher:
        segment["activations"] = train_activations(s, seq, seq, 4, layers=k)
    else:
        segment["input Hessians"] = _hessians(s, 1)
        segment["activations"] = forward_activations(s, batch // (s.hidden * 4), seq, 4)
    # The head's gradient and Fisher sums only when scored; the untied table in its own pass.
    table = s.embed_params if s.tied else s.head_params
    scored_head = cfg.include_lm_head or (s.tied and cfg.include_embeddings)
    head = {
        "lm_head fp32": table * 4 * (copies if scored_head else 1),
        "logits": logits(s, seq if fisher else batch // (s.hidden * 4), 3),
    }
    # Reading the embedding table or lm_head casts it: both dtypes' copies held for a moment.
    read = {"table read (stored + fp32)": max(table, s.embed_params) * (s.dtype_bytes + 4)}
    parts = [segment, head, read]
    if cfg.include_embeddings and not s.tied:
        parts.append({"embeddings fp32": s.embed_params * 4 * min(copies, 2)})  # + Fisher sums
    on = _on_device(facts, cfg)
    return peak(facts.split(on, part, host) for part in parts)


def _sensitivity_fixes(facts: RunFacts, cfg: Any) -> Fixes:
    q, out, also = facts.run.quant, [], ""
    loadable = cfg.method != "hutchinson" and cfg.importance == "single"
    if not cfg.stream and loadable:
        also = "stage.sensitivity.stream=true "
        cfg = nested(cfg, stream=True)
        out.append((also.strip(), facts, cfg))
    if cfg.stream and q.segment_size > 1:
        out.append((also + "quant.segment_size=1", with_quant(facts, segment_size=1), cfg))
    if cfg.stream:
        small = with_quant(facts, segment_size=1, activation_budget_gb=0.5)
        out.append((also + "quant.segment_size=1 quant.activation_budget_gb=0.5", small, cfg))
    return out


def _quantize(facts: RunFacts, cfg: Any) -> tuple[Terms, Terms]:
    s, q, (n, seq) = facts.target, facts.run.quant, facts.calib
    elem = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    rows = math.ceil(n / facts.ranks)
    batch = min(cfg.batch_size, rows)
    one = rows * seq * s.hidden * elem
    host: Terms = {"calibration": n * seq * 8}
    host["activation cache"] = _kept_caches(facts, 1, one, batch * seq * s.hidden * elem)
    gptq = q.method == "gptq"
    widest = max(s.input_widths)
    segment = {
        "segment": q.segment_size * s.block_params * elem,
        # H, its permuted copy, the damped sum, L, L^-1 and U live together in the factorisation
        "Hessian + factors": 6 * widest * widest * 4 if gptq else 0,
        "GPTQ working copies": s.largest_linear * (32 if gptq else 16),
        "codes": q.segment_size * s.block_linear_params,
        "activations": forward_activations(s, batch * seq, seq, elem),
    }
    start = {"embedding table": s.embed_params * s.dtype_bytes}
    head = {"lm_head": (s.embed_params if s.tied else s.head_params) * elem}
    if "lm_head" not in q.keep_float:
        head["Hessian + factors"] = 6 * s.hidden * s.hidden * 4 if gptq else 0
        head["logits"] = logits(s, batch * seq, 2)
    on = _on_device(facts, cfg)
    return peak(facts.split(on, part, host) for part in (segment, start, head))


def _quantize_fixes(facts: RunFacts, cfg: Any) -> Fixes:
    q, out = facts.run.quant, []
    if q.segment_size > 1:
        out.append(("quant.segment_size=1", with_quant(facts, segment_size=1), cfg))
    if q.activation_budget_gb > 0.5:
        out.append(
            ("quant.activation_budget_gb=0.5", with_quant(facts, activation_budget_gb=0.5), cfg)
        )
    if cfg.dtype == "float32":
        out.append(("stage.quantize.dtype=bfloat16", facts, nested(cfg, dtype="bfloat16")))
    out.append(
        (
            f"more ranks (trainer.num_nodes={2 * facts.ranks // facts.ranks_per_node})",
            with_facts(facts, ranks=2 * facts.ranks),
            cfg,
        )
    )
    return out


SPREAD = ("auto", "balanced", "balanced_low_0", "sequential")  # device maps over every device


def _evaluate(facts: RunFacts, cfg: Any) -> tuple[Terms, Terms]:
    """A target and a draft loaded at a time (the pair acceptance measures), scoring windows."""
    s, d, model = facts.target, facts.draft, facts.run.model
    seq = facts.run.data.eval_seq_len or (
        min(2048, s.max_positions) if model.target.path else facts.run.data.seq_len
    )
    tokens = cfg.batch_size * seq
    over = facts.ranks_per_node if model.device_map in SPREAD and facts.device != "cpu" else 1
    loaded = facts.loaded_bytes("target")
    compute = {
        "target": s.params * loaded // over,
        "draft": d.params * facts.loaded_bytes("draft") // over if d is not None else 0,
        "activations": forward_activations(s, tokens, seq, 4),
        "logits": logits(s, tokens, 2),
    }
    # Teacher-forced acceptance: a batch of the longest prompts, logits, softmaxes, their minimum.
    lengths = [cfg.long_len if name == "long" else cfg.prompt_len for name in cfg.scenarios]
    longest = max(lengths, default=0)
    tf = min(cfg.batch_size, cfg.scenario_prompts) * longest
    accept = compute | {"activations": forward_activations(s, tf, longest, 4),
                        "logits": logits(s, tf, 5)}  # fmt: skip
    # A target stored in a dtype it does not compute in is cast whole, held in both a moment.
    load = {"target": compute["target"], "as stored (cast)": s.params * s.dtype_bytes // over}
    phases = [compute, accept] + ([load] if loaded != s.dtype_bytes else [])
    return peak(facts.split(True, phase, {}) for phase in phases)


def _evaluate_fixes(facts: RunFacts, cfg: Any) -> Fixes:
    out = []
    if cfg.batch_size > 1:
        out.append(("stage.evaluate.batch_size=1", facts, nested(cfg, batch_size=1)))
    model = facts.run.model
    if facts.device != "cpu" and model.device_map not in SPREAD and facts.ranks_per_node > 1:
        spread = replace(facts.run, model=replace(model, device_map="auto"))
        out.append(("model.device_map=auto", with_facts(facts, run=spread), cfg))
    return out


def _export(facts: RunFacts, cfg: Any) -> tuple[Terms, Terms]:
    s, d, group = facts.target, facts.draft, smallest_group(facts.run)
    host = {
        "quantized model": quantized_model(s, facts.loaded_bytes("target"), group),
        "one tensor packed": s.largest_linear * 4 * 2,
        "draft": d.params * facts.loaded_bytes("draft") if d is not None else 0,
    }
    return {}, host


ESTIMATES = {
    "sensitivity": Estimate(_sensitivity, _sensitivity_fixes),
    "quantize": Estimate(_quantize, _quantize_fixes),
    "evaluate": Estimate(_evaluate, _evaluate_fixes),
    "export": Estimate(_export),
}
