"""Peak memory of streaming (segment-wise) quantization against quantizing a loaded model.

Writes a random-weight Llama checkpoint of about ``--gb`` GiB (fp16, many layers, shard by
shard), then quantizes it twice with the quantize stage's core function, each time in a fresh
child process whose peak resident set size is read from the OS (``ru_maxrss``):

* ``stream``: one segment of ``--segment-size`` blocks at a time (the stage's mode);
* ``full``: the whole model loaded first (``stream=False``), then the same loop.

The table shows the checkpoint size, the largest segment in the compute dtype, the
activation cache, the child's RSS after its imports (the interpreter, torch, transformers) and
its peak, and the two ratios the design aims for: ``peak / checkpoint`` (<= 0.15 at 4 GiB)
and ``(peak - baseline) / (2 * segment + cache)`` (<= 1).

    python -m bench.streaming_memory --gb 4 --method rtn
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import REPO, quantize_uniform, result_table, write_result

GIB = 2**30


def _rss_now_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def child(args: argparse.Namespace) -> None:
    """Quantize in this process and print one JSON line with the memory figures."""
    if args.mmap_threshold_mb:
        import ctypes  # glibc: allocations above the threshold are mmapped, freed to the OS

        ctypes.CDLL("libc.so.6").mallopt(-3, args.mmap_threshold_mb << 20)  # M_MMAP_THRESHOLD
    import safetensors.torch  # noqa: F401  (imports count in the baseline, not the run)
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401

    import pipeline.streaming  # noqa: F401
    from pipeline.config import QuantConfig
    from pipeline.models import StreamingCheckpoint, linear_names

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    baseline_kb = _rss_now_kb()
    ck = StreamingCheckpoint(args.src, dtype=dtype)
    plan = {n: args.format for n in linear_names(ck.config, include_lm_head=False)}
    calib = torch.randint(0, ck.config.vocab_size, (args.samples, args.seq_len))
    s = args.segment_size
    seg_bytes = max(
        sum(ck.block_nbytes(j) for j in range(i, min(i + s, ck.num_layers)))
        for i in range(0, ck.num_layers, s)
    )
    work = Path(args.work)
    t0 = time.time()
    quantize_uniform(
        args.src, work / "out", plan, calib, quant=QuantConfig(method=args.method, segment_size=s),
        batch_size=args.samples, work_dir=work / "w", dtype=dtype, stream=args.mode == "stream",
    )  # fmt: skip
    print(json.dumps({
        "mode": args.mode,
        "seconds": time.time() - t0,
        "baseline_gb": baseline_kb / 2**20,
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
        "segment_gb": seg_bytes / GIB,
        "cache_gb": args.samples * args.seq_len * ck.config.hidden_size * dtype.itemsize / GIB,
    }))  # fmt: skip


def write_checkpoint(path: Path, gb: float, hidden: int, inter: int, vocab: int) -> None:
    """A fp16 Llama of about ``gb`` GiB (config.json is written last: it marks completion)."""
    from pipeline.models.synthetic import write_synthetic_checkpoint

    per_block = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden  # q,k,v,o + mlp + norms
    layers = max(1, round((gb * GIB / 2 - 2 * vocab * hidden) / per_block))
    write_synthetic_checkpoint(
        path, hidden=hidden, layers=layers, intermediate=inter, heads=hidden // 64,
        kv_heads=hidden // 64, vocab=vocab, shard_bytes=GIB // 2,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=4.0, help="checkpoint size (GiB, fp16)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
    p.add_argument("--format", default="int4g128")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--segment-size", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--mmap-threshold-mb",
        type=int,
        default=0,
        help="pin glibc's mmap threshold (what MALLOC_MMAP_THRESHOLD_ does); 0 = default",
    )
    p.add_argument("--modes", default="stream,full", help="comma list of stream, full")
    p.add_argument(
        "--dir",
        default=None,
        help="scratch directory, kept (a checkpoint already in DIR/ckpt is reused); "
        "default: a temporary directory, removed",
    )
    p.add_argument("--out", default="bench-out/streaming_memory", help="folder for result.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    root = Path(args.dir or tempfile.mkdtemp(prefix="lowbit-bench-")).resolve()  # child: cwd REPO
    src = root / "ckpt"
    t0 = time.time()
    if not (src / "config.json").is_file():
        write_checkpoint(src, args.gb, args.hidden, args.intermediate, args.vocab)
    config = json.loads((src / "config.json").read_text())
    ckpt_gb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / GIB
    print(f"checkpoint: {ckpt_gb:.2f} GiB fp16, {config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}, ready in {time.time() - t0:.0f}s in {src}")  # fmt: skip
    rows = []
    try:
        for mode in args.modes.split(","):
            work = root / f"work-{mode}"
            cmd = [sys.executable, "-m", "bench.streaming_memory", "--child", "--mode", mode,
                   "--src", str(src), "--work", str(work)]  # fmt: skip
            keys = ("method", "format", "samples", "seq_len", "segment_size", "dtype",
                    "mmap_threshold_mb")  # fmt: skip
            for key in keys:
                cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    setting = (f"method={args.method} format={args.format} calib={args.samples}x{args.seq_len} "
               f"segment_size={args.segment_size} compute={args.dtype} "
               f"mmap_threshold_mb={args.mmap_threshold_mb}")  # fmt: skip
    print("\n" + setting)
    head = ("mode", "ckpt GiB", "segment GiB", "cache GiB", "base GiB", "peak GiB",
            "peak/ckpt", "(peak-base)/(2seg+cache)", "seconds")  # fmt: skip
    print(" | ".join(head))
    cells = []
    for r in rows:
        budget = 2 * r["segment_gb"] + r["cache_gb"]
        cells.append([
            r["mode"], f"{ckpt_gb:.2f}", f"{r['segment_gb']:.3f}", f"{r['cache_gb']:.3f}",
            f"{r['baseline_gb']:.3f}", f"{r['peak_gb']:.3f}", f"{r['peak_gb'] / ckpt_gb:.3f}",
            f"{(r['peak_gb'] - r['baseline_gb']) / budget:.2f}", f"{r['seconds']:.0f}",
        ])  # fmt: skip
        print(" | ".join(cells[-1]))
    table = result_table(setting, [dict(zip(head, c)) for c in cells])
    write_result(args.out, "streaming_memory", [table])


if __name__ == "__main__":
    main()
