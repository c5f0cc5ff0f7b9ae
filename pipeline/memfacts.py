"""The run facts the memory estimates read, and the pieces they share (`pipeline.memstages`):
each estimate returns ({term: bytes} on the device, {term: bytes} on the host) per rank at its peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.config import RunConfig
from pipeline.errors import LowbitError
from pipeline.modelshape import DTYPE_BYTES, ModelShape, size_defaults

Terms = dict[str, int]
GIB = 2**30

# The process itself, measured at each stage's start in the embedded default's runs: Python,
# torch, transformers, datasets and MLflow; Lightning adds its own once a training stage ran.
RUNTIME = int(0.60 * GIB)
LIGHTNING = int(0.12 * GIB)
DEVICE_CONTEXT = int(0.5 * GIB)  # a CUDA/CANN context and its kernels, outside torch's counts
# The built-in corpus per character of its text: read by a stage (text, token ids, the imported
# packages), and bootstrap's BPE training on it (during bootstrap); the standard library's
# docstrings alone (conf/experiment/smoke.yaml) hold about 1.5 M characters.
CORPUS_BYTES_PER_CHAR = 22
CORPUS_KEPT_BYTES_PER_CHAR = 10  # what reading it leaves: its imports and cached text
TOKENIZER_BYTES_PER_CHAR = 28
STDLIB_CHARS = 1_500_000
TRAINING = ("bootstrap", "distill", "reinforce")
NO_CORPUS = ("allocate", "export")  # the stages that never read the corpus
# A stored shard read whole before its tensors move to the device (transformers' loaders).
SHARD_BYTES = 5 * 10**9


def count(n: int) -> str:
    """A parameter count as people write it: 1.4 M, 8.03 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


@dataclass(frozen=True)
class RunFacts:
    """The run's settings the estimates read, parsed once."""

    target: ModelShape
    draft: ModelShape | None
    run: RunConfig
    stages: tuple[str, ...]
    device: str = "cpu"  # cpu | cuda | npu: where trainer.accelerator puts the work
    ranks: int = 1
    ranks_per_node: int = 1
    bf16: bool = False  # training precision is a 16-bit mixed one
    zero: int = 0  # DeepSpeed ZeRO stage (0: DDP or one process)
    offload_optimizer: bool = False
    offload_params: bool = False
    notes: tuple[str, ...] = ()

    @property
    def title(self) -> str:
        t = self.target
        draft = f", draft {count(self.draft.params)}" if self.draft else ""
        return f"target {count(t.params)} parameters ({t.layers} layers x {t.hidden}){draft}"

    @property
    def act_bytes(self) -> int:
        return 2 if self.bf16 else 4

    def loaded_bytes(self, role: str) -> int:
        """Bytes per parameter of ``role`` as loaded to compute: ``model.<role>.dtype``, "auto" as
        pipeline.hardware.compute_dtype does it (two stored bytes taken as bfloat16)."""
        import torch

        from pipeline.hardware import native

        shape = self.target if role == "target" else self.draft or self.target
        dtype = getattr(self.run.model, role).dtype
        if dtype != "auto":
            return DTYPE_BYTES[dtype]
        if shape.dtype_bytes != 2:
            return shape.dtype_bytes
        return 2 if native(torch.bfloat16, self.device)[0] else 4

    @property
    def calib(self) -> tuple[int, int]:
        c = self.run.quant.calib
        return c.samples, c.seq_len

    def runtime_bytes(self, stage: str) -> int:
        ran = (*self.stages[: self._index(stage)], stage)
        return RUNTIME + (LIGHTNING if any(s in TRAINING for s in ran) else 0)

    def corpus(self, stage: str) -> Terms:
        """The built-in corpus in this process (text, token ids, the packages imported to read
        it); a user's corpus is unknown until read (a note says so)."""
        out, chars = {}, self.builtin_chars
        if not chars:
            return out
        before = self.stages[: self._index(stage)]
        if "bootstrap" in before or stage not in NO_CORPUS:
            out["corpus"] = chars * CORPUS_BYTES_PER_CHAR
        elif any(s not in NO_CORPUS for s in before):
            out["corpus read before"] = chars * CORPUS_KEPT_BYTES_PER_CHAR
        return out

    @property
    def builtin_chars(self) -> int:
        data = self.run.data
        if data.path is not None or data.name is not None:
            return 0
        chars = data.builtin_max_chars or 0
        if not data.builtin_packages:  # the standard library's docstrings alone
            chars = min(chars, STDLIB_CHARS)
        return chars

    def _index(self, stage: str) -> int:
        return self.stages.index(stage) if stage in self.stages else len(self.stages)

    def split(self, on_device: bool, compute: Terms, host: Terms) -> tuple[Terms, Terms]:
        """(device, host) terms of a stage computing on the accelerator or on the host."""
        if self.device == "cpu" or not on_device:
            return {}, host | compute
        return {"context": DEVICE_CONTEXT} | compute, host


def facts_of(run: RunConfig, shapes: dict[str, ModelShape | None], stages: dict) -> RunFacts:
    """The facts of `run` (a full RunConfig) for the models of `shapes`."""
    from pipeline.hardware import device_type, resolve_precision

    target = shapes.get("target")
    if target is None:
        raise LowbitError(
            "the memory plan needs the target's config.json; check model.target.path, or set "
            "plan.check=false"
        )
    calib = run.quant.calib
    if calib.samples is None or calib.seq_len is None:  # a RunConfig built by hand
        chosen = size_defaults(target)
        calib = replace(
            calib,
            samples=calib.samples or chosen.calib_samples,
            seq_len=calib.seq_len or chosen.calib_seq_len,
        )
        run = replace(run, quant=replace(run.quant, calib=calib))
    trainer = dict(run.trainer or {})
    device = device_type(trainer.get("accelerator", "cpu"))
    per_node = _devices(trainer.get("devices", 1), device)
    nodes = int(trainer.get("num_nodes", 1) or 1)
    precision = str(trainer.get("precision") or size_defaults(target).precision)
    if precision == "auto":
        precision = str(resolve_precision("auto", trainer.get("accelerator"), "trainer.precision"))
    zero, off_opt, off_par = _deepspeed(trainer)
    notes = []
    if run.data.path is not None or run.data.name is not None:
        notes.append("the corpus itself is not counted (its size is known only once read)")
    return RunFacts(
        target,
        shapes.get("draft"),
        run,
        tuple(stages),
        device,
        per_node * nodes,
        per_node,
        precision.startswith(("bf16", "16")),
        zero,
        off_opt,
        off_par,
        tuple(notes),
    )


def _devices(devices: Any, device: str) -> int:
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    if str(devices).isdigit() and int(devices) > 0:
        return int(devices)
    if device == "cuda":  # auto / -1: every visible one
        import torch

        return max(torch.cuda.device_count(), 1)
    return 1


def _deepspeed(trainer: dict) -> tuple[int, bool, bool]:
    """(ZeRO stage, optimizer offloaded, parameters offloaded) of trainer.deepspeed_config."""
    if trainer.get("strategy") != "deepspeed":
        return 0, False, False
    import json

    from pipeline.lit.trainer import deepspeed_config_path

    ds = json.loads(
        deepspeed_config_path(trainer.get("deepspeed_config") or "zero2.json").read_text()
    )
    zero = ds.get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return str((zero.get(key) or {}).get("device", "none")) in ("cpu", "nvme")

    return int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param")


# ---- shared pieces ------------------------------------------------------------------------


def train_activations(
    s: ModelShape, tokens: int, seq: int, elem: int, layers: int | None = None, eager=False
) -> int:
    """What autograd keeps of `tokens` tokens (windows of `seq`) through `layers` blocks: per
    token and block the norms, q/k/v/o, gate/up/down inputs; eager attention also keeps its
    (heads, seq) scores and probabilities, which SDPA's fused kernels recompute instead."""
    per_token = 10 * s.hidden + 4 * s.intermediate + 2 * s.kv_width + 2 * s.heads * seq * eager
    return (s.layers if layers is None else layers) * tokens * per_token * elem


def forward_activations(s: ModelShape, tokens: int, seq: int, elem: int, eager=False) -> int:
    """One block's working set without gradients (the residual stream, MLP, attention)."""
    return tokens * (4 * s.hidden + 3 * s.intermediate + 2 * s.heads * seq * eager) * elem


def logits(s: ModelShape, tokens: int, copies: int) -> int:
    """(tokens, vocab) float32 logits and the copies the loss makes of them."""
    return tokens * s.vocab * 4 * copies


def quantized_model(s: ModelShape, float_bytes: int, group: int) -> int:
    """A fake-quant model as loaded (pipeline.models.quantized): uint8 codes, float32 scales and
    zeros, the unquantized tensors in `float_bytes`."""
    floats = s.embed_params + s.head_params + s.layers * 2 * s.hidden + s.hidden
    return s.linear_params + scales(s, group) * 4 + floats * float_bytes


def scales(s: ModelShape, group: int) -> int:
    """Scales and zero points of every block linear at `group` weights per group (0: a row)."""
    if group <= 0:
        return 2 * s.layers * (2 * s.attn_width + 2 * s.kv_width + 2 * s.intermediate + s.hidden)
    return 2 * math.ceil(s.linear_params / group)


def smallest_group(run: RunConfig) -> int:
    groups = [f.group_size for f in run.quant.formats if f.kind != "float"]
    positive = [g for g in groups if g > 0]
    return min(positive) if positive else 0


def peak(phases: Iterable[tuple[Terms, Terms]]) -> tuple[Terms, Terms]:
    """The device terms of the phase with the most on the device, the host terms likewise."""
    phases = list(phases)
    device = max((d for d, _ in phases), key=lambda t: sum(t.values()))
    host = max((h for _, h in phases), key=lambda t: sum(t.values()))
    return device, host


def with_facts(facts: RunFacts, **changes: Any) -> RunFacts:
    return replace(facts, **changes)


def with_quant(facts: RunFacts, **changes: Any) -> RunFacts:
    return replace(facts, run=replace(facts.run, quant=replace(facts.run.quant, **changes)))


def nested(obj: Any, **changes: Any) -> Any:
    """`obj` (a frozen dataclass) with `changes`; `train__batch` changes `obj.train.batch`."""
    direct = {k: v for k, v in changes.items() if "__" not in k}
    for key, value in changes.items():
        if "__" in key:
            outer, inner = key.split("__", 1)
            direct[outer] = nested(getattr(obj, outer), **{inner: value})
    return replace(obj, **direct)


Fixes = list[tuple[str, RunFacts, Any]]


@dataclass(frozen=True)
class Estimate:
    """A stage's estimate (`plan`) and the settings that lower it (`fixes`), cheapest first."""

    plan: Callable[[RunFacts, Any], tuple[Terms, Terms]]
    fixes: Callable[[RunFacts, Any], Fixes] = field(default=lambda facts, cfg: [])
