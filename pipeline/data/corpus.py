"""The built-in English corpus: the Python standard library's own documentation.

No data set can be downloaded at run time, but every Python installation carries a few MB of
well-edited English prose in its docstrings. Modules are visited in a fixed order and each
docstring is kept once, so the corpus is the same on every run of the same Python version.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import sys
import warnings

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


def builtin_documents(max_chars: int | None = None) -> list[str]:
    """Docstrings of the standard library (modules, classes, functions), in a fixed order."""
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
    # The language reference topics that `help()` shows: long, well-edited prose.
    from pydoc_data.topics import topics

    for key in sorted(topics):
        docs.append(topics[key].strip())
    return docs
