"""The built-in corpus: standard library docstrings, then installed packages' (read with ast)."""

from __future__ import annotations

import sys

import pytest

from pipeline.data import corpus
from pipeline.data.corpus import builtin_documents

DOC = "A docstring long enough to count as a document of the built-in corpus, about {}."


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An installed package whose import would fail: only `ast` may read it."""
    pkg = tmp_path / "lowbitdocpkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'"""{DOC.format("the package")}"""\nraise SystemExit(3)\n')
    (pkg / "mod.py").write_text(
        f'"""{DOC.format("a module")}"""\n'
        f'def public():\n    """{DOC.format("a function")}"""\n'
        f'def _private():\n    """{DOC.format("a private function")}"""\n'
        f'class K:\n    """{DOC.format("the package")}"""\n'  # a repeat: kept once
    )
    (pkg / "tests" / "test_x.py").write_text(f'"""{DOC.format("a test")}"""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "lowbitdocpkg"
    sys.modules.pop("lowbitdocpkg", None)


def test_package_docstrings_follow_the_standard_library_without_importing(package):
    stdlib = builtin_documents()
    docs = builtin_documents(packages=[package, "no_such_package_installed"])
    assert docs[: len(stdlib)] == stdlib  # the standard library first, unchanged
    added = docs[len(stdlib) :]
    assert added == [DOC.format(w) for w in ("the package", "a module", "a function")]
    assert package not in sys.modules  # read, never imported (its import raises SystemExit)


def test_max_chars_stops_the_corpus(package):
    stdlib_chars = sum(map(len, builtin_documents()))
    docs = builtin_documents(max_chars=stdlib_chars + 10, packages=[package])
    assert sum(map(len, docs)) >= stdlib_chars + 10
    assert len(docs) == len(builtin_documents()) + 1  # stopped after the first package document


def test_the_corpus_is_collected_once_per_process_and_each_caller_gets_its_own_list():
    first = builtin_documents(max_chars=5000)
    first.append("a caller's own document")
    hits = corpus._collected.cache_info().hits
    again = builtin_documents(max_chars=5000)
    assert corpus._collected.cache_info().hits == hits + 1  # not collected a second time
    assert "a caller's own document" not in again  # a fresh list, the cached documents intact
    assert again == first[:-1]
