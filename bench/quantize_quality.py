"""Perplexity after quantization: GPTQ against RTN for uniform recipes.

Quantizes an FP checkpoint with the quantize stage's core function for every format and
method, loads each result with ``load_quantized`` and prints the perplexity on the corpus'
held-out windows (the same windows `evaluate` uses), next to the FP model's.

    python bench/quantize_quality.py TARGET_DIR [hydra overrides, e.g. experiment=smoke]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="FP HF checkpoint directory")
    p.add_argument("overrides", nargs="*", help="config overrides (data, quant.calib, seed)")
    p.add_argument("--formats", default="int4g128,int3g128,int2g64")
    p.add_argument("--methods", default="gptq,rtn")
    args = p.parse_args()

    from hydra import compose, initialize_config_dir

    from pipeline import conf_dir
    from pipeline.config import data_cfg, quant_cfg
    from pipeline.data.text import Corpus
    from pipeline.models.adapters import linear_names
    from pipeline.models.hf import load_causal_lm, load_tokenizer, perplexity
    from pipeline.models.quantized import load_quantized
    from pipeline.quant.sequential import QuantOptions
    from pipeline.stages.quantize import quantize_checkpoint

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args.overrides)
    q, target = quant_cfg(cfg), Path(args.target)
    corpus = Corpus(data_cfg(cfg), load_tokenizer(target))
    win = corpus.eval_windows()
    calib = corpus.calibration(q.calib.samples, q.calib.seq_len, cfg.seed)
    fp = load_causal_lm(target)
    names = linear_names(fp.config, include_lm_head=False)
    print(f"eval windows {tuple(win.shape)}, calibration {tuple(calib.shape)}")
    rows = [("float", "-", perplexity(fp, win), 0.0)]
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            for method in args.methods.split(","):
                out = Path(tmp) / f"{fmt}-{method}"
                opts = QuantOptions(method, q.block_size, q.damp, q.act_order)
                report = quantize_checkpoint(
                    target, out / "model", {n: fmt for n in names}, calib, method=method,
                    work_dir=out / "work", opts=opts, progress=False,
                )  # fmt: skip
                ppl = perplexity(load_quantized(out / "model"), win)
                rows.append((fmt, method, ppl, report["mean_rel_output_error"]))
    print(f"{'format':<10} {'method':<6} {'ppl':>9} {'mean rel. output error':>24}")
    for fmt, method, ppl, err in rows:
        print(f"{fmt:<10} {method:<6} {ppl:9.3f} {err:24.4f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
