"""The benchmarks still run: each parses its command line, every library import it makes (those
inside functions too, which `--help` never reaches) resolves, and the memory benchmark quantizes
a tiny checkpoint end to end through `python -m bench.streaming_memory`. Benchmarks measure; this
only catches an import or call site that a change of the library left broken in them."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = REPO / "bench"
NAMES = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))
FIRST_PARTY = ("pipeline", "bench")


def library_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every first-party import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(FIRST_PARTY):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith(FIRST_PARTY)]
    return found


def test_every_bench_is_found():
    assert {"packing", "export_size", "streaming_memory", "scaling"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_help_exits_zero(name, monkeypatch, capsys):
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"bench.{name}", "--help"])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", NAMES)
def test_every_library_import_resolves(name):
    missing = []
    for module_name, attr in library_imports(BENCH / f"{name}.py"):
        try:
            module = importlib.import_module(module_name)
            if attr is not None and not hasattr(module, attr):
                importlib.import_module(f"{module_name}.{attr}")  # a submodule
        except ImportError as err:
            missing.append(f"{module_name}: {attr or ''} ({err})")
    assert not missing, f"bench/{name}.py imports what the library no longer has: {missing}"


def test_streaming_memory_quantizes_a_tiny_checkpoint(tmp_path):
    cmd = [sys.executable, "-m", "bench.streaming_memory", "--gb", "0.002", "--hidden", "128",
           "--intermediate", "384", "--vocab", "512", "--samples", "2", "--seq-len", "16",
           "--dir", str(tmp_path), "--out", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines()]
    rows = [r for r in rows if r[0] in ("stream", "full")]  # mode, ckpt, seg, cache, base, peak
    assert [r[0] for r in rows] == ["stream", "full"]
    assert all(float(r[5]) >= float(r[4]) > 0 for r in rows)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["bench"] == "streaming_memory" and "--gb 0.002" in result["command"]
    assert [r[0] for r in result["tables"][0]["rows"]] == ["stream", "full"]


def test_decode_speed_rows_quantize_the_head_only_when_asked_and_put_it_back():
    from bench import decode_speed as ds

    model = ds.llama(64, 2, 128, 512, 1)
    head = model.lm_head
    with ds.run_as(model, "W4g128") as m:
        kept = ds.bytes_per_token(m, 8)
        assert m.lm_head is head
    with ds.run_as(model, "W4g128", "int8") as m:
        assert m.lm_head is not head and not hasattr(m.lm_head, "weight")
        # about a byte a weight (and its scales) instead of 4
        assert ds.bytes_per_token(m, 8) < kept - 2.5 * head.weight.numel()
    assert model.lm_head is head
