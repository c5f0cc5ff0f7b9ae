"""Artifact size per recipe against the FP16 checkpoint, and the torch runtime's decode speed.

A random-weight Llama (no checkpoint can be downloaded; sizes and speed do not depend on the
weights' values) is saved as an FP16 HF checkpoint, quantized per recipe by RTN, exported
(lowbit format; ascend too where MindIE can run the recipe, with 2/3-bit widened to int4) and
loaded with ``pipeline.runtime``. Columns:

* ``artifact MB``: every file of the artifact (weights, config, tokenizer, description,
  manifest); ``fp16 MB``: the FP16 checkpoint's files the same way; ``ratio`` = fp16 / artifact.
* ``bits/w``: stored bits per linear weight (codes + scales + offsets / LUT parameters).
* ``tok/s``: greedy decoding of ``--tokens`` tokens after a 16-token prompt, batch 1, with the
  torch reference backend (dequantize per group every call) next to the same FP model in
  float32 (``FP``), each the best of ``--repeats`` runs. ``cpu tok/s`` divides by process CPU
  time instead of wall time, which is robust to other load on a shared machine (run with
  ``--threads 1`` for that).

Usage: python -m bench.export_size [--hidden 512] [--layers 4] [--tokens 32] [--threads N]
                                   [--recipes int4g128,int2g64,...] [--out bench-out/export_size]
                                   [--mlflow URI]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench._common import parsed_tables, stage_cfg, write_result

RECIPES = ("int2g64", "int3g128", "int4g128", "int4g128-sym", "int8", "exp4g128")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_fp(root: Path, hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.data.corpus import builtin_documents
    from pipeline.models.hf import train_tokenizer

    tok = train_tokenizer(builtin_documents(max_chars=2_000_000), vocab)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    fp16 = root / "fp16"
    model.half().save_pretrained(fp16)
    tok.save_pretrained(fp16)
    return model.float(), tok, fp16


def quantize_dir(model, fp16: Path, fmt: str, out: Path) -> Path:
    import copy

    from pipeline.models.quantized import save_quantized_model
    from pipeline.quant.fakequant import FakeQuantLinear
    from pipeline.quant.rtn import quantize_rtn

    m = copy.deepcopy(model)
    for name, lin in list(m.named_modules()):
        if isinstance(lin, torch.nn.Linear) and name != "lm_head":
            m.set_submodule(name, FakeQuantLinear.from_qtensor(quantize_rtn(lin.weight, fmt)))
    return save_quantized_model(m, out, fp16, "rtn")


def decode_rate(model, prompt: torch.Tensor, tokens: int, repeats: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per process-CPU second), best of ``repeats``."""
    from pipeline.speculative.decoding import plain_generate

    best_wall, best_cpu = float("inf"), float("inf")
    plain_generate(model, prompt, 2, temperature=0.0)  # warm-up
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        plain_generate(model, prompt, tokens, temperature=0.0)
        best_wall = min(best_wall, time.perf_counter() - w)
        best_cpu = min(best_cpu, time.process_time() - c)
    return tokens / best_wall, tokens / best_cpu


def linear_bits(manifest: dict) -> float:
    quantized = [t for t in manifest["tensors"].values() if t["type"] != "FLOAT"]
    bits = 8 * sum(_nbytes(t) for t in quantized)
    weights = sum(d["shape"][0] * d["shape"][1] for d in manifest["layers"].values())
    return bits / max(weights, 1)


def _nbytes(t: dict) -> int:
    size = {"int8": 1, "uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}
    n = 1
    for d in t["shape"]:
        n *= d
    return n * size[t["dtype"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--out", default="bench-out/export_size", help="folder for result.json")
    ap.add_argument("--mlflow", default=None, help="tracking URI to log the table's numbers to")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pipeline.export import ExportError, export_artifact
    from pipeline.runtime import load

    metrics: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, tok, fp16 = build_fp(root, args.hidden, args.layers, args.vocab)
        fp_mb = dir_bytes(fp16) / 1e6
        prompt = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(0))
        fp_rate = decode_rate(model, prompt, args.tokens, args.repeats)
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, vocab {len(tok)}, "
            f"{n_params / 1e6:.1f}M params; FP16 checkpoint {fp_mb:.2f} MB; "
            f"threads {torch.get_num_threads()}\n"
        )
        lines = [
            "| recipe | format | artifact MB | fp16 MB | ratio | bits/w | tok/s | FP tok/s "
            "| cpu tok/s | FP cpu tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        print("\n".join(lines))
        for fmt in args.recipes.split(","):
            qdir = quantize_dir(model, fp16, fmt, root / f"q-{fmt}")
            for target in ("lowbit", "ascend"):
                art = root / f"a-{fmt}-{target}"
                opts = stage_cfg(
                    "export", f"stage.export.format={target}", "stage.export.widen=true"
                ).options()
                try:
                    manifest = export_artifact(qdir, art, opts)
                except ExportError as e:
                    lines.append(
                        f"| {fmt} | {target} | refused: {str(e).split(':')[1][:60]}... "
                        "| | | | | | | |"
                    )
                    print(lines[-1])
                    continue
                mb = dir_bytes(art) / 1e6
                rate = decode_rate(
                    load(art, "torch", draft=None).model, prompt, args.tokens, args.repeats
                )
                bits = linear_bits(manifest)
                lines.append(
                    f"| {fmt} | {target} | {mb:.2f} | {fp_mb:.2f} | {fp_mb / mb:.2f}x "
                    f"| {bits:.2f} | {rate[0]:.1f} | {fp_rate[0]:.1f} | {rate[1]:.1f} "
                    f"| {fp_rate[1]:.1f} |"
                )
                print(lines[-1], flush=True)
                key = f"{fmt}_{target}"
                metrics.update(
                    {
                        f"{key}_mb": mb,
                        f"{key}_bits_per_weight": bits,
                        f"{key}_tok_s": rate[0],
                        f"{key}_cpu_tok_s": rate[1],
                    }
                )
    metrics.update({"fp16_mb": fp_mb, "fp_tok_s": fp_rate[0], "fp_cpu_tok_s": fp_rate[1]})
    title = f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}"
    write_result(args.out, "export_size", parsed_tables(title, lines))
    if args.mlflow:
        import mlflow

        mlflow.set_tracking_uri(args.mlflow)
        mlflow.set_experiment("lowbit-bench")
        with mlflow.start_run(run_name="export_size"):
            mlflow.log_params(vars(args))
            mlflow.log_metrics(metrics)


if __name__ == "__main__":
    main()
