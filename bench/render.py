"""Render docs/benchmarks.md and README.md's results block from the committed bench results.

Each bench writes ``<out>/result.json`` (``bench._common.write_result``); the ones committed under
``docs/results/<bench>/`` are the project's current figures. This script turns them into the
report, one section per bench: what it measures and its goal (from the bench's docstring), the
command, commit, date and machine it ran with, its tables and its goals' verdicts, as the bench
computed them. A bench without a committed result gets the command that would make one. Nothing
in either file is written by hand between the markers, so ``--check`` can hold them to the data.

    python -m bench.render            # rewrite docs/benchmarks.md and README.md's block
    python -m bench.render --check    # exit 1 when either differs from a fresh render
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

from bench._common import REPO, markdown_table

RESULTS = Path("docs/results")
DOC = Path("docs/benchmarks.md")
README = Path("README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_BENCHES = {"render"}
# The README's headline figures: benches whose goals (or, for a bench without goals, one column
# of its first table: (what it is, the column, the columns that label each row)) README quotes.
HEADLINES: dict[str, tuple[str, str, tuple[str, ...]] | None] = {
    "headline": None,
    "default_model": None,
    "log_gaps": None,
    "distill_effect": None,
    "acceptance": None,
    "decode_speed": None,
    "streaming_memory": ("peak RSS / checkpoint size", "peak/ckpt", ("mode",)),
    "export_size": ("FP16 checkpoint / artifact size", "ratio", ("recipe", "format")),
}
README_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_fp16")

INTRO = """\
# Benchmarks

Speed, memory and quality are measured by the scripts under `bench/`, never by tests. Each one
writes `result.json` beside its other outputs; the results committed under `docs/results/` are
rendered here by `python -m bench.render` (this file is generated: edit the benches or rerun
them, not this file). To refresh a section, run its command with `--out docs/results/<bench>`
on a quiet machine, then `python -m bench.render`; `python -m bench.render --check` (a test)
fails when this file or README's figures differ from the committed results.

A bench with goals ends with a goals table and exits 1 when one is missed. A goal whose rows are
missing (not selected, a peer not installed, a stage the run lacks) is missed too, as
`(not measured: <why>)`; `--skip-goal TEXT` (repeatable) leaves out the goals whose name
contains TEXT, shown as `skipped (<verdict>)`. Timings come from the machine named in their
section, with its load average when the run ended: rerun on your machine before comparing.
"""


def benches() -> list[str]:
    """Every bench module under bench/ (the scripts that produce a result)."""
    names = (p.stem for p in (REPO / "bench").glob("*.py") if not p.stem.startswith("_"))
    return sorted(n for n in names if n not in NOT_BENCHES)


def _docstring(name: str) -> str:
    return ast.get_docstring(ast.parse((REPO / "bench" / f"{name}.py").read_text())) or ""


def _plain(text: str) -> str:
    """Docstring reST as one markdown line: ``x`` and :func:`x` as `x`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text.replace("``", "`"))
    return " ".join(text.split())


def about(name: str) -> tuple[str, str, str]:
    """(what the bench measures, its goal sentence or "", the command that records a result),
    from the bench's docstring."""
    doc = _docstring(name)
    summary = _plain(doc.split("\n\n")[0])
    start = re.search(r"\bGoals?\b", doc)
    goal = ""
    if start:
        rest = doc[start.start() :].split("\n\n")[0]
        end = re.search(r"\.(\s+(?=[A-Z`])|\s*$)", rest)
        goal = _plain(rest[: end.start() + 1] if end else rest)
    used = re.search(rf"python -m bench\.{name}\b[^\n]*", doc)
    command = re.split(r"\s+(\[|#|\\$)", used.group(0))[0] if used else f"python -m bench.{name}"
    out = f"--out {RESULTS / name}"
    command = re.sub(r"--out \S+", out, command) if "--out " in command else f"{command} {out}"
    return summary, goal, command


def load(name: str, root: Path = REPO) -> dict[str, Any] | None:
    """The committed result of bench ``name`` (or of its variant ``name@variant``); None when
    there is none."""
    path = root / RESULTS / name / "result.json"
    return json.loads(path.read_text()) if path.is_file() else None


def variants(name: str, root: Path = REPO) -> list[str]:
    """The variants of bench ``name`` with a committed result: ``docs/results/<name>@<variant>/``
    holds the same bench run another way (e.g. ``@avx2``: under the AVX2 emulation), rendered
    beside the main result rather than replacing it."""
    found = (root / RESULTS).glob(f"{name}@*/result.json")
    return sorted(p.parent.name.split("@", 1)[1] for p in found)


def _commit(result: dict) -> str:
    commit = (result.get("commit") or "outside git")[:12]
    return f"{commit} (with uncommitted changes)" if result.get("dirty") else commit


def _cpu(result: dict, flags: tuple[str, ...] | None = None) -> str:
    m = result.get("machine", {})
    have = " ".join(f for f in m.get("cpu_flags", []) if flags is None or f in flags)
    isa = m.get("isa_env", "auto")
    env = "" if isa in ("auto", "") else f", LOWBIT_CPU_ISA={isa}"  # an emulated ISA says so
    return f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores; {have or 'no listed flags'}{env})"


def _table(columns: list[str], rows: list[list]) -> str:
    def cell(v: Any) -> Any:
        return v.replace("|", "\\|") if isinstance(v, str) else v

    return markdown_table([dict(zip(columns, map(cell, r))) for r in rows], columns)


def section(name: str, result: dict | None) -> str:
    """One bench's section of docs/benchmarks.md."""
    summary, goal, command = about(name)
    lines = [f"## `bench/{name}.py`", "", summary + (f" {goal}" if goal else ""), ""]
    if result is None:
        return "\n".join([*lines, f"Not measured at a recorded commit yet: run `{command}`.", ""])
    return "\n".join(lines) + "\n" + body(result)


def body(result: dict, level: int = 3) -> str:
    """A result's command, commit, machine, notes, tables (headed at ``level``) and goals."""
    m = result.get("machine", {})
    lines = [
        f"```\n{result['command']}\n```",
        "",
        f"Commit `{_commit(result)}`, {result['date']}; {_cpu(result)}, torch "
        f"{m.get('torch', '?')}, load avg {m.get('load_avg', float('nan')):.1f}.",
        "",
    ]
    lines += [f"- {note}" for note in result.get("notes", [])]
    lines += [""] if result.get("notes") else []
    for t in result.get("tables", []):
        lines += [f"{'#' * level} {t['title']}", ""] if t.get("title") else []
        lines += [_table(t["columns"], t["rows"]), ""]
    if result.get("goals"):
        goals = [[g["goal"], g["value"], g["want"], g["verdict"]] for g in result["goals"]]
        lines += ["Goals:", "", _table(["goal", "value", "want", "verdict"], goals), ""]
    return "\n".join(lines)


def render_doc(root: Path = REPO) -> str:
    """docs/benchmarks.md, from the results under ``root``: each bench's section, then its
    variants' results under their own headings."""
    parts = [INTRO]
    for n in benches():
        parts.append(section(n, load(n, root)))
        for v in variants(n, root):
            parts += [f"### Variant `{n}@{v}`\n", body(load(f"{n}@{v}", root), level=4)]
    return "\n".join(parts).rstrip() + "\n"


def _figure(v: Any) -> str:
    return markdown_table([{"v": v}], ["v"]).splitlines()[-1].strip("| ")


def headline(name: str, result: dict | None) -> str:
    """One line of README's results block (``name`` may be a variant: ``bench@variant``)."""
    summary, _, command = about(name.split("@")[0])
    if result is None:
        return f"- `bench/{name}.py`: not measured at a recorded commit yet: run `{command}`."
    column = HEADLINES.get(name)
    if column is None:
        what = "goals"
        figures = [f"{g['goal']}: {_figure(g['value'])} (want {g['want']}; {g['verdict']})"
                   for g in result.get("goals", [])]  # fmt: skip
    else:
        what, value, labels = column
        t = result["tables"][0]
        idx = [t["columns"].index(c) for c in (*labels, value)]
        figures = [
            " ".join(str(r[i]) for i in idx) for r in t["rows"] if r[idx[-1]] not in ("", None)
        ]
    at = f"at `{_commit(result)}` on {_cpu(result, README_FLAGS)}"
    if column is not None and t.get("title"):
        what = f"{what} ({t['title']})"
    bench, _, variant = name.partition("@")
    label = f"`bench/{bench}.py`" + (f" (`@{variant}`)" if variant else "")
    return f"- {label}, {what}: " + "; ".join(figures) + f" ({at})."


def render_block(root: Path = REPO) -> str:
    """README's results block, markers included."""
    names = [m for n in HEADLINES for m in (n, *(f"{n}@{v}" for v in variants(n, root)))]
    lines = [headline(n, load(n, root)) for n in names]
    return "\n".join([BEGIN, *lines, "", "Every result: `docs/benchmarks.md`.", END])


def render_readme(text: str, root: Path = REPO) -> str:
    """``text`` (README.md) with its results block rendered afresh."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{README} has no {BEGIN} ... {END} block: add one where the figures go")
    return text[:start] + render_block(root) + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a rendered file is stale")
    args = p.parse_args(argv)
    fresh = {
        DOC: render_doc(),
        README: render_readme((REPO / README).read_text()),
    }
    stale = [path for path, text in fresh.items() if (REPO / path).read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} differs from the committed results: run `python -m bench.render`")
        return 1 if stale else 0
    for path in stale:
        (REPO / path).write_text(fresh[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
