"""Peak memory of the streamed Fisher against the loaded one, as the model gets deeper.

For each depth in ``--layers`` a random-weight Llama checkpoint (fp16 on disk) is written, then
the diagonal empirical Fisher of every linear is computed in a fresh child process whose peak
resident set (``VmHWM``) is read from the kernel:

* ``stream``: :func:`pipeline.analysis.streamed_fisher.fisher_streamed`, one segment at a time,
  the kept activations spilled to files (``act_budget_gb=0``), each tensor's Fisher dropped once
  handed over;
* ``loaded``: :func:`pipeline.analysis.estimators.fisher_diagonal` on the whole model.

The streamed peak should stay flat in depth while the loaded one grows with it. Goal: the
deepest model's streamed peak within 10% of the shallowest's; exits 1 when it is not, or when
fewer than two depths were streamed.

    python -m bench.fisher_memory --layers 4,16,64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import (
    REPO,
    add_goal_args,
    goal,
    parsed_tables,
    report_goals,
    unmeasured,
    write_result,
)

MIB = 2**20
FLAT = 1.1  # the deepest model's streamed peak / the shallowest's


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def child(args: argparse.Namespace) -> None:
    """Compute the Fisher in this process; print one JSON line with the memory figures."""
    import torch

    from pipeline.analysis.estimators import fisher_diagonal
    from pipeline.analysis.sensitivity import scored_modules
    from pipeline.analysis.streamed_fisher import fisher_streamed
    from pipeline.dist import Dist
    from pipeline.models import StreamingCheckpoint
    from pipeline.streaming import StreamOptions

    ck = StreamingCheckpoint(args.src, dtype=torch.float32)
    ids = torch.randint(0, ck.config.vocab_size, (args.samples, args.seq_len),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    baseline = _rss_mib()
    t0 = time.time()
    total = [0.0]
    if args.mode == "stream":
        walk = StreamOptions(args.segment_size, args.samples, 0.0, progress=False)
        fisher_streamed(ck, ids, walk, lambda n, w, f: total.__setitem__(0, total[0] + f.sum()),
                        spill_dir=args.work)  # fmt: skip
    else:
        model = ck.full_model()
        params = {n: m.weight for n, m in scored_modules(model).items()}
        total[0] = sum(f.sum() for f in fisher_diagonal(model, ids, params, Dist()).values())
    print(json.dumps({"mode": args.mode, "seconds": time.time() - t0, "base_mib": baseline,
                      "peak_mib": _hwm_mib(), "fisher_sum": float(total[0])}))  # fmt: skip


def flat_goals(stream_peaks: dict[int, float]) -> list[dict]:
    """The streamed peak flat in depth: the deepest model's within ``FLAT`` of the shallowest's;
    missed unless at least two depths were streamed.

    Args:
        stream_peaks: {layers: peak MiB of the ``stream`` mode}.
    """
    name, want = "streamed peak, deepest / shallowest", f"<= {FLAT}"
    if len(stream_peaks) < 2:
        return [unmeasured(name, want, "needs stream in --modes and two --layers depths")]
    ratio = stream_peaks[max(stream_peaks)] / stream_peaks[min(stream_peaks)]
    return [goal(name, ratio, want, ratio <= FLAT)]


def main() -> int | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="4,16,64", help="comma list of depths")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--segment-size", type=int, default=2)
    p.add_argument("--modes", default="stream,loaded")
    p.add_argument("--out", default="bench-out/fisher_memory", help="folder for result.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    add_goal_args(p)
    args = p.parse_args()
    if args.child:
        return child(args)

    from pipeline.models.synthetic import write_synthetic_checkpoint

    size = f"hidden {args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}"
    setting = f"{size}, calib {args.samples}x{args.seq_len}, segment_size {args.segment_size}"
    lines = ["| layers | checkpoint MiB (fp16) | mode | peak MiB | peak - base MiB | seconds |",
             "|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    print(setting + "\n\n" + "\n".join(lines))
    stream_peaks: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="lowbit-fisher-") as root:
        for layers in [int(x) for x in args.layers.split(",")]:
            src = Path(root) / f"ckpt{layers}"
            write_synthetic_checkpoint(
                src, hidden=args.hidden, layers=layers, intermediate=args.intermediate,
                heads=args.hidden // 64, kv_heads=args.hidden // 64, vocab=args.vocab,
                shard_bytes=64 * MIB,
            )  # fmt: skip
            ckpt_mib = sum(f.stat().st_size for f in src.glob("*.safetensors")) / MIB
            for mode in args.modes.split(","):
                cmd = [sys.executable, "-m", "bench.fisher_memory", "--child", "--mode", mode,
                       "--src", str(src), "--work", str(Path(root) / "work"),
                       "--samples", str(args.samples), "--seq-len", str(args.seq_len),
                       "--segment-size", str(args.segment_size)]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                if proc.returncode != 0:
                    sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                grown = r["peak_mib"] - r["base_mib"]
                if mode == "stream":
                    stream_peaks[layers] = r["peak_mib"]
                lines.append(f"| {layers} | {ckpt_mib:.0f} | {mode} | {r['peak_mib']:.0f} | "
                             f"{grown:.0f} | {r['seconds']:.1f} |")  # fmt: skip
                print(lines[-1], flush=True)
    goals = flat_goals(stream_peaks)
    write_result(args.out, "fisher_memory", parsed_tables(setting, lines), goals, args.skip_goal)
    return report_goals(goals, skip=args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
