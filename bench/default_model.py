"""Is the embedded default model quantization-sensitive like a real LLM? Exits 1 when it is not.

Real LLMs lose a lot to low-bit weights (Llama-2-7B: ~10% perplexity at RTN int3g128, unusable at
RTN int2); a barely trained model loses almost nothing, and then no stage's effect can be seen.
This script trains the bootstrap pair (the workflow's own stage, reused when its fingerprint
matches), and on the whole held-out test split (the evaluate protocol) measures:

* the perplexity cost of RTN int2g64, RTN int3g128 and GPTQ int2g64 on every decoder linear
  (lm_head and embeddings float, as `quant.keep_float` keeps them);
* the draft's expected acceptance α = mean Σ_x min(p, q) against the target (teacher-forced,
  temperature 1);
* the bootstrap stage's wall time.

Goals: RTN int2g64 ≥ 8%, RTN int3g128 ≥ 1.5%, GPTQ int2g64 ≥ 2%, 0.5 ≤ α ≤ 0.7, bootstrap ≤ 360 s
(on a 2-core CPU). Config overrides measure another shape:

    python -m bench.default_model --run-dir /tmp/lowbit-bench/default
    python -m bench.default_model --run-dir /tmp/b6 model.target.layers=6 model.draft.layers=2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from bench._common import (
    add_goal_args,
    compose,
    goal,
    machine,
    markdown_table,
    quantize_uniform,
    report_goals,
    result_table,
    stage_cfg,
    unmeasured,
    write_result,
)

GOALS = {  # name: (low, high) bounds the measured value must lie within
    "rtn int2g64 cost %": (8.0, None),
    "rtn int3g128 cost %": (1.5, None),
    "gptq int2g64 cost %": (2.0, None),
    "alpha draft@target": (0.5, 0.7),
    "bootstrap seconds": (None, 360.0),
}


def rtn_ppl(model, fmt: str, win, names: set[str]) -> float:
    """Perplexity with every linear in `names` replaced by its RTN reconstruction, then restored."""
    import torch

    from pipeline.models.hf import perplexity
    from pipeline.quant.rtn import quantize_rtn

    saved = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name in names:
                saved[name] = mod.weight.detach().clone()
                mod.weight.copy_(quantize_rtn(mod.weight, fmt).dequantize())
        ppl = perplexity(model, win)
        for name, mod in model.named_modules():
            if name in saved:
                mod.weight.copy_(saved[name])
    return ppl


def gptq_ppl(target: Path, fmt: str, calib, win, names: list[str], q) -> float:
    from pipeline.models.hf import perplexity
    from pipeline.models.quantized import load_quantized

    out = Path(tempfile.mkdtemp(prefix="lowbit-default-model-"))
    quantize_uniform(
        target, out / "model", {n: fmt for n in names}, calib,
        quant=dataclasses.replace(q, method="gptq"), batch_size=stage_cfg("quantize").batch_size,
        work_dir=out / "work",
    )  # fmt: skip
    return perplexity(load_quantized(out / "model"), win)


def default_model_goals(values: dict[str, float]) -> list[dict]:
    """Each of ``GOALS``: its measured value within its bounds; missed when not measured."""
    goals = []
    for name, (low, high) in GOALS.items():
        want = " and ".join(
            s for s in (low is not None and f">= {low}", high is not None and f"<= {high}") if s
        )
        value = values.get(name)
        if value is None:
            goals.append(unmeasured(name, want, "no such measure"))
            continue
        ok = (low is None or value >= low) and (high is None or value <= high)
        goals.append(goal(name, value, want, ok))
    return goals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides (model shape, bootstrap steps)")
    p.add_argument("--run-dir", default="/tmp/lowbit-bench/default-model")
    p.add_argument("--out", default="bench-out/default_model")
    add_goal_args(p)
    args = p.parse_args()

    from transformers import AutoConfig

    from pipeline import runmodels
    from pipeline.config import data_cfg, model_cfg, quant_cfg
    from pipeline.data.heldout import corpus_heldout
    from pipeline.data.text import Corpus
    from pipeline.models.adapters import linear_names
    from pipeline.models.hf import load_causal_lm, load_tokenizer, perplexity
    from pipeline.speculative.metrics import teacher_forced_acceptance
    from pipeline.workflow import run

    base = [f"run_dir={args.run_dir}", "tracking=none", *args.overrides]
    t0 = time.perf_counter()
    run(compose([*base, "stages=[bootstrap]"]))  # skipped when the run dir already holds it
    print(f"bootstrap ready in {time.perf_counter() - t0:.0f} s", flush=True)
    cfg = compose(base)
    finished = runmodels.finished_stages(Path(args.run_dir).resolve())
    if "bootstrap" not in finished:
        raise SystemExit("this bench measures the bootstrap pair: leave model.target.path unset")
    target = runmodels.fp_target(model_cfg(cfg), finished)
    draft = runmodels.fp_draft(model_cfg(cfg), finished)
    q = quant_cfg(cfg)
    corpus = Corpus(data_cfg(cfg), load_tokenizer(target))
    test = corpus_heldout(corpus)
    calib = corpus.calibration(q.calib.samples, q.calib.seq_len, cfg.seed)
    names = linear_names(AutoConfig.from_pretrained(target), include_lm_head=False)
    print(f"machine: {machine()}\nperplexity on the {test.label()}", flush=True)

    fp = load_causal_lm(target)
    fp_ppl = perplexity(fp, test.windows)
    values = {"fp ppl": fp_ppl}
    for fmt in ("int2g64", "int3g128"):
        ppl = rtn_ppl(fp, fmt, test.windows, set(names))
        values[f"rtn {fmt} cost %"] = 100 * (ppl / fp_ppl - 1)
    values["gptq int2g64 cost %"] = 100 * (
        gptq_ppl(target, "int2g64", calib, test.windows, names, q) / fp_ppl - 1
    )
    batches = test.windows.split(8)
    values["alpha draft@target"] = teacher_forced_acceptance(fp, load_causal_lm(draft), batches)
    values["draft ppl"] = perplexity(load_causal_lm(draft), test.windows)
    done = json.loads((finished["bootstrap"] / "_done.json").read_text())
    values["bootstrap seconds"] = done["timings"]["seconds"]

    rows = [{"measure": k, "value": v} for k, v in values.items()]
    table = markdown_table(rows, ("measure", "value"))
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "default_model.md").write_text(table + "\n")
    (out / "default_model.json").write_text(
        json.dumps({"overrides": base, "protocol": test.describe(), **values}, indent=1)
    )
    goals, tables = default_model_goals(values), [result_table(test.label(), rows)]
    write_result(out, "default_model", tables, goals, args.skip_goal, [f"overrides: {base}"])
    return report_goals(goals, out, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
