"""Benchmark of the quantization core: bit packing, GPTQ/RTN time, exp4 vs int4 fidelity.

Tables (markdown):
1. Pack / unpack throughput per bit width on a 4096x4096 code matrix, next to torch.clone of
   the same packed bytes and of the unpacked uint8 codes, in the same run. GB/s count the
   packed bytes (the weights as stored); Gw/s counts weights. Each time is the best of
   ``--repeats`` runs (wall clock, or process CPU time with ``--cpu-time``, which on a shared
   machine with ``--threads 1`` ignores time spent waiting for a core).
2. Time to quantize one 4096x4096 layer: GPTQ (H from 2048 correlated inputs) and RTN, wall
   clock and process CPU time (the latter is robust to other load on a shared machine).
3. exp4g128 vs int4g128 reconstruction error and grid use on synthetic weights (Laplace and
   Gaussian; no trained checkpoint is available offline): MSE relative to the weight
   variance, fraction of the grid's distinct values a group actually uses, code entropy.

Usage: python -m bench.packing [--size 4096] [--repeats 10] [--threads N] [--cpu-time]
                               [--out bench-out/packing] [--mlflow URI]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench._common import parsed_tables, write_result
from pipeline.quant import HessianAccumulator, gptq_quantize, pack_bits, quantize_rtn, unpack_bits
from pipeline.quant.codec import to_groups


def best_time(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()  # warm-up (allocator, caches)
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def packing_table(n: int, repeats: int, clock) -> tuple[list[str], dict[str, float]]:
    rows = [
        "| bits | packed MB | pack GB/s | unpack GB/s | unpack Gw/s | clone GB/s (packed) "
        "| unpack / clone | clone GB/s (uint8 codes) | unpack / clone (codes) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    metrics = {}
    for bits in (2, 3, 4, 8):
        codes = torch.randint(0, 1 << bits, (n, n), dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert torch.equal(unpack_bits(packed, bits, codes.shape), codes)
        nb = packed.numel()
        t_pack = best_time(lambda c=codes, b=bits: pack_bits(c, b), repeats, clock)
        t_unpack = best_time(
            lambda p=packed, b=bits, s=codes.shape: unpack_bits(p, b, s), repeats, clock
        )
        t_clone = best_time(packed.clone, repeats, clock)
        t_clone_codes = best_time(codes.clone, repeats, clock)
        rows.append(
            f"| {bits} | {nb / 1e6:.1f} | {nb / t_pack / 1e9:.2f} | {nb / t_unpack / 1e9:.2f} "
            f"| {codes.numel() / t_unpack / 1e9:.2f} | {nb / t_clone / 1e9:.2f} "
            f"| {t_clone / t_unpack:.0%} | {codes.numel() / t_clone_codes / 1e9:.2f} "
            f"| {t_clone_codes / t_unpack:.0%} |"
        )
        metrics[f"unpack_gbps_{bits}bit"] = nb / t_unpack / 1e9
        metrics[f"unpack_over_clone_{bits}bit"] = t_clone / t_unpack
    return rows, metrics


def quantize_table(n: int) -> tuple[list[str], dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(256, n, generator=g) / 16
    x = torch.randn(2048, 256, generator=g) @ mix + 0.1 * torch.randn(2048, n, generator=g)
    acc = HessianAccumulator(n)
    acc.add_batch(x)
    w = torch.randn(n, n, generator=g) * 0.02
    rows = ["| layer | method | format | wall s | CPU s |", "|---|---|---|---:|---:|"]
    metrics = {}
    for method, fmt in (
        ("gptq", "int4g128"),
        ("gptq", "exp4g128"),
        ("rtn", "int4g128"),
        ("rtn", "exp4g128"),
    ):
        t, cpu = time.perf_counter(), time.process_time()
        if method == "gptq":
            gptq_quantize(w, acc.H, fmt)
        else:
            quantize_rtn(w, fmt)
        dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
        rows.append(f"| {n}x{n} | {method} | {fmt} | {dt:.2f} | {dcpu:.2f} |")
        metrics[f"{method}_{fmt}_s"] = dt
    return rows, metrics


def fidelity_table(rows_: int, n: int) -> tuple[list[str], dict[str, float]]:
    g = torch.Generator().manual_seed(1)
    u = torch.rand(rows_, n, generator=g).clamp(1e-6, 1 - 1e-6) - 0.5  # finite log below
    tensors = {
        "laplace": -torch.sign(u) * torch.log1p(-2 * u.abs()) * 0.02,
        "gaussian": torch.randn(rows_, n, generator=g) * 0.02,
    }
    rows = [
        "| weights | format | MSE / var | grid values used per group | code entropy (bits) |",
        "|---|---|---:|---:|---:|",
    ]
    metrics = {}
    for dist, w in tensors.items():
        for fmt in ("int4g128", "exp4g128"):
            qt = quantize_rtn(w, fmt)
            rel = float((qt.dequantize() - w).square().mean() / w.var())
            values = 15 if qt.fmt.kind == "exp" else 16  # exp: codes 0 and 8 both decode to 0
            c = qt.codes.long()
            if qt.fmt.kind == "exp":
                c = torch.where(c == 8, 0, c)
            groups = to_groups(c, 128).reshape(-1, 128)  # (groups, 128)
            present = torch.zeros(groups.shape[0], 16).scatter_(1, groups, 1.0)
            used = float(present.sum(1).mean() / values)
            p = torch.bincount(c.reshape(-1), minlength=16).float()
            p = p[p > 0] / p.sum()
            entropy = float(-(p * p.log2()).sum())
            rows.append(f"| {dist} | {fmt} | {rel:.4f} | {used:.0%} | {entropy:.2f} |")
            metrics[f"{dist}_{fmt}_rel_mse"] = rel
    return rows, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time packing with process CPU time (with --threads 1: immune to other load)",
    )
    ap.add_argument("--out", default="bench-out/packing", help="folder for result.json")
    ap.add_argument("--mlflow", default=None, help="tracking URI to log the numbers to")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    metrics: dict[str, float] = {}
    timer = "process CPU time" if args.cpu_time else "wall clock"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.size}, {timer}\n")
    tables = []
    for title, (rows, m) in (
        ("Packing", packing_table(args.size, args.repeats, clock)),
        ("Quantization time", quantize_table(args.size)),
        ("exp4 vs int4 (synthetic weights)", fidelity_table(1024, args.size)),
    ):
        print(f"### {title}\n" + "\n".join(rows) + "\n")
        tables += parsed_tables(title, rows)
        metrics.update(m)
    write_result(args.out, "packing", tables)
    if args.mlflow:
        import mlflow

        mlflow.set_tracking_uri(args.mlflow)
        mlflow.set_experiment("lowbit-bench")
        with mlflow.start_run(run_name="packing"):
            mlflow.log_params({"size": args.size, "threads": torch.get_num_threads()})
            mlflow.log_metrics(metrics)


if __name__ == "__main__":
    main()
