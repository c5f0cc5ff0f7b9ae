"""Scaling of the sensitivity and quantize stages with model size, projected to 7B/13B/70B.

For each size a random-weight Llama checkpoint (``write_synthetic_checkpoint``; fixed width,
depth grows with the size) is scored by the sensitivity stage's core (``analyze``, default
``gptq_proxy``) and quantized by the quantize stage's core (``quantize_checkpoint``, default
GPTQ int4g128, one block per segment), each in a fresh child process that reports its wall
and CPU time and its own peak RSS (``VmHWM``). Then, per stage:

* time per parameter: least-squares slope of seconds vs parameters (through the intercept the
  fit finds: start-up work that does not grow with the model);
* memory: sensitivity loads the whole model, so its peak is fitted as ``a + b * params``; the
  quantize stage streams, so its peak is reported per segment: ``(peak - start-up RSS) /
  segment bytes`` (segment in the fp32 compute dtype), the quantity that stays flat when
  streaming works.

Projection for one node (Llama-2 7B/13B/70B shapes, same calibration set): time = slope x
params + intercept; sensitivity memory from the fit; quantize memory = start-up RSS + the
measured per-segment factor x that model's segment + its activation cache. The width of the
synthetic models (512 by default) is much smaller than 7B's 4096: GPTQ's per-weight cost
grows with the input width (a Cholesky of the in x in Hessian per layer), so the projected
times are lower bounds; the memory projection only assumes peak is linear in segment size.

    python bench/scaling.py                      # 0.02, 0.04, 0.08 GiB (minutes on 2 cores)
    python bench/scaling.py --sizes 0.1,0.5,1,2,4 --hidden 4096 --intermediate 11008 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import hwm_mib, log_mlflow, machine, markdown_table, rss_mib, run_child, write_csv  # noqa: E402

GIB = 2**30
# (params, hidden, intermediate, layers) of the Llama-2 family, for the projection.
TARGETS = {
    "7B": (6.74e9, 4096, 11008, 32),
    "13B": (13.0e9, 5120, 13824, 40),
    "70B": (69.0e9, 8192, 28672, 80),
}


def child(args: argparse.Namespace) -> None:
    """Run one stage core on ``args.src`` in this process; print one JSON line."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (counted in the baseline)

    from pipeline.models.adapters import linear_names

    base = rss_mib()
    torch.manual_seed(0)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.src)
    calib = torch.randint(0, config.vocab_size, (args.samples, args.seq_len))  # (N, T)
    t0, c0 = time.perf_counter(), time.process_time()
    if args.stage == "sensitivity":
        from pipeline.analysis.sensitivity import analyze
        from pipeline.models.hf import load_causal_lm

        model = load_causal_lm(args.src)
        analyze(model, calib, args.candidates.split(","), args.sens_method, batch_size=4)
    else:
        from pipeline.stages.quantize import quantize_checkpoint

        plan = {n: args.format for n in linear_names(config, include_lm_head=False)}
        quantize_checkpoint(
            args.src, Path(args.work) / "out", plan, calib, method=args.method,
            work_dir=Path(args.work) / "w", batch_size=args.samples, progress=False,
        )  # fmt: skip
    cpu = time.process_time() - c0  # all threads; robust to other jobs sharing the cores
    print(
        json.dumps(
            {
                "seconds": time.perf_counter() - t0,
                "cpu_s": cpu,
                "baseline_mib": base,
                "peak_mib": hwm_mib(),
            }
        )
    )


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; (a, b). One point: through the origin."""
    n = len(xs)
    if n == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b /= sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.02,0.04,0.08", help="checkpoint sizes, GiB of fp16")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--stages", default="sensitivity,quantize")
    p.add_argument("--sens-method", default="gptq_proxy", choices=["gptq_proxy", "fisher"])
    p.add_argument("--candidates", default="int2g64,int3g128,int4g128")
    p.add_argument("--method", default="gptq", choices=["gptq", "rtn"])
    p.add_argument("--format", default="int4g128")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--out", default="bench-out/scaling")
    p.add_argument(
        "--time-basis",
        default="cpu_s",
        choices=["cpu_s", "seconds"],
        help="fit CPU seconds (default: meaningful on a shared machine) or wall seconds",
    )
    p.add_argument("--tracking-uri")
    p.add_argument(
        "--report", metavar="ROWS_JSONL",
        help="measure nothing: print the tables for the rows an earlier (maybe interrupted) "
        "run appended to OUT/rows.jsonl",
    )  # fmt: skip
    for hidden in ("--child", "--stage", "--src", "--work"):
        p.add_argument(hidden, action="store_true" if hidden == "--child" else None,
                       help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args()
    if args.child:
        return child(args)

    if args.report:
        lines = Path(args.report).read_text().splitlines()
        return report([json.loads(line) for line in lines if line.strip()], args)
    report(measure(args), args)


def measure(args: argparse.Namespace) -> list[dict]:
    """Write each checkpoint, run each stage in a child; rows also go to OUT/rows.jsonl."""
    from pipeline.models.synthetic import write_synthetic_checkpoint

    h, inter, vocab = args.hidden, args.intermediate, args.vocab
    log_file = Path(args.out) / "rows.jsonl"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text("")
    per_block = 4 * h * h + 3 * h * inter + 2 * h
    root = Path(tempfile.mkdtemp(prefix="lowbit-scaling-"))
    rows = []
    print(f"machine: {machine()}", flush=True)
    try:
        for gb in [float(s) for s in args.sizes.split(",")]:
            layers = max(1, round((gb * GIB / 2 - 2 * vocab * h) / per_block))
            src = root / f"ckpt-{gb}"
            write_synthetic_checkpoint(
                src, hidden=h, layers=layers, intermediate=inter, heads=h // 64,
                kv_heads=h // 64, vocab=vocab, shard_bytes=GIB // 4,
            )  # fmt: skip
            params = layers * per_block + 2 * vocab * h + h
            for stage in args.stages.split(","):
                cmd = [sys.executable, __file__, "--child", "--stage", stage, "--src", str(src),
                       "--work", str(root / "work"), "--samples", str(args.samples),
                       "--seq-len", str(args.seq_len), "--method", args.method,
                       "--format", args.format, "--candidates", args.candidates,
                       "--sens-method", args.sens_method]  # fmt: skip
                out, wall, _ = run_child(cmd)
                res = json.loads(out.strip().splitlines()[-1])
                peak = res["peak_mib"]
                shutil.rmtree(root / "work", ignore_errors=True)
                rows.append({
                    "stage": stage, "size_gib": gb, "layers": layers, "params": params,
                    "seconds": res["seconds"], "cpu_s": res["cpu_s"],
                    "cpu_us_per_param": 1e6 * res["cpu_s"] / params,
                    "baseline_mib": res["baseline_mib"], "peak_rss_mib": peak,
                    "segment_mib": 4 * per_block / 2**20,
                    "peak_per_segment": (peak - res["baseline_mib"]) / (4 * per_block / 2**20),
                    "child_wall_s": wall,
                })  # fmt: skip
                print(rows[-1], flush=True)
                with log_file.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            shutil.rmtree(src, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the measurements and the projection; write the CSVs; log to MLflow."""
    h, inter, vocab = args.hidden, args.intermediate, args.vocab
    cols = ("stage", "size_gib", "layers", "params", "seconds", "cpu_s", "cpu_us_per_param",
            "baseline_mib", "peak_rss_mib", "segment_mib", "peak_per_segment")  # fmt: skip
    print(
        f"\nwidth {h}/{inter}, vocab {vocab}, calib {args.samples}x{args.seq_len}, "
        f"sensitivity={args.sens_method}, quantize={args.method} {args.format}, segment=1 block"
    )
    print(markdown_table(rows, cols))
    proj = project(rows, args)
    print("\nProjection to one node (see the docstring for the assumptions):")
    pcols = ("stage", "model", "hours", "peak_gib")
    print(f"(hours from {args.time_basis}: CPU time of all threads, or wall time)")
    print(markdown_table(proj, pcols))
    out = Path(args.out)
    write_csv(out / "scaling.csv", rows, cols)
    write_csv(out / "projection.csv", proj, pcols)
    log_mlflow(args.tracking_uri, "lowbit-bench", "scaling", rows + proj, "stage",
               vars(args), [out / "scaling.csv", out / "projection.csv"])  # fmt: skip


def project(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    out = []
    for stage in dict.fromkeys(r["stage"] for r in rows):
        rs = [r for r in rows if r["stage"] == stage]
        t0, t1 = _fit([r["params"] for r in rs], [r[args.time_basis] for r in rs])
        m0, m1 = _fit([r["params"] for r in rs], [r["peak_rss_mib"] for r in rs])
        base = max(r["baseline_mib"] for r in rs)
        factor = max(r["peak_per_segment"] for r in rs)
        for name, (params, h, inter, _layers) in TARGETS.items():
            if stage == "quantize":
                seg = 4 * (4 * h * h + 3 * h * inter) / 2**20  # fp32 block, MiB
                cache = 4 * args.samples * args.seq_len * h / 2**20
                peak = base + factor * seg + cache
            else:
                peak = m0 + m1 * params
            hours = max(t0 + t1 * params, 0.0) / 3600
            out.append({"stage": stage, "model": name, "hours": hours, "peak_gib": peak / 1024})
    return out


if __name__ == "__main__":
    main()
