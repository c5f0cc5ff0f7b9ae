"""The source's shape: short functions, thin stages, prose that explains rather than narrates,
and format names parsed once at the config edges."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "pipeline").rglob("*.py"))
MAX_FUNCTION_LINES = 80
MAX_STAGE_CODE_LINES = 150
MAX_PROSE_SHARE = 0.15
# where a format name becomes a Format: quant itself and the config schemas (the run's, and the
# quantized directory's own config.json)
PARSE_AT = ("pipeline/quant/", "pipeline/config.py", "pipeline/models/hf_quantizer.py")


def _prose_lines(src: str) -> set[int]:
    """Line numbers of docstrings and comments."""
    lines = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    return lines


def test_no_function_is_long():
    long = [
        f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"split into named steps (at most {MAX_FUNCTION_LINES} lines): {long}"


@pytest.mark.parametrize("path", sorted((ROOT / "pipeline/stages").glob("*.py")), ids=str)
def test_a_stage_is_its_schema_and_wiring(path):
    src = path.read_text()
    prose = _prose_lines(src)
    code = [i for i, line in enumerate(src.splitlines(), 1) if line.strip() and i not in prose]
    assert len(code) <= MAX_STAGE_CODE_LINES, (
        f"{path.name}: {len(code)} lines of code; move the algorithm below the stage"
    )


def test_prose_is_a_small_share_of_the_source():
    total = prose = 0
    for path in SOURCES:
        src = path.read_text()
        total += len(src.splitlines())
        prose += len(_prose_lines(src))
    assert prose / total <= MAX_PROSE_SHARE, (
        f"docstrings and comments are {prose / total:.1%} of pipeline/: measurements and "
        "histories belong in docs/, a comment says why in a line"
    )


def test_format_names_are_parsed_at_the_edges_only():
    calls = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in SOURCES
        if not str(path.relative_to(ROOT)).startswith(PARSE_AT)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "parse_format"
    ]
    assert not calls, f"take the Format the config parsed, not its name: {calls}"


def test_the_prose_counter_counts_docstrings_and_comments():
    src = '"""Module."""\n\ndef f():\n    """Doc\n    more."""\n    return 1  # why\n'
    assert _prose_lines(src) == {1, 4, 5, 6}
