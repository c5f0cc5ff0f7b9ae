"""Quantization-aware training set-up, shared by the two training stages (distill, reinforce).

`prepare_qat` chooses what trains, as EfficientQAT does: step sizes and zero points (`scales`,
codes frozen), optionally latent weights, norm gains and the float-kept layers; each quantized
linear's scale/zero gradient gets a factor (2^-bits, LSQ's 1/sqrt(N·Q_P), or none) so step sizes
of very different magnitudes learn at comparable rates. `keep_full_precision` keeps chosen
modules out of bf16 autocast.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipeline.quant.fakequant import FakeQuantLinear, grad_scale_factor

TRAINABLE = ("scales", "weights", "norms", "float")


def train_sets_problem(train: Sequence[str]) -> str | None:
    """Why `train` is not a valid choice of trainable sets, or None when it is."""
    if set(train) - set(TRAINABLE) or "scales" not in train or len(set(train)) != len(train):
        return f"must contain 'scales', each once, and only {', '.join(TRAINABLE)}"
    return None


def prepare_qat(
    model: nn.Module, train: Sequence[str], grad_scale: str
) -> dict[str, list[nn.Parameter]]:
    """Freeze `model` except its `train` sets, and set each quantized linear's gradient factor."""
    problem = train_sets_problem(train)
    if problem:
        raise ValueError(f"train={list(train)}: {problem}")
    model.requires_grad_(False)
    groups: dict[str, list[nn.Parameter]] = {k: [] for k in TRAINABLE}
    for module in model.modules():
        if isinstance(module, FakeQuantLinear):
            groups["scales"] += [p for p in (module.scale, module.zero) if p is not None]
            if "weights" in train:
                groups["weights"] += [p for p in (module.weight, module.bias) if p is not None]
        elif "norms" in train and "norm" in type(module).__name__.lower():
            groups["norms"] += list(module.parameters(recurse=False))
        elif "float" in train and isinstance(module, (nn.Linear, nn.Embedding)):
            groups["float"] += list(module.parameters(recurse=False))
    # Tied embeddings: lm_head and embed_tokens share one tensor, which the optimizer takes once.
    groups["float"] = list({id(p): p for p in groups["float"]}.values())
    for params in groups.values():
        for p in params:
            p.requires_grad_(True)
    apply_grad_scale(model, grad_scale)
    return groups


def apply_grad_scale(model: nn.Module, mode: str) -> dict[str, float]:
    """Give every FakeQuantLinear its scale/zero gradient factor; returns {name: factor}."""
    factors = {}
    for name, m in model.named_modules():
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


def keep_full_precision(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Run modules matching `patterns` (a substring of the module's own name, or an fnmatch of
    its full name) outside autocast, in their parameters' dtype; returns the matched names."""
    matched: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(m + ".") for m in matched):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if any(p in leaf or fnmatch.fnmatch(name, p) for p in patterns):
            module.forward = _fp32_forward(module.forward, module)
            matched.append(name)
    return matched
