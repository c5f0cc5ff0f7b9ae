"""The training stages' peak memory per rank (`pipeline.memplan`): bootstrap, distill, reinforce.

Per trainable value 16 bytes (weight, gradient, Adam's moments), split over ranks by the ZeRO
stage, moved to the host by offload; the fake-quant student keeps each linear's dequantized weight.
"""

from __future__ import annotations

from typing import Any

from pipeline.memfacts import (
    TOKENIZER_BYTES_PER_CHAR,
    Estimate,
    Fixes,
    RunFacts,
    Terms,
    forward_activations,
    logits,
    nested,
    peak,
    quantized_model,
    scales,
    smallest_group,
    train_activations,
    with_facts,
)
from pipeline.modelshape import ModelShape

ADAM = 8  # two float32 moments


def _trainable(s: ModelShape, sets: list[str], group: int) -> int:
    n = 0
    if "scales" in sets:
        n += scales(s, group)
    if "norms" in sets:
        n += s.layers * 2 * s.hidden + s.hidden
    if "float" in sets:
        n += s.embed_params + s.head_params
    if "weights" in sets:
        n += s.linear_params
    return n


def _optimizer(facts: RunFacts, trainable: int) -> tuple[Terms, Terms]:
    """(on the device, on the host) gradients, optimizer states and master copies."""
    r, z = facts.ranks, facts.zero
    grads = trainable * 4 // (r if z >= 2 else 1)
    states = trainable * ADAM // (r if z >= 1 else 1)
    if z and facts.bf16:
        states += trainable * 4 // r  # DeepSpeed's float32 master weights
    device = {"gradients": grads}
    if facts.offload_optimizer:
        return device, {"optimizer states": states}
    return device | {"optimizer states": states}, {}


def _distill(facts: RunFacts, cfg: Any) -> tuple[Terms, Terms]:
    s, a = facts.target, facts.act_bytes
    seq = cfg.seq_len or facts.run.data.seq_len
    batch = cfg.train.batch
    tokens = batch * seq
    group = smallest_group(facts.run)
    shard = facts.ranks if facts.zero >= 3 else 1
    student = quantized_model(s, 4, group)
    if "weights" in cfg.trainable:
        student += s.linear_params * 3  # float32 latent weights instead of uint8 codes
    teacher = s.params * (2 if cfg.teacher_dtype == "bfloat16" else 4)
    compute: Terms = {"student": student // shard, "teacher": teacher // shard}
    trainable = _trainable(s, list(cfg.trainable), group)
    optimizer, host = _optimizer(facts, trainable)
    compute |= optimizer
    # Kept for backward on every rank (ZeRO shards parameters, not what autograd saves), or one
    # block's with activation checkpointing, which keeps each block's input instead.
    eager = cfg.beta > 0 and cfg.match != "hidden"  # attention maps matched: eager attention
    if getattr(cfg, "activation_checkpointing", False):
        compute["dequantized weights"] = s.block_linear_params * (4 + a)
        compute["activations"] = s.layers * tokens * s.hidden * a + train_activations(
            s, tokens, seq, a, layers=1, eager=eager
        )
    else:
        compute["dequantized weights"] = s.linear_params * (4 + a)
        compute["activations"] = train_activations(s, tokens, seq, a, eager=eager)
    compute["teacher forward"] = forward_activations(s, tokens, seq, a, eager=eager)
    if eager:  # the teacher's maps, kept for the loss
        compute["attention maps"] = s.layers * batch * s.heads * seq * seq * 4
    compute["logits"] = logits(s, tokens, 6)
    host["checkpoint"] = trainable * (4 + ADAM) // shard  # a copy on its way to disk
    return facts.split(True, compute, host)


def _distill_fixes(facts: RunFacts, cfg: Any) -> Fixes:
    out: Fixes = []
    if "float" in cfg.trainable:
        frozen = [t for t in cfg.trainable if t != "float"]
        out.append(
            (
                f"stage.distill.trainable=[{','.join(frozen)}] (lm_head and embeddings frozen)",
                facts,
                nested(cfg, trainable=frozen),
            )
        )
    if not getattr(cfg, "activation_checkpointing", True):
        recompute = nested(cfg, activation_checkpointing=True)
        out.append(("stage.distill.activation_checkpointing=true", facts, recompute))
    if cfg.teacher_dtype == "float32":
        out.append(
            ("stage.distill.teacher_dtype=bfloat16", facts, nested(cfg, teacher_dtype="bfloat16"))
        )
    if cfg.train.batch > 1:
        out.append(("stage.distill.train.batch=1", facts, nested(cfg, train__batch=1)))
    if facts.ranks > 1 and facts.zero < 3:
        out.append(("trainer=deepspeed_zero3", with_facts(facts, zero=3), cfg))
    if facts.zero >= 3 and not facts.offload_optimizer:
        offload = with_facts(facts, offload_optimizer=True, offload_params=True)
        out.append(("trainer.deepspeed_config=zero3_offload.json", offload, cfg))
    nodes = facts.ranks // facts.ranks_per_node
    for more in (2, 4, 8):
        wider = with_facts(facts, ranks=facts.ranks * more, zero=max(facts.zero, 3))
        out.append((f"trainer=deepspeed_zero3 trainer.num_nodes={nodes * more}", wider, cfg))
    return out


def _reinforce(facts: RunFacts, cfg: Any) -> tuple[Terms, Terms]:
    s, d, a = facts.target, facts.draft or facts.target, facts.act_bytes
    quantized = "quantize" in facts.stages
    loaded, group = facts.loaded_bytes("target"), smallest_group(facts.run)
    target = quantized_model(s, loaded, group) if quantized else s.params * loaded
    seq = cfg.long_len + cfg.gamma  # the long-context scenario's windows
    tokens = cfg.train.batch * seq
    compute: Terms = {"target": target, "draft fp32": d.params * 4, "anchor copy": d.params * 4}
    optimizer, host = _optimizer(facts, d.params)
    compute |= optimizer
    compute["activations"] = train_activations(d, tokens, seq, a)
    compute["target forward"] = forward_activations(s, tokens, seq, a)
    compute["logits"] = logits(d, tokens, 4)
    if not quantized:
        return facts.split(True, compute, host)
    # Then rank 0 measures the FP pair beside the trained one, the optimizer state gone.
    after: Terms = {"target": target, "FP target (after)": s.params * loaded}
    after["FP and trained drafts (after)"] = 2 * d.params * 4
    after["target forward"] = compute["target forward"]
    return peak(facts.split(True, phase, host) for phase in (compute, after))


def _reinforce_fixes(facts: RunFacts, cfg: Any) -> Fixes:
    if cfg.train.batch > 1:
        return [("stage.reinforce.train.batch=1", facts, nested(cfg, train__batch=1))]
    return []


def _bootstrap(facts: RunFacts, cfg: Any) -> tuple[Terms, Terms]:
    s, data = facts.target, facts.run.data
    tokens = cfg.batch_size * data.seq_len
    compute = {
        "model, gradients, Adam": s.params * 16,
        "activations": train_activations(s, tokens, data.seq_len, 4, eager=True),
        "logits": logits(s, tokens, 3),
    }
    # The tokenizer's BPE training ends, and frees its memory, before the models train.
    tokenizer = {"tokenizer training": facts.builtin_chars * TOKENIZER_BYTES_PER_CHAR}
    return peak(facts.split(True, c, h) for c, h in ((compute, {}), ({}, tokenizer)))


ESTIMATES = {
    "bootstrap": Estimate(_bootstrap),
    "distill": Estimate(_distill, _distill_fixes),
    "reinforce": Estimate(_reinforce, _reinforce_fixes),
}
