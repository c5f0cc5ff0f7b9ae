"""The built-in English corpus: the docstrings of the Python installation itself.

Read in a fixed order (packages with ``ast``, no imports), so it is the same on every run."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# Packages whose import has side effects (GUI, test suites, self-tests) or is slow.
_SKIP = (
    "test",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "antigravity",
    "this",
    "lib2to3",
    "ensurepip",
    "venv",
    "__main__",
    "pydoc_data",
    "xxsubtype",
)


def _module_names() -> list[str]:
    names = set(sys.stdlib_module_names)
    # Submodules of standard packages (email.mime, xml.dom, concurrent.futures, ...).
    for pkg in sorted(names):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        if spec and spec.submodule_search_locations and pkg not in _SKIP:
            for m in pkgutil.walk_packages(spec.submodule_search_locations, pkg + "."):
                names.add(m.name)
    return sorted(
        n
        for n in names
        if not any(p.startswith("_") for p in n.split(".")) and n.split(".")[0] not in _SKIP
    )


def _docstrings(obj, home: str, seen: set[str], depth: int = 0):
    """Docstrings of `obj` and its public classes/routines defined in module `home`."""
    doc = inspect.getdoc(obj)
    if doc and len(doc) >= 80 and doc not in seen:
        seen.add(doc)
        yield doc
    if depth >= 2:
        return
    try:
        members = sorted(vars(obj).items())
    except TypeError:
        return
    for name, member in members:
        if name.startswith("_") or not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        # Only what the module defines itself, so re-exported names are not counted twice.
        if getattr(member, "__module__", home) == home:
            yield from _docstrings(member, home, seen, depth + 1)


def _package_docstrings(package: str, seen: set[str]) -> Iterator[str]:
    """Docstrings of an installed package's public modules, classes and functions, via `ast`."""
    try:
        spec = importlib.util.find_spec(package)  # locates a top-level package without importing it
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    for root in map(Path, spec.submodule_search_locations):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).parts
            if any(p in ("test", "tests", "testing") or p.startswith("_") for p in parts[:-1]):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            nodes = [tree] + [
                n
                for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and not n.name.startswith("_")
            ]
            for node in nodes:
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80 and doc not in seen:
                    seen.add(doc)
                    yield doc


def builtin_documents(
    max_chars: int | None = None, packages: tuple[str, ...] | list[str] = ()
) -> list[str]:
    """Docstrings of the standard library, then of the installed `packages`, in a fixed order,
    up to `max_chars` characters."""
    # Collecting imports and parses every module, and every stage reads it: once per process.
    return list(_collected(max_chars, tuple(packages)))


@functools.cache
def _collected(max_chars: int | None, packages: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_collect(max_chars, packages))


def _collect(max_chars: int | None, packages: tuple[str, ...]) -> list[str]:
    docs: list[str] = []
    seen: set[str] = set()
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _module_names():
            try:
                mod = importlib.import_module(name)
            except BaseException:  # some modules exit or raise on import on some platforms
                continue
            for doc in _docstrings(mod, mod.__name__, seen):
                docs.append(doc)
                total += len(doc)
                if max_chars and total >= max_chars:
                    return docs
    from pydoc_data.topics import topics

    for key in sorted(topics):
        docs.append(topics[key].strip())
        total += len(docs[-1])
    for package in packages:
        for doc in _package_docstrings(package, seen):
            docs.append(doc)
            total += len(doc)
            if max_chars and total >= max_chars:
                return docs
    return docs
