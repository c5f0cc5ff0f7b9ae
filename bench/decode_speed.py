"""Batch-1 decode speed of the torch runtime's packed kernels against FP32, per weight format.

A random-weight Llama (TinyLlama-1.1B's shape by default; speed does not depend on the
weights' values) is built in memory, and each row runs it one way, one row at a time:

* ``FP32`` as built, its float32 linears of >= 4 MiB on the runtime's few-row kernel
  (``float_rows``: ``f32rows``, for one-token steps and verification's gamma + 1 rows; prompts
  run ``F.linear``); ``BF16``: the whole model cast to bfloat16;
* ``W8``, ``W4g128``, ``W3``, ``W2``, ``exp4``: every decoder-layer linear quantized by RTN
  (int8, int4g128, int3g128, int2g64, exp4g128) and replaced by the runtime's layer
  (``runtime_linear``: the export's packing, the kernel ``load`` picks); embeddings, norms and
  lm_head stay float32, as the quantize stage keeps them (lm_head on ``f32rows``; ``--head
  int8`` quantizes it too, as ``quant.keep_float=[embed_tokens]`` lets the plan do). exp4 codes
  are fitted once per weight shape (RTN's exp grid search would take most of the run) and
  copied to every layer.

``<row>@torch`` (FP32, W8, W4g128, W3, W2) runs the same row on torch's own kernels alone:
float linears on ``F.linear`` (MKL) and int layers on ``int4pack`` / ``int8pack``, what the
runtime falls back to without lowbit's CPU kernels; ``x torch`` divides a row's tokens/s by its
``@torch`` row's, measured side by side in the same run. lowbit's kernels run on the ISA
``pipeline.cpu_ext`` picks (``LOWBIT_CPU_ISA``: auto, avx512gfni, avx512, avx2, none); every
output names it and the CPU.

Per row: decode tokens/s (greedy ``plain_generate``, on ``pipeline.models.lean``'s forward as the
runtime decodes, prompt excluded: the n - 1 steps after the prompt's forward, timed within each
pass; the rows are measured in turn ``--rounds`` times, and a row's tokens/s is its median over
the rounds, its ``x`` columns the medians of the rounds' ratios, so that a slow spell of a
shared machine (which moved single-pass ratios by 30%) falls on every row alike), the kernels
the layers run, the bytes one decode step reads (every parameter and buffer of the forward, one
embedding row, and the KV cache at the mean context of the timed steps), and the bandwidth
limit: copy bandwidth / bytes per token, with the copy bandwidth measured in the same run
(STREAM-like ``dst.copy_(src)``, which reads and writes: 2 x bytes / time, best of 5 at each
round's start, and of the rounds). ``of limit`` is how close a format comes to what memory
bandwidth allows.

Crossover: FP32 against W4g128 at the ``--crossover-widths`` (``--crossover-layers`` layers,
intermediate 3 x width and the ``--crossover-vocab`` of the embedded default model): on tiny
models per-call overhead hides what the packed weights save, and the table shows from which
width they pay.

Speculative decoding with the W4g128 model as target: a draft made of the target's own first
``--draft-layers`` layers (shared, no extra memory) and an ``--draft-head`` copy of its
lm_head. So that this draft agrees with the target (alpha high by construction, which random
weights never give two independent models), the layers after the draft's write to the residual
stream scaled by ``--tail-scale`` (their o_proj and down_proj; values only, their cost is
unchanged; 0.01 gave alpha ~0.8 on 22-layer models, 0 gives ~0.93, what the int8 head and bf16
activations leave). Reported, as ``pipeline.runtime.speed.decode_speed`` times a run's pairs:
alpha, tau, the measured cost ratio c, the measured speed-up (speculative / plain tokens/s of
the target, medians of ``--rounds`` x ``--repeats`` decodes, prompt included), the theoretical
one tau / (gamma c + 1); and ``v``: what one verification (a gamma + 1 token forward of the target)
costs in single-token steps. The theory takes v = 1, as on memory-bound hardware; where
v > 1 (CPU kernels whose time grows with the tokens) ``theory at v`` = tau / (gamma c + v)
is the speed-up to expect.

Goals (exit 1 when one is missed, or cannot be checked for want of its rows): speculative
measured speed-up >= 0.8 x theoretical at every one of the ``--gammas`` (2 to 5 by default);
W2 >= 1.5 x, W3 >= 1.2 x and exp4 >= 0.8 x W4g128's tokens/s; and on AVX-512 (or
torch's kernels) W4g128 >= 1.8 x FP32 tokens/s, W8 >= 1.5 x FP32; on AVX2 (issue 29) W4g128 and
W8 each >= 0.65 of their bandwidth limit, W4g128 >= 1.7 x and W8 >= 1.3 x their ``@torch`` rows,
FP32 >= 1 x ``FP32@torch``, and v <= 1.3 at every gamma up to 4 (verifying up to 5 rows). On
AVX2 the default ``--rows`` add FP32@torch, W8@torch and W4g128@torch. ``--skip-goal TEXT``
leaves out each goal whose name contains TEXT (e.g. ``--skip-goal W8`` with ``--rows FP32,W4g128``).

Usage:
  python -m bench.decode_speed                                  # ~1.1B, the full measurement
  python -m bench.decode_speed --hidden 512 --layers 2 --intermediate 1408 --vocab 4096 \\
      --new-tokens 16 --crossover-widths 256,512                # smoke
  LOWBIT_CPU_ISA=avx2 python -m bench.decode_speed --threads 2 --crossover-widths '' \\
      --rows FP32,FP32@torch,W8,W8@torch,W4g128,W4g128@torch   # AVX2 against torch's kernels
  LOWBIT_CPU_ISA=avx2 python -m bench.decode_speed --threads 2 --head int8 --crossover-widths '' \\
      --gammas '' --rows W4g128,W3,W2 --skip-goal FP32 --skip-goal W8 --skip-goal exp4 \\
      --skip-goal speculative --skip-goal v: --skip-goal @torch       # the lm_head in int8 too
  [--rows FP32,W4g128,...] [--threads N] [--rounds 9] [--repeats 1] [--gammas 2,3,4,5]
  [--temperature 0] [--out bench-out/decode_speed] [--mlflow URI] [--skip-goal TEXT ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from bench._common import (
    add_goal_args,
    cpu_kernels,
    goal,
    hwm_mib,
    log_mlflow,
    machine,
    markdown_table,
    report_goals,
    result_table,
    unmeasured,
    write_csv,
    write_result,
)
from pipeline import cpu_ext
from pipeline.runtime import float_rows

ROWS = {  # row: the decoder linears' format (None: float, in the dtype the row casts to)
    "FP32": None,
    "BF16": None,
    "W8": "int8",
    "W4g128": "int4g128",
    "W3": "int3g128",
    "W2": "int2g64",
    "exp4": "exp4g128",
}
TORCH = "@torch"  # a row's suffix: the same row on torch's own kernels
TORCH_ROWS = ("FP32", "W8", "W4g128", "W3", "W2")  # rows whose kernels differ from torch's
SPEC_TARGET = "W4g128"
GOALS = {"W4g128": 1.8, "W8": 1.5}  # row: tokens/s it must reach, as a multiple of FP32
SPEC_GOAL = 0.8  # measured speed-up / theoretical, at every timed gamma
# row: tokens/s it must reach as a multiple of W4g128's on every ISA (bandwidth-bound: the bytes
# a step reads fall with the bits; exp4 pays a LUT lookup per weight)
SUB4_GOALS = {"W2": 1.5, "W3": 1.2, "exp4": 0.8}
# AVX2 (issue 29): a row's "of limit" and tokens/s as a multiple of its @torch row's, and the
# verification cost v at up to AVX2_V_ROWS rows
AVX2_OF_LIMIT = {"W4g128": 0.65, "W8": 0.65}
AVX2_X_TORCH = {"W4g128": 1.7, "W8": 1.3, "FP32": 1.0}
AVX2_V, AVX2_V_ROWS = 1.3, 5
COLUMNS = ("row", "isa", "kernels", "MB/token", "tok/s", "limit tok/s", "of limit", "x FP32",
           "x W4g128", "x torch")  # fmt: skip
CROSS_COLUMNS = ("width", "params M", "FP32 tok/s", "W4g128 tok/s", "W4g128 / FP32", "kernels")
SPEC_COLUMNS = (
    "target", "draft", "gamma", "alpha", "tau", "c", "spec tok/s", "plain tok/s",
    "measured", "theoretical", "measured / theoretical", "v", "theory at v",
)  # fmt: skip


def llama(
    hidden: int, layers: int, intermediate: int, vocab: int, kv_heads: int, *, meta=False
) -> nn.Module:
    """A random float32 Llama (HF init: std 0.02, so activations stay finite), in eval mode."""
    from transformers import AutoModelForCausalLM

    from pipeline.models.synthetic import synthetic_config

    heads = max(1, hidden // 64)
    config = synthetic_config(
        hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
        kv_heads=math.gcd(kv_heads, heads), vocab=vocab, dtype=torch.float32,
        initializer_range=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(config).eval()


@contextlib.contextmanager
def torch_kernels(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` on torch's own kernels, restored after: its ``FloatRowsLinear`` layers as plain
    ``nn.Linear`` (parameters shared), and layers built inside on int4pack / int8pack."""
    swapped = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, float_rows.FloatRowsLinear):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=False, device="meta")
            lin.weight, lin.bias = mod.weight, mod.bias
            swapped[name] = mod
            model.set_submodule(name, lin)
    try:
        with cpu_ext.forced_isa(None):
            yield model
    finally:
        for name, mod in swapped.items():
            model.set_submodule(name, mod)


@contextlib.contextmanager
def run_as(model: nn.Module, row: str, head: str = "float") -> Iterator[nn.Module]:
    """``model`` as ``row`` runs it (decoder linears swapped or the model cast), restored after;
    a quantized row's lm_head in ``head`` (a format, or "float": kept)."""
    if row.endswith(TORCH):
        with torch_kernels(model), run_as(model, row.removesuffix(TORCH), head) as m:
            yield m
        return
    if row == "BF16":
        # An in-place cast: no second copy of the model. Casting back leaves the weights
        # rounded to bf16, which no later row's speed depends on.
        model.to(torch.bfloat16)
        try:
            yield model
        finally:
            model.float()
        return
    with swapped(model, row_layers(model, row, head)) as m:
        yield m


def row_layers(model: nn.Module, row: str, head: str = "float") -> dict[str, nn.Module] | None:
    """The runtime layers ``row`` swaps into ``model`` ({} for FP32), or None where the row is
    not a swap of layers (BF16 casts the model, ``@torch`` rows rebuild theirs)."""
    if row.endswith(TORCH) or row == "BF16":
        return None
    fmt = ROWS[row]
    if fmt is None:
        return {}
    return built_linears(model, lambda name: fmt, None if head == "float" else head)


@contextlib.contextmanager
def quantized_linears(model: nn.Module, fmt_of, head: str | None = None) -> Iterator[nn.Module]:
    """``model`` with :func:`built_linears` swapped in; the float layers are put back on exit."""
    with swapped(model, built_linears(model, fmt_of, head)) as m:
        yield m


def built_linears(model: nn.Module, fmt_of, head: str | None = None) -> dict[str, nn.Module]:
    """Each decoder-layer linear ``name`` of ``model`` quantized by RTN to ``fmt_of(name)``
    (None: left out) and the lm_head to ``head`` (None: left out), as the runtime's layers."""
    from pipeline.models.adapters import linear_names
    from pipeline.quant.formats import parse_format
    from pipeline.quant.rtn import quantize_rtn
    from pipeline.runtime.inmemory import runtime_linear

    # RTN's exp grid search takes minutes per 1B-model layer type; speed does not depend on
    # the codes' values, so exp codes are fitted once per weight shape (each layer still gets
    # its own packed copy, read from memory like any other).
    fitted = {}  # (weight shape, format) -> its codes (exp formats only)
    layers = {}
    for name in [*linear_names(model.config, include_lm_head=False), "lm_head"]:
        fmt = fmt_of(name) if name != "lm_head" else head
        if fmt is None:
            continue
        lin = model.get_submodule(name)
        key = (tuple(lin.weight.shape), fmt)
        qt = fitted[key] if key in fitted else quantize_rtn(lin.weight, fmt)
        if parse_format(fmt).kind == "exp":
            fitted[key] = qt
        layers[name] = runtime_linear(name, qt, lin.bias)
    return layers


@contextlib.contextmanager
def swapped(model: nn.Module, layers: dict[str, nn.Module]) -> Iterator[nn.Module]:
    """``model`` with ``layers`` ({submodule name: layer}) in place; the old ones put back."""
    saved = {name: model.get_submodule(name) for name in layers}
    try:
        for name, layer in layers.items():
            model.set_submodule(name, layer)
        yield model
    finally:
        for name, layer in saved.items():
            model.set_submodule(name, layer)


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: 2 x bytes / time of ``dst.copy_(src)``, best of ``repeats``."""
    src = torch.ones(mib * 2**20 // 4)  # written, so no first-touch page faults are timed
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms up the threads
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def bytes_per_token(model: nn.Module, context: float) -> int:
    """Bytes one decode step reads: parameters and buffers, one embedding row, the KV cache.

    Args:
        context: Mean number of cached positions each step's attention reads.
    """
    from pipeline.runtime.speed import kv_cache_bytes, weight_bytes

    embed = model.get_input_embeddings().weight
    total = weight_bytes(model)
    head = getattr(model.get_output_embeddings(), "weight", None)  # None: a quantized head
    if head is None or head.data_ptr() != embed.data_ptr():
        total -= embed.nbytes - embed[0].nbytes  # an untied embedding is read one row a step
    return int(total + kv_cache_bytes(model, context))


def decode_rate(
    model: nn.Module, prompt: torch.Tensor, n: int, repeats: int, warm_up: bool = True
) -> float:
    """Decode tokens/s without the prompt: (n - 1) / (seconds - prefill_seconds) of a greedy
    ``plain_generate`` pass (the n - 1 steps after the prompt's forward, timed within the pass),
    the median of ``repeats`` passes, after an untimed one if ``warm_up``."""
    from pipeline.speculative.decoding import plain_generate

    if warm_up:  # the allocator, the kernels' first calls
        plain_generate(model, prompt, n, temperature=0.0)
    runs = [plain_generate(model, prompt, n, temperature=0.0)[1] for _ in range(repeats)]
    return statistics.median((n - 1) / max(s.seconds - s.prefill_seconds, 1e-9) for s in runs)


def measure_rows(
    model: nn.Module, args: argparse.Namespace, prompt: torch.Tensor, info: dict
) -> tuple[list[dict], dict | None]:
    """One row per ``--rows`` entry, each measured once per ``--rounds`` round (rows in turn, so
    that a slow spell of a shared machine falls on every row alike), and a speculative row per
    ``--gammas`` entry (in the first round, while the W4g128 model exists). The copy bandwidth
    is measured at each round's start, and the best goes into ``info``: one measured in a slow
    spell put rows above their limit."""
    from pipeline.runtime.backends import kernel_summary

    names, spec = args.rows.split(","), []
    rates: dict[str, list[float]] = {row: [] for row in names}
    context = args.prompt_len + args.new_tokens / 2
    # Every row's layers built once and held (the 1.1 B model's W8, W4g128, W3, W2 and exp4
    # together: ~3 GB beside its 4.4 GB of float32), so a round swaps them in and its rows run
    # seconds apart, not a build apart; a BF16 or @torch row is rebuilt each round.
    layers, built = {}, {}
    for row in names:
        t0 = time.perf_counter()
        layers[row] = row_layers(model, row, args.head)
        built[row] = time.perf_counter() - t0
    rows = {}
    for round_ in range(args.rounds):
        bandwidth = copy_bandwidth(args.copy_mib)
        print(f"round {round_ + 1}/{args.rounds} copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
        info["bandwidth_bytes_s"] = max(bandwidth, info.get("bandwidth_bytes_s", 0.0))
        for row in names:
            t0 = time.perf_counter()
            held = layers[row] is not None
            with swapped(model, layers[row]) if held else run_as(model, row, args.head) as m:
                if not held and round_ == 0:
                    built[row] = time.perf_counter() - t0
                # held layers stay warm from one round to the next
                warm_up = round_ == 0 or not held
                rates[row].append(decode_rate(m, prompt, args.new_tokens, args.repeats, warm_up))
                print(
                    f"round {round_ + 1}/{args.rounds} {row}: {rates[row][-1]:.3f} tok/s",
                    flush=True,
                )
                if round_ == 0:
                    nbytes = bytes_per_token(m, context)
                    rows[row] = {
                        "row": row, "isa": cpu_ext.isa() or "torch",
                        "kernels": kernel_summary(m) or str(m.dtype).removeprefix("torch."),
                        "MB/token": nbytes / 1e6,
                    }  # fmt: skip
                if round_ == 0 and row == SPEC_TARGET and args.gammas:
                    spec = [speculative_row(m, args, prompt, g) for g in args.gammas]
                    for r in spec:
                        print(r, flush=True)

    def ratio(row: str, to: str) -> float | None:  # median over rounds of the rounds' ratios
        return (
            statistics.median(a / b for a, b in zip(rates[row], rates[to])) if to in rates else None
        )

    for row, r in rows.items():
        r["build s"] = built[row]
        limit = info["bandwidth_bytes_s"] / (r["MB/token"] * 1e6)
        r["tok/s"] = statistics.median(rates[row])
        r.update({"limit tok/s": limit, "of limit": r["tok/s"] / limit})
        r["x FP32"], r["x W4g128"] = ratio(row, "FP32"), ratio(row, "W4g128")
        r["x torch"] = ratio(row, row + TORCH)
    return list(rows.values()), spec


def damp_tail(model: nn.Module, first: int, scale: float) -> None:
    """Scale what layers ``first``.. write to the residual stream (o_proj, down_proj) by ``scale``.

    The first ``first`` layers then decide the output, so a draft made of them agrees with the
    target: alpha is high by construction. Weight values do not change any layer's cost.
    """
    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def shallow_draft(target: nn.Module, args: argparse.Namespace) -> nn.Module:
    """The target's embedding, first ``--draft-layers`` layers and norm (shared, not copied),
    and an ``--draft-head`` copy of its float lm_head (a quantized one, ``--head``, is shared
    too): a self-draft costing a fraction of a step."""
    from pipeline.quant.rtn import quantize_rtn
    from pipeline.runtime.inmemory import runtime_linear

    cfg = target.config
    draft = llama(cfg.hidden_size, args.draft_layers, cfg.intermediate_size, cfg.vocab_size,
                  cfg.num_key_value_heads, meta=True)  # fmt: skip
    for name in ("embed_tokens", "norm", "rotary_emb"):
        setattr(draft.model, name, getattr(target.model, name))
    draft.model.layers = nn.ModuleList(target.model.layers[: args.draft_layers])
    head = target.get_output_embeddings()
    if isinstance(head, nn.Linear):
        head = runtime_linear("lm_head", quantize_rtn(head.weight.float(), args.draft_head))
    draft.lm_head = head
    return draft.eval()


def samples(args: argparse.Namespace) -> int:
    """Decodes a measurement outside the rows' rounds takes its median of."""
    return args.repeats * args.rounds


def speculative_row(
    target: nn.Module, args: argparse.Namespace, prompt: torch.Tensor, gamma: int
) -> dict:
    """Speculative against plain decoding of ``target`` (``pipeline.runtime.speed``), and v."""
    from pipeline.runtime.speed import decode_speed

    draft = shallow_draft(target, args)
    speed = decode_speed(
        {"target": target, "draft": draft}, [("draft", "target")], [prompt],
        new_tokens=args.new_tokens, gamma=gamma, temperature=args.temperature,
        repeats=samples(args),
    )  # fmt: skip
    (pair,) = speed["speculative"].values()
    return {
        "target": SPEC_TARGET,
        "draft": f"{args.draft_layers} of its layers + {args.draft_head} lm_head",
        "gamma": gamma, "alpha": pair["alpha"], "tau": pair["tau"], "c": pair["cost_ratio"],
        "spec tok/s": pair["tokens_per_s"], "plain tok/s": speed["plain"]["target"]["tokens_per_s"],
        "measured": pair["speedup"], "theoretical": pair["theoretical_speedup"],
        "measured / theoretical": pair["of_theory"], "v": pair["verify_cost"],
        "theory at v": pair["theory_at_v"],
    }  # fmt: skip


def crossover(args: argparse.Namespace) -> list[dict]:
    """FP32 against W4g128 decode tokens/s at each ``--crossover-widths`` width."""
    from pipeline.runtime.backends import kernel_summary

    rows = []
    for width in [int(w) for w in args.crossover_widths.split(",") if w]:
        model = llama(width, args.crossover_layers, 3 * width, args.crossover_vocab,
                      args.kv_heads)  # fmt: skip
        float_rows.convert(model)
        prompt = random_prompt(args.crossover_vocab, args.prompt_len)
        fp = decode_rate(model, prompt, args.new_tokens, samples(args))
        with run_as(model, "W4g128") as m:
            w4 = decode_rate(m, prompt, args.new_tokens, samples(args))
            kernels = kernel_summary(m)
        rows.append({
            "width": width, "params M": sum(p.numel() for p in model.parameters()) / 1e6,
            "FP32 tok/s": fp, "W4g128 tok/s": w4, "W4g128 / FP32": w4 / fp, "kernels": kernels,
        })  # fmt: skip
        print(rows[-1], flush=True)
        del model
    return rows


def crossover_width(rows: list[dict]) -> int | None:
    """The smallest width from which on W4g128 beats FP32 at every larger width, or None."""
    first = None
    for r in sorted(rows, key=lambda r: r["width"], reverse=True):
        if r["W4g128 / FP32"] <= 1:
            break
        first = r["width"]
    return first


def random_prompt(vocab: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def check_goals(rows: list[dict], spec: list[dict], isa: str | None) -> list[dict]:
    """The goals of ``isa``'s kernels (on AVX2 issue 29's, elsewhere the multiples of FP32), the
    sub-4-bit rows against W4g128, and speculative decoding at every timed gamma; each one
    checked, or missed for want of its rows."""
    by_row = {r["row"]: r for r in rows}
    if isa == "avx2":
        goals = avx2_goals(by_row, spec)
    else:
        goals = [
            _at_least(f"{row} tok/s / FP32 tok/s", by_row, row, "x FP32", (row, "FP32"), want)
            for row, want in GOALS.items()
        ]
    goals += [
        _at_least(f"{row} tok/s / W4g128 tok/s", by_row, row, "x W4g128", (row, "W4g128"), want)
        for row, want in SUB4_GOALS.items()
    ]
    name, want = "speculative measured / theoretical speed-up", f">= {SPEC_GOAL}"
    if not spec:
        goals.append(unmeasured(name, want, f"needs the {SPEC_TARGET} row and --gammas"))
    # every gamma a user might run, not the best of them (a goal met at one gamma only would
    # hide the draft lengths where the kernels' cost per verified row eats the speed-up)
    for r in spec:
        ratio = r["measured / theoretical"]
        goals.append(goal(f"{name} (gamma {r['gamma']})", ratio, want, ratio >= SPEC_GOAL))
    return goals


def _at_least(
    name: str, by_row: dict[str, dict], row: str, key: str, needs: tuple[str, ...], want: float
) -> dict:
    """``by_row[row][key] >= want``; missed, naming the rows to add, when it was not measured."""
    value = by_row.get(row, {}).get(key)
    if value is None:
        missing = [r for r in needs if r not in by_row] or list(needs)
        return unmeasured(name, f">= {want}", f"add {','.join(missing)} to --rows")
    return goal(name, value, f">= {want}", value >= want)


def avx2_goals(by_row: dict[str, dict], spec: list[dict]) -> list[dict]:
    """Issue 29's goals for the AVX2 kernels; one whose rows were not measured is missed."""
    goals = [
        _at_least(f"{row} of bandwidth limit", by_row, row, "of limit", (row,), want)
        for row, want in AVX2_OF_LIMIT.items()
    ]
    goals += [
        _at_least(f"{row} tok/s / {row}{TORCH} tok/s", by_row, row, "x torch",
                  (row, row + TORCH), want)
        for row, want in AVX2_X_TORCH.items()
    ]  # fmt: skip
    vs = [r["v"] for r in spec if r["gamma"] + 1 <= AVX2_V_ROWS]
    name = f"v: verifying up to {AVX2_V_ROWS} rows, in single-row steps (worst gamma)"
    if not vs:
        goals.append(unmeasured(name, f"<= {AVX2_V}", f"needs the {SPEC_TARGET} row and --gammas"))
    else:
        goals.append(goal(name, max(vs), f"<= {AVX2_V}", max(vs) <= AVX2_V))
    return goals


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-heads", type=int, default=4, help="cut to a divisor of hidden / 64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="decodes per row and round (median)")
    p.add_argument(
        "--rounds",
        type=int,
        default=9,
        help="rows measured in turn this many times; medians over rounds",
    )
    rows_help = (f"a subset of {','.join(ROWS)} and {TORCH} rows of {','.join(TORCH_ROWS)} "
                 f"(default: all {len(ROWS)}; on AVX2 also FP32, W8, W4g128{TORCH})")  # fmt: skip
    p.add_argument("--rows", default=None, help=rows_help)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--copy-mib", type=int, default=512, help="each copy buffer, MiB of float32")
    p.add_argument("--crossover-widths", default="128,256,512,1024,2048", help="'' skips it")
    p.add_argument("--crossover-layers", type=int, default=2)
    p.add_argument("--crossover-vocab", type=int, default=2048)
    p.add_argument("--gammas", default="2,3,4,5", help="draft lengths to time; '' skips")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft-layers", type=int, default=None, help="default: a quarter of them")
    p.add_argument("--head", default="float",
                   help="the quantized rows' lm_head: float (as quantize.keep_float keeps it) "
                   "or a format (int8: quant.keep_float=[embed_tokens] plans it)")  # fmt: skip
    p.add_argument("--draft-head", default="int8", help="the draft's lm_head format")
    p.add_argument("--tail-scale", type=float, default=0.01,
                   help="residual writes of the layers after the draft's")  # fmt: skip
    p.add_argument("--out", default="bench-out/decode_speed")
    p.add_argument("--mlflow", default=None, help="tracking URI to log the rows to")
    add_goal_args(p)
    args = p.parse_args()
    if args.rows is None:
        extra = [f"{r}{TORCH}" for r in ("FP32", "W8", "W4g128")] if cpu_ext.isa() == "avx2" else []
        args.rows = ",".join([*ROWS, *extra])
    known = [*ROWS, *(f"{r}{TORCH}" for r in TORCH_ROWS)]
    unknown = set(args.rows.split(",")) - set(known)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; choose from {','.join(known)}")
    args.gammas = [int(g) for g in args.gammas.split(",") if g]
    args.draft_layers = args.draft_layers or max(1, args.layers // 4)
    if not 0 < args.draft_layers < args.layers and args.gammas:
        p.error(f"--draft-layers must lie in [1, {args.layers - 1}] (or --gammas '')")
    return args


def report(
    args: argparse.Namespace, info: dict, rows: list[dict], cross: list[dict], spec: list[dict]
) -> int:
    """Print and write the tables (md, csv, json), log to MLflow; the exit status of the goals."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [
        f"machine: {info['machine']}\nlowbit CPU kernels: {info['isa']}; threads "
        f"{info['threads']}; copy bandwidth {info['bandwidth_bytes_s'] / 1e9:.1f} GB/s; "
        f"peak RSS {info['peak_rss_mib']:.0f} MiB\n"
        f"model: {info['params'] / 1e9:.3f}B params, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens; rows: medians over {args.rounds} rounds of "
        f"{args.repeats}, the rest: of {samples(args)}",
        markdown_table(rows, COLUMNS),
    ]
    width = crossover_width(cross)
    if cross:
        beats = f"from width {width} on" if width is not None else "at none of the widths"
        parts += [
            f"crossover ({args.crossover_layers} layers, vocab {args.crossover_vocab}): "
            f"W4g128 beats FP32 {beats}",
            markdown_table(cross, CROSS_COLUMNS),
        ]
    if spec:
        parts.append(markdown_table(spec, SPEC_COLUMNS))
    text = "\n\n".join(parts)
    print("\n" + text)
    (out / "decode_speed.md").write_text(text + "\n")
    write_csv(out / "decode_speed.csv", rows, (*COLUMNS, "build s"))
    write_csv(out / "crossover.csv", cross, CROSS_COLUMNS)
    goals = check_goals(rows, spec, cpu_ext.isa())
    (out / "decode_speed.json").write_text(json.dumps({
        **info, "args": vars(args), "rows": rows, "crossover": cross, "crossover_width": width,
        "speculative": spec, "goals": goals,
    }, indent=1))  # fmt: skip
    log_mlflow(
        args.mlflow, "lowbit-bench", "decode_speed", rows, "row", vars(args),
        [out / "decode_speed.md", out / "decode_speed.json"],
    )  # fmt: skip
    tables = [result_table("decode speed", rows, COLUMNS),
              result_table(f"crossover ({args.crossover_layers} layers)", cross, CROSS_COLUMNS),
              result_table("speculative decoding", spec, SPEC_COLUMNS)]  # fmt: skip
    notes = parts[0].splitlines()[1:]  # the machine line is the result's own
    write_result(out, "decode_speed", tables, goals, args.skip_goal, notes)
    return report_goals(goals, out, args.skip_goal)


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = {"machine": machine(), "isa": cpu_kernels(), "threads": torch.get_num_threads()}
    print(f"machine: {info['machine']}\nlowbit CPU kernels: {info['isa']}\n"
          f"threads: {info['threads']}", flush=True)  # fmt: skip
    model = llama(args.hidden, args.layers, args.intermediate, args.vocab, args.kv_heads)
    damp_tail(model, args.draft_layers, args.tail_scale)
    float_rows.convert(model)  # float32 layers as the runtime runs them (every row's lm_head)
    info["params"] = sum(p.numel() for p in model.parameters())
    print(f"model: {info['params'] / 1e9:.3f}B params", flush=True)
    rows, spec = measure_rows(model, args, random_prompt(args.vocab, args.prompt_len), info)
    del model
    cross = crossover(args)
    info["peak_rss_mib"] = hwm_mib()
    return report(args, info, rows, cross, spec)


if __name__ == "__main__":
    sys.exit(main())
