"""`lowbit-run ARTIFACT --prompt "..."`: generate text from an exported artifact.

    lowbit-run outputs/default/export/artifact --prompt "Once upon a time" --max-new-tokens 64
    lowbit-run ARTIFACT --prompt "..." --draft OTHER_ARTIFACT --temperature 0.7
    lowbit-run ARTIFACT --prompt "..." --chat --temperature 0.7 --top-p 0.9 --stop "###" --stream

The artifact's own draft decodes speculatively unless ``--draft`` or ``--no-draft`` says
otherwise; ``Runtime.generate`` documents the options.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.errors import LowbitError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit-run", description=__doc__.split("\n")[0])
    p.add_argument(
        "artifact", help="artifact directory (<run_dir>/export/artifact) or hub id in the HF cache"
    )
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="text to continue (repeat for several prompts)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft", help="draft artifact for speculative decoding")
    g.add_argument("--no-draft", action="store_true", help="plain decoding, even with a draft")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--gamma", type=int, default=None, help="fixed draft length (default: adaptive)")
    p.add_argument(
        "--temperature-schedule",
        action="store_true",
        help="draft temperature T * (1 + 0.1 cos(step / 1000)) over the decoding steps",
    )
    p.add_argument("--backend", choices=("auto", "torch", "npu"), default="auto")
    p.add_argument(
        "--kernel",
        choices=("auto", "reference"),
        default="auto",
        help="torch backend: packed kernels (auto) or dequantize-per-call reference",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pipelined",
        action="store_true",
        help="draft the next block while the target verifies (CUDA stream; CPU thread if faster)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of every file (paths are still checked)",
    )
    p.add_argument("--stats", action="store_true", help="print tokens/s and acceptance to stderr")
    hf = p.add_argument_group(
        "transformers generate",
        "any of these decodes through transformers' model.generate (the draft as its "
        "assistant model) instead of lowbit's engine",
    )
    hf.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (0, 1]")
    hf.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    hf.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string: the output ends with the first one (repeatable)",
    )
    hf.add_argument("--stream", action="store_true", help="print tokens as they are decoded")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user turn with the tokenizer's chat template",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.max_new_tokens < 0:
        p.error("--max-new-tokens must be >= 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.gamma is not None and args.gamma < 1:
        p.error("--gamma must be >= 1")
    from pipeline.runtime.hf_generate import check_options

    try:
        check_options(
            args.temperature,
            args.top_p,
            args.top_k,
            args.stop,
            args.stream,
            args.gamma,
            args.pipelined,
            args.temperature_schedule,
        )
    except ValueError as e:  # the rules of Runtime.generate, checked before loading
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from pipeline.runtime.loader import load

    draft = None if args.no_draft else (args.draft or "auto")
    try:
        rt = load(
            args.artifact,
            args.backend,
            draft=draft,
            verify_hashes=not args.no_verify,
            kernel=args.kernel,
        )
        if args.stats:
            print(f"[kernels: {rt.kernel_summary() or 'no quantized layers'}]", file=sys.stderr)
        for prompt in args.prompt:
            if args.stream:  # the streamer prints the continuation and the newline
                print(prompt, end="", flush=True)
            out = rt.generate(
                prompt,
                args.max_new_tokens,
                args.temperature,
                gamma=args.gamma,
                seed=args.seed,
                pipelined=args.pipelined,
                temperature_schedule=args.temperature_schedule,
                top_p=args.top_p,
                top_k=args.top_k,
                stop=args.stop,
                stream=args.stream,
                chat=args.chat,
            )
            if not args.stream:
                print(prompt + out.text, flush=True)
            if args.stats:
                s = out.stats
                rate = s.new_tokens / s.seconds if s.seconds else float("nan")
                extra = ""
                if s.drafted:
                    extra = (
                        f", {s.accepted}/{s.drafted} drafted tokens accepted, "
                        f"{s.tau:.2f} tokens per target call"
                    )
                print(
                    f"[{s.new_tokens} tokens in {s.seconds:.2f}s = {rate:.1f} tok/s{extra}]",
                    file=sys.stderr,
                )
    except (LowbitError, OSError) as e:
        print(f"lowbit-run: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
