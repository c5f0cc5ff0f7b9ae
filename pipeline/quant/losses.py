"""Distillation losses for quantization-aware training: a quantized student mimics its FP teacher.

Logits: KL(p_teacher ‖ p_student) at temperature τ, multiplied by τ² so that its gradient keeps
the same magnitude whatever τ (Hinton et al. 2015). Forward KL is mode-covering: the student is
pushed to put mass wherever the teacher does, which is what perplexity measures.

Intermediate matching (OneBit, NeurIPS 2024, uses logits + hidden states + attention): per decoder
layer l the squared distance between teacher and student attention probabilities
‖A_t^l − A_s^l‖² (summed over keys, averaged over batch, heads and queries), or the relative
squared error of the layer's output hidden state. Layers are weighted by w_l, larger where the
quantizer hurt more: w_l ∝ the mean relative output error of layer l's quantized linears, as
measured by the quantize stage. The trade-off: matching intermediate maps gives dense,
layer-local gradients (fast recovery of badly quantized layers) at the price of constraining
the student to the teacher's internal solution, which at 2 bits may not be reachable; β sets how
hard that constraint is.

Everything here is pure tensor math: no modules, no config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# Decoder-layer index inside a linear's name: Llama/Mistral/Qwen "model.layers.3.self_attn.q_proj",
# GPT-2/Falcon "transformer.h.3.attn.c_attn", T5-like "block.3".
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


def kl_divergence(
    teacher_logits: Tensor, student_logits: Tensor, temperature: float = 1.0
) -> Tensor:
    """τ²·KL(softmax(t/τ) ‖ softmax(s/τ)), averaged over tokens.

    Args:
        teacher_logits: (B, T, V) teacher logits (no gradient needed).
        student_logits: (B, T, V) student logits.
        temperature: τ > 0.

    Returns:
        Scalar float32 loss.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # (B, T)
    return kl.mean() * temperature**2


def attention_distances(teacher: Sequence[Tensor], student: Sequence[Tensor]) -> Tensor:
    """Per-layer ‖A_t − A_s‖² of attention probabilities.

    Args:
        teacher: L tensors (B, H, T, T) of attention probabilities.
        student: the student's, same shapes.

    Returns:
        (L,) float32: squared distance summed over keys, averaged over batch, heads, queries.
    """
    _same_length(teacher, student, "attention maps")
    return torch.stack(
        [(a_t.float() - a_s.float()).square().sum(-1).mean() for a_t, a_s in zip(teacher, student)]
    )


def hidden_distances(teacher: Sequence[Tensor], student: Sequence[Tensor]) -> Tensor:
    """Per-layer relative squared error ‖h_t − h_s‖² / ‖h_t‖² of decoder-layer outputs.

    The relative form keeps layers comparable: residual-stream norms grow with depth.

    Args:
        teacher: L tensors (B, T, C), the outputs of decoder layers 1..L (HF's `hidden_states`
            without the embedding output at index 0).
        student: the student's, same shapes.

    Returns:
        (L,) float32, each averaged over tokens.
    """
    _same_length(teacher, student, "hidden states")
    out = []
    for h_t, h_s in zip(teacher, student):
        h_t, h_s = h_t.float(), h_s.float()
        err = (h_t - h_s).square().sum(-1)  # (B, T)
        out.append((err / h_t.square().sum(-1).clamp_min(1e-12)).mean())
    return torch.stack(out)


def _same_length(a: Sequence[Tensor], b: Sequence[Tensor], what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"teacher has {len(a)} {what}, student {len(b)}")


def layer_of(name: str) -> int | None:
    """Decoder-layer index of a module name, or None (embeddings, lm_head, ...)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def layer_weights(errors: Mapping[str, float], num_layers: int) -> Tensor:
    """w_l ∝ mean quantization error of the linears of decoder layer l, normalised to Σ w_l = 1.

    Args:
        errors: {linear name: relative output error} (quant_report.json's rel_output_error).
        num_layers: L, the number of decoder layers.

    Returns:
        (L,) float32 weights. Layers without a quantized linear get 0; when no layer has a positive
        error (nothing measured, or everything exact) the weights are uniform.
    """
    total = torch.zeros(num_layers)
    count = torch.zeros(num_layers)
    for name, err in errors.items():
        idx = layer_of(name)
        if idx is None or not 0 <= idx < num_layers:
            continue
        if not err >= 0:  # NaN or negative: a broken report, not a weight
            raise ValueError(f"quantization error of {name} is {err}; expected a value >= 0")
        total[idx] += float(err)
        count[idx] += 1
    mean = total / count.clamp_min(1)
    if mean.sum() <= 0:
        return torch.full((num_layers,), 1.0 / num_layers)
    return mean / mean.sum()


def distill_loss(
    teacher_logits: Tensor,
    student_logits: Tensor,
    weights: Tensor,
    alpha: float,
    beta: float,
    temperature: float,
    teacher_attn: Sequence[Tensor] | None = None,
    student_attn: Sequence[Tensor] | None = None,
    teacher_hidden: Sequence[Tensor] | None = None,
    student_hidden: Sequence[Tensor] | None = None,
) -> dict[str, Tensor]:
    """α·KL + β·Σ_l w_l·d_l, with d_l from attention maps and/or hidden states.

    Args:
        teacher_logits, student_logits: (B, T, V).
        weights: (L,) per-layer weights (see `layer_weights`).
        alpha, beta: term weights; a term whose weight is 0 is not computed.
        temperature: τ of the KL term.
        teacher_attn, student_attn: L attention maps (B, H, T, T) each, or None.
        teacher_hidden, student_hidden: L decoder-layer outputs (B, T, C) each, or None.

    Returns:
        {"kl", "attn", "hidden", "total"}: scalar tensors (unused terms are 0); "total" carries the
        gradient.
    """
    zero = student_logits.new_zeros((), dtype=torch.float32)
    kl = kl_divergence(teacher_logits, student_logits, temperature) if alpha else zero
    attn = hidden = zero
    if beta and teacher_attn is not None and student_attn is not None:
        attn = (weights.to(zero.device) * attention_distances(teacher_attn, student_attn)).sum()
    if beta and teacher_hidden is not None and student_hidden is not None:
        hidden = (weights.to(zero.device) * hidden_distances(teacher_hidden, student_hidden)).sum()
    total = alpha * kl + beta * (attn + hidden)
    return {"kl": kl.detach(), "attn": attn.detach(), "hidden": hidden.detach(), "total": total}
