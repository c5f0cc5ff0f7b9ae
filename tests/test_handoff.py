"""Stage hand-off files: one typed owner each, and nothing else names the file in code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline import handoff
from pipeline.errors import LowbitError

ROOT = Path(__file__).resolve().parents[1]
# file -> the module of the type that writes and reads it
OWNERS = {
    "sensitivity.json": "pipeline/analysis/report.py",
    "bitplan.json": "pipeline/quant/plan.py",
    "quant_report.json": "pipeline/streaming/quant_report.py",
    "eval.json": "pipeline/evaluation/result.py",
}
# readers that still open the file themselves, until they use the owner's load
PENDING: set[tuple[str, str]] = set()


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def code_strings(path: Path) -> list[str]:
    """Every string constant in ``path`` that is code, not a docstring."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_only_the_owner_names_its_file():
    found = set()
    for folder in ("pipeline", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for s in code_strings(path):
                found |= {(name, rel) for name in OWNERS if name in s and OWNERS[name] != rel}
    assert found <= PENDING, f"read these through their owner's type: {sorted(found - PENDING)}"
    for name, owner in OWNERS.items():
        assert any(name in s for s in code_strings(ROOT / owner)), f"{owner} names no {name}"


@pytest.mark.parametrize("text", ["[1, 2]", "{not json"])
def test_a_file_that_is_no_json_object_names_the_stage_to_rerun(tmp_path, text):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(LowbitError, match="rerun the quantize stage"):
        handoff.load(tmp_path / "x.json", "lowbit.x", 1, "quantize", dict)
