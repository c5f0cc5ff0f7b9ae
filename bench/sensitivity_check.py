"""How well does predicted sensitivity match reality, and does allocation pay off?

On the bootstrap target (a path, or trained here into a temporary run dir):

1. Measured effect: quantize one layer at a time with RTN (int3g128, int2g64) and measure the
   increase of the mean token loss (ΔL) and the mean token KL(p_FP ‖ p_Q), on the held-out
   evaluation windows and on the calibration windows the estimators see.
2. Predicted ΔL: the sensitivity analysis (fisher with data labels, fisher:model with labels
   sampled from the model, hutchinson, gptq_proxy) on the calibration windows; Spearman ρ
   between predicted and each measured quantity across layers.
3. Perplexity and KL to FP of the allocated plan (each method, the quant=mixed candidates) at
   budget 3.0 vs uniform int3g128 and at 2.5 vs uniform int2g64, quantized with RTN and with
   GPTQ (Hessians of the FP model's calibration inputs, each layer independently).

    python -m bench.sensitivity_check --smoke                 # trains the smoke bootstrap
    python -m bench.sensitivity_check outputs/default/bootstrap/target

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

from bench._common import compose, result_table, write_result
from pipeline import runmodels, workflow
from pipeline.analysis import Capture
from pipeline.analysis.estimate import Estimator
from pipeline.analysis.report import SensitivityReport
from pipeline.analysis.sensitivity import METHODS, analyze, scored_modules
from pipeline.config import QuantConfig, data_cfg, model_cfg, quant_cfg
from pipeline.data.heldout import corpus_heldout
from pipeline.data.text import Corpus
from pipeline.lit.losses import kl_divergence
from pipeline.models.hf import load_causal_lm, load_tokenizer
from pipeline.quant.allocate import layer_bits, make_plan
from pipeline.quant.formats import Format
from pipeline.quant.gptq import gptq_quantize
from pipeline.quant.rtn import quantize_rtn

CANDIDATES = ["int2g64", "int3g128", "int4g128", "int8"]
MEASURED = ["int3g128", "int2g64"]
KEEP_FLOAT = ["lm_head", "embed_tokens"]


def config(smoke: bool, run_dir: Path):
    smoke_sizes = ["experiment=smoke"] if smoke else []
    return compose([*smoke_sizes, f"run_dir={run_dir}", "tracking=none", "stages=[bootstrap]"])


@torch.no_grad()
def log_probs(model, windows: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """Next-token log-probabilities (S, T-1, V), float32."""
    parts = [model(input_ids=windows[i : i + batch_size]).logits[:, :-1].float().log_softmax(-1)
             for i in range(0, len(windows), batch_size)]  # fmt: skip
    return torch.cat(parts)


def loss_and_kl(logp: torch.Tensor, base: torch.Tensor, windows: torch.Tensor) -> tuple:
    """Mean token loss of ``logp`` and mean token KL(p_base ‖ p) on the same windows."""
    loss = -logp.gather(-1, windows[:, 1:, None]).mean()
    return float(loss), float(kl_divergence(base, logp))  # log-probs are valid logits


@torch.no_grad()
def measure(model, windows: torch.Tensor, names: list[str]) -> dict[str, dict]:
    """True effect of quantizing each layer alone (RTN): {"loss": ΔL, "kl": KL} per layer, format.

    ΔL is what the loss does; KL(p_FP ‖ p_Q) is the damage to the model's predictions, the
    quantity a curvature estimate predicts without the first-order (gradient) term, which is
    not zero on a model that is not at a minimum of this data's loss.
    """
    base = log_probs(model, windows)
    base_loss, _ = loss_and_kl(base, base, windows)
    out: dict[str, dict] = {"loss": {}, "kl": {}}
    for name in names:
        w = model.get_submodule(name).weight
        orig = w.detach().clone()
        out["loss"][name], out["kl"][name] = {}, {}
        for fmt in MEASURED:
            w.copy_(quantize_rtn(orig, fmt).dequantize())
            loss, kl = loss_and_kl(log_probs(model, windows), base, windows)
            out["loss"][name][fmt], out["kl"][name][fmt] = loss - base_loss, kl
        w.copy_(orig)
    return out


@torch.no_grad()
def input_hessians(model, calib: torch.Tensor) -> dict[str, torch.Tensor]:
    linears = {n: m for n, m in scored_modules(model, True, False).items()}
    cap = Capture(linears, hessians=True)
    for i in range(0, len(calib), 8):
        model(input_ids=calib[i : i + 8])
    cap.remove()
    return {n: cap.hessian(n) for n in linears}


@torch.no_grad()
def score_plan(model, plan: dict[str, Format], windows, base, hessians=None, block_size=128):
    """(perplexity, mean token KL to FP) with the plan's quantized layers (``BitPlan.quantized``)
    quantized (RTN, or GPTQ when Hessians are given)."""
    saved = {}
    for name, fmt in plan.items():
        w = model.get_submodule(name).weight
        saved[name] = w.detach().clone()
        if hessians is None:
            q = quantize_rtn(saved[name], fmt)
        else:
            q, _ = gptq_quantize(
                saved[name], hessians[name], fmt, block_size=block_size, act_order=True
            )
        w.copy_(q.dequantize())
    try:
        loss, kl = loss_and_kl(log_probs(model, windows), base, windows)
        return math.exp(loss), kl
    finally:
        for name, orig in saved.items():
            model.get_submodule(name).weight.copy_(orig)


def avg_bits(plan: dict[str, Format], shapes: dict) -> float:
    bits = sum(layer_bits(f, shapes[n]) for n, f in plan.items())
    return bits / sum(shapes[n][0] * shapes[n][1] for n in plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", nargs="?", help="FP target HF dir (default: train the bootstrap)")
    ap.add_argument("--smoke", action="store_true", help="smoke bootstrap sizes")
    ap.add_argument("--run-dir", help="where the bootstrap runs (default: a temp dir)")
    ap.add_argument("--methods", default=",".join([*METHODS, "fisher:model"]))
    ap.add_argument("--no-gptq", action="store_true")
    ap.add_argument("--json", help="also write every measurement and table to this file")
    ap.add_argument("--out", default="bench-out/sensitivity_check", help="folder for result.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="lowbit-sens-"))
    cfg = config(args.smoke, run_dir)
    target = Path(args.target) if args.target else None
    if target is None:
        t0 = time.time()
        workflow.run(cfg)
        target = runmodels.fp_target(model_cfg(cfg), runmodels.finished_stages(run_dir))
        print(f"bootstrap trained in {time.time() - t0:.0f}s: {target}")
    q = quant_cfg(cfg)
    model, tokenizer = load_causal_lm(target), load_tokenizer(target)
    corpus = Corpus(data_cfg(cfg), tokenizer)
    calib = corpus.calibration(q.calib.samples, q.calib.seq_len, cfg.seed)
    evalw = corpus_heldout(corpus).windows
    print(f"target {target}: calib {tuple(calib.shape)}, eval {tuple(evalw.shape)}")

    t0 = time.time()
    names = list(scored_modules(model))
    blocks = [n for n in names if ".layers." in n]  # what allocate quantizes by default
    measured = {"eval": measure(model, evalw, names), "calib": measure(model, calib, names)}
    print(
        f"measured ΔL and KL of {len(names)} layers x {len(MEASURED)} formats x 2 window sets "
        f"in {time.time() - t0:.0f}s"
    )
    reports, seconds = {}, {}
    probes = Estimator().probes  # the sensitivity stage's default
    for m in args.methods.split(","):
        method, _, labels = m.partition(":")  # fisher:model = sampled-label (true) Fisher
        t0 = time.time()
        reports[m] = SensitivityReport.from_dict(analyze(model, calib, CANDIDATES, method,
                             probes=probes, fisher_labels=labels or "data"))  # fmt: skip
        seconds[m] = time.time() - t0

    def rho(a: dict, b: dict, subset: list[str]) -> list[float]:
        pairs = [([a[n][f] for n in subset], [b[n][f] for n in subset]) for f in MEASURED]
        return [spearmanr(x, y)[0] for x, y in pairs]

    truths = {
        "ΔL eval": measured["eval"]["loss"],
        "ΔL calib": measured["calib"]["loss"],
        "KL calib": measured["calib"]["kl"],
        "KL eval": measured["eval"]["kl"],
    }
    cols = [f"{t} {f}" for t in truths for f in MEASURED]
    results: dict = {"rho": {}, "plans": []}
    for subset_name, subset in (("every scored layer", names), ("decoder-block linears", blocks)):
        print(f"\n### Spearman ρ, predicted (calibration windows) vs measured, {subset_name}\n")
        print("| predictor | " + " | ".join(cols) + " | seconds |")
        print("|---|" + "---|" * (len(cols) + 1))
        for m, rep in reports.items():
            pred = {layer.name: layer.dloss for layer in rep.layers}
            r = [x for t in truths.values() for x in rho(pred, t, subset)]
            results["rho"][f"{m} / {subset_name}"] = dict(zip(cols, r))
            print(f"| {m} | " + " | ".join(f"{x:.3f}" for x in r) + f" | {seconds[m]:.0f} |")
        # How reproducible the measurement itself is: a ceiling for any predictor.
        ceil = rho(truths["ΔL calib"], truths["ΔL eval"], subset)
        results["rho"][f"(ΔL calib as the predictor of ΔL eval) / {subset_name}"] = dict(
            zip(cols, ceil)
        )
        print("| (ΔL calib as the predictor of ΔL eval) | " + " | ".join(f"{x:.3f}" for x in ceil)
              + " |" * (len(cols) - 1) + " |")  # fmt: skip

    first = next(iter(reports.values()))
    shapes = {layer.name: layer.shape for layer in first.layers}
    fused = first.fused_groups
    hessians = None if args.no_gptq else input_hessians(model, calib)
    quantizers = {"rtn": None} if hessians is None else {"rtn": None, "gptq": hessians}
    base = log_probs(model, evalw)
    fp_ppl = math.exp(loss_and_kl(base, base, evalw)[0])
    print(f"\n### Eval windows: perplexity and KL(FP ‖ Q) per token (FP ppl {fp_ppl:.3f}); "
          "lm_head and embeddings float\n")  # fmt: skip
    heads = [f"{q} {what}" for q in quantizers for what in ("ppl", "KL")]
    print("| plan | avg bits | " + " | ".join(heads) + " |")
    print("|---|---|" + "---|" * len(heads))

    def row(label: str, plan: dict[str, Format]) -> None:
        cells = [x for h in quantizers.values()
                 for x in score_plan(model, plan, evalw, base, h, q.block_size)]  # fmt: skip
        bits = avg_bits(plan, shapes)
        results["plans"].append({"plan": label, "avg_bits": bits, **dict(zip(heads, cells))})
        text = [f"{x:.3f}" if h.endswith("ppl") else f"{x:.3g}" for h, x in zip(heads, cells)]
        print(f"| {label} | {bits:.3f} | " + " | ".join(text) + " |")

    for uniform, budgets in (("int3g128", [3.0, None]), ("int2g64", [2.5])):
        recipe = QuantConfig(candidates=[uniform], keep_float=KEEP_FLOAT).recipe
        plan_u = make_plan(shapes, {}, fused, recipe).quantized()
        row(f"uniform {uniform}", plan_u)
        for budget in budgets:  # None: the uniform plan's own average (a matched budget)
            b = budget or avg_bits(plan_u, shapes)
            for m, rep in reports.items():
                qc = QuantConfig(candidates=CANDIDATES, budget_bits=b, keep_float=KEEP_FLOAT)
                row(
                    f"{m} @ {b:.3f}", make_plan(shapes, rep.by_name(), fused, qc.recipe).quantized()
                )
    if args.json:
        predicted = {m: r.to_dict() for m, r in reports.items()}
        dump = {"measured": measured, "predicted": predicted, **results}
        Path(args.json).write_text(json.dumps(dump, indent=1))
    tables = [
        result_table(f"Spearman ρ, predicted (calibration windows) vs measured, {subset}",
                     [{"predictor": key.rsplit(" / ", 1)[0], **rhos}
                      for key, rhos in results["rho"].items() if key.endswith(f" / {subset}")],
                     ["predictor", *cols])
        for subset in ("every scored layer", "decoder-block linears")
    ]  # fmt: skip
    title = f"eval windows: perplexity and KL(FP ‖ Q) per token (FP ppl {fp_ppl:.3f})"
    tables.append(result_table(title, results["plans"], ["plan", "avg_bits", *heads]))
    notes = [f"target {target}: calib {tuple(calib.shape)}, eval {tuple(evalw.shape)}"]
    write_result(args.out, "sensitivity_check", tables, notes=notes)


if __name__ == "__main__":
    main()
