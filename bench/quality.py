"""Quantization quality: perplexity of FP, uniform RTN/GPTQ, allocated mixed plans, llmcompressor.

Every row is scored on the held-out test windows (``corpus_heldout``, the protocol and windows
`evaluate` uses) and quantized from the same calibration windows (``Corpus.calibration`` with
the run's seed, as the quantize stage draws them):

* ``fp``: the target as stored;
* ``lowbit rtn|gptq <fmt>``: a uniform plan through the quantize stage's core function
  (``quantize_checkpoint``), lm_head and embeddings kept float as in ``quant.keep_float``;
* ``lowbit mixed@B``: the workflow's sensitivity -> allocate -> quantize stages with
  ``quant.budget_bits=B`` (``--distill`` adds the distill stage after each);
  ``lowbit mixed@B [LABEL]``: the same with ``--mixed-variant``'s overrides (an ablation, e.g.
  error feedback off: ``--mixed-variant 'no feedback:quant.feedback.slack_bits=0'``);
* ``llmcompressor gptq|rtn <scheme>``: llm-compressor's GPTQModifier / QuantizationModifier
  on the same saved model and the same calibration windows, run in its own virtualenv (created
  on first use; rows are skipped with the reason when it cannot be created or imported).

Columns: ppl, ppl / ppl(fp), bits per quantized weight including scales and zeros, quantization
wall time, peak RSS (MiB; lowbit rows: this process sampled while the row ran, so it includes
the FP model held for scoring; llmcompressor rows: that child's own ``VmHWM``).

Goals (exit 1 when one is missed or cannot be checked): lowbit GPTQ <= llmcompressor GPTQ
perplexity at each ``--formats`` entry, and the 2.5-bit plan (after ``--distill`` when run) <=
uniform GPTQ int3g128. Without the llmcompressor rows (no venv, ``--no-llmc``) the peer goals
are missed; ``--skip-goal llmcompressor`` leaves them out.

    python -m bench.quality --out bench-out/quality                    # smoke bootstrap target
    python -m bench.quality --model /path/to/hf --out q -- data=local data.path=...
    python -m bench.quality --model outputs/default/bootstrap/target --out q   # default sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import (
    PeakRSS,
    add_goal_args,
    compose,
    goal,
    last_json_line,
    log_mlflow,
    machine,
    markdown_table,
    quantize_uniform,
    report_goals,
    result_table,
    rss_mib,
    run_child,
    stage_cfg,
    unmeasured,
    write_csv,
    write_result,
)

COLUMNS = ("row", "ppl", "ratio_to_fp", "bits_per_weight", "quant_seconds", "peak_rss_mib")
LLMC_PINS = ("llmcompressor==0.14.0.1",)  # resolves its compressed-tensors and transformers
# Runs inside the llmcompressor venv (its own torch/transformers): quantize, score, print JSON.
CHILD_SRC = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from datasets import Dataset

target, data, method, scheme = sys.argv[1:5]
tensors = torch.load(data)
calib, win = tensors["calib"], tensors["eval"]
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
if scheme.upper() == "W4A16":
    kw, bits, group = {"scheme": "W4A16"}, 4, 128  # symmetric int4, group 128
else:
    bits, group = int(scheme[3]), int(scheme.split("g")[1])
    w = {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group",
         "group_size": group}
    kw = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}
Mod = GPTQModifier if method == "gptq" else QuantizationModifier
recipe = Mod(targets="Linear", ignore=["lm_head"], **kw)
ds = Dataset.from_dict({"input_ids": calib.tolist(),
                        "attention_mask": torch.ones_like(calib).tolist()})
t0 = time.perf_counter()
oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=calib.shape[0],
        max_seq_length=calib.shape[1], shuffle_calibration_samples=False)
seconds = time.perf_counter() - t0
total = count = 0.0
with torch.no_grad():
    for i in range(0, win.shape[0], 8):
        x = win[i : i + 8]
        logits = model(input_ids=x).logits[:, :-1].float()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
# counted as lowbit counts: an fp16 scale per group, plus a b-bit zero when asymmetric
over = 16 if scheme.upper() == "W4A16" else 16 + bits
with open("/proc/self/status") as f:  # VmHWM: this process's own peak, not its parent's
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
print(json.dumps({"ppl": float(torch.exp(torch.tensor(total / count))), "seconds": seconds,
                  "bits": bits + over / group, "peak_rss_mib": hwm}))
"""


def _workflow(overrides: list[str], stages: list[str]) -> dict:
    from pipeline.workflow import run

    return run(compose([*overrides, f"stages=[{','.join(stages)}]"]))


def lowbit_rows(args, base: list[str], target: Path, calib, win, fp_ppl: float) -> list[dict]:
    from transformers import AutoConfig

    from pipeline.config import quant_cfg
    from pipeline.errors import ConfigError
    from pipeline.models.adapters import linear_names
    from pipeline.models.hf import perplexity
    from pipeline.models.quantized import load_quantized

    q = quant_cfg(compose(base))
    batch = stage_cfg("quantize", *base).batch_size
    rows = []
    names = linear_names(AutoConfig.from_pretrained(target), include_lm_head=False)
    tmp = Path(tempfile.mkdtemp(prefix="lowbit-quality-"))
    for fmt in args.formats.split(","):
        for method in args.methods.split(","):
            out = tmp / f"{fmt}-{method}"
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                rep = quantize_uniform(
                    target, out / "model", {n: fmt for n in names}, calib,
                    quant=dataclasses.replace(q, method=method),
                    batch_size=batch, work_dir=out / "work",
                )  # fmt: skip
                seconds = time.perf_counter() - t0
            ppl = perplexity(load_quantized(out / "model"), win)
            rows.append(_row(f"lowbit {method} {fmt}", ppl, fp_ppl, rep["avg_bits"], seconds, mem))
            print(rows[-1], flush=True)
    variants = [("", [])] + [_variant(v) for v in args.mixed_variant]
    for budget in [b for b in args.budgets.split(",") if b]:
        for label, extra in variants:
            over = [*base, f"quant.budget_bits={budget}", *extra]
            try:
                rows += _mixed_rows(args, over, f"lowbit mixed@{budget}{label}", win, fp_ppl)
            except ConfigError as err:  # one refused setting: the other rows still count
                print(f"SKIPPED lowbit mixed@{budget}{label}: {err}", flush=True)
    return rows


def _variant(spec: str) -> tuple[str, list[str]]:
    """``LABEL:OVERRIDE[,OVERRIDE...]`` -> (" [LABEL]", overrides)."""
    label, sep, overrides = spec.partition(":")
    if not sep or not label or not overrides:
        raise SystemExit(f"--mixed-variant {spec!r}: expected LABEL:OVERRIDE[,OVERRIDE...]")
    return f" [{label}]", overrides.split(",")


def _mixed_rows(args, over: list[str], name: str, win, fp_ppl: float) -> list[dict]:
    """The workflow's sensitivity -> allocate -> quantize (and distill) with ``over``: its rows."""
    from pipeline import runmodels
    from pipeline.models.hf import perplexity
    from pipeline.models.quantized import load_quantized

    with PeakRSS() as mem:
        done = _workflow(over, ["sensitivity", "allocate", "quantize"])
    seconds = sum(done[s]["timings"]["seconds"] for s in ("sensitivity", "allocate", "quantize"))
    bits = done["quantize"]["metrics"]["avg_bits"]
    run_dir = Path(compose(over).run_dir)
    # The run dir is shared by every budget: a distill from an earlier one may be there.
    quantized = runmodels.quantized_targets(runmodels.finished_stages(run_dir))
    ppl = perplexity(load_quantized(quantized["target_quantized"]), win)
    rows = [_row(name, ppl, fp_ppl, bits, seconds, mem)]
    print(rows[-1], flush=True)
    if args.distill:
        with PeakRSS() as mem:
            done = _workflow(over, ["distill"])
        quantized = runmodels.quantized_targets(runmodels.finished_stages(run_dir))
        ppl = perplexity(load_quantized(quantized["target_distilled"]), win)
        secs = seconds + done["distill"]["timings"]["seconds"]
        rows.append(_row(f"{name}+distill", ppl, fp_ppl, bits, secs, mem))
        print(rows[-1], flush=True)
    return rows


def _row(name, ppl, fp_ppl, bits, seconds, mem) -> dict:
    peak = mem if isinstance(mem, float) else mem.peak_mib
    return {
        "row": name,
        "ppl": ppl,
        "ratio_to_fp": ppl / fp_ppl,
        "bits_per_weight": bits,
        "quant_seconds": seconds,
        "peak_rss_mib": peak,
    }


def llmc_python(venv: Path, install: bool) -> tuple[Path | None, str]:
    """The llmcompressor venv's interpreter, creating it when asked; (None, reason) if unusable."""
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import llmcompressor, compressed_tensors, transformers, torch"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py, ""
    if not install:
        return None, f"no usable llmcompressor venv at {venv} (rerun with --llmc-install)"
    steps = [[sys.executable, "-m", "venv", str(venv)]]
    wheels = sorted(Path("/opt/wheels").glob("torch-*.whl"))  # a local CPU torch, if provided
    if wheels:
        steps.append([str(py), "-m", "pip", "install", "-q", str(wheels[-1])])
    steps.append([str(py), "-m", "pip", "install", "-q", *LLMC_PINS])
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"`{' '.join(cmd[-3:])}` failed: {r.stderr.strip()[-300:]}"
    r = subprocess.run(probe, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"llmcompressor does not import: {r.stderr.strip().splitlines()[-1]}"
    return py, ""


def llmc_rows(args, target: Path, data: Path, fp_ppl: float) -> list[dict]:
    py, reason = llmc_python(Path(args.llmc_venv), args.llmc_install)
    if py is None:
        print(f"SKIPPED llmcompressor rows: {reason}", flush=True)
        return []
    child = Path(args.out) / "llmc_child.py"
    child.write_text(CHILD_SRC)
    rows = []
    for method in args.methods.split(","):
        for scheme in args.llmc_schemes.split(","):
            cmd = [str(py), str(child), str(target), str(data), method, scheme]
            try:
                out, _wall, _ = run_child(cmd, timeout_s=args.llmc_timeout)
            except RuntimeError as err:
                print(f"SKIPPED llmcompressor {method} {scheme}: {err}", flush=True)
                continue
            res = last_json_line(out)
            name = f"llmcompressor {method} {scheme}"
            peak = float(res["peak_rss_mib"])
            rows.append(_row(name, res["ppl"], fp_ppl, res["bits"], res["seconds"], peak))
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides (data, quant.calib, seed)")
    p.add_argument("--model", help="FP HF checkpoint dir (default: the smoke bootstrap target)")
    p.add_argument("--run-dir", default="/tmp/lowbit-bench/quality-run")
    p.add_argument("--out", default="bench-out/quality")
    p.add_argument("--formats", default="int4g128,int3g128,int2g64")
    p.add_argument("--methods", default="rtn,gptq")
    p.add_argument("--budgets", default="4.0,3.0,2.5")
    p.add_argument("--distill", action="store_true", help="also rows after the distill stage")
    p.add_argument(
        "--mixed-variant", action="append", default=[], metavar="LABEL:OVERRIDE[,OVERRIDE...]",
        help="another mixed row per budget with these overrides, named 'lowbit mixed@B [LABEL]' "
        "(e.g. 'no feedback:quant.feedback.slack_bits=0'); repeatable",
    )  # fmt: skip
    p.add_argument("--llmc-venv", default=str(Path.home() / ".cache/lowbit/llmc"))
    p.add_argument("--llmc-install", action="store_true", help="create the venv if missing")
    p.add_argument("--llmc-schemes", default="W4A16,int4g128,int3g128,int2g64")
    p.add_argument("--llmc-timeout", type=float, default=1800)
    p.add_argument("--no-llmc", action="store_true")
    p.add_argument("--no-lowbit", action="store_true", help="only the fp and llmcompressor rows")
    p.add_argument("--tracking-uri", help="log the table to this MLflow server/URI")
    add_goal_args(p)
    args = p.parse_args()

    import torch

    from pipeline import runmodels
    from pipeline.config import data_cfg, model_cfg, quant_cfg
    from pipeline.data.heldout import corpus_heldout
    from pipeline.data.text import Corpus
    from pipeline.models.hf import load_causal_lm, load_tokenizer, perplexity

    # The smoke sizes only for the smoke bootstrap this script trains itself; a given model is
    # scored with the default data and calibration settings (positional overrides change them).
    smoke = [] if args.model else ["experiment=smoke"]
    base = [*smoke, f"run_dir={args.run_dir}", "tracking=none", *args.overrides]
    if args.model:
        base.append(f"model.target.path={Path(args.model).resolve()}")
    else:
        _workflow(base, ["bootstrap"])  # reused when its fingerprint matches
    cfg = compose(base)
    finished = runmodels.finished_stages(Path(cfg.run_dir).resolve())
    target = runmodels.fp_target(model_cfg(cfg), finished).resolve()
    q = quant_cfg(cfg)
    corpus = Corpus(data_cfg(cfg), load_tokenizer(target))
    win = corpus_heldout(corpus).windows  # (W, T): the whole test split, as evaluate scores it
    calib = corpus.calibration(q.calib.samples, q.calib.seq_len, cfg.seed)  # (N, T)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "windows.pt"  # what the llmcompressor child reads: identical tokens
    torch.save({"calib": calib, "eval": win}, data)
    print(f"target {target}; eval windows {tuple(win.shape)}; calibration {tuple(calib.shape)}")
    print(f"machine: {machine()}", flush=True)

    fp = load_causal_lm(target)
    fp_ppl = perplexity(fp, win)
    fp_bits = 8 * next(fp.parameters()).element_size()
    rows = [_row("fp", fp_ppl, fp_ppl, float(fp_bits), 0.0, rss_mib())]
    del fp
    if not args.no_lowbit:
        rows += lowbit_rows(args, base, target, calib, win, fp_ppl)
    if args.no_llmc:
        print("SKIPPED llmcompressor rows: --no-llmc")
    else:
        rows += llmc_rows(args, target, data, fp_ppl)

    table = markdown_table(rows, COLUMNS)
    print("\n" + table)
    csv_path = write_csv(out / "quality.csv", rows, COLUMNS)
    (out / "quality.md").write_text(table + "\n")
    (out / "quality.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {csv_path}")
    log_mlflow(
        args.tracking_uri, "lowbit-bench", "quality", rows, "row",
        {"target": target, "overrides": base, "calib": list(calib.shape)}, [csv_path],
    )  # fmt: skip
    ppl = {r["row"]: r["ppl"] for r in rows}
    uniform, before = ppl.get("lowbit gptq int3g128"), ppl.get("lowbit mixed@2.5")
    if uniform is not None and before is not None and "lowbit mixed@2.5+distill" in ppl:
        # reported, not a goal: the goal is the plan after distillation
        print(f"stretch: lowbit mixed@2.5 before distillation {before:.6g} vs int3g128 "
              f"{uniform:.6g}: {'met' if before <= uniform else 'missed'}")  # fmt: skip
    goals, title = quality_goals(rows, args.formats.split(",")), f"test split {tuple(win.shape)}"
    write_result(out, "quality", [result_table(title, rows, COLUMNS)], goals, args.skip_goal)
    return report_goals(goals, out, args.skip_goal)


def quality_goals(rows: list[dict], formats: list[str]) -> list[dict]:
    """lowbit GPTQ <= llmcompressor GPTQ per ``formats`` entry; the 2.5-bit plan <= uniform GPTQ
    int3g128 (after distillation when the run has that row, which is the goal; before it, the
    stretch). A goal whose rows are missing (no llmcompressor venv, ``--no-llmc``, a method,
    format or budget left out) is missed."""
    ppl = {r["row"]: r["ppl"] for r in rows}
    goals = [_no_worse(ppl, f"lowbit gptq {fmt}", f"llmcompressor gptq {fmt}") for fmt in formats]
    plan = "lowbit mixed@2.5+distill" if "lowbit mixed@2.5+distill" in ppl else "lowbit mixed@2.5"
    goals.append(_no_worse(ppl, plan, "lowbit gptq int3g128"))
    return goals


def _no_worse(ppl: dict[str, float], row: str, ref: str) -> dict:
    """``row``'s perplexity <= ``ref``'s, or missed naming the row that is not there."""
    name = f"{row} <= {ref}"
    missing = [r for r in (row, ref) if r not in ppl]
    if missing:
        return unmeasured(name, f"<= ppl of {ref}", f"no {' or '.join(missing)} row")
    return goal(name, ppl[row], f"<= {ppl[ref]:.6g}", ppl[row] <= ppl[ref])


if __name__ == "__main__":
    sys.exit(main())
