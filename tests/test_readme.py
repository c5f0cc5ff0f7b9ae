"""The README's reliability table: every row names tests that exist, so a row cannot outlive the
test that keeps its promise."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

ROW = re.compile(r"^\| [^|]+ \| [^|]+ \| (.+) \|$")
TEST = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _rows() -> list[str]:
    """The third cells of the table whose header is ``| fault | ...``."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| fault |"))
    cells = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells.append(ROW.match(line).group(1))
    return cells


def test_every_reliability_row_names_tests_that_exist():
    rows = _rows()
    assert len(rows) >= 10
    for cell in rows:
        named = TEST.findall(cell)
        assert named, f"a reliability row names no test: {cell}"
        for path, name in named:
            tree = ast.parse((REPO / path).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"README names {path}::{name}, which does not exist"
