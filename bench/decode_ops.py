"""Plain greedy decoding with the CPU extension's decode ops (``csrc/decode_ops.cpp``) between
a layer's matmuls, against torch's ops between the same kernels, on several model shapes.

The lean forward (``pipeline/models/lean.py``) runs one sequence's few rows through three
extension calls a layer (residual add + RMSNorm, rotary embedding + cache write + attention,
SiLU * up) and calls the runtime's kernels as plain functions; without them each layer costs
~50 torch calls. Each shape is a random float32 Llama (``bench.decode_speed.llama``); each row
swaps its decoder linears once (RTN, the lm_head as ``--head``) and is decoded with and without
the ops in turn (``cpu_ext.forced_isa(None)`` turns them off; the built kernels stay), the order
flipped every round; a cell is the median over ``--rounds`` of the per-round ratio.

Goal (exit 1 when missed, or when the ops do not run here): the ops never slower, ratio >= 1
in every (shape, row); the figures name the CPU (flags) and commit.

Usage:
  python -m bench.decode_ops --threads 2 [--shapes 2048x22,512x8,256x4] [--rows FP32,W4g128,W2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from bench._common import (
    add_goal_args,
    cpu_kernels,
    goal,
    machine,
    markdown_table,
    report_goals,
    result_table,
    unmeasured,
    write_csv,
    write_result,
)
from bench.decode_speed import ROWS, decode_rate, llama, random_prompt, row_layers, swapped
from pipeline import cpu_ext
from pipeline.runtime import float_rows

GOAL = "tokens/s with the decode ops / without"
COLUMNS = ("shape", "params M", "row", "tok/s with", "tok/s without", "with / without",
           "min-max")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2048x22,512x8,256x4",
                   help="hidden x layers of each model (intermediate 2.75 x hidden)")  # fmt: skip
    p.add_argument("--rows", default="FP32,W4g128,W2", help=f"a subset of {','.join(ROWS)}")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head", default="int8", help="the quantized rows' lm_head: float or a format")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="bench-out/decode_ops")
    add_goal_args(p)
    args = p.parse_args()
    try:
        args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        p.error(f"--shapes must be HIDDENxLAYERS,... (e.g. 2048x22), got {args.shapes!r}")
    if bad := sorted(set(args.rows.split(",")) - {r for r in ROWS if r != "BF16"}):
        p.error(f"unknown rows {bad}; choose from {','.join(r for r in ROWS if r != 'BF16')}")
    return args


def measure_shape(args: argparse.Namespace, hidden: int, layers: int) -> list[dict]:
    """One row per ``--rows`` entry on one model shape: rates with and without the ops."""
    model = llama(hidden, layers, 11 * hidden // 4 // 16 * 16, args.vocab, args.kv_heads)
    float_rows.convert(model)  # float32 layers as the runtime runs them (FP32's, a float head)
    prompt = random_prompt(args.vocab, args.prompt_len)
    built = {row: row_layers(model, row, args.head) for row in args.rows.split(",")}
    rates = {(row, on): [] for row in built for on in (True, False)}
    for r in range(args.rounds):
        for row, swaps in built.items():
            with swapped(model, swaps):
                for on in (True, False) if r % 2 == 0 else (False, True):
                    with cpu_ext.forced_isa(cpu_ext.isa() if on else None):
                        rate = decode_rate(model, prompt, args.new_tokens, 1, warm_up=r == 0)
                    rates[row, on].append(rate)
    out = []
    for row in built:
        ratios = [a / b for a, b in zip(rates[row, True], rates[row, False])]
        out.append({
            "shape": f"{hidden}x{layers}",
            "params M": sum(p.numel() for p in model.parameters()) / 1e6,
            "row": row,
            "tok/s with": statistics.median(rates[row, True]),
            "tok/s without": statistics.median(rates[row, False]),
            "with / without": statistics.median(ratios),
            "min-max": f"{min(ratios):.2f}-{max(ratios):.2f}",
        })  # fmt: skip
        print(markdown_table(out[-1:], COLUMNS).splitlines()[-1], flush=True)
    return out


def main() -> int:
    args = parse_args()
    if cpu_ext.extension() is None:  # the goal cannot be checked here
        why = f"lowbit's CPU kernels do not run here ({cpu_kernels()})"
        return report_goals([unmeasured(GOAL, ">= 1", why)], skip=args.skip_goal)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [r for hidden, layers in args.shapes for r in measure_shape(args, hidden, layers)]
    text = (f"machine: {machine()}\ndecode ops: {cpu_kernels()}; "
            f"threads {torch.get_num_threads()}; prompt {args.prompt_len}, "
            f"{args.new_tokens} new tokens, lm_head {args.head}; "
            f"medians of {args.rounds} rounds\n\n" + markdown_table(rows, COLUMNS))  # fmt: skip
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_ops.md").write_text(text + "\n")
    write_csv(out / "decode_ops.csv", rows, COLUMNS)
    worst = min(rows, key=lambda r: r["with / without"])
    ratio = worst["with / without"]
    goals = [goal(f"{GOAL} (worst: {worst['shape']} {worst['row']})", ratio, ">= 1", ratio >= 1)]
    notes = text.split("\n\n")[0].splitlines()
    write_result(out, "decode_ops", [result_table("", rows, COLUMNS)], goals, args.skip_goal, notes)
    return report_goals(goals, out, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
