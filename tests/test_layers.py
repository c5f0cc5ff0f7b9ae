"""The package's layering, read from the source: no import cycles, quant/ pure math.

Every `import` and `from ... import` is counted, at module level or inside a function: an import
deferred into a function still makes the two modules depend on each other, it only hides it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"

# quant/ is the math: tensors and small frozen dataclasses in, tensors out.
QUANT_FORBIDDEN = (
    "pipeline.models",
    "pipeline.dist",
    "pipeline.config",
    "pipeline.streaming",
    "lightning",
    "mlflow",
    "hydra",
    "omegaconf",
    "deepspeed",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of everything `path` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from pipeline.x import y` may name the submodule pipeline.x.y
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = {d for d in _imports(path) if d in modules and d != name}
        # an import of a package's submodule runs the package's __init__ too, but a module's own
        # package is where it lives, not a layer it calls into
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path a -> ... -> a, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between pipeline's subpackages and top-level modules."""

    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        if name == "pipeline":
            continue
        out.setdefault(top(name), set()).update(top(d) for d in deps if top(d) != top(name))
    for deps in out.values():
        deps.discard("pipeline")  # the root package holds only the version and conf_dir
    return out


def test_no_module_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_cycle():
    cycle = _cycle(_packages(_graph()))
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


@pytest.mark.parametrize("path", sorted((PACKAGE / "quant").rglob("*.py")), ids=lambda p: p.name)
def test_quant_is_pure(path):
    bad = sorted(
        d for d in _imports(path) if any(d == f or d.startswith(f + ".") for f in QUANT_FORBIDDEN)
    )
    assert not bad, f"{path.name} imports {bad}"


def test_detects_a_cycle():
    # the checker itself: a planted cycle is found, a chain is not
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_import_engines_not_stages(path):
    # the registry (pipeline.stages.register_configs, for Hydra's defaults) is not a stage
    stage_modules = {f"pipeline.stages.{p.stem}" for p in (PACKAGE / "stages").glob("[!_]*.py")}
    bad = sorted(_imports(path) & stage_modules)
    assert not bad, f"{path.name} imports {bad}: use the engine below the stage"
