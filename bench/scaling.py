"""Scaling of the sensitivity, quantize and distill stages with model size, projected to 7B-70B.

For each size a random-weight Llama checkpoint (``write_synthetic_checkpoint``, fp16; fixed
width, depth grows with the size) goes through each stage's core, each (stage, size) in a fresh
child process that reports its wall and CPU time and its own peak RSS (``VmHWM``). The depth is
the size rounded to whole blocks, at least one: at width 4096 and vocab 32000 one block with the
embeddings and lm_head is 0.87 GiB and each further block 0.38 GiB, so smaller sizes are not
possible there; a size that rounds to a depth already measured is not measured again. Run it on
an otherwise idle machine: when another process holds a core, the OpenMP threads spin waiting
for each other and the CPU time of small operations grows tens of times.

* ``sensitivity-gptq_proxy`` and ``sensitivity-fisher``: ``analyze`` on the loaded model (fp32,
  the time includes the load), as the sensitivity stage runs with ``stream=false``;
* ``sensitivity-gptq_proxy-streamed``: ``analyze_streamed``, one block at a time from the shards
  (computed in fp32), as the stage runs with ``stream=true``. Only the GPTQ proxy
  streams: Fisher (and Hutchinson) backpropagate through the whole loaded model. Hutchinson is
  not measured: its cost is a double backward per probe on top of Fisher's backward;
* ``quantize``: ``quantize_checkpoint`` (GPTQ int4g128 by default), one block per segment;
* ``distill-step``: one optimizer step of the distill stage with its default settings
  (the stage's ``CONFIG``): the student is the RTN-quantized model (``--format``) loaded by
  ``pipeline.lit.distill.load_pair`` (FakeQuantLinear layers, trained sets, fp32 modules), the
  teacher the FP model, the loss ``DistillModule.losses`` (KL on the logits + attention
  matching), then gradient clipping and the module's AdamW step, on one (samples, seq_len)
  batch, in fp32 (the cpu trainer's precision). Building the student and loading the teacher
  are not timed (``setup_s``): a run pays them once, the step ``max_steps`` times. The layer
  weights are uniform (the error-based ones cost the same).

``--stages`` picks a subset; ``stage@GIB`` runs that stage only up to that size, so the costly
stages can stop before the largest models. Before each child the peak is estimated: from a
linear fit of the stage's peaks at the smaller sizes already measured when there are two, else
from ``PRIOR_BYTES_PER_PARAM`` (deliberately pessimistic). A (stage, size) whose estimate
exceeds ``--max-gib-per-stage`` for that stage, or else 90% of the memory available at that
moment, is recorded as ``skipped``; a child that fails (killed by the OOM killer or by
``--child-timeout-s``, or an exception) is recorded as ``failed``, and the run goes on. Every
row is appended to OUT/rows.jsonl as it comes; ``--report`` re-prints the tables from one or
more such files (e.g. runs at two widths, which is what tests the FLOP model's width term).

Fits, per stage, over the rows that finished (least squares, with R² so a reader sees whether
linear holds; two sizes always give R² = 1):

* time = a + b x params, and time = a + b x FLOPs (``1/b`` is the sustained FLOP/s);
* peak = a + b x params; the streamed stages also get ``(peak - start-up RSS) / segment`` (one
  fp32 block), the quantity that stays flat when streaming works.

FLOPs are counted from the shapes (``flops``), with n = samples x seq_len tokens, per decoder
block (linears ``(out, in)``: q, k, v, o, gate, up, down; distinct inputs: q/k/v share one,
gate/up one, o and down their own):

* forward F_blk = 2 n Σ out·in + 4 n T hidden (QKᵀ and AV); the model's F adds the logits,
  2 n vocab hidden;
* GPTQ proxy: F (streamed: no logits) + Hessians 2 n in² per distinct input (and lm_head's) +
  scoring 2 out in² per linear and candidate (``(δ H) δ``);
* Fisher: 3 F (a forward and a backward of twice its cost per sequence);
* distill step: 4 F (teacher forward; student forward and backward, whose weight gradient is
  needed for the scales);
* quantize (GPTQ): per block 5 F_blk (one forward per input group to collect it, one of the
  quantized block) + Hessians 2 n in² per distinct input + per linear 5 out in² + 4/3 in³: the
  lazy column updates (out in²), the error report's ``(W - Q) H`` and ``W H`` (4 out in²), and
  Cholesky, ``cholesky_inverse`` and Cholesky again (in³/3 + 2 in³/3 + in³/3). RTN: 5 F_blk +
  4 n Σ out·in (its output-error sums).

O(params) terms (RTN grid searches, fake quantization, AdamW) are left out: they go into the fits'
FLOP rate. Across sizes at one width FLOPs grow like params, so the two time fits agree on the
measured range; they differ in extrapolation, where GPTQ's O(out in²) and O(in³) terms grow with
the width (4096 in 7B, 8192 in 70B), which is why the projection uses the FLOP fit.

Projection for one node (Llama-2 7B/13B/70B shapes, 70B with 8 KV heads; same calibration
batch): CPU hours = a + b x FLOPs of that model (``hours_params_fit``: a + b x params, to show
how much the width adds); peak from the params fit, or for the streamed stages start-up RSS +
the largest measured per-segment factor x that model's segment + its activation cache. GPU
seconds = FLOPs / ``--gpu-tflops`` (default 100 TFLOP/s: an H100-class GPU in TF32): a
projection, not measured, and a lower bound, since GPTQ's column sweep and the Cholesky
factorizations run far below a GPU's matmul rate.

    python -m bench.scaling                      # 0.02, 0.04, 0.08 GiB at width 512 (minutes)
    # Full: 1, 2, 3, 5 and 9 blocks (0.87-3.9 GiB) at Llama-7B width; 1.5-2.5 hours on two
    # idle cores (estimated from the FLOP counts), fisher and distill-step skipped where they
    # do not fit in memory.
    python -m bench.scaling --sizes 0.9,1.25,1.6,2.4,4 --hidden 4096 --intermediate 11008 \\
        --vocab 32000
    # The same sizes in 45-80 minutes (estimated): the costliest stages stop early, the
    # streamed sensitivity goes to the largest size.
    S=sensitivity-gptq_proxy@1.25,sensitivity-gptq_proxy-streamed,sensitivity-fisher
    python -m bench.scaling --sizes 0.9,1.25,1.6,2.4,4 --hidden 4096 --intermediate 11008 \\
        --vocab 32000 --stages $S,quantize@1.6,distill-step
    python -m bench.scaling --report OUT/rows.jsonl [MORE/rows.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench._common import (
    hwm_mib,
    last_json_line,
    log_mlflow,
    machine,
    markdown_table,
    quantize_uniform,
    result_table,
    rss_mib,
    run_child,
    write_csv,
    write_result,
)

GIB, MIB = 2**30, 2**20
STAGES = (
    "sensitivity-gptq_proxy",
    "sensitivity-gptq_proxy-streamed",
    "sensitivity-fisher",
    "quantize",
    "distill-step",
)
STREAMED = ("sensitivity-gptq_proxy-streamed", "quantize")
# Peak bytes per parameter held at once (the whole model; one block + embeddings + lm_head for
# the streamed stages), used until two sizes of a stage are measured. Pessimistic on purpose
# (the slopes measured at width 128-256 were ~7, ~21 and ~32): the fp32 model, + Hessians of
# every linear (gptq_proxy), + gradient and Fisher buffers (fisher), + teacher, codes, the
# fake-quant weights saved for the backward and AdamW states of the float layers (distill-step).
PRIOR_BYTES_PER_PARAM = {
    "sensitivity-gptq_proxy": 12,
    "sensitivity-gptq_proxy-streamed": 16,
    "sensitivity-fisher": 24,
    "quantize": 16,
    "distill-step": 40,
}
PRIOR_BASE_MIB = 1024  # interpreter, torch, transformers (~400 MiB measured)


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's dimensions; ``kv_dim`` = KV heads x head size (``hidden`` without GQA)."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_dim: int | None = None

    def linears(self) -> list[tuple[int, int]]:
        """(out, in) of one block's linears: q, k, v, o, gate, up, down."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim or self.hidden
        return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]

    def inputs(self) -> list[int]:
        """Width of each distinct linear input of one block (q/k/v, o, gate/up, down)."""
        return [self.hidden, self.hidden, self.hidden, self.intermediate]

    @property
    def block_params(self) -> int:
        return sum(o * i for o, i in self.linears()) + 2 * self.hidden  # + the two norms

    @property
    def params(self) -> int:
        return self.layers * self.block_params + 2 * self.vocab * self.hidden + self.hidden


TARGETS = {
    "7B": Shape(4096, 11008, 32, 32000),
    "13B": Shape(5120, 13824, 40, 32000),
    "70B": Shape(8192, 28672, 80, 32000, kv_dim=1024),
}


def flops(stage: str, s: Shape, samples: int, seq_len: int, candidates: int, method: str) -> float:
    """Counted floating-point operations of ``stage`` on shape ``s`` (formulas: module doc)."""
    n, h = samples * seq_len, s.hidden
    block_fwd = 2 * n * sum(o * i for o, i in s.linears()) + 4 * n * seq_len * h
    logits = 2 * n * s.vocab * h
    model_fwd = s.layers * block_fwd + logits
    hessians = 2 * n * sum(i * i for i in s.inputs())  # one block's
    if stage == "sensitivity-fisher":
        return 3 * model_fwd
    if stage == "distill-step":
        return 4 * model_fwd
    if stage.startswith("sensitivity-gptq_proxy"):
        per_candidate = s.layers * sum(o * i * i for o, i in s.linears()) + s.vocab * h * h
        scoring = 2 * candidates * per_candidate
        fwd = model_fwd - logits if stage in STREAMED else model_fwd
        return fwd + s.layers * hessians + 2 * n * h * h + scoring
    if stage == "quantize":
        forwards = (len(s.inputs()) + 1) * block_fwd
        if method == "rtn":
            return s.layers * (forwards + 4 * n * sum(o * i for o, i in s.linears()))
        gptq = sum(5 * o * i * i + 4 * i**3 / 3 for o, i in s.linears())
        return s.layers * (forwards + hessians + gptq)
    raise ValueError(f"no FLOP count for stage {stage!r}")


def child(args: argparse.Namespace) -> None:
    """Run one stage core on ``args.src`` in this process; print one JSON line."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (counted in the baseline)

    base = rss_mib()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    run = _prepare(args)
    setup = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    cpu = time.process_time() - c0  # all threads
    print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu, "setup_s": setup,
                      "baseline_mib": base, "peak_mib": hwm_mib()}))  # fmt: skip


def _prepare(args: argparse.Namespace):
    """What ``args.stage`` does before its timed part; returns the timed part."""
    import torch
    from transformers import AutoConfig

    import pipeline.streaming  # noqa: F401  (imported here, not in the timed part)
    from pipeline.config import QuantConfig
    from pipeline.models.adapters import linear_names

    config = AutoConfig.from_pretrained(args.src)
    calib = torch.randint(0, config.vocab_size, (args.samples, args.seq_len))  # (N, T)
    candidates = args.candidates.split(",")
    plan = {n: args.format for n in linear_names(config, include_lm_head=False)}
    work = Path(args.work)
    if args.stage == "distill-step":
        return _distill_step(args.src, plan, calib, work)
    if args.stage == "quantize":
        return lambda: quantize_uniform(
            args.src, work / "out", plan, calib, quant=QuantConfig(method=args.method),
            batch_size=args.samples, work_dir=work / "w",
        )  # fmt: skip
    if args.stage == "sensitivity-gptq_proxy-streamed":
        from pipeline.analysis.streamed import analyze_streamed
        from pipeline.models import StreamingCheckpoint
        from pipeline.streaming import StreamOptions

        # One block per spill file, as the stage's stream=true; the budget is QuantConfig's.
        walk = StreamOptions(1, args.samples, QuantConfig().activation_budget_gb, progress=False)
        return lambda: analyze_streamed(
            StreamingCheckpoint(args.src, dtype=torch.float32),  # as the stage's stream=true
            calib, candidates, walk, spill_dir=work, weighting="full", include_lm_head=True,
            include_embeddings=True,
        )  # fmt: skip
    from pipeline.analysis.sensitivity import analyze
    from pipeline.models.hf import load_causal_lm

    method = args.stage.split("-")[1]
    return lambda: analyze(load_causal_lm(args.src), calib, candidates, method,
                           batch_size=args.samples)  # fmt: skip


def _distill_step(src: str, plan: dict[str, str], calib, work: Path):
    """Set up the distill stage's student, teacher, loss and optimizer; return one step."""
    import torch

    from pipeline.config import QuantConfig
    from pipeline.lit.distill import DistillHParams, DistillModule, load_pair

    p = DistillHParams()
    model_dir = work / "student"
    quantize_uniform(src, model_dir, plan, calib, quant=QuantConfig(method="rtn"),
                     batch_size=len(calib), work_dir=work / "w")  # fmt: skip
    # Student and teacher as the distill stage sets them up, for one step without warm-up.
    hp = replace(p, train=replace(p.train, steps=1, warmup=0))
    student, teacher, groups = load_pair(model_dir, Path(src), hp, allow_bin=False)
    layers = student.config.num_hidden_layers
    module = DistillModule(student, teacher, hp, torch.full((layers,), 1.0 / layers), groups)
    module.train()
    opt = module.configure_optimizers()["optimizer"]
    trained = [q for g in opt.param_groups for q in g["params"]]

    def step() -> None:
        module.losses(calib)["total"].backward()
        torch.nn.utils.clip_grad_norm_(trained, p.train.grad_clip)  # the trainer's clipping
        opt.step()
        opt.zero_grad()

    return step


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float | None]:
    """Least squares y = a + b x; (a, b, R²). One point, or one x: through the origin, no R²."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my / mx, None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, 1 - ss_res / ss_tot if ss_tot > 0 else None


def _stage_limits(spec: str) -> dict[str, float]:
    """``"stage=GiB,..."`` -> {stage: GiB}."""
    out = {}
    for item in filter(None, spec.split(",")):
        stage, _, gib = item.partition("=")
        if stage not in STAGES:
            raise SystemExit(f"--max-gib-per-stage: unknown stage {stage!r}; one of {STAGES}")
        out[stage] = float(gib)
    return out


def _stages(spec: str) -> dict[str, float]:
    """``"stage[@GIB],..."`` -> {stage: largest size to run it at}."""
    out = {}
    for item in spec.split(","):
        stage, _, gib = item.partition("@")
        if stage not in STAGES:
            raise SystemExit(f"--stages: unknown stage {stage!r}; one of {STAGES}")
        out[stage] = float(gib) if gib else float("inf")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.02,0.04,0.08", help="checkpoint sizes, GiB of fp16")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument(
        "--stages", default=",".join(STAGES),
        help="comma-separated, of " + ", ".join(STAGES) + "; stage@GIB: only up to that size",
    )  # fmt: skip
    p.add_argument("--candidates", default="int2g64,int3g128,int4g128")
    p.add_argument("--method", default="gptq", choices=["gptq", "rtn"], help="quantize's")
    p.add_argument("--format", default="int4g128", help="quantize's and the distill student's")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--out", default="bench-out/scaling")
    p.add_argument(
        "--max-gib-per-stage", default="", metavar="STAGE=GIB,...",
        help="skip a (stage, size) whose estimated peak exceeds this (default: 90%% of the "
        "memory available when it would start)",
    )  # fmt: skip
    p.add_argument("--child-timeout-s", type=float, help="kill a child after this long")
    p.add_argument(
        "--time-basis",
        default="cpu_s",
        choices=["cpu_s", "seconds"],
        help="fit CPU seconds of all threads (default) or wall seconds",
    )
    p.add_argument("--gpu-tflops", type=float, default=100.0,
                   help="sustained TFLOP/s of the GPU projection")  # fmt: skip
    p.add_argument("--tracking-uri")
    p.add_argument(
        "--report", metavar="ROWS_JSONL", nargs="+",
        help="measure nothing: print the tables for the rows earlier (maybe interrupted) runs "
        "appended to OUT/rows.jsonl",
    )  # fmt: skip
    for hidden in ("--child", "--stage", "--src", "--work"):
        p.add_argument(hidden, action="store_true" if hidden == "--child" else None,
                       help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args()
    if args.child:
        return child(args)

    if args.report:
        lines = [ln for f in args.report for ln in Path(f).read_text().splitlines()]
        return report([json.loads(line) for line in lines if line.strip()], args)
    report(measure(args), args)


def _estimate_peak_mib(stage: str, shape: Shape, done: list[dict]) -> float:
    """Peak RSS expected of ``stage`` on ``shape``: fitted on ``done`` rows, else the prior."""
    ok = [r for r in done if r["stage"] == stage and r["status"] == "ok"]
    if len({r["params"] for r in ok}) >= 2:
        a, b, _ = _fit([r["params"] for r in ok], [r["peak_rss_mib"] for r in ok])
        return a + b * shape.params
    held = shape.params
    if stage in STREAMED:
        held = shape.block_params + 2 * shape.vocab * shape.hidden
    return PRIOR_BASE_MIB + PRIOR_BYTES_PER_PARAM[stage] * held / MIB


def measure(args: argparse.Namespace) -> list[dict]:
    """Write each checkpoint, run each stage in a child; rows also go to OUT/rows.jsonl."""
    import psutil

    from pipeline.models.synthetic import write_synthetic_checkpoint

    stages, caps = _stages(args.stages), _stage_limits(args.max_gib_per_stage)
    h, inter, vocab = args.hidden, args.intermediate, args.vocab
    log_file = Path(args.out) / "rows.jsonl"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text("")
    root = Path(tempfile.mkdtemp(prefix="lowbit-scaling-"))
    rows: list[dict] = []
    print(f"machine: {machine()}", flush=True)
    try:
        per_block = Shape(h, inter, 1, vocab).block_params
        done_layers: set[int] = set()
        for gb in [float(s) for s in args.sizes.split(",")]:
            layers = max(1, round((gb * GIB / 2 - 2 * vocab * h) / per_block))
            shape = Shape(h, inter, layers, vocab)
            if layers in done_layers:  # below one block's size, or closer than half a block
                print(f"{gb} GiB: {layers} layer(s), {2 * shape.params / GIB:.3g} GiB, as an "
                      "earlier size: not measured again", flush=True)  # fmt: skip
                continue
            done_layers.add(layers)
            src = root / f"ckpt-{gb}"
            t0 = time.perf_counter()
            write_synthetic_checkpoint(
                src, hidden=h, layers=layers, intermediate=inter, heads=h // 64,
                kv_heads=h // 64, vocab=vocab, shard_bytes=GIB // 4,
            )  # fmt: skip
            print(f"{gb} GiB: {layers} layers written in {time.perf_counter() - t0:.0f}s",
                  flush=True)  # fmt: skip
            for stage, largest in stages.items():
                row = {
                    "stage": stage, "size_gib": gb, "gib": 2 * shape.params / GIB,
                    "layers": layers, "params": shape.params,
                    "hidden": h, "intermediate": inter, "vocab": vocab, "samples": args.samples,
                    "seq_len": args.seq_len, "candidates": len(args.candidates.split(",")),
                    "method": args.method, "format": args.format,
                }  # fmt: skip
                row["flops"] = flops(stage, shape, args.samples, args.seq_len,
                                     row["candidates"], args.method)  # fmt: skip
                est = _estimate_peak_mib(stage, shape, rows) / 1024
                limit = caps.get(stage, 0.9 * psutil.virtual_memory().available / GIB)
                row["est_peak_gib"] = est
                if gb > largest:
                    row.update(status="skipped", note=f"--stages {stage}@{largest:g}")
                elif est > limit:
                    row.update(status="skipped", note=f"est. peak > limit {limit:.1f} GiB")
                else:
                    row.update(_run_stage(stage, src, root / "work", args, shape))
                rows.append(row)
                print(row, flush=True)
                with log_file.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            shutil.rmtree(src, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _run_stage(stage: str, src: Path, work: Path, args: argparse.Namespace, shape: Shape) -> dict:
    """Measure ``stage`` on ``src`` in a child; the row's measured fields (or why it failed)."""
    cmd = [sys.executable, "-m", "bench.scaling", "--child", "--stage", stage,
           "--src", str(src), "--work", str(work),
           "--samples", str(args.samples), "--seq-len", str(args.seq_len),
           "--method", args.method, "--format", args.format,
           "--candidates", args.candidates]  # fmt: skip
    try:
        out, wall, _ = run_child(cmd, args.child_timeout_s)
        res = last_json_line(out)
    except (RuntimeError, ValueError) as e:  # killed (OOM, timeout), raised, or printed nothing
        lines = str(e).strip().splitlines()
        return {"status": "failed", "note": " / ".join(lines[:1] + lines[-1:])[:300]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak, base = res["peak_mib"], res["baseline_mib"]
    seg = 4 * shape.block_params / MIB  # one block in fp32
    return {
        "status": "ok", "seconds": res["seconds"], "cpu_s": res["cpu_s"],
        "setup_s": res["setup_s"], "cpu_us_per_param": 1e6 * res["cpu_s"] / shape.params,
        "baseline_mib": base, "peak_rss_mib": peak, "segment_mib": seg,
        "peak_per_segment": (peak - base) / seg if stage in STREAMED else None,
        "child_wall_s": wall,
    }  # fmt: skip


def report(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the measurements, fits and projections; write the CSVs; log to MLflow."""
    cols = ("stage", "size_gib", "gib", "layers", "params", "flops", "status", "seconds", "cpu_s",
            "setup_s", "cpu_us_per_param", "baseline_mib", "peak_rss_mib", "est_peak_gib",
            "peak_per_segment", "note")  # fmt: skip
    keys = ("hidden", "intermediate", "vocab", "samples", "seq_len", "candidates", "method",
            "format")  # fmt: skip
    for config in dict.fromkeys(tuple(r.get(k) for k in keys) for r in rows):
        print("\n" + ", ".join(f"{k} {v}" for k, v in zip(keys, config)))
    print(markdown_table(rows, cols))
    ok = [r for r in rows if r.get("status", "ok") == "ok"]
    fits = fit(ok, args.time_basis)
    fcols = ("stage", "n", "t_a_s", "t_s_per_gparam", "t_r2", "t_flops_a_s", "gflop_per_s",
             "t_flops_r2", "peak_a_mib", "peak_mib_per_gparam", "peak_r2",
             "peak_per_segment")  # fmt: skip
    print(f"\nFits (time = {args.time_basis}: CPU time of all threads, or wall time):")
    print(markdown_table(fits, fcols))
    cpu, gpu = project(ok, fits, args.gpu_tflops)
    print("\nProjection to one node, CPU like this one (from the fits; see the docstring):")
    pcols = ("stage", "model", "params", "tflop", "hours", "hours_params_fit", "peak_gib")
    print(markdown_table(cpu, pcols))
    print(f"\nGPU: projection, not measured: counted FLOPs at {args.gpu_tflops:g} TFLOP/s "
          "sustained (a lower bound on time):")  # fmt: skip
    gcols = ("stage", "model", "tflop", "seconds")
    print(markdown_table(gpu, gcols))
    out = Path(args.out)
    files = [write_csv(out / "scaling.csv", rows, cols), write_csv(out / "fits.csv", fits, fcols),
             write_csv(out / "projection.csv", cpu, pcols),
             write_csv(out / "projection_gpu.csv", gpu, gcols)]  # fmt: skip
    labelled = (
        [{**r, "label": f"{r['stage']}@{r['size_gib']}"} for r in rows]
        + [{**r, "label": f"{r['stage']}/fit"} for r in fits]
        + [{**r, "label": f"{r['stage']}@{r['model']}"} for r in cpu]
        + [{**r, "label": f"{r['stage']}@{r['model']}/gpu"} for r in gpu]
    )
    log_mlflow(args.tracking_uri, "lowbit-bench", "scaling", labelled, "label", vars(args), files)
    write_result(out, "scaling", [
        result_table("measured", rows, cols), result_table("fits", fits, fcols),
        result_table("projection to one node, CPU like this one", cpu, pcols),
        result_table(f"GPU projection at {args.gpu_tflops:g} TFLOP/s (not measured)", gpu, gcols),
    ])  # fmt: skip


def fit(rows: list[dict], time_basis: str) -> list[dict]:
    """Per stage: time vs params and vs FLOPs, peak vs params (+ per segment if streamed).

    Each row's ``coef`` holds the fitted (a, b) per relation, for the projection.
    """
    out = []
    for stage in dict.fromkeys(r["stage"] for r in rows):
        rs = [r for r in rows if r["stage"] == stage]
        params, times = [r["params"] for r in rs], [r[time_basis] for r in rs]
        t0, t1, t_r2 = _fit(params, times)
        m0, m1, m_r2 = _fit(params, [r["peak_rss_mib"] for r in rs])
        row = {"stage": stage, "n": len(rs), "t_a_s": t0, "t_s_per_gparam": t1 * 1e9,
               "t_r2": t_r2, "peak_a_mib": m0, "peak_mib_per_gparam": m1 * 1e9, "peak_r2": m_r2,
               "baseline_mib": max(r["baseline_mib"] for r in rs),
               "coef": {"time_params": (t0, t1), "peak_params": (m0, m1)},
               "calib": tuple(rs[0].get(k) for k in ("samples", "seq_len", "candidates")),
               "method": rs[0].get("method", "gptq")}  # fmt: skip
        if stage in STAGES and all(r.get("flops") for r in rs):
            f0, f1, f_r2 = _fit([r["flops"] for r in rs], times)
            row["coef"]["time_flops"] = (f0, f1)
            row.update(t_flops_a_s=f0, gflop_per_s=1e-9 / f1 if f1 > 0 else None, t_flops_r2=f_r2)
        if stage in STREAMED:
            row["peak_per_segment"] = max(r["peak_per_segment"] for r in rs)
        out.append(row)
    return out


def project(rows: list[dict], fits: list[dict], gpu_tflops: float) -> tuple[list, list]:
    """(CPU rows: hours and peak GiB from the fits; GPU rows: seconds from the FLOPs)."""
    cpu, gpu = [], []
    for f in fits:
        stage, (samples, seq_len, candidates), coef = f["stage"], f["calib"], f["coef"]
        for name, s in TARGETS.items():
            if stage in STREAMED:
                seg = 4 * s.block_params / MIB  # fp32 block, MiB
                cache = 4 * samples * seq_len * s.hidden / MIB
                peak = f["baseline_mib"] + f["peak_per_segment"] * seg + cache
            else:
                peak = coef["peak_params"][0] + coef["peak_params"][1] * s.params
            t0, t1 = coef["time_params"]
            row = {"stage": stage, "model": name, "params": s.params, "peak_gib": peak / 1024,
                   "hours_params_fit": max(t0 + t1 * s.params, 0.0) / 3600}  # fmt: skip
            if "time_flops" in coef:
                n_flops = flops(stage, s, samples, seq_len, candidates, f["method"])
                f0, f1 = coef["time_flops"]
                row.update(tflop=n_flops / 1e12, hours=max(f0 + f1 * n_flops, 0.0) / 3600)
                gpu.append({"stage": stage, "model": name, "tflop": n_flops / 1e12,
                            "seconds": n_flops / (gpu_tflops * 1e12)})  # fmt: skip
            cpu.append(row)
    return cpu, gpu


if __name__ == "__main__":
    main()
